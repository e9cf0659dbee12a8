"""The notebooks as a reader gets them: the setup cell that runs a chapter outside the repository,
no execution timestamps, and the launch buttons."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_cell = load("setup_cell", ROOT / "scripts" / "setup_cell.py")
launch_buttons = load("launch_buttons", ROOT / "book" / "_ext" / "launch_buttons.py")


def test_every_notebook_starts_with_the_current_setup_cell():
    source = setup_cell.cell_source(setup_cell.repository_url())
    assert len(setup_cell.notebooks()) >= 15
    assert setup_cell.stale(setup_cell.notebooks(), source) == []
    assert setup_cell.main(["--check"]) == 0


def test_no_notebook_stores_execution_timestamps():
    stamped = [f"{path.name} cell {i}" for path in setup_cell.notebooks()
               for i, cell in enumerate(json.loads(path.read_text())["cells"]) if "execution" in cell["metadata"]]
    assert stamped == []


def test_setup_cell_does_nothing_inside_the_repository():
    path, cwd = list(sys.path), os.getcwd()
    exec(setup_cell.cell_source("https://github.com/owner/repo"), {})  # attnbook is importable here
    assert (sys.path, os.getcwd()) == (path, cwd)


def run_outside(monkeypatch, url):
    """Run the cell as if attnbook were not installed; return the commands, chdirs and the new sys.path[0]."""
    calls, moves = [], []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(subprocess, "run", lambda command, check: calls.append(command))
    monkeypatch.setattr(os, "chdir", moves.append)
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(setup_cell.cell_source(url), {})
    return calls, moves, sys.path[0]


def test_setup_cell_outside_the_repository_clones_installs_and_moves_to_book(monkeypatch):
    url = "https://github.com/owner/repo"
    calls, moves, first_path = run_outside(monkeypatch, url)
    assert calls == [["git", "clone", "--depth", "1", url, "attention-book"],
                     [sys.executable, "-m", "pip", "install", "-q", "./attention-book[book]"]]
    assert moves == ["attention-book/book"]
    assert first_path == os.path.abspath("attention-book/lib")


def test_setup_cell_without_a_repository_url_says_what_to_do(monkeypatch):
    with pytest.raises(ModuleNotFoundError, match="clone the book's repository"):
        run_outside(monkeypatch, "")


def test_repository_url_reads_the_config(tmp_path):
    config = tmp_path / "_config.yml"
    config.write_text("title: t\nrepository:\n  url: https://github.com/owner/repo\n")
    assert setup_cell.repository_url(config) == "https://github.com/owner/repo"
    config.write_text("title: t\n")
    assert setup_cell.repository_url(config) == ""


@pytest.mark.parametrize("url, kept", [
    (None, False),
    ("", False),
    ("https://github.com/executablebooks/jupyter-book", False),  # Jupyter Book's default: not ours
    ("https://github.com/owner/repo/", True),
])
def test_launch_buttons_only_with_a_repository(url, kept):
    options = {"launch_buttons": {"colab_url": "https://colab.research.google.com"}}
    if url is not None:
        options["repository_url"] = url
    launch_buttons.drop_launch_buttons_without_repository(None, SimpleNamespace(html_theme_options=options))
    assert bool(options["launch_buttons"]) == kept
