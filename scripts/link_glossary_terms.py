"""Link each glossary term at its first use on a page: ``{term}`KV cache``` (MyST's term
role), so that a reader can look a word up where it first appears.

    python scripts/link_glossary_terms.py [PAGE ...]           # list the links it would add
    python scripts/link_glossary_terms.py --write [PAGE ...]   # add them

PAGE is a notebook (``book/NN_topic.ipynb``, its Markdown cells) or a Markdown page
(``book/intro.md``); without PAGE, every page of the book but the glossary. The terms are
those of ``book/glossary.md``'s ``{glossary}`` directive, each with its aliases (the term
lines above one definition: ``grouped-query attention`` and ``GQA``). For each term a page
does not link yet, the first use in its prose gets the link: the first match of the term
or an alias, as a whole word, with a plural "s" or "es" allowed (``KV caches`` links
``{term}`KV caches <KV cache>```). A term with a capital letter matches only as written
(``CTC``, ``RMSNorm``); a term in lower case matches in any case. Not read as prose:
headings, code (inline and fenced), math, roles (citations, glued numbers, links already
there), Markdown links, HTML and directive lines. A term inside a longer term's words
(``attention`` in ``linear attention``) is left to the longer term. Words too common to
mean the term everywhere (``key``, ``value``, ``head`` ...) are left to the author:
``COMMON_WORDS``.

A notebook is rewritten with its outputs and metadata as they were (only Markdown
sources change): no re-execution is needed, and the sweep fingerprints, which read only
code cells, still match. Run ``make book`` afterwards: the build checks every link.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
GLOSSARY = BOOK / "glossary.md"

# Glossary words that are also plain English or mean something else on many pages: linking
# their first appearance would more often point at the wrong sense than help.
COMMON_WORDS = {
    "attention", "backend", "decoder", "encoder", "expert", "head", "key", "logits",
    "mask", "patch", "query", "rank", "recomputation", "router", "score", "softmax",
    "temperature", "tile", "token", "value",
}  # fmt: skip

# Spans that are not prose: fenced code, math, roles, inline code, Markdown links, HTML,
# bare URLs, and whole lines that are headings, directive fences or directive options.
NOT_PROSE = re.compile(
    r"""
    ^(?P<fence>```|~~~).*?^(?P=fence)[^\n]*$   # fenced code or directive block
    | \$\$.+?\$\$                              # display math
    | (?<!\\)\$[^$\n]+?(?<!\\)\$               # inline math
    | \{[\w:.-]+\}`[^`]*`                      # a role: {term}, {cite:p}, {glue:text} ...
    | `[^`\n]*`                                # inline code
    | !?\[[^\]\n]*\]\([^)\n]*\)                # a Markdown link or image
    | <[^>\n]+>                                # HTML, autolinks
    | https?://\S+                             # a bare URL
    | ^[ \t]*\#[^\n]*$                         # a heading
    | ^[ \t]*:::[^\n]*$                        # a colon fence
    | ^[ \t]*:[\w-]+:[^\n]*$                   # a directive option
    | ^\(\w[\w-]*\)=$                          # a label
    """,
    re.S | re.M | re.X,
)
ROLE = re.compile(r"\{term\}`(?:[^`<]*<)?([^`>]+)>?`")


@dataclass(frozen=True)
class Term:
    """A glossary entry: the name it is listed under and every name it answers to."""

    name: str
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class Link:
    """One link to add: in cell ``cell`` (0 for a Markdown page), ``text`` at ``start``."""

    cell: int
    start: int
    text: str
    term: str

    @property
    def role(self) -> str:
        return f"{{term}}`{self.text}`" if self.text == self.term else (
            f"{{term}}`{self.text} <{self.term}>`")  # fmt: skip


def glossary_terms(glossary: Path = GLOSSARY) -> list[Term]:
    """The terms of the ``{glossary}`` directive: each definition's term lines, the first
    its name, the others its aliases."""
    text = glossary.read_text(encoding="utf-8")
    block = re.search(r"^```\{glossary\}[^\n]*\n(.*?)^```", text, re.S | re.M)
    if block is None:
        raise ValueError(f"{glossary} has no ```{{glossary}} directive")
    terms, lines = [], []
    for line in block.group(1).splitlines():
        if line.startswith(":") or not line.strip():
            if lines:
                terms.append(Term(lines[0], tuple(lines)))
                lines = []
            continue
        if line[0].isspace():  # the definition: the term lines above it are complete
            if lines:
                terms.append(Term(lines[0], tuple(lines)))
                lines = []
            continue
        lines.append(line.strip())
    if lines:
        terms.append(Term(lines[0], tuple(lines)))
    return terms


def _pattern(alias: str) -> re.Pattern:
    """``alias`` as a whole word (hyphens join words), with a plural allowed, on one line;
    in any case unless it has a capital letter."""
    words = r"[ \t]+".join(re.escape(word) for word in alias.split())
    flags = 0 if any(c.isupper() for c in alias) else re.I
    return re.compile(rf"(?<![\w-]){words}(?:e?s)?(?![\w-])", flags)


def prose_spans(text: str) -> list[tuple[int, int]]:
    """The stretches of ``text`` that are prose (what NOT_PROSE leaves)."""
    spans, start = [], 0
    for match in NOT_PROSE.finditer(text):
        if match.start() > start:
            spans.append((start, match.start()))
        start = max(start, match.end())
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def find_links(sources: list[str], terms: list[Term]) -> list[Link]:
    """For each term the page does not link yet (``sources``: its Markdown, cell by
    cell), the link at its first use in prose; in reading order."""
    linked = {m.group(1).strip().lower() for source in sources for m in ROLE.finditer(source)}
    wanted = [
        term for term in terms
        if not {alias.lower() for alias in term.aliases} & linked
        and term.name.lower() not in COMMON_WORDS
    ]  # fmt: skip
    # every use of every term's names in prose: (cell, start, end, term)
    uses = []
    for cell, source in enumerate(sources):
        for begin, end in prose_spans(source):
            for term in terms:
                for alias in term.aliases:
                    for match in _pattern(alias).finditer(source, begin, end):
                        uses.append((cell, match.start(), match.end(), term))
    def inside_a_longer_use(cell: int, start: int, end: int, term: Term) -> bool:
        """A use inside a longer name's use (attention in linear attention)."""
        return any(
            other_cell == cell and other is not term and other_start <= start
            and end <= other_end and other_end - other_start > end - start
            for other_cell, other_start, other_end, other in uses
        )  # fmt: skip

    links, taken = [], set()
    for cell, start, end, term in sorted(uses, key=lambda use: (use[0], use[1])):
        if term not in wanted or term.name in taken:
            continue
        if inside_a_longer_use(cell, start, end, term) or any(
            link.cell == cell and link.start < end and start < link.start + len(link.text)
            for link in links
        ):
            continue
        taken.add(term.name)
        links.append(Link(cell, start, sources[cell][start:end], term.name))
    return links


def apply_links(source: str, links: list[Link]) -> str:
    """``source`` with ``links`` (all of one cell) written in as term roles."""
    for link in sorted(links, key=lambda link: link.start, reverse=True):
        end = link.start + len(link.text)
        assert source[link.start : end] == link.text, (source[link.start : end], link)
        source = source[: link.start] + link.role + source[end:]
    return source


def _front_matter_end(text: str) -> int:
    match = re.match(r"---\n.*?\n---\n", text, re.S)
    return match.end() if match else 0


def page_sources(page: Path) -> list[str]:
    """A page's Markdown: a notebook's Markdown cells (others as ""), or a Markdown page
    without its front matter, as one cell."""
    if page.suffix == ".ipynb":
        cells = json.loads(page.read_text(encoding="utf-8"))["cells"]
        return ["".join(c["source"]) if c["cell_type"] == "markdown" else "" for c in cells]
    text = page.read_text(encoding="utf-8")
    return [text[_front_matter_end(text) :]]


def write_links(page: Path, links: list[Link]) -> None:
    """Write ``links`` into ``page``, leaving everything else as it was."""
    if page.suffix == ".ipynb":
        raw = page.read_text(encoding="utf-8")
        notebook = json.loads(raw)
        for index in sorted({link.cell for link in links}):
            cell = notebook["cells"][index]
            source = apply_links("".join(cell["source"]), [x for x in links if x.cell == index])
            cell["source"] = source.splitlines(keepends=True)
        text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
        page.write_text(text, encoding="utf-8")
        return
    text = page.read_text(encoding="utf-8")
    head = _front_matter_end(text)
    page.write_text(text[:head] + apply_links(text[head:], links), encoding="utf-8")


def _line_of(source: str, start: int) -> str:
    line_start = source.rfind("\n", 0, start) + 1
    line_end = source.find("\n", start)
    return source[line_start : line_end if line_end >= 0 else len(source)].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="notebooks or Markdown pages")
    parser.add_argument("--write", action="store_true", help="add the links (default: list)")
    args = parser.parse_args(argv)
    pages = args.pages or sorted(
        p for p in [*BOOK.glob("*.ipynb"), *BOOK.glob("*.md")] if p != GLOSSARY
    )
    terms = glossary_terms()
    total = 0
    for page in pages:
        sources = page_sources(page)
        links = find_links(sources, terms)
        total += len(links)
        for link in links:
            where = f"cell {link.cell}" if page.suffix == ".ipynb" else "text"
            line = _line_of(sources[link.cell], link.start)
            print(f"{page.name} {where}: {link.role}  <- {line[:90]!r}")
        if args.write and links:
            write_links(page, links)
    verb = "added" if args.write else "to add (dry run; --write adds them)"
    print(f"{total} links {verb} on {len(pages)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
