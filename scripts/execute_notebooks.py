"""Execute notebooks top to bottom, in place; a notebook is replaced only when its whole run succeeded.

Usage: python scripts/execute_notebooks.py [--out DIR] [NOTEBOOK ...]   (default: every book/NN_*.ipynb)

With ``--out DIR`` the executed notebooks are written to DIR and the originals are never touched
(``make robust`` and ``make timings`` use it); the notebooks still run with book/ as their working
directory. At the end a table gives each notebook's wall time, the machine it ran on, and flags
any notebook over the 90 s budget; with ``--out`` the table is also saved as DIR/timings.md.

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
    names = ("ATEN_CPU_CAPABILITY", "ATTNBOOK_SEED_OFFSET")
    settings = " ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ)
    return f"{model}, {os.cpu_count()} cores, torch {torch_version}" + (f", {settings}" if settings else "")


def timings_table(times: dict[str, float]) -> str:
    lines = [f"Notebook execution times on {machine()}", "", "| notebook | seconds |", "| --- | ---: |"]
    lines += [f"| {name} | {seconds:.1f}{' (over the 90 s budget)' if seconds > BUDGET_S else ''} |"
              for name, seconds in times.items()]
    lines.append(f"| all | {sum(times.values()):.1f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out_dir = None
    if argv[:1] == ["--out"]:
        if len(argv) < 2:
            print("--out needs a folder", file=sys.stderr)
            return 2
        out_dir = Path(argv[1])
        out_dir.mkdir(parents=True, exist_ok=True)
        argv = argv[2:]
    paths = [Path(p) for p in argv] or sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
    failed, times = [], {}
    for path in paths:
        try:
            seconds = execute(path, out_dir)
        except Exception as error:  # keep the old notebook, report, go on
            failed.append(path)
            message = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
            print(f"FAILED {path}: {message[-3000:]}", file=sys.stderr)
            continue
        print(f"{path}: executed in {seconds:.1f} s")
        times[path.name] = seconds
    if len(times) > 1:
        table = timings_table(times)
        print("\n" + table)
        if out_dir is not None:
            (out_dir / "timings.md").write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
