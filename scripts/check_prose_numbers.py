"""Find numbers in the notebooks' prose that nothing on the page backs.

A number in a Markdown cell passes when it is glued (``{glue:text}``), when an output of
the same notebook prints it, when a code cell of the notebook writes it (a setting, a
size, a formula's constant), or when its sentence cites the literature (``{cite:...}``).
Integers up to 10 pass (counts and indices in words' place), and so do years. A number
that is no measurement of this page (a paper's figure with its citation elsewhere in the
paragraph, a setting of another chapter, a dataset's size, arithmetic the prose does) is
marked in its Markdown cell's metadata, with why: ``"literal_numbers": {"4000": "the
paper's warm-up steps"}`` (the number as written, without thousands separators). A mark
without a reason, or one for a number the cell no longer holds, is an error too. What is
left is a number typed by hand that a re-run can leave behind.

    python scripts/check_prose_numbers.py [NOTEBOOK ...]   # every notebook by default

Prints one line per number that nothing backs and the count, and exits with status 1
when there is one. Numbers inside math are not read: a formula's worked values are
checked by the cells that compute them.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parents[1] / "book"
NUMBER = re.compile(r"(?<![\w.^_{\\])\d[\d,]*(?:\.\d+)?(?![\w])")
# math (formulas and their worked values), inline code, glue roles, links' targets,
# cross-references, citations, labels
SKIP = re.compile(
    r"\$\$.+?\$\$|\$[^$]+\$|`[^`]*`|\]\([^)]*\)|\{[a-z:]+\}`[^`]*`|\(\w[\w-]*\)=",
    re.S,
)
# a decimal point is no full stop
SENTENCE = re.compile(r"(?:[^.!?]|[.!?](?=\d))*(?:[.!?](?!\d)|$)", re.S)


def _text(source) -> str:
    return "".join(source) if isinstance(source, list) else source


def _numbers_in(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def unbacked(path: Path) -> list[tuple[int, str, str]]:
    """``(cell index, number, sentence)`` for each number in ``path``'s prose that
    nothing backs."""
    notebook = json.loads(path.read_text())
    backed: set[str] = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        backed |= _numbers_in(_text(cell["source"]))
        for output in cell.get("outputs", []):
            text = _text(output.get("text", "")) + _text(
                output.get("data", {}).get("text/plain", "")
            )
            backed |= _numbers_in(text)
    found = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        literal = cell.get("metadata", {}).get("literal_numbers", {})
        prose = SKIP.sub(" ", _text(cell["source"]))
        for number, why in literal.items():
            if not isinstance(why, str) or not why.strip():
                found.append((index, number, "marked literal without a reason"))
            elif number not in _numbers_in(prose):
                found.append((index, number, "marked literal, not in the cell's prose"))
        for sentence in SENTENCE.findall(_text(cell["source"])):
            if "{cite:" in sentence:
                prose = prose.replace(SKIP.sub(" ", sentence), " ")
        for match in NUMBER.finditer(prose):
            number = match.group().replace(",", "")
            value = float(number)
            if value <= 10 and "." not in number or 1900 <= value <= 2030:
                continue
            percent = prose[match.end() : match.end() + 2].strip().startswith("%")
            forms = {number, number.rstrip("0").rstrip(".") if "." in number else number}
            if percent:  # 15 % is 0.15 in code
                forms.add(f"{value / 100:g}")
            if forms & backed or number in literal:
                continue
            start = max(0, match.start() - 60)
            context = " ".join(prose[start : match.end() + 30].split())
            found.append((index, match.group(), context))
    return found


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))
    total = 0
    for path in paths:
        for index, number, context in unbacked(path):
            print(f"{path.name} cell {index}: {number}: ...{context}...")
            total += 1
    print(f"{total} numbers in the prose that nothing on the page backs")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
