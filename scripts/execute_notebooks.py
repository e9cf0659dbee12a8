"""Execute notebooks top to bottom, in place; a notebook is replaced only when its whole run succeeded.

Usage: python scripts/execute_notebooks.py [--out DIR] [NOTEBOOK ...]   (default: every book/NN_*.ipynb)

With ``--out DIR`` the executed notebooks are written to DIR and the originals are never touched
(``make robust`` uses it); the notebooks still run with book/ as their working directory.

Progress bars write carriage returns to stderr many times a second; before saving, consecutive
stream outputs are merged and each line keeps only what a terminal would show after its last
carriage return, so the stored notebook holds each bar's final state once.
"""

from __future__ import annotations

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
    failed = []
    for path in paths:
        try:
            seconds = execute(path, out_dir)
        except Exception as error:  # keep the old notebook, report, go on
            failed.append(path)
            message = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
            print(f"FAILED {path}: {message[-3000:]}", file=sys.stderr)
            continue
        print(f"{path}: executed in {seconds:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
