"""scripts/execute_notebooks.py: notebooks run one at a time or several at once, each kernel with
the threads it was given, and a table of their times."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # importable by name: the worker processes of --jobs import it too
import execute_notebooks  # noqa: E402


def write_notebook(path: Path) -> Path:
    # prints the thread count its kernel got from OMP_NUM_THREADS (unset: the machine's default)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nprint('threads', os.environ.get('OMP_NUM_THREADS', 'default'))")])
    nbformat.write(nb, path)
    return path


def threads_printed(path: Path) -> str:
    return nbformat.read(path, as_version=4).cells[0].outputs[0].text.split()[1]


@pytest.mark.parametrize("jobs", [1, 2])
def test_jobs_run_every_notebook_and_give_each_kernel_its_threads(tmp_path, monkeypatch, jobs):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    paths = [write_notebook(tmp_path / f"0{i}_tiny.ipynb") for i in (1, 2, 3)]
    out = tmp_path / "out"
    assert execute_notebooks.main(["--out", str(out), "--jobs", str(jobs), *map(str, paths)]) == 0
    expected = "default" if jobs == 1 else str(max(1, os.cpu_count() // jobs))
    assert [threads_printed(out / p.name) for p in paths] == [expected] * 3
    table = (out / "timings.md").read_text()
    assert [line.split("|")[1].strip() for line in table.splitlines() if "_tiny" in line] == [p.name for p in paths]
    assert ("one at a time" in table) == (jobs == 1) and ("wall time" in table) == (jobs > 1)
    for path in paths:  # --out never touches the originals
        assert not nbformat.read(path, as_version=4).cells[0].outputs


@pytest.mark.parametrize("argv", [["--jobs", "0"], ["--jobs", "two"], ["--jobs"], ["--out"]])
def test_bad_arguments_are_refused(argv, capsys):
    assert execute_notebooks.main(argv) == 2
    assert "--" in capsys.readouterr().err
