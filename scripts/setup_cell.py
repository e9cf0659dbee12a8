"""Write (or, with --check, verify) the setup cell at the top of every notebook of the book.

Outside the book's repository (on Colab, say) a notebook cannot import ``attnbook`` nor find its
data. Its first code cell then clones the repository named by ``repository.url`` in ``_config.yml``,
installs the packages the notebooks read (``pip install ".[book]"``), puts the clone's library first
on ``sys.path`` and moves to its ``book/`` folder. Inside the repository the cell does nothing.

    python scripts/setup_cell.py          # after changing repository.url: rewrite every setup cell
    python scripts/setup_cell.py --check  # exit 1 if a notebook's setup cell is missing or stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
TAG = "setup"  # the cell's tag; "hide-cell" folds it away on the pages

TEMPLATE = '''\
# Outside the book's repository (on Colab, say) this fetches the book first; inside it, it does nothing.
import importlib.util
import os
import subprocess
import sys

REPOSITORY = {url}  # repository.url in the book's _config.yml (written by scripts/setup_cell.py)
if importlib.util.find_spec("attnbook") is None:
    if not REPOSITORY:
        raise ModuleNotFoundError("attnbook is not installed: clone the book's repository and see its README")
    subprocess.run(["git", "clone", "--depth", "1", REPOSITORY, "attention-book"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "./attention-book[book]"], check=True)
    sys.path.insert(0, os.path.abspath("attention-book/lib"))  # the clone's library, next to its data
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


def write(path: Path, source: str) -> bool:
    """Put the setup cell (before the first code cell) or update it; return True if the file changed."""
    nb = nbformat.read(path, as_version=4)
    index = setup_cell_index(nb)
    if index is not None:
        if nb.cells[index].source == source:
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
    """The notebooks whose setup cell is missing or differs from ``source``."""
    out = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        index = setup_cell_index(nb)
        if index != first_code_cell(nb) or nb.cells[index].source != source:
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
            print("setup cell missing or stale (run python scripts/setup_cell.py):", ", ".join(bad))
            return 1
        print(f"setup cell up to date in {len(notebooks())} notebooks")
        return 0
    changed = [path.name for path in notebooks() if write(path, source)]
    print(f"setup cell written to {len(changed)} notebooks" + (": " + ", ".join(changed) if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
