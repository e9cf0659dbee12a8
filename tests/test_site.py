"""Browser test of the built book (``_build/html``): what a reader sees, checked page by page.

Headless Chromium (Debian's ``chromium``) loads every page of the built site from disk, with the
network cut off, and dumps the DOM after the page's scripts (MathJax) have run. For each page:

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
  local (and exists), and Chromium's network log shows no request made by the page.
- the layout a reader meets (pages at 1,280 px): every figure is shown wide enough that its
  10-pt text stays readable; library listings keep their lines (they scroll sideways, as code
  cells do) while printed output wraps; on a phone (09_vit at Chromium's narrowest window) the
  same holds; from 1,500 px the in-page contents are back beside the column; the Key ideas page's
  formulas table links every chapter of Parts I and II that has a formula.

The test fails (it does not skip) when the site is not built or Chromium is missing; set
``ATTNBOOK_SKIP_SITE=1`` to skip it on purpose. The checker functions are tested at the bottom of
this file on crafted HTML, so a checker that stops catching its problem fails too.

Build the site first: ``make book`` (``make test`` runs this file after the build).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
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


# What a reader sees laid out, from the probe's ``data-layout`` (see PROBE_BODY).
# Matplotlib draws the book's figures at 100 dpi, so their 10-pt text is 10 / 72 * 100 = 13.9 px tall
# at full size; shown narrower than drawn, it shrinks in proportion. Under 9 px it is hard to read.
FIGURE_TEXT_PX = 10 / 72 * 100
MIN_TEXT_PX = 9.0


def layout_of(rendered_html: str) -> dict:
    """The layout the probe recorded on a rendered page: ``{"viewport", "figures": [{"src",
    "natural", "shown"}], "blocks": [{"listing", "whiteSpace", "scrolls"}], "contents"}`` (the
    number of links in the in-page contents bar, 0 when it is hidden)."""
    html_el = (parse_html(rendered_html).find_all("html") or [Element("html", {})])[0]
    if "data-layout" not in html_el.attrs:
        raise ValueError("the page carries no layout probe (data-layout)")
    return json.loads(html_el.attrs["data-layout"])


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


def wrap_problems(layout: dict) -> list[str]:
    """A library listing (a code block in a cell's output) keeps its lines and scrolls sideways, as a
    code cell does; printed output wraps at the column."""
    problems = []
    for block in layout["blocks"]:
        if block["listing"] and block["whiteSpace"] != "pre":
            problems.append(f"a listing wraps its lines (white-space: {block['whiteSpace']})")
        elif not block["listing"] and block["whiteSpace"] != "pre-wrap":
            problems.append(f"printed output does not wrap (white-space: {block['whiteSpace']})")
    return problems


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

# Put at the top of <head>: records JavaScript errors and failed loads of scripts, stylesheets
# and images; at the end of <body>: records every image's naturalWidth once the page has loaded.
PROBE_HEAD = """<script>(function () {
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
})();</script>"""
PROBE_BODY = """<script>window.addEventListener("load", function () {
  document.querySelectorAll("img").forEach(function (img) {
    img.setAttribute("data-natural-width", img.complete ? img.naturalWidth : 0);
  });
  var figures = [], blocks = [];  // the layout, for the checks of what a reader sees
  document.querySelectorAll("article img").forEach(function (img) {
    figures.push({src: img.getAttribute("src"), natural: img.naturalWidth,
                  shown: img.getBoundingClientRect().width});
  });
  document.querySelectorAll("div.cell_output pre").forEach(function (pre) {
    blocks.push({listing: !pre.closest(".output"), whiteSpace: getComputedStyle(pre).whiteSpace,
                 scrolls: pre.scrollWidth > pre.clientWidth + 1});
  });
  var bar = document.querySelector(".bd-sidebar-secondary");
  var shown = bar && getComputedStyle(bar).display !== "none" && bar.getBoundingClientRect().width > 0;
  document.documentElement.setAttribute("data-layout", JSON.stringify({
    viewport: window.innerWidth, figures: figures, blocks: blocks,
    contents: shown ? bar.querySelectorAll("nav.page-toc a").length : 0}));
});</script>"""
WINDOW = (1280, 1000)  # the window every page is loaded in: a laptop's screen, in CSS pixels


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


def _with_probes(html: str) -> str:
    html = re.sub(r"(<head[^>]*>)", lambda m: m.group(1) + PROBE_HEAD, html, count=1, flags=re.I)
    return re.sub(r"(</body>)", lambda m: PROBE_BODY + m.group(1), html, count=1, flags=re.I)


def mirror_with_probes(site: Path, dest: Path, pages: list[str]) -> None:
    """A copy of ``site`` under ``dest`` in which each page carries the probe scripts; everything
    else is a symbolic link into ``site``, so the built site itself is never modified."""
    page_set = {Path(p) for p in pages}
    for dirpath, dirnames, filenames in os.walk(site):
        rel = Path(dirpath).relative_to(site)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        keep = []
        for name in dirnames:
            sub = rel / name
            if any(sub in p.parents for p in page_set):
                keep.append(name)
            else:
                (dest / sub).symlink_to(site / sub, target_is_directory=True)
        dirnames[:] = keep
        for name in filenames:
            sub = rel / name
            if sub in page_set:
                (dest / sub).write_text(_with_probes((site / sub).read_text(encoding="utf-8")), encoding="utf-8")
            else:
                (dest / sub).symlink_to(site / sub)


@dataclass
class Rendered:
    dom: str = ""
    requests: list[str] = field(default_factory=list)
    error: str = ""


def render(
    chromium: str, page_file: Path, workdir: Path, window: tuple[int, int] = WINDOW, query: str = ""
) -> Rendered:
    """Load one page in headless Chromium (a ``window`` of width, height CSS pixels; ``query``
    appended to its URL), network cut off; return its DOM and network requests."""
    profile = Path(tempfile.mkdtemp(prefix="profile-", dir=workdir))
    netlog = profile.with_suffix(".netlog.json")
    command = [
        chromium,
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
    """Every page loaded once in Chromium, two at a time."""
    chromium = chromium_for_the_site()
    with tempfile.TemporaryDirectory(prefix="attnbook-site-") as tmp:
        mirror = Path(tmp) / "site"
        mirror_with_probes(SITE, mirror, PAGES)
        to_render = [p for p in PAGES if not is_redirect((SITE / p).read_text(encoding="utf-8"))]
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            results = pool.map(lambda p: render(chromium, mirror / p, Path(tmp)), to_render)
            return dict(zip(to_render, results, strict=True))


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
@pytest.mark.parametrize("page", PAGES or ["<no built site>"])
def test_figures_readable_and_listings_unwrapped(rendered, page):
    """At 1,280 px: figure text at least MIN_TEXT_PX tall, listings unwrapped, output wrapped."""
    path, html, result = _page(rendered, page)
    if result is None:  # a redirect page
        return
    layout = layout_of(result.dom)
    assert layout["viewport"] == WINDOW[0], layout["viewport"]
    problems = figure_problems(layout) + wrap_problems(layout)
    assert not problems, _report(page, problems)


LAYOUT_PAGES = ["book/09_vit.html", "book/14_decoding.html", "book/16_induction_heads.html"]


@pytest.fixture(scope="module")
def layouts() -> dict[tuple[str, int], dict]:
    """The three longest pages loaded on a phone (Chromium's narrowest window, 500 px, for 390) and
    on a wide screen (1,600 px): (page, width) -> layout."""
    chromium = chromium_for_the_site()
    found = {}
    with tempfile.TemporaryDirectory(prefix="attnbook-layout-") as tmp:
        mirror = Path(tmp) / "site"
        mirror_with_probes(SITE, mirror, LAYOUT_PAGES)
        for page in LAYOUT_PAGES:
            for width in (390, 1600):
                result = render(chromium, mirror / page, Path(tmp), window=(width, 1000))
                assert not result.error, f"{page} at {width} px: {result.error}"
                found[page, width] = layout_of(result.dom)
    return found


@skip_site
@pytest.mark.parametrize("page", LAYOUT_PAGES)
def test_layout_on_a_phone_and_a_wide_screen(layouts, page):
    phone, wide = layouts[page, 390], layouts[page, 1600]
    assert phone["viewport"] <= 500, phone["viewport"]
    problems = wrap_problems(phone)
    listings = [block for block in phone["blocks"] if block["listing"]]
    if page == "book/09_vit.html" and not any(block["scrolls"] for block in listings):
        problems.append("no listing scrolls sideways on a phone: are its lines wrapped?")
    # from 1,500 px the in-page contents are back: a link for each section of the page at least
    sections = len(re.findall(r'<h2><span class="section-number">', (SITE / page).read_text(encoding="utf-8")))
    if wide["contents"] < sections:
        problems.append(f"in-page contents at 1,600 px: {wide['contents']} links for {sections} sections")
    assert not problems, _report(page, problems)


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


def _layout_page(layout: dict) -> str:
    return f"<html data-layout='{json.dumps(layout)}'><body></body></html>"


def test_layout_checkers():
    layout = {
        "viewport": 1280,
        "figures": [{"src": "a.png", "natural": 900, "shown": 896}],
        "blocks": [{"listing": True, "whiteSpace": "pre", "scrolls": True},
                   {"listing": False, "whiteSpace": "pre-wrap", "scrolls": False}],
        "contents": 0,
    }
    assert layout_of(_layout_page(layout)) == layout
    assert figure_problems(layout) == [] and wrap_problems(layout) == []
    # a 16-inch figure in an 896-px column: 13.9 px text shown at 7.7 px
    wide = {**layout, "figures": [{"src": "b.png", "natural": 1607, "shown": 896}]}
    assert len(figure_problems(wide)) == 1 and "7.7 px" in figure_problems(wide)[0]
    assert figure_problems({**layout, "figures": [{"src": "c.png", "natural": 0, "shown": 0}]}) == []
    flipped = [{**block, "whiteSpace": "pre-wrap" if block["listing"] else "pre"}
               for block in layout["blocks"]]
    assert len(wrap_problems({**layout, "blocks": flipped})) == 2
    with pytest.raises(ValueError, match="no layout probe"):
        layout_of("<html><body></body></html>")


def test_formula_table_checker():
    page = ('<section id="formulas"><table><tr><td><a href="01_attention.html#x">1</a></td></tr>'
            '<tr><td><a href="02_masking.html">2</a></td></tr></table></section>'
            '<p><a href="03_multihead.html">after the table</a></p>')
    assert formula_table_problems(page, {"01_attention", "02_masking"}) == []
    assert formula_table_problems(page, {"03_multihead"}) == ["the formulas table does not link 03_multihead"]
    assert formula_table_problems("<p>none</p>", set()) == ["the Key ideas page has no Formulas section"]
