/* Search lists each page once (Jupyter Book includes every .js file in _static/).
 *
 * Sphinx's search gives a page one result for each match that has its own anchor, a glossary
 * term or a section title, and one more for the page's text: "induction" listed the glossary
 * twice. Results arrive best first, so the first result of each page is kept, the rest removed,
 * and the count in "Search finished, found N page(s)" follows. */
document.addEventListener("DOMContentLoaded", function () {
  var box = document.getElementById("search-results");
  if (!box) return;
  new MutationObserver(function () {
    var seen = new Set();
    box.querySelectorAll("ul.search > li").forEach(function (item) {
      var link = item.querySelector("a");
      if (!link) return;
      var page = link.getAttribute("href").split(/[#?]/)[0];
      if (seen.has(page)) item.remove();
      else seen.add(page);
    });
    var summary = box.querySelector("p.search-summary");
    var found = summary && summary.innerText.match(/found (\d+) page/);
    if (found && Number(found[1]) !== seen.size) {
      summary.innerText = summary.innerText.replace(found[0], "found " + seen.size + " page");
    }
  }).observe(box, {childList: true, subtree: true, characterData: true});
});
