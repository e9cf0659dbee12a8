"""Recorded experiments: every record in book/experiments/ matches the code its runs executed and
covers its grid; the runner records, resumes and fingerprints only what ran; the page's reader and
its re-run check."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from attnbook.experiments import (
    Record,
    Run,
    code_units,
    current_units,
    fingerprint,
    grid,
    load_record,
    staleness,
)

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "book" / "experiments"
RECORDS = sorted(EXPERIMENTS.glob("*.json"))
sys.path.insert(0, str(ROOT / "scripts"))
import run_experiment  # noqa: E402


@pytest.mark.parametrize("path", RECORDS, ids=[path.stem for path in RECORDS])
def test_every_record_measured_the_code_as_it_is(path):
    reason = staleness(path.stem, EXPERIMENTS)
    assert reason is None, reason
    record = load_record(path.stem, EXPERIMENTS)
    module = run_experiment.load_module(path.stem)
    expected = sorted(run_experiment.task_key(p, s) for p, s in run_experiment.tasks_of(module))
    found = sorted(run_experiment.task_key(run.point, run.seed) for run in record.runs)
    assert found == expected, f"{path.name} does not cover GRID x SEEDS of {path.stem}.py"
    for key in ("commit", "torch", "device", "threads_per_process", "started", "finished",
                "wall_seconds", "run_seconds"):
        assert key in record.provenance, key


def test_every_experiment_has_its_record():
    modules = [p.stem for p in EXPERIMENTS.glob("*.py") if not p.stem.startswith("_")]
    missing = [m for m in modules if not (EXPERIMENTS / f"{m}.json").is_file()]
    assert not missing, f"run `make experiment NAME=...` for {missing}"


def test_grid_is_every_combination_last_axis_fastest():
    assert grid(a=[1, 2], b=["x", "y"]) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    with pytest.raises(ValueError, match="axis 'a' has no values"):
        grid(a=[])
    with pytest.raises(ValueError, match="axis 'b' must be a list"):
        grid(b="xy")


TOY = '''
from attnbook.masks import causal_mask

GRID = [{"n": 2}, {"n": 3}]
SEEDS = (0, 1)


def COST(point):
    return point["n"]


def run(point, seed):
    with open(__file__ + ".calls", "a") as calls:
        calls.write(f"{point['n']} {seed}\\n")
    return {"allowed": float((~causal_mask(point["n"])).sum()) + seed, "n": point["n"]}
'''


@pytest.fixture
def toy_folder():
    # the runner records paths relative to the repository, so the folder lies inside it
    (ROOT / "_build").mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="test-experiments-", dir=ROOT / "_build"))
    (folder / "toy.py").write_text(TOY)
    yield folder
    shutil.rmtree(folder)


def calls(folder):
    path = folder / "toy.py.calls"
    return sorted(path.read_text().split("\n")[:-1]) if path.exists() else []


def test_the_runner_records_every_run_and_only_the_code_they_executed(toy_folder):
    out = run_experiment.run_experiment("toy", jobs=2, folder=toy_folder, partial_folder=toy_folder,
                                        progress=False)
    data = json.loads(out.read_text())
    toy = str((toy_folder / "toy.py").relative_to(ROOT))
    # causal_mask and the validator it calls; not the rest of their modules, nor the library
    assert data["code"] == {toy: ["run"], "lib/attnbook/masks.py": ["causal_mask", "key_minus_query"],
                            "lib/attnbook/utils.py": ["check_positive_int"]}
    assert data["units"] == current_units(data["code"], ROOT)
    assert set(data["units"]["lib/attnbook/masks.py"]) == {"<module>", "causal_mask", "key_minus_query"}
    assert data["fingerprint"] == fingerprint(data["code"], ROOT)
    assert [(r["point"]["n"], r["seed"]) for r in data["runs"]] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    record = load_record("toy", toy_folder)
    assert record.values("allowed", n=3) == [6.0, 7.0]  # 3 * 4 / 2 allowed entries, + seed
    assert record.points == [{"n": 2}, {"n": 3}] and record.seeds == [0, 1]
    assert staleness("toy", toy_folder) is None
    for key in ("commit", "torch", "device", "cores", "processes", "started", "finished"):
        assert key in data["provenance"]
    assert data["provenance"]["run_seconds"] >= 0 and data["provenance"]["sessions"] == 1
    # a new function in a file the runs executed: the record still holds
    (toy_folder / "toy.py").write_text(TOY + "\n\ndef unrelated():\n    return 1\n")
    assert staleness("toy", toy_folder) is None
    # a line changed in a function the runs executed: stale, saying what changed and how to refresh
    (toy_folder / "toy.py").write_text(TOY.replace("+ seed", "+ 2 * seed"))
    message = staleness("toy", toy_folder)
    assert f"{toy}: run changed" in message and "make experiment NAME=toy" in message
    assert "STALE" in run_experiment.list_experiments(toy_folder)
    # and a grid that changed (the module's own statements)
    (toy_folder / "toy.py").write_text(TOY.replace('{"n": 3}]', '{"n": 4}]'))
    assert f"{toy}: <module> changed" in staleness("toy", toy_folder)


def test_code_units_hash_what_ran_and_ignore_the_rest(tmp_path):
    source = (
        '"""A module."""\nLIMIT = 3\n\n\nclass A:\n    size = 2\n\n'
        '    def f(self):\n        """Doc."""\n        return [x for x in range(self.size)]\n\n'
        '    def g(self):\n        return 0\n\n\ndef h():\n    return LIMIT\n'
    )
    path = tmp_path / "m.py"
    path.write_text(source)
    base = code_units(path, ["A.f", "A.f.<locals>.<listcomp>", "h"])
    assert set(base) == {"<module>", "A", "A.f", "h"}  # the comprehension belongs to A.f
    # a docstring, a comment, another method: nothing that ran changed
    path.write_text(source.replace('"""Doc."""', '"""Other."""').replace("return 0", "return 1  # x"))
    assert code_units(path, ["A.f", "h"]) == base
    changed = {
        "A.f": source.replace("range(self.size)", "range(self.size + 1)"),
        "A": source.replace("size = 2", "size = 3"),
        "<module>": source.replace("LIMIT = 3", "LIMIT = 4"),
    }
    for unit, text in changed.items():
        path.write_text(text)
        now = code_units(path, ["A.f", "h"])
        assert [u for u in base if now[u] != base[u]] == [unit]
    path.write_text(source.replace("def h():", "def k():"))
    assert code_units(path, ["h"])["h"] == "gone"
    with pytest.raises(FileNotFoundError, match="which is gone"):
        current_units({"missing.py": ["f"]}, tmp_path)


def test_the_runner_resumes_where_it_stopped(toy_folder):
    toy = str((toy_folder / "toy.py").relative_to(ROOT))
    code = {toy: ["run"], "lib/attnbook/masks.py": ["causal_mask"]}
    kept = {"point": {"n": 3}, "seed": 1, "metrics": {"allowed": 99.0, "n": 3.0}, "seconds": 0.5,
            "code": code, "units": current_units(code, ROOT)}
    gone = {**kept, "point": {"n": 4}}  # a point no longer in the grid
    (toy_folder / "toy.jsonl").write_text(json.dumps(kept) + "\n" + json.dumps(gone) + "\n")
    run_experiment.run_experiment("toy", jobs=1, folder=toy_folder, partial_folder=toy_folder,
                                  progress=False)
    assert calls(toy_folder) == ["2 0", "2 1", "3 0"]  # the kept run was not run again
    record = load_record("toy", toy_folder)
    assert record.values("allowed", n=3) == [6.0, 99.0] and len(record.runs) == 4
    # a run whose code changed since is run again
    (toy_folder / "toy.py.calls").unlink()
    (toy_folder / "toy.jsonl").write_text(json.dumps({**kept, "units": {}}) + "\n")
    run_experiment.run_experiment("toy", jobs=1, folder=toy_folder, partial_folder=toy_folder,
                                  progress=False)
    assert calls(toy_folder) == ["2 0", "2 1", "3 0", "3 1"]
    # --restart runs everything again
    (toy_folder / "toy.py.calls").unlink()
    run_experiment.run_experiment("toy", jobs=1, restart=True, folder=toy_folder,
                                  partial_folder=toy_folder, progress=False)
    assert calls(toy_folder) == ["2 0", "2 1", "3 0", "3 1"]


@pytest.mark.parametrize("source, message", [
    ("SEEDS = (0,)\ndef run(point, seed): return {}", "GRID must be a non-empty list of dicts"),
    ("GRID = [{}]\nSEEDS = (-1,)\ndef run(point, seed): return {}", "SEEDS must be a non-empty list"),
    ("GRID = [{}]\nSEEDS = (0,)", "no function run"),
    ("GRID = [{'a': 1}, {'a': 1}]\nSEEDS = (0,)\ndef run(point, seed): return {}", "lists a point twice"),
])
def test_the_runner_refuses_a_malformed_experiment(toy_folder, source, message):
    (toy_folder / "bad.py").write_text(source)
    with pytest.raises(ValueError, match=message):
        run_experiment.load_module("bad", toy_folder)
    with pytest.raises(ValueError, match="no experiment 'nothing'"):
        run_experiment.load_module("nothing", toy_folder)


def test_a_record_is_refused_when_the_code_changed_while_it_ran(toy_folder):
    # the first run edits the experiment's file on disk: the workers still run the code they imported
    edit = ("    from pathlib import Path\n    f = Path(__file__)\n"
            "    f.write_text(f.read_text().replace('+ seed}', '+ 2 * seed}'))\n")
    (toy_folder / "toy.py").write_text(TOY.replace("    return {", edit + "    return {"))
    with pytest.raises(RuntimeError, match="the code changed while toy ran .*toy.py: run"):
        run_experiment.run_experiment("toy", jobs=1, folder=toy_folder, partial_folder=toy_folder,
                                      progress=False)
    assert not (toy_folder / "toy.json").exists()


def test_a_failing_run_is_reported_and_the_others_kept(toy_folder):
    (toy_folder / "toy.py").write_text(TOY.replace("    return {", "    assert point['n'] == 2\n    return {"))
    with pytest.raises(RuntimeError, match="2 run\\(s\\) of toy raised"):
        run_experiment.run_experiment("toy", jobs=1, folder=toy_folder, partial_folder=toy_folder,
                                      progress=False)
    kept = (toy_folder / "toy.jsonl").read_text().splitlines()
    assert sum('"point"' in line for line in kept) == 2  # the n = 2 runs
    assert not (toy_folder / "toy.json").exists()


def record(runs):
    return Record("nb", "f", {}, {}, {}, tuple(Run(p, s, m, 1.0) for p, s, m in runs))


def test_pick_draws_from_the_clock_and_check_widens_the_spread_by_the_tolerance():
    rec = record([({"lr": 1}, 0, {"acc": 0.80}), ({"lr": 1}, 1, {"acc": 0.84}),
                  ({"lr": 2}, 0, {"acc": 0.5}), ({"lr": 2}, 1, {"acc": 0.6})])
    assert rec.pick(clock=0) == ({"lr": 1}, 0) and rec.pick(clock=3000) == ({"lr": 2}, 1)
    assert rec.pick(where=lambda p: p["lr"] == 2, clock=0) == ({"lr": 2}, 0)
    with pytest.raises(ValueError, match="no point of nb"):
        rec.pick(where=lambda p: False)
    assert rec.check({"lr": 1}, {"acc": 0.86}, {"acc": 0.02}) == [("acc", 0.86, 0.80, 0.84, 0.02)]
    rec.check({"lr": 1}, {"acc": 0.78}, {"acc": 0.02})  # just inside, below
    with pytest.raises(AssertionError, match="acc = 0.87 lies outside the recorded \\[0.8, 0.84\\]"):
        rec.check({"lr": 1}, {"acc": 0.87}, {"acc": 0.02})
    with pytest.raises(AssertionError):
        rec.check({"lr": 1}, {"acc": float("nan")}, {"acc": 1.0})
    with pytest.raises(ValueError, match="no tolerance given for 'acc'"):
        rec.check({"lr": 1}, {"acc": 0.8}, {})
    with pytest.raises(KeyError, match="is not a point"):
        rec.check({"lr": 3}, {"acc": 0.8}, {"acc": 0.1})
    assert rec.spread("acc", lr=2) == (0.5, 0.6)
    with pytest.raises(KeyError, match="no parameter \\['rate'\\]"):
        rec.values("acc", rate=1)
    with pytest.raises(KeyError, match="recorded no 'loss'"):
        rec.values("loss")


def test_load_record_names_the_command_when_there_is_none(tmp_path):
    with pytest.raises(FileNotFoundError, match="make experiment NAME=gone"):
        load_record("gone", tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad"}))
    with pytest.raises(ValueError, match="lacks"):
        load_record("bad", tmp_path)


def test_the_order_of_the_public_names_changes_no_unit(tmp_path):
    from attnbook.experiments import code_units

    def units(source):
        path = tmp_path / "module.py"
        path.write_text(source)
        return code_units(path, [])

    listed = units('__all__ = ["b", "a"]\nX = 1\n')
    assert units('__all__ = ["a", "b"]\nX = 1\n') == listed  # the order alone: the same
    assert units('__all__ = ("a", "b")\nX = 1\n') != listed  # a tuple is other code
    assert units('__all__ = ["a", "b", "c"]\nX = 1\n') != listed  # another name
    assert units('__all__ = ["b", "a"]\nX = 2\n') != listed  # another statement
    assert units('names = ["b", "a"]\nX = 1\n') != units('names = ["a", "b"]\nX = 1\n')
