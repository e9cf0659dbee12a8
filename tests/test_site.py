"""Browser test of the built book (``_build/html``): what a reader sees, checked page by page.

Headless Chromium (Debian's ``chromium``), driven over the DevTools protocol (``DevTools``), loads
every page of the built site from disk once, with the network cut off, takes its DOM after the
page's scripts (MathJax) have run, and lays the page out at three widths. For each page:

- MathJax rendered every formula: each ``.math`` element holds an ``mjx-container``, there is no
  MathJax error, and no raw TeX is left in the visible text: no ``$...$``, ``$$...$$``,
  ``\\(...\\)`` or ``\\[...\\]``, and no TeX command (``\\mathrm``) or lone ``$`` anywhere
  (code and outputs excluded: a ``$`` in code is legitimate);
- every image loaded: its file exists and is a real PNG/JPEG/GIF/SVG/WebP, and in the browser
  its ``naturalWidth`` is positive;
- no error output: no traceback, no error output cell, no warning on stderr, no docutils
  system message, no JavaScript error or failed resource load;
- every internal link resolves: the target file exists and the ``#fragment`` is an id in it;
- nothing comes from the network: every ``<script src>``, ``<link href>`` and ``<img src>`` is
  local (and exists), and Chromium saw no request of the page go to the network.
- the layout a reader meets, on a phone (390 px), a laptop (1,280 px) and a wide screen
  (1,600 px), measured in the page at each width (``LAYOUT_PROBE``). At every width the page never scrolls sideways (what
  sticks out is named), no formula is cut off at the column's edge (one wider than the column
  scrolls) and no formula that fits carries a scroll bar, library listings keep their lines, and
  the page's in-page contents can be reached: beside the column, or behind a visible button that
  opens it (the test clicks it). On the phone printed output keeps its lines and scrolls sideways
  (a table stays a table); from 960 px, where the column holds the book's 88-character lines, it
  wraps. At 1,280 px every figure is shown wide enough that its 10-pt text stays readable. The
  Key ideas page's formulas table links every chapter of Parts I and II that has a formula.

The test fails (it does not skip) when the site is not built or Chromium is missing; set
``ATTNBOOK_SKIP_SITE=1`` to skip it on purpose. The checker functions are tested at the bottom of
this file on crafted HTML (the layout probe on a crafted page in Chromium), so a checker that
stops catching its problem fails too.

Build the site first: ``make book`` (``make test`` runs this file after the build).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import chapters_with_formula

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("ATTNBOOK_SITE", ROOT / "_build" / "html"))
SKIP = os.environ.get("ATTNBOOK_SKIP_SITE", "") not in ("", "0")
WORKERS = 2  # Chromium processes at a time
PAGE_TIMEOUT_S = 90
# Pages Sphinx generates that are not chapters (they need JavaScript search data, hold no math).
GENERATED_PAGES = {"genindex.html", "search.html", "py-modindex.html"}

# ---------------------------------------------------------------------------------------------
# A small DOM built with the standard library's HTML parser
# ---------------------------------------------------------------------------------------------

VOID_TAGS = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
    "source", "track", "wbr",
}  # fmt: skip


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self):
        """This element and every element below it, in document order."""
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        return [el for el in self.iter() if (tag is None or el.tag == tag) and (cls is None or cls in el.classes)]

    def text(self, skip=lambda el: False) -> str:
        """The text below this element, leaving out the subtrees for which ``skip`` is true."""
        parts: list[str] = []

        def walk(el: Element) -> None:
            for child in el.children:
                if isinstance(child, str):
                    parts.append(child)
                elif not skip(child):
                    walk(child)
                    if child.tag in ("p", "div", "li", "td", "th", "br", "tr", "h1", "h2", "h3", "h4", "dt", "dd"):
                        parts.append("\n")

        walk(self)
        return "".join(parts)


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        el = Element(tag, {name: value or "" for name, value in attrs})
        self.stack[-1].children.append(el)
        if tag not in VOID_TAGS:
            self.stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Element(tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag):
        for depth in range(len(self.stack) - 1, 0, -1):  # close up to the matching open tag
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse_html(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


# ---------------------------------------------------------------------------------------------
# The checkers: each takes HTML (and paths) and returns a list of problems, empty when all is well
# ---------------------------------------------------------------------------------------------

# Subtrees whose text is not prose: code, program output, and rendered formulas.
NOT_PROSE_TAGS = {"script", "style", "pre", "code", "kbd", "samp", "textarea", "noscript", "template", "math"}
NOT_PROSE_CLASSES = {"highlight", "cell_input", "cell_output", "output", "math"}

# Raw TeX the way MyST's dollarmath reads it: `$` not followed by a space opens, `$` not preceded
# by a space (nor followed by a digit) closes; so "a price of $5 or $10" is not math.
RAW_MATH = [
    re.compile(r"\$\$.+?\$\$", re.S),
    re.compile(r"(?<![\\$])\$(?![\s$])[^$\n]*?[^\s\\$]\$(?![\d$])"),
    re.compile(r"\\\(.+?\\\)", re.S),
    re.compile(r"\\\[.+?\\\]", re.S),
    re.compile(r"\\begin\{[a-z*]+\}"),
    re.compile(r"\\[A-Za-z]{2,}"),  # a TeX command anywhere in the prose (\mathrm, \sqrt, ...)
    re.compile(r"\$(?!\d)"),  # a lone dollar (not a price): MathJax consumes the delimiters it renders
]


def _is_not_prose(el: Element) -> bool:
    return el.tag in NOT_PROSE_TAGS or el.tag.startswith("mjx-") or bool(el.classes & NOT_PROSE_CLASSES)


def math_problems(rendered_html: str) -> list[str]:
    """Formulas MathJax did not render, MathJax errors, and raw TeX left in the visible text."""
    dom = parse_html(rendered_html)
    problems = []
    for el in dom.find_all(cls="math"):
        if not el.find_all("mjx-container"):
            problems.append(f"formula not rendered by MathJax: {el.text().strip()[:80]!r}")
    for el in dom.find_all("mjx-merror"):
        problems.append(f"MathJax error in a formula: {el.attrs.get('data-mjx-error') or el.text()[:80]!r}")
    body = (dom.find_all("body") or [dom])[0]
    prose = body.text(skip=_is_not_prose)
    for pattern in RAW_MATH:
        for match in pattern.finditer(prose):
            problems.append(f"raw TeX in the page text: {match.group(0)[:80]!r}")
    return problems


def count_formulas(html: str) -> int:
    """The number of formulas (``.math`` elements) Sphinx put on a page."""
    return len(parse_html(html).find_all(cls="math"))


def error_problems(html: str) -> list[str]:
    """Tracebacks, error outputs, warnings on stderr, and docutils system messages on a page."""
    dom = parse_html(html)
    problems = []
    if "Traceback (most recent call last)" in dom.text():
        problems.append("a Python traceback is on the page")
    for el in dom.iter():
        classes = el.classes
        if classes & {"traceback", "output_error", "output-error"} or ("output" in classes and "error" in classes):
            problems.append(f"error output: {el.text().strip()[:200]!r}")
        elif "system-message" in classes or "problematic" in classes:
            problems.append(f"docutils/Sphinx error rendered on the page: {el.text().strip()[:200]!r}")
        elif classes & {"stderr", "output_stderr"}:
            text = el.text()
            if re.search(r"Traceback|\w*(Error|Warning|Exception)\b|\bwarn(ing)?:", text, re.I):
                problems.append(f"warning or error on stderr: {text.strip()[:200]!r}")
    html_el = (dom.find_all("html") or [dom])[0]
    errors = html_el.attrs.get("data-page-errors")
    if errors:
        for error in json.loads(errors):
            problems.append(f"in the browser: {error}")
    return problems


def _is_external(url: str) -> bool:
    return bool(re.match(r"^([a-z][a-z0-9+.-]*:|//)", url, re.I)) and not url.lower().startswith("file:")


def _local_target(page: Path, url: str) -> Path:
    """The file a relative (or file:) URL of ``page`` points to."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if target.is_dir():
        target = target / "index.html"
    return target


IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")


def _is_image_file(path: Path) -> bool:
    head = path.read_bytes()[:512]
    if head.startswith(IMAGE_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return True
    return path.suffix.lower() == ".svg" and b"<svg" in path.read_bytes()[:4096]


def image_problems(page: Path, html: str, rendered_html: str | None = None) -> list[str]:
    """Images whose file is missing, empty or not an image, remote images, images without alt text
    that describes them (none, or a file name), and (given the browser's DOM) images the browser
    could not display (``naturalWidth`` 0)."""
    problems = []
    for img in parse_html(html).find_all("img"):
        src = img.attrs.get("src", "")
        alt = img.attrs.get("alt", "").strip()
        if len(alt) < 4 or re.fullmatch(r"[0-9a-f]{16,}(\.\w+)?|\S+\.(png|svg|jpe?g|gif)", alt):
            problems.append(f"image without alt text that describes it: {src[:60]} (alt {alt!r})")
        if not src:
            problems.append("an <img> without src")
        elif src.startswith("data:"):
            continue
        elif _is_external(src):
            problems.append(f"image loaded from the network: {src}")
        else:
            target = _local_target(page, src)
            if not target.is_file():
                problems.append(f"image file missing: {src}")
            elif target.stat().st_size == 0 or not _is_image_file(target):
                problems.append(f"image file empty or not an image: {src}")
    if rendered_html is not None:
        for img in parse_html(rendered_html).find_all("img"):
            width = img.attrs.get("data-natural-width")
            if width is None:
                problems.append(f"image not seen by the browser check: {img.attrs.get('src', '')[:80]}")
            elif int(width) <= 0:
                problems.append(f"image did not load in the browser: {img.attrs.get('src', '')[:80]}")
    return problems


def resource_problems(page: Path, html: str) -> list[str]:
    """Scripts, stylesheets and other <link>ed files that come from the network or are missing."""
    problems = []
    dom = parse_html(html)
    refs = [("script", el.attrs.get("src")) for el in dom.find_all("script")]
    refs += [
        ("link", el.attrs.get("href"))
        for el in dom.find_all("link")
        if not set(el.attrs.get("rel", "").lower().split()) & {"canonical", "alternate"}
    ]
    refs += [(el.tag, el.attrs.get("src")) for tag in ("iframe", "source", "audio", "video", "embed")
             for el in dom.find_all(tag)]  # fmt: skip
    for tag, url in refs:
        if not url or url.startswith("data:"):
            continue
        if _is_external(url):
            problems.append(f"<{tag}> loads from the network: {url}")
        elif not _local_target(page, url).is_file():
            problems.append(f"<{tag}> points to a missing file: {url}")
    return problems


@cache
def _ids(path: Path) -> frozenset[str]:
    dom = parse_html(path.read_text(encoding="utf-8", errors="replace"))
    ids = {el.attrs["id"] for el in dom.iter() if "id" in el.attrs}
    ids |= {el.attrs["name"] for el in dom.find_all("a") if "name" in el.attrs}
    return frozenset(ids)


def link_problems(page: Path, html: str) -> list[str]:
    """Internal links (``<a href>`` and a meta refresh) whose file or #fragment does not exist."""
    problems = []
    dom = parse_html(html)
    hrefs = [el.attrs.get("href", "") for el in dom.find_all("a")]
    for meta in dom.find_all("meta"):
        if meta.attrs.get("http-equiv", "").lower() == "refresh":
            match = re.search(r"url=(.+)$", meta.attrs.get("content", ""), re.I)
            if match:
                hrefs.append(match.group(1).strip().strip("'\""))
    for href in hrefs:
        if not href or href == "#" or _is_external(href):
            continue
        parts = urlsplit(href)
        target = _local_target(page, href)
        if not target.exists():
            problems.append(f"link to a missing file: {href}")
            continue
        fragment = unquote(parts.fragment)
        if fragment and target.suffix == ".html" and fragment not in _ids(target.resolve()):
            problems.append(f"link to a missing anchor: {href}")
    return problems


def network_requests(netlog: dict) -> list[str]:
    """URLs the page asked the network for, from Chromium's --log-net-log JSON.

    Requests made by the page carry its site (``file://``) in their network isolation key;
    Chromium's own background requests (updates, time) do not, and are left out.
    """
    types = {number: name for name, number in netlog["constants"]["logEventTypes"].items()}
    urls = []
    for event in netlog.get("events", []):
        params = event.get("params") or {}
        if types.get(event.get("type")) == "URL_REQUEST_START_JOB" and str(
            params.get("network_isolation_key", "")
        ).startswith("file://"):
            url = params.get("url", "")
            if not url.startswith(("file:", "data:", "blob:")) and url not in urls:
                urls.append(url)
    return urls


# What a reader sees laid out, as LAYOUT_PROBE measures it in the page at each width.
# Matplotlib draws the book's figures at 100 dpi, so their 10-pt text is 10 / 72 * 100 = 13.9 px tall
# at full size; shown narrower than drawn, it shrinks in proportion. Under 9 px it is hard to read.
FIGURE_TEXT_PX = 10 / 72 * 100
MIN_TEXT_PX = 9.0


# The widths the layout is checked at (CSS pixels): a phone, a laptop, a wide screen. From
# WRAP_FROM px the column holds the book's 88-character lines, and printed output wraps there
# (book.css); below it printed output keeps its lines and scrolls sideways.
WIDTHS = (1280, 1600, 390)  # the phone last: the switch to a phone's viewport costs a full relayout
PHONE = 390
WRAP_FROM = 960


def figure_problems(layout: dict) -> list[str]:
    """Figures shown so much narrower than they were drawn that their 10-pt text falls under
    MIN_TEXT_PX."""
    problems = []
    for figure in layout["figures"]:
        natural, shown = figure["natural"], figure["shown"]
        if natural <= 0:
            continue  # not loaded: image_problems reports it
        text_px = FIGURE_TEXT_PX * min(1.0, shown / natural)
        if text_px < MIN_TEXT_PX:
            problems.append(
                f"figure {figure['src'][-50:]} drawn {natural} px wide is shown at {shown:.0f} px: its "
                f"10-pt text is {text_px:.1f} px tall (at least {MIN_TEXT_PX:g}); draw it narrower"
            )
    return problems


def page_scroll_problems(layout: dict) -> list[str]:
    """The page scrolls sideways: the document is wider than the window (naming what sticks out)."""
    if layout["scrollWidth"] <= layout["viewport"] + 1:
        return []
    return [f"the page scrolls sideways: {layout['scrollWidth']} px wide in a {layout['viewport']} px window; "
            f"sticking out: {'; '.join(layout['overflow']) or 'nothing found'}"]


def output_problems(layout: dict) -> list[str]:
    """A library listing (a code block in a cell's output) keeps its lines at every width, as a code
    cell does. Printed output keeps its lines too below WRAP_FROM px and scrolls sideways when it is
    wider than the column (a table stays a table; nothing is cut off); from WRAP_FROM px it wraps at
    the column."""
    problems = []
    wraps = layout["viewport"] >= WRAP_FROM
    for block in layout["blocks"]:
        what = f"{'a listing' if block['listing'] else 'printed output'} {block['text']!r}"
        if block["listing"] or not wraps:
            if block["whiteSpace"] != "pre":
                problems.append(f"{what} wraps its lines (white-space: {block['whiteSpace']})")
            elif block["wider"] and block["overflowX"] not in ("auto", "scroll"):
                problems.append(f"{what} is wider than the column and cut off (overflow-x: {block['overflowX']})")
        elif block["whiteSpace"] != "pre-wrap":
            problems.append(f"{what} does not wrap at the column (white-space: {block['whiteSpace']})")
    return problems


def formula_problems(layout: dict) -> list[str]:
    """Formulas wider than their box that are cut off instead of scrolling, and formulas that fit
    but carry a scroll bar anyway."""
    problems = []
    for formula in layout["formulas"]:
        if formula["cut"]:
            problems.append(f"formula {formula['text']!r} is cut off at the column's edge (no scroll bar)")
        if formula["needlessBar"]:
            problems.append(f"formula {formula['text']!r} fits its line but carries a scroll bar")
    return problems


def contents_links(html: str) -> int:
    """The number of top-level entries (a link each) in a page's in-page contents (the theme's
    ``nav.page-toc``), as Sphinx wrote them; 0 for a page without sections. (The entries below
    them unfold as the reader scrolls into their section.)"""
    count = 0
    for nav in parse_html(html).find_all("nav"):
        if "page-toc" in nav.classes:
            for ul in (child for child in nav.children if isinstance(child, Element) and child.tag == "ul"):
                for li in (child for child in ul.children if isinstance(child, Element) and child.tag == "li"):
                    count += any(isinstance(c, Element) and c.tag == "a" for c in li.children)
    return count


def contents_problems(layout: dict, expected: int) -> list[str]:
    """The page's in-page contents cannot be reached: fewer of its ``expected`` links are on screen
    beside the column, or in the panel its button opens, than Sphinx wrote."""
    contents = layout["contents"]
    if expected and contents["links"] < expected:
        return [f"in-page contents: {contents['links']} of its {expected} links can be reached ({contents['how']})"]
    return []


def formula_table_problems(key_ideas_html: str, chapters: set[str]) -> list[str]:
    """The chapters (page names, no extension) that the Key ideas page's formulas table does not
    link."""
    start = key_ideas_html.find('id="formulas"')
    if start < 0:
        return ["the Key ideas page has no Formulas section"]
    end = key_ideas_html.find("</table>", start)
    linked = set(re.findall(r'href="(\w+)\.html[#"]', key_ideas_html[start:end]))
    return [f"the formulas table does not link {name}" for name in sorted(chapters - linked)]


# ---------------------------------------------------------------------------------------------
# Loading the pages in Chromium
# ---------------------------------------------------------------------------------------------

# Run in every page before its own scripts: records JavaScript errors and failed loads of scripts,
# stylesheets and images on the <html> element (``data-page-errors``, read by error_problems).
ERROR_PROBE = """(function () {
  var errors = [];
  function note(text) {
    errors.push(text);
    document.documentElement.setAttribute("data-page-errors", JSON.stringify(errors));
  }
  window.addEventListener("error", function (event) {
    var t = event.target;
    if (t && t !== window && (t.src || t.href)) { note("failed to load " + (t.src || t.href)); }
    else { note("JavaScript error: " + event.message); }
  }, true);
  window.addEventListener("unhandledrejection", function (event) {
    note("unhandled promise rejection: " + event.reason);
  });
})();"""
# Run in the page once it has loaded: waits (at most 20 s) for MathJax's formulas and the fonts,
# and records every image's naturalWidth (read by image_problems).
SETTLE = """(async function () {
  var ready = (async function () {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
    await document.fonts.ready;
  })();
  await Promise.race([ready, new Promise(function (done) { setTimeout(done, 20000); })]);
  document.querySelectorAll("img").forEach(function (img) {
    img.setAttribute("data-natural-width", img.complete ? img.naturalWidth : 0);
  });
})()"""
WINDOW = (1280, 1000)  # the window every page is loaded in: a laptop's screen, in CSS pixels
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--allow-file-access-from-files",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no name resolves: the page must need no network
)


def find_chromium() -> str | None:
    """Debian's chromium, or the browser named by ATTNBOOK_CHROMIUM (then only that one)."""
    named = os.environ.get("ATTNBOOK_CHROMIUM")
    for candidate in [named] if named else ["/usr/bin/chromium", "chromium", "chromium-browser"]:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def list_pages(site: Path = SITE) -> list[str]:
    """Every page of the site (relative paths), except the generated index and search pages."""
    if not site.is_dir():
        return []
    pages = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site)
        if any(part.startswith(("_", ".")) for part in rel.parts) or rel.as_posix() in GENERATED_PAGES:
            continue
        pages.append(rel.as_posix())
    return pages


def is_redirect(html: str) -> bool:
    return any(meta.attrs.get("http-equiv", "").lower() == "refresh" for meta in parse_html(html).find_all("meta"))


@dataclass
class Rendered:
    """A page as Chromium showed it: its DOM (at 1,280 px), the network requests it made, its
    layout at each of WIDTHS (``DevTools.read_page``), or the error that stopped the browser."""

    dom: str = ""
    requests: list[str] = field(default_factory=list)
    error: str = ""
    layouts: dict[int, dict] = field(default_factory=dict)


def render(
    chromium: str, page_file: Path, workdir: Path, window: tuple[int, int] = WINDOW, query: str = ""
) -> Rendered:
    """Load one page in headless Chromium (a ``window`` of width, height CSS pixels; ``query``
    appended to its URL), network cut off; return its DOM and network requests. One process a
    page, ``--dump-dom`` after 5 s of the page's own (virtual) time: for a page that works on
    after it has loaded (the search page); ``DevTools`` loads the book's pages."""
    profile = Path(tempfile.mkdtemp(prefix="profile-", dir=workdir))
    netlog = profile.with_suffix(".netlog.json")
    command = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--log-net-log={netlog}",
        f"--user-data-dir={profile}",
        f"--window-size={window[0]},{window[1]}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        page_file.as_uri() + query,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Rendered(error=f"Chromium did not finish within {PAGE_TIMEOUT_S} s")
    if result.returncode != 0 or "<html" not in result.stdout:
        return Rendered(error=f"Chromium failed (exit {result.returncode}): {result.stderr[-2000:]}")
    try:
        requests = network_requests(json.loads(netlog.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError) as error:
        return Rendered(error=f"Chromium's network log {netlog} is unreadable: {error}")
    return Rendered(dom=result.stdout, requests=requests)


# ---------------------------------------------------------------------------------------------
# Measuring the layout at several widths: one Chromium over the DevTools protocol
# ---------------------------------------------------------------------------------------------

# Run in the page at each width (``width``: the window's width in CSS pixels) once its formulas and
# fonts are in: what a reader meets there. See layout checkers above for what each field means.
LAYOUT_PROBE = """async function (width) {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await document.fonts.ready;
  await new Promise(function (done) { requestAnimationFrame(function () { requestAnimationFrame(done); }); });
  var root = document.documentElement;
  var viewport = Math.min(root.clientWidth, width);
  function describe(el) {
    var classes = typeof el.className === "string" ? el.className.trim().split(/\\s+/).slice(0, 2) : [];
    var text = (el.textContent || "").replace(/\\s+/g, " ").trim().slice(0, 50);
    return el.tagName.toLowerCase() + (classes[0] ? "." + classes.join(".") : "") + " " + JSON.stringify(text);
  }
  function shown(el) {  // laid out on the page: not hidden, not in a closed or fixed panel
    for (var a = el; a && a !== root; a = a.parentElement) {
      var style = getComputedStyle(a);
      if (style.display === "none" || style.visibility === "hidden" || style.position === "fixed") return false;
    }
    return true;
  }
  function sticksOut(el) {  // past the window's right edge, and no box of its own clips it
    var box = el.getBoundingClientRect();
    if (box.width === 0 || box.right <= viewport + 1) return false;
    for (var a = el.parentElement; a && a !== root; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== "visible" && a.getBoundingClientRect().right <= viewport + 1) return false;
    }
    return shown(el);
  }
  var overflow = [];
  if (root.scrollWidth > viewport + 1) {
    document.querySelectorAll("body *").forEach(function (el) {
      if (overflow.length < 5 && sticksOut(el) && !(el.parentElement && sticksOut(el.parentElement))) {
        overflow.push(describe(el));
      }
    });
  }
  var blocks = Array.from(document.querySelectorAll("div.cell_output pre")).map(function (pre) {
    var style = getComputedStyle(pre);
    return {listing: !pre.closest(".output"), whiteSpace: style.whiteSpace, overflowX: style.overflowX,
            wider: pre.scrollWidth > pre.clientWidth + 1,
            text: pre.textContent.trim().split("\\n")[0].slice(0, 50)};
  });
  var formulas = [];
  document.querySelectorAll("mjx-container").forEach(function (container) {
    var math = container.querySelector("mjx-math");
    if (!math || !shown(container)) return;
    var clip = null;  // the nearest box that clips the formula (or scrolls it)
    for (var a = math.parentElement; a && a !== root && !clip; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== "visible") clip = a;
    }
    if (!clip) return;  // nothing clips it: if it is too wide, the page scrolls (checked above)
    var box = math.getBoundingClientRect(), edge = clip.getBoundingClientRect();
    var scrolls = /auto|scroll/.test(getComputedStyle(clip).overflowX);
    var cut = !scrolls && (box.right > edge.right + 1 || box.left < edge.left - 1);
    var needlessBar = scrolls && clip.scrollWidth > clip.clientWidth && box.width <= clip.clientWidth;
    if (cut || needlessBar) {
      var text = (container.querySelector("mjx-assistive-mml") || container).textContent;
      formulas.push({text: text.replace(/\\s+/g, " ").trim().slice(0, 50), cut: cut, needlessBar: needlessBar});
    }
  });
  var figures = Array.from(document.querySelectorAll("article img")).map(function (img) {
    return {src: img.getAttribute("src"), natural: img.naturalWidth, shown: img.getBoundingClientRect().width};
  });
  // The in-page contents: its links on screen beside the column, or else in the panel that the
  // visible "Contents" button opens (the button is clicked, the panel closed again).
  function onScreen(el) {
    var box = el.getBoundingClientRect();
    return box.width > 0 && box.height > 0 && box.left >= -1 && box.right <= viewport + 1 &&
      getComputedStyle(el).visibility !== "hidden";
  }
  function reachable(el) {
    return el ? Array.from(el.querySelectorAll("nav.page-toc a")).filter(onScreen).length : 0;
  }
  var contents = {links: reachable(document.getElementById("pst-secondary-sidebar")), how: "beside the column"};
  if (!contents.links) {
    var button = Array.from(document.querySelectorAll(".secondary-toggle")).filter(onScreen)[0];
    var panel = document.getElementById("pst-secondary-sidebar-modal");
    contents.how = button ? "the panel its button opens" : "no contents beside the column, no button on screen";
    if (button && panel) {
      button.click();
      var entries = document.querySelectorAll("nav.page-toc > ul > li > a").length;
      for (var tries = 0; tries < 20 && contents.links < entries; tries++) {  // the panel slides in
        await new Promise(function (done) { setTimeout(done, 50); });
        contents.links = panel.open ? reachable(panel) : 0;
      }
      if (panel.open) panel.close();
      await new Promise(function (done) { setTimeout(done, 0); });  // the panel's links go back
    }
  }
  return {viewport: viewport, scrollWidth: root.scrollWidth, overflow: overflow, blocks: blocks,
          formulas: formulas, figures: figures, contents: contents};
}"""


def _high_fd(fd: int) -> int:
    """The same pipe end as ``fd`` on a descriptor number of 10 or more (``fd`` is closed)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class DevTools:
    """One headless Chromium, driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: JSON messages ended by a NUL byte, which Chromium reads on its
    file descriptor 3 and writes on 4). It loads page after page in one tab and lays a loaded page
    out at several widths without loading it again. Offline like ``render``: no name resolves."""

    def __init__(self, chromium: str, workdir: Path) -> None:
        profile = Path(tempfile.mkdtemp(prefix="profile-", dir=workdir))
        to_browser, self._commands = (_high_fd(fd) for fd in os.pipe())
        self._replies, from_browser = (_high_fd(fd) for fd in os.pipe())
        # Bash hands Chromium the two pipes as its descriptors 3 and 4 (no preexec_fn: the
        # browsers are started from threads); the pipes sit above 9, clear of 3 and 4.
        shell = f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-'
        self.process = subprocess.Popen(
            ["/bin/bash", "-c", shell, chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             "--remote-debugging-pipe", "about:blank"],
            pass_fds=(to_browser, from_browser), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._last_id, self._events = b"", 0, []
        self._session = None
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Network.enable")
        self.send("Page.addScriptToEvaluateOnNewDocument", {"source": ERROR_PROBE})

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {PAGE_TIMEOUT_S} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe (it crashed?)")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None) -> dict:
        """Send one command (to the tab, once it is attached) and return its result."""
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if self._session:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def load(self, page_file: Path, width: int = WINDOW[0]) -> None:
        """Load a page in a window ``width`` CSS pixels wide and wait for its load event."""
        self._events.clear()
        self.resize(width)
        self.send("Page.navigate", {"url": page_file.as_uri()})
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while not any(event.get("method") == "Page.loadEventFired" for event in self._events):
            self._events.append(self._receive(deadline))

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True})  # fmt: skip
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"JavaScript error: {details.get('exception', {}).get('description') or details}")
        return result["result"].get("value")

    def resize(self, width: int) -> None:
        """A window ``width`` CSS pixels wide (a phone's under 576 px: the page's viewport settings
        apply and scroll bars float over the page)."""
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": width < 576})  # fmt: skip

    def layout(self, width: int) -> dict:
        """The loaded page laid out in a window ``width`` CSS pixels wide (LAYOUT_PROBE)."""
        self.resize(width)
        return self.evaluate(f"({LAYOUT_PROBE})({width})")

    def requests(self) -> list[str]:
        """The URLs outside the site that the page loaded last asked for."""
        urls = []
        for event in self._events:
            if event.get("method") == "Network.requestWillBeSent":
                url = event["params"]["request"]["url"]
                if not url.startswith(("file:", "data:", "blob:")) and url not in urls:
                    urls.append(url)
        return urls

    def read_page(self, page_file: Path, widths: tuple[int, ...] = WIDTHS) -> Rendered:
        """Load a page at the first of ``widths``, wait for its formulas, take its DOM, then lay it
        out at each width."""
        self.load(page_file, widths[0])
        self.evaluate(SETTLE)
        dom = self.evaluate("document.documentElement.outerHTML")
        layouts = {width: self.layout(width) for width in widths}
        return Rendered(dom=dom, requests=self.requests(), layouts=layouts)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (OSError, TimeoutError, EOFError, RuntimeError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_pages(chromium: str, pages: dict[str, Path], workdir: Path) -> dict[str, Rendered]:
    """Each page read once by one browser (``DevTools.read_page``); a page that stops the browser
    gets the error, and a fresh browser goes on with the next page."""
    found: dict[str, Rendered] = {}
    browser = DevTools(chromium, workdir)
    try:
        for page, path in pages.items():
            try:
                found[page] = browser.read_page(path)
            except (OSError, TimeoutError, EOFError, RuntimeError) as error:
                found[page] = Rendered(error=f"{type(error).__name__}: {error}")
                browser.close()
                browser = DevTools(chromium, workdir)
    finally:
        browser.close()
    return found


# ---------------------------------------------------------------------------------------------
# The tests of the built site
# ---------------------------------------------------------------------------------------------

PAGES = list_pages()
skip_site = pytest.mark.skipif(SKIP, reason="ATTNBOOK_SKIP_SITE is set")


def chromium_for_the_site() -> str:
    """Chromium's path; fails the test (it does not skip) when Chromium or the built site is missing."""
    chromium = find_chromium()
    if chromium is None:
        pytest.fail("Chromium not found (apt-get install chromium, or set ATTNBOOK_CHROMIUM)")
    if not PAGES:
        pytest.fail(f"no built site at {SITE}: run `make book` first")
    return chromium


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    """Every page read once in Chromium (its DOM, its requests, its layout at each width), by
    WORKERS browsers at a time."""
    chromium = chromium_for_the_site()
    to_read = [p for p in PAGES if not is_redirect((SITE / p).read_text(encoding="utf-8"))]
    shares = [{page: SITE / page for page in to_read[start::WORKERS]} for start in range(WORKERS)]
    found: dict[str, Rendered] = {}
    with tempfile.TemporaryDirectory(prefix="attnbook-site-") as tmp:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            for part in pool.map(lambda share: read_pages(chromium, share, Path(tmp)), shares):
                found.update(part)
    return found


def _page(rendered: dict[str, Rendered], page: str) -> tuple[Path, str, Rendered | None]:
    path = SITE / page
    html = path.read_text(encoding="utf-8")
    result = rendered.get(page)
    if result is not None and result.error:
        pytest.fail(f"{page}: {result.error}")
    return path, html, result


def _report(page: str, problems: list[str]) -> str:
    return f"{page}:\n  " + "\n  ".join(problems)


@skip_site
def test_site_is_built_and_chromium_present():
    assert SITE.joinpath("index.html").is_file(), f"no built site at {SITE}: run `make book` first"
    assert PAGES, f"no pages in {SITE}"
    assert find_chromium(), "Chromium not found (apt-get install chromium, or set ATTNBOOK_CHROMIUM)"
    # The pages the table of contents names are all there.
    toc = (ROOT / "_toc.yml").read_text(encoding="utf-8")
    for name in re.findall(r"^\s*(?:-\s*file|root):\s*(\S+)", toc, re.M):
        assert (SITE / f"{name}.html").is_file(), f"{name} is in _toc.yml but not in the built site"


def citation_problems(references_html: str, chapter_pages: dict[str, str]) -> list[str]:
    """A citation in the text must read as its entry is labelled on the references page: one style
    ("Vaswani et al., 2017") for both, not "[Vaswani et al., 2017]" in the text and "[VSP+17]" in the list."""
    references_html = references_html.replace("\xa0", " ")  # a no-break space reads as a space
    labels = set(re.findall(r'class="label"><span class="fn-bracket">\[</span>(.*?)<span class="fn-bracket">\]',
                            references_html))
    problems = [f"references page label {label!r} is not 'Author(s), year'" for label in sorted(labels)
                if not re.fullmatch(r".+, (\d{4}|n\.d\.)[a-z]?", label)]
    if not labels:
        problems.append("no labelled entries on the references page")
    for page, html in chapter_pages.items():
        for link in re.findall(r'<a class="reference internal" href="references\.html#[^"]+"[^>]*>(.*?)</a>', html):
            text = re.sub(r"<[^>]+>", "", link).replace("\xa0", " ").strip()
            if ", " in text and text not in labels:  # "2017" alone is the year of a textual citation
                problems.append(f"{page}: citation {text!r} matches no label of the references page")
    return problems


@skip_site
def test_citations_read_as_the_references_page_labels_them():
    references = SITE / "book" / "references.html"
    assert references.is_file(), f"no references page in {SITE}: run `make book` first"
    chapters = {page: (SITE / page).read_text(encoding="utf-8") for page in PAGES}
    problems = citation_problems(references.read_text(encoding="utf-8"), chapters)
    assert not problems, "\n".join(problems[:20])


@skip_site
def test_landing_page_has_a_description_and_every_page_a_favicon():
    intro = (SITE / "book" / "intro.html").read_text(encoding="utf-8")
    assert re.search(r'<meta content="[^"]{50,}"[^>]*name="description"', intro), "no page description"
    missing = [page for page in PAGES
               if not is_redirect((SITE / page).read_text(encoding="utf-8"))
               and 'rel="icon"' not in (SITE / page).read_text(encoding="utf-8")]
    assert not missing, f"pages without a favicon: {missing[:5]}"


def solution_label_problems(page: str, html: str) -> list[str]:
    """After a page's "Exercises" heading every folded cell reads "Show solution", not the generic
    "Show code cell content"; a page with exercises has at least one solution."""
    start = html.find('id="exercises"')
    if start < 0:
        return []
    end = html.find("<section", start + 1)
    exercises = html[start : end if end > 0 else len(html)]
    problems = [f"{page}: a solution folded as {label!r}" for label in
                re.findall(r'class="collapsed admonition-title">(Show code cell \w+)<', exercises)]
    if "Show solution" not in exercises:
        problems.append(f"{page}: an Exercises section with no 'Show solution'")
    return problems


@skip_site
def test_exercise_solutions_fold_under_show_solution():
    with_exercises = [page for page in PAGES if 'id="exercises"' in (SITE / page).read_text(encoding="utf-8")]
    assert len(with_exercises) >= 15, f"only {len(with_exercises)} pages with exercises"
    problems = [p for page in with_exercises
                for p in solution_label_problems(page, (SITE / page).read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems[:20])


def test_solution_label_checker():
    fold = '<p class="collapsed admonition-title">{}</p>'
    good = '<section id="exercises"><h2>Exercises</h2>' + fold.format("Show solution") + "</section>"
    assert solution_label_problems("a.html", good) == []
    generic = good.replace("Show solution", "Show code cell content")
    assert len(solution_label_problems("a.html", generic)) == 2
    earlier = fold.format("Show code cell content") + good  # a folded cell before the exercises is fine
    assert solution_label_problems("a.html", earlier) == []
    assert solution_label_problems("a.html", "<p>no exercises</p>") == []


def test_citation_checker():
    references = ('<div class="citation"><span class="label"><span class="fn-bracket">[</span>Vaswani et al., 2017'
                  '<span class="fn-bracket">]</span></span></div>')
    good = '<a class="reference internal" href="references.html#id2" title="x">Vaswani et al., 2017</a>'
    assert citation_problems(references, {"a.html": good}) == []
    nbsp = good.replace("Vaswani et al., 2017", "van\xa0den Oord et al., 2016")
    assert citation_problems(references.replace("Vaswani et al., 2017", "van den Oord et al., 2016"),
                             {"a.html": nbsp}) == []
    alpha = references.replace("Vaswani et al., 2017", "VSP+17")
    assert any("not 'Author(s), year'" in p for p in citation_problems(alpha, {"a.html": good}))
    assert any("matches no label" in p for p in citation_problems(alpha, {"a.html": good}))


@skip_site
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_math_rendered(rendered, page):
    path, html, result = _page(rendered, page)
    if result is None:  # a redirect page
        return
    problems = math_problems(result.dom)
    expected, found = count_formulas(html), len(parse_html(result.dom).find_all("mjx-container"))
    if found < expected:
        problems.append(f"{expected} formulas on the page but only {found} rendered by MathJax")
    assert not problems, _report(page, problems)


@skip_site
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_images_loaded(rendered, page):
    path, html, result = _page(rendered, page)
    problems = image_problems(path, html, result.dom if result else None)
    assert not problems, _report(page, problems)


@skip_site
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_no_error_output(rendered, page):
    path, html, result = _page(rendered, page)
    problems = error_problems(result.dom if result else html)
    assert not problems, _report(page, problems)


@skip_site
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_internal_links_resolve(rendered, page):
    path, html, _ = _page(rendered, page)
    problems = link_problems(path, html)
    assert not problems, _report(page, problems)


@skip_site
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_no_network(rendered, page):
    path, html, result = _page(rendered, page)
    problems = resource_problems(path, html)
    problems += [f"the page requested {url}" for url in (result.requests if result else [])]
    assert not problems, _report(page, problems)


@skip_site
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_layout(rendered, page, width):
    """At each width: no sideways scroll, no formula cut off, listings and printed output laid out
    as book.css promises, the in-page contents within reach; at 1,280 px, figures readable."""
    path, html, result = _page(rendered, page)
    if result is None:  # a redirect page
        return
    layout = result.layouts[width]
    assert layout["viewport"] <= width, layout["viewport"]
    problems = page_scroll_problems(layout) + output_problems(layout) + formula_problems(layout)
    problems += contents_problems(layout, contents_links(html))
    if width == WINDOW[0]:
        problems += figure_problems(layout)
    assert not problems, _report(f"{page} at {width} px", problems)


@skip_site
def test_intro_states_the_archive_size_as_built():
    """The first page gives the source archive's size as measured when the site was built
    (book/_ext/archive_size.py), not a size typed into book/intro.md."""
    import importlib.util

    archives = list(SITE.glob("_downloads/*/attention-and-transformers.zip"))
    assert len(archives) == 1, f"the site should hold one source archive, found {archives}"
    spec = importlib.util.spec_from_file_location("archive_size", ROOT / "book" / "_ext" / "archive_size.py")
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    size = extension.size_in_words(archives[0].stat().st_size)
    intro = parse_html((SITE / "book" / "intro.html").read_text(encoding="utf-8")).text()
    assert re.search(rf"(?<![\d.]){re.escape(size)}\b", intro), f"the intro does not say {size!r}"
    typed = re.findall(r"\d+(?:\.\d+)? [kM]B\b", (ROOT / "book" / "intro.md").read_text(encoding="utf-8"))
    assert not typed, f"book/intro.md types a size ({typed}): use {{{{ archive_size }}}}"


@skip_site
def test_key_ideas_formulas_link_every_chapter():
    html = (SITE / "book" / "key_ideas.html").read_text(encoding="utf-8")
    problems = formula_table_problems(html, chapters_with_formula())
    assert not problems, "\n".join(problems)


@skip_site
def test_search_lists_each_page_once():
    """"induction" matches a glossary term and the glossary's text, and a chapter's title and
    text: each page is listed once (_static/search-once.js)."""
    chromium = chromium_for_the_site()
    with tempfile.TemporaryDirectory(prefix="attnbook-search-") as tmp:
        result = render(chromium, SITE / "search.html", Path(tmp), query="?q=induction")
    assert not result.error, result.error
    results = parse_html(result.dom).find_all("ul", cls="search")
    assert results, "no search results on the page"
    pages = [a.attrs["href"].split("#")[0] for li in results[0].find_all("li") for a in li.find_all("a")[:1]]
    assert {"book/glossary.html", "book/16_induction_heads.html"} <= set(pages), pages
    assert len(pages) == len(set(pages)), pages


# ---------------------------------------------------------------------------------------------
# The checkers catch what they are meant to catch (crafted HTML; no browser needed)
# ---------------------------------------------------------------------------------------------

RENDERED_OK = """<html><body><p>Divide by <span class="math notranslate nohighlight"><mjx-container
jax="CHTML"><mjx-math><mjx-c></mjx-c></mjx-math><mjx-assistive-mml><math><mi>d</mi></math>
</mjx-assistive-mml></mjx-container></span>: a price of $5 or $10 is not math.</p>
<div class="highlight"><pre>cost = "$x$"  # code may hold dollars: $a$ \\(b\\)</pre></div>
<div class="cell_output"><pre>$y$ printed</pre></div></body></html>"""


def test_math_checker_accepts_rendered_math():
    assert math_problems(RENDERED_OK) == []
    assert count_formulas(RENDERED_OK) == 1


@pytest.mark.parametrize(
    "raw",
    [
        "the scale $\\sqrt{d}$ here",
        "a one-letter $x$ formula",
        "display $$\\sum_i w_i = 1$$ math",
        "inline \\(q^\\top k\\) math",
        "display \\[a = b\\] math",
        "\\begin{align} a &= b \\end{align}",
        # a formula cut by a line that Markdown read as a list item: half of it is left raw
        "<ul><li>\\mathrm{Sublayer}(\\mathbf{x}))$, post-norm</li></ul>",
        "a lone $ sign",
        "the command \\mathrm{LayerNorm} outside a formula",
    ],
)
def test_math_checker_catches_raw_tex(raw):
    problems = math_problems(f"<html><body><p>{raw}</p></body></html>")
    assert any("raw TeX" in p for p in problems), problems


def test_math_checker_catches_unrendered_and_broken_formulas():
    unrendered = '<html><body><p><span class="math notranslate nohighlight">\\(x\\)</span></p></body></html>'
    assert any("not rendered" in p for p in math_problems(unrendered))
    broken = (
        '<html><body><span class="math"><mjx-container><mjx-merror data-mjx-error="Undefined control '
        'sequence \\foo"></mjx-merror></mjx-container></span></body></html>'
    )
    assert any("MathJax error" in p for p in math_problems(broken))


def test_error_checker():
    clean = (
        '<html><body><div class="output stream highlight-myst-ansi"><pre>ok</pre></div>'
        '<div class="output stderr"><pre>100%|##########| 50/50 [00:01&lt;00:00]</pre></div></body></html>'
    )
    assert error_problems(clean) == []
    traceback = '<html><body><pre>Traceback (most recent call last):\n  File "x"</pre></body></html>'
    assert error_problems(traceback)
    error_cell = '<html><body><div class="output traceback highlight-ipythontb"><pre>ZeroDivisionError</pre></div>'
    assert error_problems(error_cell)
    warning = '<html><body><div class="output stderr"><pre>UserWarning: something</pre></div></body></html>'
    assert error_problems(warning)
    system_message = '<html><body><div class="system-message">Unknown directive type</div></body></html>'
    assert error_problems(system_message)
    js_error = """<html data-page-errors='["JavaScript error: x is not defined"]'><body></body></html>"""
    assert error_problems(js_error)


def test_image_checker(tmp_path):
    page = tmp_path / "book" / "page.html"
    (tmp_path / "_images").mkdir()
    page.parent.mkdir()
    (tmp_path / "_images" / "good.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 32)
    (tmp_path / "_images" / "empty.png").write_bytes(b"")
    (tmp_path / "_images" / "text.png").write_text("not a picture")
    html = '<html><body><img alt="Figure: loss against steps" src="../_images/{}"></body></html>'
    assert image_problems(page, html.format("good.png")) == []
    for alt in ("", ' alt="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08.png"',
                ' alt="good.png"'):
        assert any("alt text" in p for p in image_problems(page, f'<img{alt} src="../_images/good.png">'))
    assert image_problems(page, html.format("missing.png"))
    assert image_problems(page, html.format("empty.png"))
    assert image_problems(page, html.format("text.png"))
    assert image_problems(page, '<img alt="a remote figure" src="https://example.com/a.png">')
    loaded = '<img src="../_images/good.png" data-natural-width="640">'
    broken = '<img src="../_images/good.png" data-natural-width="0">'
    assert image_problems(page, html.format("good.png"), loaded) == []
    assert image_problems(page, html.format("good.png"), broken)


def test_link_checker(tmp_path):
    (tmp_path / "book").mkdir()
    page = tmp_path / "book" / "a.html"
    (tmp_path / "book" / "b.html").write_text('<html><body><section id="summary">x</section></body></html>')
    page.write_text('<html><body><p id="top">x</p></body></html>')
    ok = (
        '<a href="b.html">b</a><a href="b.html#summary">s</a><a href="#top">t</a><a href="#">menu</a>'
        '<a href="https://arxiv.org/abs/1706.03762">paper</a><a href="mailto:a@b.c">mail</a>'
    )
    assert link_problems(page, ok) == []
    assert link_problems(page, '<a href="c.html">gone</a>')
    assert link_problems(page, '<a href="b.html#nowhere">gone</a>')
    assert link_problems(page, '<a href="#nowhere">gone</a>')
    assert link_problems(page, '<meta http-equiv="Refresh" content="0; url=c.html">')


def test_resource_checker(tmp_path):
    page = tmp_path / "page.html"
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "a.js").write_text("")
    assert resource_problems(page, '<script src="_static/a.js?v=1"></script><script>inline()</script>') == []
    assert resource_problems(page, '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex.js"></script>')
    assert resource_problems(page, '<link rel="stylesheet" href="//fonts.googleapis.com/css">')
    assert resource_problems(page, '<script src="_static/missing.js"></script>')


def test_network_log_reader():
    netlog = {
        "constants": {"logEventTypes": {"URL_REQUEST_START_JOB": 7}},
        "events": [
            {"type": 7, "params": {"url": "https://cdn.example/x.js", "network_isolation_key": "file:// file://"}},
            {"type": 7, "params": {"url": "https://update.googleapis.com/x", "network_isolation_key": "null null"}},
        ],
    }
    assert network_requests(netlog) == ["https://cdn.example/x.js"]


def test_author_year_label_keeps_the_von_part():
    """The references page must label an entry as the text cites it: "van den Oord et al., 2016"."""
    import importlib.util

    from pybtex.database import Entry, Person

    spec = importlib.util.spec_from_file_location("labels", ROOT / "book" / "_ext" / "author_year_labels.py")
    labels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(labels)
    entry = Entry("misc", fields={"year": "2016"},
                  persons={"author": [Person("van den Oord, Aäron"), Person("Dieleman, Sander"),
                                      Person("Zen, Heiga")]})
    assert labels.author_year_label(entry) == "van den Oord et al., 2016"
    two = Entry("misc", fields={"year": "2014"}, persons={"author": [Person("Graves, Alex"),
                                                                   Person("Jaitly, Navdeep")]})
    assert labels.author_year_label(two) == "Graves and Jaitly, 2014"


def _layout(viewport: int = 1280, **fields) -> dict:
    layout = {"viewport": viewport, "scrollWidth": viewport, "overflow": [], "blocks": [], "formulas": [],
              "figures": [], "contents": {"links": 3, "how": "beside the column"}}
    return {**layout, **fields}


def test_layout_checkers():
    listing = {"listing": True, "whiteSpace": "pre", "overflowX": "auto", "wider": True, "text": "def f():"}
    printed = {"listing": False, "whiteSpace": "pre-wrap", "overflowX": "auto", "wider": False, "text": "loss 0.1"}
    wide = _layout(blocks=[listing, printed], figures=[{"src": "a.png", "natural": 900, "shown": 896}])
    assert page_scroll_problems(wide) == output_problems(wide) == formula_problems(wide) == []
    assert figure_problems(wide) == [] and contents_problems(wide, 3) == []
    # a 16-inch figure in an 896-px column: 13.9 px text shown at 7.7 px
    narrow_figure = _layout(figures=[{"src": "b.png", "natural": 1607, "shown": 896}])
    assert len(figure_problems(narrow_figure)) == 1 and "7.7 px" in figure_problems(narrow_figure)[0]
    assert figure_problems(_layout(figures=[{"src": "c.png", "natural": 0, "shown": 0}])) == []
    # on a phone printed output keeps its lines and scrolls; from WRAP_FROM px it wraps
    table = {**printed, "whiteSpace": "pre", "wider": True}
    assert output_problems(_layout(390, blocks=[listing, table])) == []
    assert "wraps its lines" in output_problems(_layout(390, blocks=[printed]))[0]
    assert "cut off" in output_problems(_layout(390, blocks=[{**table, "overflowX": "hidden"}]))[0]
    assert "does not wrap" in output_problems(_layout(1280, blocks=[table]))[0]
    assert output_problems(_layout(390, blocks=[{**listing, "whiteSpace": "pre-wrap"}])) == [
        "a listing 'def f():' wraps its lines (white-space: pre-wrap)"]
    sideways = _layout(390, scrollWidth=437, overflow=['code.docutils.literal "torch.distributed"'])
    assert "437 px wide in a 390 px window" in page_scroll_problems(sideways)[0]
    assert "torch.distributed" in page_scroll_problems(sideways)[0]
    cut = {"text": "softmax(x)", "cut": True, "needlessBar": False}
    assert "cut off" in formula_problems(_layout(formulas=[cut]))[0]
    bar = {"text": "L", "cut": False, "needlessBar": True}
    assert "scroll bar" in formula_problems(_layout(formulas=[bar]))[0]
    hidden = _layout(contents={"links": 0, "how": "no contents beside the column, no button on screen"})
    assert "0 of its 3 links" in contents_problems(hidden, 3)[0]
    assert contents_problems(hidden, 0) == []  # a page without sections has no contents to reach
    page_toc = ('<nav class="bd-toc-nav page-toc"><ul><li><a href="#a">a</a><ul><li><a href="#a1">a.1</a></li>'
                '</ul></li><li><a href="#b">b</a></li></ul></nav>')
    assert contents_links(page_toc) == 2 and contents_links("<p>no sections</p>") == 0


# A page with one of each problem the browser checks must see, and the same page without them.
CRAFTED_PAGE = """<!DOCTYPE html><html><head><meta name="viewport" content="width=device-width, initial-scale=1">
<style>body {{ margin: 0; }} article {{ width: 100%; }} mjx-math {{ display: inline-block; width: 800px; }}
span.math {{ display: inline-flex; max-width: 100%; overflow-x: {formula}; }}
div.cell_output pre {{ white-space: {output}; overflow-x: auto; }}</style></head><body><article>
<p>A formula <span class="math"><mjx-container><mjx-math>x</mjx-math></mjx-container></span> here.</p>
<div class="cell_output"><div class="output"><pre>{row}</pre></div></div>
<div style="width: {wide}px">a box</div>{extra}
<div id="pst-secondary-sidebar" style="display: {contents}"><nav class="page-toc"><a href="#x">x</a></nav></div>
</article></body></html>"""


def test_devtools_reader_sees_each_problem(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.fail("Chromium not found (apt-get install chromium, or set ATTNBOOK_CHROMIUM)")
    bad, good = tmp_path / "bad.html", tmp_path / "good.html"
    row = "  ".join(f"column{i}" for i in range(30))
    remote = '<img alt="a remote figure" src="http://example.com/a.png"><script>no_such_function();</script>'
    bad.write_text(CRAFTED_PAGE.format(formula="hidden", output="pre-wrap", row=row, wide=900, contents="none",
                                       extra=remote))  # fmt: skip
    good.write_text(CRAFTED_PAGE.format(formula="auto", output="pre", row=row, wide=300, contents="block",
                                        extra=""))  # fmt: skip
    with DevTools(chromium, tmp_path) as browser:
        worse = browser.read_page(bad, widths=(PHONE,))
        fine = browser.read_page(good, widths=(PHONE,))
    assert worse.requests == ["http://example.com/a.png"] and fine.requests == []
    errors = error_problems(worse.dom)
    assert any("no_such_function" in e for e in errors) and any("failed to load" in e for e in errors)
    assert error_problems(fine.dom) == []
    phone = worse.layouts[PHONE]
    assert phone["viewport"] == PHONE
    assert "div" in page_scroll_problems(phone)[0]
    assert "wraps its lines" in output_problems(phone)[0]
    assert "cut off" in formula_problems(phone)[0]
    assert "0 of its 1 links" in contents_problems(phone, 1)[0]  # hidden, and no button
    phone = fine.layouts[PHONE]
    assert page_scroll_problems(phone) == output_problems(phone) == formula_problems(phone) == []
    assert contents_problems(phone, 1) == []
    assert phone["blocks"][0]["wider"]  # the printed row scrolls inside its box


def test_formula_table_checker():
    page = ('<section id="formulas"><table><tr><td><a href="01_attention.html#x">1</a></td></tr>'
            '<tr><td><a href="02_masking.html">2</a></td></tr></table></section>'
            '<p><a href="03_multihead.html">after the table</a></p>')
    assert formula_table_problems(page, {"01_attention", "02_masking"}) == []
    assert formula_table_problems(page, {"03_multihead"}) == ["the formulas table does not link 03_multihead"]
    assert formula_table_problems("<p>none</p>", set()) == ["the Key ideas page has no Formulas section"]
