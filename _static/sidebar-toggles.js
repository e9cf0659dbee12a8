/* The buttons at the top of every page open the sidebars (Jupyter Book includes every .js file
 * in _static/).
 *
 * The page carries each sidebar button twice: once in the theme's header bar, which book.css
 * hides, and once in the bar above the article, the one a reader sees. The theme wires only the
 * first button of each kind it finds, the hidden one, so the visible "Contents" and menu buttons
 * did nothing. A click on a visible button is passed on to the wired one, and the theme does the
 * rest: the menu (left) and the page's contents (right) open as panels on a narrow screen, the
 * menu folds away on a wide one, and a click beside a panel or Escape closes it. */
document.addEventListener("DOMContentLoaded", function () {
  ["primary-toggle", "secondary-toggle"].forEach(function (kind) {
    var buttons = document.querySelectorAll("." + kind);
    var wired = buttons[0];
    buttons.forEach(function (button) {
      if (button === wired) return;
      button.addEventListener("click", function (event) {
        event.preventDefault();
        event.stopPropagation();
        wired.click();
      });
    });
  });
});
