"""Run a recorded experiment: every grid point at every seed, and keep the record beside the book.

Usage: python scripts/run_experiment.py NAME [--jobs N] [--restart]   (make experiment NAME=...)
       python scripts/run_experiment.py --list                          (every experiment and its state)

NAME is a module of book/experiments/ (NAME.py) declaring GRID (a list of points, each a dict of
parameters), SEEDS and run(point, seed) -> dict of figures (see attnbook.experiments); it may
declare COST(point), a number proportional to a run's time, so the longest runs start first and
the progress bar's estimate of the time left is right.

Runs go N at a time (default 2), each in its own (spawned) process on one thread, with no seed offset. Each
finished run is appended at once to _build/experiments/NAME.jsonl with the hashes of the code it
executed, so an experiment interrupted (Ctrl-C, a lost machine) resumes where it stopped: a run kept
there is reused while its point and seed are still in the grid and the code it executed is unchanged
(--restart discards them all). An experiment that keeps its training code in a module of its own
(book/experiments/_NAME.py, say) can then grow its grid without running its old points again. While a run executes, the functions
of the library and of the experiment it calls are noted (a trace of Python calls); when every run
is done, book/experiments/NAME.json is written: every run's figures and time, the code the runs
executed with a hash of each function, of the classes holding them and of their modules' own
statements (attnbook.experiments.code_units), and the provenance (commit, torch, CPU, threads,
start and end, wall time and the runs' summed time). tests/test_experiments.py then fails when one
of those changes, naming what changed and this command.

Exit status 1 if a run raised, 2 for bad arguments.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import execute_notebooks  # noqa: E402

EXPERIMENTS = ROOT / "book" / "experiments"
PARTIAL = ROOT / "_build" / "experiments"
LIBRARY = ROOT / "lib" / "attnbook"


def load_module(name: str, folder: Path = EXPERIMENTS):
    """The experiment's module, imported from ``folder``/NAME.py; its declarations checked."""
    path = folder / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"no experiment {name!r} in {folder}; there are: {', '.join(known) or 'none'}")
    if str(folder.parent) not in sys.path:  # the experiments import their helpers as experiments.*
        sys.path.insert(0, str(folder.parent))
    spec = importlib.util.spec_from_file_location(f"experiments.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    grid, seeds = getattr(module, "GRID", None), getattr(module, "SEEDS", None)
    if not isinstance(grid, list) or not grid or not all(isinstance(p, dict) for p in grid):
        raise ValueError(f"{path.name}: GRID must be a non-empty list of dicts, got {grid!r:.80}")
    if not isinstance(seeds, (list, tuple)) or not seeds or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds
    ):
        raise ValueError(f"{path.name}: SEEDS must be a non-empty list of ints >= 0, got {seeds!r}")
    if not callable(getattr(module, "run", None)):
        raise ValueError(f"{path.name}: no function run(point, seed)")
    keys = [json.dumps(p, sort_keys=True) for p in grid]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{path.name}: GRID lists a point twice")
    return module


def tasks_of(module) -> list[tuple[dict, int]]:
    return [(point, seed) for point in module.GRID for seed in module.SEEDS]


def task_key(point: dict, seed: int) -> str:
    return json.dumps({"point": point, "seed": seed}, sort_keys=True)


# --- one run, in a worker process -----------------------------------------------------------------

IMPORTED: dict[str, str] = {}  # in a worker: every source file as it was when imported


def _init_worker(name: str, folder: str) -> None:
    """A worker: one thread, no seed offset, the experiment imported, and the text of every source
    file it may run kept as imported (the runs' code hashes come from it, not from the disk, which
    may change while the workers run)."""
    import torch

    os.environ.pop("ATTNBOOK_SEED_OFFSET", None)  # the seeds as declared
    torch.set_num_threads(1)
    load_module(name, Path(folder))
    IMPORTED.update(source_texts(Path(folder)))


def source_texts(folder: Path) -> dict[str, str]:
    """The text of every Python file of the library and of ``folder``, by path relative to ROOT."""
    files = [*LIBRARY.rglob("*.py"), *folder.resolve().glob("*.py")]
    return {str(f.resolve().relative_to(ROOT)): f.read_text() for f in files}


def _run_task(name: str, folder: str, point: dict, seed: int) -> dict:
    """Run one point at one seed; returns its figures, seconds and the code it executed (file ->
    the functions that ran there) with the hash of each piece (attnbook.experiments.current_units)."""
    module = sys.modules.get(f"experiments.{name}") or load_module(name, Path(folder))
    ran: set[tuple[str, str]] = set()

    def note(frame, event, arg):  # 'call' events only: no line tracing, a few % of overhead
        ran.add((frame.f_code.co_filename, frame.f_code.co_qualname))

    start = time.perf_counter()
    sys.settrace(note)
    try:
        metrics = module.run(dict(point), seed)
    finally:
        sys.settrace(None)
    seconds = time.perf_counter() - start
    if not isinstance(metrics, dict) or not metrics:
        raise TypeError(f"run({point}, {seed}) must return a non-empty dict of figures, got {metrics!r:.80}")
    metrics = {str(k): float(v) for k, v in metrics.items()}
    code: dict[str, list[str]] = {}
    for filename, qualname in ran:
        path = Path(filename).resolve()
        if path.is_file() and _inside(path, (LIBRARY, Path(folder).resolve())):
            code.setdefault(str(path.relative_to(ROOT)), []).append(qualname)
    code = {file: sorted(set(names)) for file, names in sorted(code.items())}
    from attnbook.experiments import current_units

    return {"point": point, "seed": seed, "metrics": metrics, "seconds": round(seconds, 3),
            "code": code, "units": current_units(code, ROOT, IMPORTED or None)}


def _inside(path: Path, folders) -> bool:
    return any(path.is_relative_to(folder.resolve()) for folder in folders)


# --- the record ------------------------------------------------------------------------------------

def provenance(jobs: int, sessions: list[dict], runs: list[dict]) -> dict:
    import torch
    from attnbook.utils import device

    where = device()
    return {
        "commit": execute_notebooks.git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(where) if where.type == "cuda" else f"CPU: {execute_notebooks.cpu_model()}",
        "cores": os.cpu_count(),
        "processes": jobs,
        "threads_per_process": 1,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "started": sessions[0]["started"],
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(sum(s.get("wall", 0.0) for s in sessions), 1),
        "sessions": len(sessions),
        "run_seconds": round(sum(r["seconds"] for r in runs), 1),
    }


def write_record(name: str, module, done: dict, jobs: int, sessions: list[dict],
                 folder: Path = EXPERIMENTS) -> Path:
    from attnbook.experiments import current_units, fingerprint

    runs = [done[task_key(point, seed)] for point, seed in tasks_of(module)]
    changed = sorted({f"{file}: {unit}" for run in runs
                      for file, units in current_units(run["code"], ROOT).items()
                      for unit, digest in units.items() if run["units"][file].get(unit) != digest})
    if changed:
        raise RuntimeError(f"the code changed while {name} ran ({'; '.join(changed)}): the runs of the "
                           f"code as it is now are kept; run `make experiment NAME={name}` again")
    code: dict[str, set[str]] = {str((folder / f"{name}.py").resolve().relative_to(ROOT)): set()}
    for run in runs:
        for file, names in run["code"].items():
            code.setdefault(file, set()).update(names)
    code = {file: sorted(names) for file, names in sorted(code.items())}
    record = {
        "name": name,
        "fingerprint": fingerprint(code, ROOT),
        "code": code,
        "units": current_units(code, ROOT),
        "provenance": provenance(jobs, sessions, runs),
        "runs": [{k: run[k] for k in ("point", "seed", "metrics", "seconds")} for run in runs],
    }
    out = folder / f"{name}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    return out


# --- the driver ------------------------------------------------------------------------------------

def read_partial(path: Path, tasks: set[str]) -> tuple[dict, list[dict]]:
    """The runs kept in ``path`` that are still tasks of the grid and whose code is as it ran (each
    run's hashes of the code it executed), and the sessions logged there."""
    from attnbook.experiments import current_units

    done, sessions = {}, []
    if not path.is_file():
        return done, sessions
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if "session" in entry:
            sessions.append(entry["session"])
            continue
        key = task_key(entry["point"], entry["seed"])
        try:
            same = current_units(entry["code"], ROOT) == entry.get("units")
        except (FileNotFoundError, KeyError, SyntaxError):
            same = False
        if key in tasks and same:
            done[key] = entry
    return done, sessions


def run_experiment(name: str, jobs: int = 2, restart: bool = False, folder: Path = EXPERIMENTS,
                   partial_folder: Path = PARTIAL, progress: bool = True) -> Path:
    if not folder.resolve().is_relative_to(ROOT):
        raise ValueError(f"an experiment's folder must lie in the repository {ROOT}, got {folder}")
    module = load_module(name, folder)
    partial = partial_folder / f"{name}.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    if restart:
        partial.unlink(missing_ok=True)
    done, sessions = read_partial(partial, {task_key(p, s) for p, s in tasks_of(module)})
    if done:
        print(f"{name}: resuming, {len(done)} of {len(tasks_of(module))} runs kept in {partial}", flush=True)
    session = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    todo = [(p, s) for p, s in tasks_of(module) if task_key(p, s) not in done]
    cost = getattr(module, "COST", lambda point: 1.0)
    todo.sort(key=lambda task: -float(cost(task[0])))  # the longest first: the last to finish are short
    total_cost = sum(float(cost(p)) for p, _ in tasks_of(module))
    from attnbook.utils import progress as bar

    start = time.perf_counter()
    failed = []
    with open(partial, "a") as log, ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
        initargs=(name, str(folder)),
    ) as pool, bar(
        total=round(total_cost), initial=round(sum(float(cost(d["point"])) for d in done.values())),
        desc=f"{name}: {len(todo)} runs", unit=" cost", disable=not progress,
        bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}]",
    ) as shown:
        pending = {pool.submit(_run_task, name, str(folder), p, s): (p, s) for p, s in todo}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                point, seed = pending.pop(future)
                try:
                    result = future.result()
                except Exception as error:  # report it, keep the others going
                    failed.append((point, seed, error))
                    print(f"\n{name}: run {point} seed {seed} raised {type(error).__name__}: {error}",
                          file=sys.stderr, flush=True)
                    continue
                done[task_key(point, seed)] = result
                log.write(json.dumps(result) + "\n")
                log.flush()
                shown.update(float(cost(point)))
        session["wall"] = round(time.perf_counter() - start, 1)
        log.write(json.dumps({"session": session}) + "\n")
    sessions.append(session)
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) of {name} raised; the others are kept in {partial}")
    return write_record(name, module, done, jobs, sessions, folder)


def list_experiments(folder: Path = EXPERIMENTS) -> str:
    from attnbook.experiments import staleness

    lines = []
    for path in sorted(folder.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        record = folder / f"{path.stem}.json"
        if not record.is_file():
            state = "not recorded"
        else:
            data = json.loads(record.read_text())
            fresh = staleness(path.stem, folder) is None
            wall = data["provenance"].get("wall_seconds", math.nan)
            state = (f"recorded {data['provenance'].get('finished', '?')[:10]}, {len(data['runs'])} runs, "
                     f"{wall / 60:.0f} min" + ("" if fresh else "; STALE: its code changed"))
        lines.append(f"{path.stem:<24} {state}")
    return "\n".join(lines) or "no experiments"


def main(argv: list[str]) -> int:
    jobs, restart, names = 2, False, []
    while argv:
        arg, argv = argv[0], argv[1:]
        if arg == "--list":
            print(list_experiments())
            return 0
        if arg == "--restart":
            restart = True
        elif arg == "--jobs":
            if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
                print("--jobs needs a whole number >= 1", file=sys.stderr)
                return 2
            jobs, argv = int(argv[0]), argv[1:]
        elif arg.startswith("--"):
            print(f"unknown option {arg}", file=sys.stderr)
            return 2
        else:
            names.append(arg)
    if len(names) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        out = run_experiment(names[0], jobs, restart)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"record kept in {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
