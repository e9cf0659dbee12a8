"""Execute notebooks top to bottom, in place; a notebook is replaced only when its whole run succeeded.

Usage: python scripts/execute_notebooks.py [--out DIR] [--jobs N] [--robust [--both]] [--busy N] [NOTEBOOK ...]
       (default: every book/NN_*.ipynb)

With ``--out DIR`` the executed notebooks are written to DIR and the originals are never touched
(``make robust`` and ``make timings`` use it); the notebooks still run with book/ as their working
directory. At the end a table gives each notebook's wall time, the machine it ran on, and flags
any notebook over the 90 s budget; with ``--out`` the table is also saved as DIR/timings.md.

With ``--jobs N`` (default 1) N notebooks run at once, each kernel with ``cores // N`` threads
(``OMP_NUM_THREADS``). The book's models are small, so on 2 cores two notebooks on one thread each
finish the book sooner than one after another on two threads; each notebook's own time is then
longer, and the 90 s budget (one notebook alone on 2 cores) is not checked.

With ``--robust`` (``make robust``) each notebook runs once more under another seed offset and other
CPU kernels, into ``--out``: in book order the notebooks alternate between seed offset 11 with the
avx2 kernel family and seed offset 12 with the default (plain) family, so that both families run
across the book in half the time of running each notebook under both. ``--both`` runs each
notebook under both. The margins of the claims come from sweeps over offsets 1 to 10 and both
families (scripts/sweep_notebooks.py); offsets 11 and 12 are seeds no sweep saw (each offset trains
seeds of its own: attnbook.shifted_seed), so this run checks the margins on a fresh draw.

With ``--busy N`` (``make robust`` passes ``--busy 2``), the notebooks that assert a timing (their
metadata says ``"attnbook": {"asserts_timing": true}``) run after the others, while N processes keep
N cores busy with matrix products (each stops by itself after an hour at most): a timing claim must
hold on a reader's busy laptop, and CI runs two notebooks side by side.

Progress bars write carriage returns to stderr many times a second; before saving, consecutive
stream outputs are merged and each line keeps only what a terminal would show after its last
carriage return, so the stored notebook holds each bar's final state once.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]

# The CPU kernel families a claim is checked on (make robust, make sweep). PyTorch's own kernels
# follow ATEN_CPU_CAPABILITY, but its matrix products come from MKL and many convolutions from
# oneDNN, which choose their instructions themselves: under ATEN_CPU_CAPABILITY=avx2 alone an
# AVX-512 machine still multiplies with AVX-512 and rounds as before, while a CPU with AVX2 only
# (an AMD EPYC, say) multiplies otherwise. So a family caps all three libraries. On an ARM CPU
# these variables change nothing, and on a CPU without AVX2 the avx2 family runs what it has.
KERNEL_FAMILIES = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
# make robust: offset 11 (avx2) and offset 12 (default), alternating by notebook; beyond the sweeps' 1..10
ROBUST_OFFSETS = (11, 12)


def kernel_family(offset: int) -> str:
    """The kernel family a seed offset runs with: avx2 at odd offsets, default at even ones."""
    return "avx2" if offset % 2 else "default"


def variant_env(offset: int) -> dict[str, str]:
    """The environment of a run at seed ``offset``, with its kernel family (see KERNEL_FAMILIES)."""
    return {"ATTNBOOK_SEED_OFFSET": str(offset), **KERNEL_FAMILIES[kernel_family(offset)]}


def robust_offsets(path: Path, both: bool = False) -> tuple[int, ...]:
    """The seed offsets make robust runs ``path`` at: one of ROBUST_OFFSETS, alternating with the
    notebook's place among the NN_*.ipynb of its folder (the book's order), or both."""
    if both:
        return ROBUST_OFFSETS
    names = [p.name for p in sorted(path.parent.glob("[0-9][0-9]_*.ipynb"))]
    place = names.index(path.name) if path.name in names else 0
    return (ROBUST_OFFSETS[place % len(ROBUST_OFFSETS)],)


# A busy machine (--busy N): N processes that each keep one core busy with matrix products while the
# notebooks run, as a reader's laptop busy with other work would, or CI running two notebooks side by
# side. Each stops by itself after BUSY_LIMIT_S even if this script is killed, and is stopped as soon
# as the notebooks are done.
BUSY_LIMIT_S = 3600
BUSY_LOAD = """
import sys, time
import numpy as np
a = np.random.default_rng(0).random((384, 384), dtype=np.float32)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    a = a @ a
    a /= np.abs(a).max()
"""


@contextlib.contextmanager
def busy_machine(processes: int, limit_s: float = BUSY_LIMIT_S):
    """While the block runs, ``processes`` load processes each keep one core busy (one thread
    each); they are stopped when it ends, and stop by themselves after ``limit_s``."""
    single = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    loads = [subprocess.Popen([sys.executable, "-c", BUSY_LOAD, str(limit_s)], env={**os.environ, **single},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(processes)]
    try:
        yield loads
    finally:
        for load in loads:
            load.terminate()
        for load in loads:
            try:
                load.wait(timeout=10)
            except subprocess.TimeoutExpired:
                load.kill()


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


def notebook_client(nb, path: Path) -> NotebookClient:
    """A client that runs ``nb`` (read from ``path``) with ``path``'s folder as the working directory."""
    resources = {"metadata": {"path": str(path.parent)}}
    # a kernel may take minutes to start on a loaded machine (nbclient waits 60 s by default)
    return NotebookClient(
        nb, timeout=900, startup_timeout=600, kernel_name="python3", record_timing=False,
        resources=resources,
    )


# A kernel that never answered never ran a cell: two kernels started at the same moment can be
# handed the same free port (jupyter_client picks the ports, closes them and lets the kernel bind
# them), and the second one dies with "Address already in use", which the client may notice only
# when its startup timeout runs out.
KERNEL_START_FAILURES = (
    "Kernel died before replying to kernel_info",
    "Kernel didn't respond in",
)
KERNEL_START_TRIES = 3


def execute(path: Path, out_dir: Path | None = None, out_name: str | None = None) -> float:
    for attempt in range(1, KERNEL_START_TRIES + 1):
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        try:
            notebook_client(nb, path).execute()
        except RuntimeError as error:  # a kernel that never started: start another
            if attempt == KERNEL_START_TRIES or not any(
                failure in str(error) for failure in KERNEL_START_FAILURES
            ):
                raise
            print(f"{path.name}: its kernel died before it started ({error}); starting "
                  "another", flush=True)
            continue
        break
    elapsed = time.perf_counter() - start
    tidy_streams(nb)
    nbformat.write(nb, path if out_dir is None else out_dir / (out_name or path.name))
    return elapsed


BUDGET_S = 90  # per notebook, on a 2-core CPU (DESIGN.md)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def git_commit() -> str:
    """The commit the working tree is at, with ``+changes`` when tracked files differ from it (the
    provenance of a sweep or a recorded experiment)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    """CPU model, cores, torch version and the settings that change the kernels (for timing tables)."""
    model = cpu_model()
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        torch_version = "?"
    names = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATTNBOOK_SEED_OFFSET",
             "OMP_NUM_THREADS")
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


def _run(path: Path, out_dir: Path | None, offset: int | None = None) -> tuple[Path, int | None, float | None, str]:
    """Execute one notebook; with ``offset``, under that seed offset and its kernel family (the
    kernel started for it inherits this process's environment, set here for the one run)."""
    env = variant_env(offset) if offset is not None else {}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        out_name = None if offset is None else f"{path.stem}.offset{offset}.ipynb"
        return path, offset, execute(path, out_dir, out_name), ""
    except Exception as error:  # keep the old notebook, report, go on
        return path, offset, None, re.sub(r"\x1b\[[0-9;]*m", "", str(error))[-3000:]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: list[str]) -> int:
    out_dir, jobs, robust, both, busy = None, 1, False, False, 0
    while argv[:1] in (["--out"], ["--jobs"], ["--robust"], ["--both"], ["--busy"]):
        if argv[0] in ("--robust", "--both"):
            robust, both = True, both or argv[0] == "--both"
            argv = argv[1:]
            continue
        if len(argv) < 2:
            print(f"{argv[0]} needs a value", file=sys.stderr)
            return 2
        if argv[0] == "--out":
            out_dir = Path(argv[1])
            out_dir.mkdir(parents=True, exist_ok=True)
        elif not argv[1].isdigit() or int(argv[1]) < (0 if argv[0] == "--busy" else 1):
            least = 0 if argv[0] == "--busy" else 1
            print(f"{argv[0]} needs a whole number >= {least}, got {argv[1]!r}", file=sys.stderr)
            return 2
        elif argv[0] == "--busy":
            busy = int(argv[1])
        else:
            jobs = int(argv[1])
        argv = argv[2:]
    if robust and out_dir is None:
        print("--robust needs --out DIR: its runs never replace the committed notebooks", file=sys.stderr)
        return 2
    paths = [Path(p) for p in argv] or sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
    tasks = [(path, offset) for path in paths for offset in (robust_offsets(path, both) if robust else [None])]
    # with --busy, the notebooks that assert a timing run last, beside the load; the others before, without
    phases = [(tasks, 0)] if not busy else [
        ([t for t in tasks if not asserts_timing(t[0])], 0), ([t for t in tasks if asserts_timing(t[0])], busy)]
    failed, times, wall = [], {}, 0.0
    for phase, load in phases:
        if phase:
            with busy_machine(load):
                wall += run_phase(phase, out_dir, jobs, failed, times, load)
    ordered = {}  # book order
    for path, offset in tasks:
        if (path.name, offset) in times:
            name = path.name if offset is None else f"{path.name} ({offset}, {kernel_family(offset)})"
            if busy and asserts_timing(path):
                name += f", beside {busy} busy"
            ordered[name] = times[path.name, offset]
    if len(ordered) > 1:
        table = timings_table(ordered, jobs, wall if jobs > 1 else None)
        print("\n" + table)
        if out_dir is not None:
            (out_dir / "timings.md").write_text(table + "\n")
    if failed:
        print(f"\n{len(failed)} notebook run(s) failed: " + ", ".join(sorted({p.name for p in failed})),
              file=sys.stderr)
    return 1 if failed else 0


def asserts_timing(path: Path) -> bool:
    """Whether a notebook asserts a timing (its metadata: ``"attnbook": {"asserts_timing": true}``)."""
    return bool(nbformat.read(path, as_version=4).metadata.get("attnbook", {}).get("asserts_timing"))


def run_phase(tasks, out_dir: Path | None, jobs: int, failed: list, times: dict, busy: int) -> float:
    """Execute ``tasks`` ``(path, offset)``, ``jobs`` at a time; fills ``failed`` and ``times``; returns the
    wall time."""
    start = time.perf_counter()
    pool = None
    if jobs == 1:
        results = (_run(path, out_dir, offset) for path, offset in tasks)
    else:
        pool = ProcessPoolExecutor(jobs, initializer=_limit_threads, initargs=(threads_per_job(jobs),))
        futures = [pool.submit(_run, path, out_dir, offset) for path, offset in tasks]
        results = (future.result() for future in as_completed(futures))
    for path, offset, seconds, error in results:
        label = path.name if offset is None else f"{path.name} (offset {offset}, {kernel_family(offset)} kernels)"
        if busy:
            label += f", beside {busy} busy process{'es' if busy > 1 else ''}"
        if seconds is None:
            failed.append(path)
            print(f"FAILED {label}: {error}", file=sys.stderr)
            continue
        print(f"{label}: executed in {seconds:.1f} s", flush=True)
        times[path.name, offset] = seconds
    if pool is not None:
        pool.shutdown()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
