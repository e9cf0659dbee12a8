"""Sweeps kept beside the notebooks: each one's fingerprint matches its notebook's code, and the reader
gives what the sweep script wrote."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from attnbook.sweeps import Sweep, fingerprint, load_sweep
from attnbook.utils import SEED_STRIDE

BOOK = Path(__file__).resolve().parents[1] / "book"
SWEEPS = sorted((BOOK / "sweeps").glob("*.json"))


@pytest.mark.parametrize("path", SWEEPS, ids=[path.stem for path in SWEEPS])
def test_every_sweep_measured_the_notebook_as_it_is(path):
    data = json.loads(path.read_text())
    notebook = BOOK / f"{data['notebook']}.ipynb"
    assert notebook.is_file(), f"{path.name} is the sweep of a notebook that is gone: {notebook.name}"
    assert data["fingerprint"] == fingerprint(json.loads(notebook.read_text())), (
        f"book/sweeps/{path.name} was measured on another version of book/{notebook.name}'s code: "
        f"refresh it with `make sweep NB=book/{notebook.name} OFFSETS=10`"
    )
    # the settings a GPU gets train several times longer: three runs, both kernel families
    least = 3 if data.get("settings") == "gpu" else 10
    assert len(data["runs"]) >= least and {run["kernels"] for run in data["runs"]} == {"avx2", "default"}


@pytest.mark.parametrize("path", SWEEPS, ids=[path.stem for path in SWEEPS])
def test_every_sweep_trained_seeds_no_other_offset_shares(path):
    stride = json.loads(path.read_text()).get("seed_stride")
    assert stride == SEED_STRIDE, (
        f"book/sweeps/{path.name} was not made with disjoint seeds (seed_stride "
        f"{stride}, not {SEED_STRIDE}): refresh it with `make sweep NB=book/{path.stem}.ipynb`"
    )


def notebook(*sources, markdown="# a page"):
    cells = [{"cell_type": "markdown", "source": markdown}]
    cells += [{"cell_type": "code", "source": source} for source in sources]
    return {"cells": cells}


NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_other_runs_come_after_the_summary_folded_away(path):
    """A page's "Other seeds and other CPUs" section is bookkeeping: it follows the
    summary, and the cells that read the sweep show neither code nor table unless opened."""
    cells = json.loads(path.read_text())["cells"]
    text = ["".join(cell["source"]) for cell in cells]
    heads = [i for i, s in enumerate(text) if s.startswith("## Other seeds and other CPUs")]
    if not heads:
        return
    summaries = [i for i, s in enumerate(text) if s.startswith("## Summary")]
    assert all(i < heads[0] for i in summaries), f"{path.name}: the summary comes after"
    for cell, source in zip(cells[heads[0] + 1 :], text[heads[0] + 1 :], strict=True):
        if cell["cell_type"] != "code":
            continue
        tags = cell["metadata"].get("tags", [])
        assert "load_sweep(" in source or "load_record(" in source, path.name
        assert {"hide-input", "hide-output"} <= set(tags), f"{path.name}: {tags}"

def test_fingerprint_is_the_code_and_only_the_code_that_measures():
    base = fingerprint(notebook("x = 1", "print(x)"))
    assert fingerprint(notebook("x = 1", "print(x)", markdown="other prose")) == base
    assert fingerprint(notebook(["x = 1"], ["print(x)"])) == base  # .ipynb stores lines as lists
    assert fingerprint(notebook("x = 1", "print(x)", "s = load_sweep('nb')")) == base  # reads, measures not
    setup = notebook("import os", "x = 1", "print(x)")
    setup["cells"][1]["metadata"] = {"tags": ["setup", "hide-cell"]}
    assert fingerprint(setup) == base  # the setup cell does nothing inside the book
    assert fingerprint(notebook("x = 2", "print(x)")) != base
    assert fingerprint(notebook("print(x)", "x = 1")) != base  # order counts


def test_load_sweep_reads_what_the_script_writes(tmp_path):
    runs = [
        {"offset": 0, "kernels": "default", "ok": True, "failure": None, "glued": {"share": 0.9, "text": "a"}},
        {"offset": 1, "kernels": "avx2", "ok": False, "failure": {"cell": 3, "message": "AssertionError"},
         "glued": {"share": 0.7}},
    ]
    (tmp_path / "nb.json").write_text(json.dumps({"notebook": "nb", "fingerprint": "f", "runs": runs}))
    sweep = load_sweep("nb", tmp_path)
    assert isinstance(sweep, Sweep) and sweep.offsets == [0, 1]
    assert sweep.values("share") == [0.9, 0.7] and sweep.spread("share") == (0.7, 0.9)
    assert [run["offset"] for run in sweep.failures] == [1]
    with pytest.raises(KeyError, match="glued: \\['share', 'text'\\]"):
        sweep.values("missing")
    with pytest.raises(FileNotFoundError, match="no sweep of other"):
        load_sweep("other", tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"notebook": "bad"}))
    with pytest.raises(ValueError, match=r"lacks \['fingerprint', 'runs'\]"):
        load_sweep("bad", tmp_path)


def test_margins_are_the_worst_run_s_distance_to_each_threshold(tmp_path, capsys):
    runs = [
        {"offset": i, "kernels": "default", "ok": True, "failure": None, "glued": {"acc": a, "loss": b}}
        for i, (a, b) in enumerate([(0.95, 0.30), (0.91, 0.42), (0.99, 0.25)])
    ]
    (tmp_path / "nb.json").write_text(json.dumps({"notebook": "nb", "fingerprint": "f", "runs": runs}))
    sweep = load_sweep("nb", tmp_path)
    assert sweep.margin("acc", above=0.8) == pytest.approx(0.11)  # lowest run 0.91
    assert sweep.margin("loss", below=0.6) == pytest.approx(0.18)  # highest run 0.42
    assert sweep.margin("acc", above=0.93) == pytest.approx(-0.02)  # one run on the wrong side
    for bad in ({}, {"above": 1, "below": 2}):
        with pytest.raises(ValueError, match="one threshold"):
            sweep.margin("acc", **bad)
    margins = sweep.thresholds(
        [("acc", "accuracy", "above", 0.8), ("loss", "loss", "below", 0.6)], {"acc": 0.95, "loss": 0.3}
    )
    assert margins == pytest.approx({"acc": 0.11, "loss": 0.18})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1].split()[1:] == ["0.95", "0.91", "0.99", "above", "0.8", "+0.11"]
    with pytest.raises(ValueError, match="side must be"):
        sweep.thresholds([("acc", "accuracy", "over", 0.8)], {"acc": 0.95})
    runs[1]["kernels"] = "avx2"
    (tmp_path / "nb.json").write_text(json.dumps({"notebook": "nb", "fingerprint": "f", "runs": runs}))
    sweep = load_sweep("nb", tmp_path)
    assert sweep.values("acc", instructions="wide") == [0.91]  # the avx2 run
    assert sweep.values("acc", instructions="narrow") == [0.95, 0.99]
    with pytest.raises(ValueError, match="instructions must be one of"):
        sweep.values("acc", instructions="avx2")
    both = [("acc", "accuracy", "above", 0.8), ("acc", "accuracy", "below", 1.0)]
    assert sweep.thresholds(both, {"acc": 0.95}) == pytest.approx({"acc": 0.01})  # 1 - 0.99


def test_figures_keeps_and_glues_each_figure_as_a_float(capsys):
    from attnbook.sweeps import Figures

    measured = Figures()
    assert measured.keep("gap", np.float64(0.25)) == 0.25
    assert measured.keep("count", torch.tensor(3)) == 3.0
    assert measured == {"gap": 0.25, "count": 3.0}
    assert all(type(value) is float for value in measured.values())
    capsys.readouterr()  # outside a notebook, glue's display only prints
    for bad in (float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="finite number"):
            measured.keep("bad", bad)
    with pytest.raises(ValueError, match="non-empty string"):
        measured.keep("", 1.0)
    assert "bad" not in measured
