"""Execute notebooks top to bottom, in place; a notebook is replaced only when its whole run succeeded.

Usage: python scripts/execute_notebooks.py [--out DIR] [--jobs N] [NOTEBOOK ...]   (default: every book/NN_*.ipynb)

With ``--out DIR`` the executed notebooks are written to DIR and the originals are never touched
(``make robust`` and ``make timings`` use it); the notebooks still run with book/ as their working
directory. At the end a table gives each notebook's wall time, the machine it ran on, and flags
any notebook over the 90 s budget; with ``--out`` the table is also saved as DIR/timings.md.

With ``--jobs N`` (default 1) N notebooks run at once, each kernel with ``cores // N`` threads
(``OMP_NUM_THREADS``). The book's models are small, so on 2 cores two notebooks on one thread each
finish the book sooner than one after another on two threads; each notebook's own time is then
longer, and the 90 s budget (one notebook alone on 2 cores) is not checked.

Progress bars write carriage returns to stderr many times a second; before saving, consecutive
stream outputs are merged and each line keeps only what a terminal would show after its last
carriage return, so the stored notebook holds each bar's final state once.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def resolve_carriage_returns(text: str) -> str:
    lines = []
    for line in text.split("\n"):
        line = line.rstrip("\r")
        lines.append(line.rsplit("\r", 1)[-1])
    return "\n".join(lines)


def tidy_streams(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        merged = []
        for out in cell.outputs:
            if merged and out.output_type == "stream" and merged[-1].output_type == "stream" and (
                merged[-1].name == out.name
            ):
                merged[-1].text += out.text
            else:
                merged.append(out)
        for out in merged:
            if out.output_type == "stream":
                out.text = resolve_carriage_returns(out.text)
        cell.outputs = [out for out in merged if out.output_type != "stream" or out.text.strip()]


def execute(path: Path, out_dir: Path | None = None) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    resources = {"metadata": {"path": str(path.parent)}}  # run with book/ as the working directory
    client = NotebookClient(nb, timeout=900, kernel_name="python3", record_timing=False, resources=resources)
    client.execute()
    elapsed = time.perf_counter() - start
    tidy_streams(nb)
    nbformat.write(nb, path if out_dir is None else out_dir / path.name)
    return elapsed


BUDGET_S = 90  # per notebook, on a 2-core CPU (DESIGN.md)


def machine() -> str:
    """CPU model, cores, torch version and the settings that change the kernels (for timing tables)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        torch_version = "?"
    names = ("ATEN_CPU_CAPABILITY", "ATTNBOOK_SEED_OFFSET", "OMP_NUM_THREADS")
    settings = " ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ)
    return f"{model}, {os.cpu_count()} cores, torch {torch_version}" + (f", {settings}" if settings else "")


def timings_table(times: dict[str, float], jobs: int = 1, wall: float | None = None) -> str:
    threads = threads_per_job(jobs)
    how = "one at a time" if jobs == 1 else f"{jobs} at a time, {threads} thread{'s' if threads > 1 else ''} each"
    lines = [f"Notebook execution times on {machine()} ({how})", "", "| notebook | seconds |", "| --- | ---: |"]
    # the budget is for one notebook alone, with every core (make robust runs two on one thread each)
    flag = jobs == 1 and os.environ.get("OMP_NUM_THREADS", "") in ("", str(os.cpu_count()))
    lines += [f"| {name} | {seconds:.1f}{' (over the 90 s budget)' if flag and seconds > BUDGET_S else ''} |"
              for name, seconds in times.items()]
    lines.append(f"| all | {sum(times.values()):.1f} |")
    if wall is not None:
        lines.append(f"| wall time, start to end | {wall:.1f} |")
    return "\n".join(lines)


def threads_per_job(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // jobs)


def _limit_threads(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by torch in every kernel this process starts


def _run(path: Path, out_dir: Path | None) -> tuple[Path, float | None, str]:
    try:
        return path, execute(path, out_dir), ""
    except Exception as error:  # keep the old notebook, report, go on
        return path, None, re.sub(r"\x1b\[[0-9;]*m", "", str(error))[-3000:]


def main(argv: list[str]) -> int:
    out_dir, jobs = None, 1
    while argv[:1] in (["--out"], ["--jobs"]):
        if len(argv) < 2:
            print(f"{argv[0]} needs a value", file=sys.stderr)
            return 2
        if argv[0] == "--out":
            out_dir = Path(argv[1])
            out_dir.mkdir(parents=True, exist_ok=True)
        elif not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"--jobs needs a whole number >= 1, got {argv[1]!r}", file=sys.stderr)
            return 2
        else:
            jobs = int(argv[1])
        argv = argv[2:]
    paths = [Path(p) for p in argv] or sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
    failed, times = [], {}
    start = time.perf_counter()
    if jobs == 1:
        results = (_run(path, out_dir) for path in paths)
    else:
        pool = ProcessPoolExecutor(jobs, initializer=_limit_threads, initargs=(threads_per_job(jobs),))
        results = (future.result() for future in as_completed([pool.submit(_run, p, out_dir) for p in paths]))
    for path, seconds, error in results:
        if seconds is None:
            failed.append(path)
            print(f"FAILED {path}: {error}", file=sys.stderr)
            continue
        print(f"{path}: executed in {seconds:.1f} s", flush=True)
        times[path.name] = seconds
    wall = time.perf_counter() - start
    if jobs > 1:
        pool.shutdown()
        times = {path.name: times[path.name] for path in paths if path.name in times}  # book order
    if len(times) > 1:
        table = timings_table(times, jobs, wall if jobs > 1 else None)
        print("\n" + table)
        if out_dir is not None:
            (out_dir / "timings.md").write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
