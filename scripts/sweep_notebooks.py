"""Execute a notebook under many seed offsets and report what fails and how far each printed figure moves.

Usage: python scripts/sweep_notebooks.py [--offsets N | --offsets 3,7,11] [--jobs N] [--keep DIR] [--all-lines]
                                          [--gpu-settings] [--busy N] [--write] NOTEBOOK ...
       python scripts/sweep_notebooks.py --from DIR [--offsets ...] NOTEBOOK ...   (report on kept runs)

``make robust`` runs each notebook at two seed offsets; a threshold set from those few runs is not a
margin. This runs a notebook under ``ATTNBOOK_SEED_OFFSET`` = 1 .. N (default N = 10), or the
offsets listed (``3,7,11``; ranges such as ``10-19`` too; one offset alone: ``7,``), with the CPU
kernel family alternating between ``avx2`` (odd offsets) and ``default`` (even offsets), as ``make
robust`` pairs them, so both families are covered and a margin is taken over both. Offset 0 is
the page's own run, so it is not one of the sweep's: each offset trains seeds no other offset
shares (``attnbook.shifted_seed``), and a sweep of ten offsets is ten independent draws beside the
page's. ``make robust`` runs offsets beyond the sweep's (execute_notebooks.ROBUST_OFFSETS). A family caps
PyTorch's own kernels and the instructions of MKL and oneDNN, which do the matrix products and
convolutions (execute_notebooks.KERNEL_FAMILIES). Each run has ``OMP_NUM_THREADS=1``;
``--jobs`` (default 2) run at once. Every run is executed into a temporary folder (kept with
``--keep DIR``): the committed notebook is never touched. Cells that read a sweep (``load_sweep(``) are not run: they
show the last sweep, which this one replaces, and are outside its fingerprint. ``--from DIR`` runs nothing and reports on
the runs kept in DIR (those of the offsets asked for that are there).

The report gives, per notebook:

- each run: offset, kernels, seconds, and ``ok`` or the failing cell;
- every failure: the cell, the offset, the source line that raised (for an assert, the assert
  itself) and the exception's message;
- the spread of the printed figures: for every code cell, the numbers in its printed text (stdout
  and results, not the progress bars on stderr) are read in order (ints, floats, percentages), and
  where the cell printed the same count of numbers at every offset that ran it, each line of the
  first offset's text is shown with each number that moved replaced by
  ``{min@offset..max@offset ~mean}``. Lines whose numbers never moved are left out (``--all-lines``
  shows them). Where the count differs (a verdict printed at some offsets only), lines are matched
  by their text with the numbers taken out, and a line printed at only some offsets says at which.
  A threshold can then be set from the spread, with a margin.

With ``--write`` (``make sweep`` passes it) the sweep is also kept beside the notebook, in
``book/sweeps/<notebook>.json`` (:mod:`attnbook.sweeps`): every run's offset, kernels, whether it
passed, and every value the notebook glued for its prose, with a fingerprint of the notebook's code.
A notebook reads it with ``attnbook.sweeps.load_sweep`` to show the spread its thresholds rest on.

With ``--busy N`` (``make sweep`` passes ``--busy 2``), a notebook that asserts a timing (metadata
``"attnbook": {"asserts_timing": true}``) is swept beside N processes that keep N cores busy, as
``make robust`` runs it: its timing thresholds get margins measured on a busy machine. ``--write`` on
such a notebook without ``--busy`` is refused (exit status 2), so its sweep cannot come from a quiet
machine by mistake.

With ``--gpu-settings`` every run takes the settings a GPU gets (``attnbook.on_gpu()`` says True, as in
``make gpu-settings``: the longer trainings, on the CPU), and the sweep is kept in
``book/sweeps/<notebook>.gpu.json`` (``load_sweep("<notebook>.gpu")``), so a page can show what its
longer trainings gave without running them.

Exit status 1 if any run failed, 2 for bad arguments.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import execute_notebooks  # noqa: E402
from attnbook.sweeps import SWEEP_READER, fingerprint  # noqa: E402
from attnbook.utils import SEED_STRIDE  # noqa: E402

# a number not glued to a name (layer1, x2) or to another number: -3, +0.25, 1e-3, 34%; 1,234 is two numbers
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?%?")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def capability(offset: int) -> str:
    """The CPU kernel family a run gets: avx2 at odd offsets, default at even offsets (as make robust)."""
    return execute_notebooks.kernel_family(offset)


def parse_offsets(text: str) -> list[int]:
    """``10`` means 1..10 (offset 0 is the page's own run); ``3,7,11`` and ``10-12`` list offsets
    (``7,`` is offset 7 alone)."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise ValueError(f"--offsets needs a count >= 1 or a list such as 3,7,11, got {text!r}")
        return list(range(1, int(text) + 1))
    offsets: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"--offsets needs a count or a list such as 3,7,11 or 10-19, got {text!r}")
        offsets += range(int(low), int(high or low) + 1)
    if not offsets:
        raise ValueError(f"--offsets needs a count or a list such as 3,7,11, got {text!r}")
    return list(dict.fromkeys(offsets))


# --- one run ----------------------------------------------------------------------------------


def run_one(path: Path, out: Path) -> int:
    """Execute one notebook (in this process's environment) and save it to ``out`` even when a cell
    raised, so the report can read the error and every output before it."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # the committed outputs must not pass for this run's where a cell raised before them
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if SWEEP_READER in cell.source:  # it shows the last sweep: not part of this one
                cell.source = "pass  # reads the sweep file: not run in a sweep"
    client = execute_notebooks.notebook_client(nb, path)  # cwd: the notebook's folder
    status = 0
    try:
        client.execute()
    except Exception as error:  # a cell raised, or the kernel died: keep what ran
        status = 1
        nb.metadata["sweep_error"] = ANSI.sub("", f"{type(error).__name__}: {error}")[-3000:]
    execute_notebooks.tidy_streams(nb)
    nbformat.write(nb, out)
    return status


@dataclass
class Run:
    offset: int
    capability: str
    seconds: float = 0.0
    nb: object = None
    error: str = ""  # why no notebook came back at all
    failure: dict = field(default_factory=dict)  # cell, line, message


GPU_STARTUP = ROOT / "scripts" / "gpu_settings_startup.py"


def gpu_settings_ipython(folder: Path) -> Path:
    """An IPython folder whose startup file gives every kernel the settings a GPU gets."""
    startup = folder / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / GPU_STARTUP.name).write_text(GPU_STARTUP.read_text())
    return folder / "ipython"


def launch(path: Path, offset: int, out_dir: Path, ipython_dir: Path | None = None) -> Run:
    run = Run(offset, capability(offset))
    out = out_dir / f"{path.stem}.offset{offset}.ipynb"
    env = dict(os.environ, **execute_notebooks.variant_env(offset), OMP_NUM_THREADS="1")
    if ipython_dir is not None:
        env["IPYTHONDIR"] = str(ipython_dir)
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("JUPYTER_PREFER_ENV_PATH", "1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--run-one", str(path), str(out)], env=env,
                          capture_output=True, text=True)
    run.seconds = time.perf_counter() - start
    if out.exists():
        run.nb = nbformat.read(out, as_version=4)
        run.failure = find_failure(run.nb)
    if done.returncode != 0 and not run.failure:
        run.error = (done.stderr or done.stdout or f"exit status {done.returncode}").strip()[-2000:]
        run.failure = {"cell": None, "line": "", "message": run.error.splitlines()[-1] if run.error else ""}
    return run


def statement(source: str, number: int) -> str:
    """The whole statement (an assert over several lines, say) at line ``number`` of a cell, on one line."""
    lines = source.splitlines()
    if not 1 <= number <= len(lines):
        return ""
    text = lines[number - 1].strip()
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: the line alone
        return text
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not hasattr(node, "body") and (
            node.lineno <= number <= (node.end_lineno or node.lineno)
        ):
            text = " ".join(part.strip() for part in lines[node.lineno - 1:node.end_lineno])
            break
    return text if len(text) <= 300 else text[:297] + "..."


def find_failure(nb) -> dict:
    """The first cell with an error output: its index, the source line that raised, the message."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.output_type != "error":
                continue
            trace = ANSI.sub("", "\n".join(out.get("traceback", [])))
            # the first frame is the cell's: "Cell In[12], line 5", and an arrow at that line
            number = re.search(r"Cell In\[\d+\], line (\d+)", trace)
            arrow = re.search(r"^\s*-+>\s*\d*\s?(.*)$", trace, re.MULTILINE)
            line = statement(cell.source, int(number.group(1))) if number else ""
            if not line and arrow:
                line = arrow.group(1).strip()
            message = f"{out.ename}: {out.evalue}" if out.evalue else out.ename
            return {"cell": index, "line": line, "message": message}
    error = nb.metadata.get("sweep_error")
    if error:
        return {"cell": None, "line": "", "message": error.strip().splitlines()[-1]}
    return {}


# --- the report -------------------------------------------------------------------------------


def printed_text(cell) -> str:
    """What a code cell printed: stdout streams and text results (not stderr, where progress bars go)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data") and "text/plain" in out.get("data", {}):
            if "image/png" in out.data or "text/html" in out.data:
                continue  # a figure's or a table's repr, e.g. <Figure size ...>
            parts.append(out.data["text/plain"])
    return ANSI.sub("", "\n".join(p.rstrip("\n") for p in parts))


def numbers(text: str) -> list[float]:
    return [float(m.group().rstrip("%")) for m in NUMBER.finditer(text)]


def like(token: str, value: float, extra: int = 0) -> str:
    """``value`` written as ``token`` was (its decimals, scientific notation, percent sign)."""
    percent = "%" if token.endswith("%") else ""
    mantissa = token.rstrip("%").lstrip("+-").lower().split("e")
    places = (len(mantissa[0].split(".")[1]) if "." in mantissa[0] else 0) + extra
    sign = "+" if token.startswith("+") else ""
    return f"{value:{sign}.{places}{'e' if len(mantissa) == 2 else 'f'}}{percent}"


def render(line: str, columns: list[list[float]], offsets: list[int], all_lines: bool) -> str | None:
    """``line`` with its i-th number replaced by the spread of ``columns[i]`` (one value per offset) where
    it moved; None when nothing moved (unless ``all_lines``)."""
    moved, pieces, last = False, [], 0
    for match, column in zip(NUMBER.finditer(line), columns, strict=True):
        pieces.append(line[last : match.start()])
        last = match.end()
        low, high, token = min(column), max(column), match.group()
        if low == high:
            pieces.append(token)
            continue
        moved = True
        pieces.append(f"{{{like(token, low)}@{offsets[column.index(low)]}..{like(token, high)}@"
                      f"{offsets[column.index(high)]} ~{like(token, sum(column) / len(column), 1)}}}")
    pieces.append(line[last:])
    return "  " + "".join(pieces).rstrip() if moved or all_lines else None


def shape(line: str) -> str:
    return NUMBER.sub("#", line)


def spread_lines(runs: list[Run], index: int, all_lines: bool) -> list[str]:
    """The lines of one cell's printed text with each moving number shown as {min@o..max@o ~mean}.

    When the cell printed the same count of numbers at every offset, the i-th number of the first
    offset's text is compared with the i-th number of every other offset's. Otherwise lines are
    matched by their text with the numbers taken out (the k-th line of each such shape), and a line
    that only some offsets printed says at which."""
    ran = [(run.offset, printed_text(run.nb.cells[index])) for run in runs
           if run.nb is not None and run.nb.cells[index].get("execution_count") is not None]
    if not ran or not any(numbers(text) for _, text in ran):
        return []
    offsets = [offset for offset, _ in ran]
    if len({len(numbers(text)) for _, text in ran}) == 1:
        values = [numbers(text) for _, text in ran]
        lines, position = [], 0
        for line in ran[0][1].split("\n"):
            count = len(numbers(line))
            if count:
                columns = [[row[position + i] for row in values] for i in range(count)]
                position += count
                rendered = render(line, columns, offsets, all_lines)
                if rendered:
                    lines.append(rendered)
        return lines
    # line by line: key (shape, k-th occurrence) -> {offset: line}
    found: dict[tuple[str, int], dict[int, str]] = {}
    for offset, text in ran:
        seen: dict[str, int] = {}
        for line in text.split("\n"):
            if not NUMBER.search(line):
                continue
            key = (shape(line), seen.get(shape(line), 0))
            seen[key[0]] = key[1] + 1
            found.setdefault(key, {})[offset] = line
    lines = [f"  (the count of printed numbers differs between offsets: lines matched by their text; "
             f"a line printed at only some of the {len(ran)} offsets says at which)"]
    single = 0
    for by_offset in found.values():
        where = list(by_offset)
        if len(where) == 1 and len(ran) > 2:
            single += 1  # e.g. examples drawn at random: not a figure to compare
            continue
        template = by_offset[where[0]]
        columns = [list(column) for column in zip(*(numbers(by_offset[o]) for o in where), strict=True)]
        rendered = render(template, columns, where, all_lines or len(where) < len(ran))
        if rendered:
            note = "" if len(where) == len(ran) else f"   [at offsets {','.join(map(str, where))} only]"
            lines.append(rendered + note)
    if single:
        lines.append(f"  ({single} line{'s' if single > 1 else ''} printed at one offset only, left out)")
    return lines


def first_line(cell) -> str:
    for line in cell.source.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()[:80]
    return ""


def report(path: Path, runs: list[Run], all_lines: bool = False) -> str:
    out = [f"# {path} over {len(runs)} seed offsets ({', '.join(str(r.offset) for r in runs)})", "",
           "| offset | kernels | seconds | result |", "| ---: | --- | ---: | --- |"]
    for run in runs:
        failure = run.failure
        result = "ok" if not failure else (f"FAILED in cell {failure['cell']}" if failure["cell"] is not None
                                           else "FAILED")
        out.append(f"| {run.offset} | {run.capability} | {run.seconds:.1f} | {result} |")
    failed = [run for run in runs if run.failure]
    out += ["", f"## Failures: {len(failed)} of {len(runs)} runs" if failed else "## Failures: none"]
    for run in failed:
        failure = run.failure
        where = f"cell {failure['cell']}" if failure["cell"] is not None else "the run"
        out.append(f"- offset {run.offset} ({run.capability}): {where}: {failure['message']}")
        if failure["line"]:
            out.append(f"    at: {failure['line']}")
    cells = max((len(run.nb.cells) for run in runs if run.nb is not None), default=0)
    out += ["", "## Spread of the printed figures: {min@offset..max@offset ~mean} over the offsets that ran "
            "the cell"]
    for index in range(cells):
        cell = next(run.nb.cells[index] for run in runs if run.nb is not None)
        if cell.cell_type != "code":
            continue
        lines = spread_lines(runs, index, all_lines)
        if lines:
            out += ["", f"cell {index}: {first_line(cell)}", *lines]
    return "\n".join(out) + "\n"


def kept_runs(path: Path, offsets: list[int], out_dir: Path) -> list[Run]:
    runs = []
    for offset in offsets:
        kept = out_dir / f"{path.stem}.offset{offset}.ipynb"
        if kept.exists():
            run = Run(offset, capability(offset), nb=nbformat.read(kept, as_version=4))
            run.failure = find_failure(run.nb)
            runs.append(run)
    return runs


def glued_values(nb) -> dict:
    """Every value a run glued (``myst_nb.glue``): name -> the value (a number where its text is one)."""
    values = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            text = output.get("data", {}).get("application/papermill.record/text/plain")
            if name and text is not None:
                values[name] = glued_value(text)
    return values


def glued_value(text: str):
    """A glued value from its text: a number where it is one (NumPy's ``np.float64(1.5)`` too)."""
    numpy_scalar = re.fullmatch(r"np\.\w+\((.*)\)", text.strip())
    try:
        return ast.literal_eval(numpy_scalar.group(1) if numpy_scalar else text)
    except (ValueError, SyntaxError):
        return text


def write_sweep(path: Path, runs: list[Run], gpu_settings: bool = False, busy: int = 0,
                measured: str | None = None) -> Path:
    """Keep the sweep beside the notebook: ``book/sweeps/<notebook>.json`` (``<notebook>.gpu.json`` with the
    settings a GPU gets; see attnbook.sweeps). ``measured`` is the fingerprint of the code the runs executed,
    taken before they started (default: the notebook's now): a notebook edited during its sweep keeps a
    sweep that tests/test_sweeps.py reports as stale."""
    data = {
        "notebook": path.stem,
        **({"settings": "gpu"} if gpu_settings else {}),
        "fingerprint": measured or fingerprint(json.loads(path.read_text())),
        # what the runs measured: the library at this commit, seeds shifted by this stride per offset
        "commit": execute_notebooks.git_commit(),
        "seed_stride": SEED_STRIDE,
        **({"busy": busy} if busy else {}),  # load processes beside the runs (a notebook that asserts a timing)
        "runs": [
            {
                "offset": run.offset,
                "kernels": run.capability,
                "ok": not run.failure,
                "failure": {"cell": run.failure.get("cell"), "message": run.failure.get("message", "")}
                if run.failure else None,
                "glued": glued_values(run.nb) if run.nb is not None else {},
            }
            for run in sorted(runs, key=lambda run: run.offset)
        ],
    }
    out = path.parent / "sweeps" / f"{path.stem}{'.gpu' if gpu_settings else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out


def sweep(path: Path, offsets: list[int], jobs: int, out_dir: Path, ipython_dir: Path | None = None) -> list[Run]:
    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(launch, path, offset, out_dir, ipython_dir) for offset in offsets]
        runs = []
        for future in futures:
            run = future.result()
            state = "ok" if not run.failure else f"FAILED ({run.failure['message'][:100]})"
            print(f"{path.name} offset {run.offset} ({run.capability}): {run.seconds:.1f} s, {state}", flush=True)
            runs.append(run)
    return runs


def main(argv: list[str]) -> int:
    if argv[:1] == ["--run-one"]:
        return run_one(Path(argv[1]), Path(argv[2]))
    offsets, jobs, keep, source, all_lines, write, paths = list(range(1, 11)), 2, None, None, False, False, []
    gpu_settings, busy = False, 0
    while argv:
        name, argv = argv[0], argv[1:]
        if name == "--all-lines":
            all_lines = True
        elif name == "--write":
            write = True
        elif name == "--gpu-settings":
            gpu_settings = True
        elif name in ("--offsets", "--jobs", "--keep", "--from", "--busy"):
            if not argv:
                print(f"{name} needs a value", file=sys.stderr)
                return 2
            value, argv = argv[0], argv[1:]
            try:
                if name == "--offsets":
                    offsets = parse_offsets(value)
                elif name == "--jobs":
                    if not value.isdigit() or int(value) < 1:
                        raise ValueError(f"--jobs needs a whole number >= 1, got {value!r}")
                    jobs = int(value)
                elif name == "--busy":
                    if not value.isdigit():
                        raise ValueError(f"--busy needs a whole number >= 0, got {value!r}")
                    busy = int(value)
                elif name == "--keep":
                    keep = Path(value)
                else:
                    source = Path(value)
            except ValueError as error:
                print(error, file=sys.stderr)
                return 2
        elif name.startswith("--"):
            print(f"unknown option {name}", file=sys.stderr)
            return 2
        else:
            paths.append(Path(name))
    if not paths:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    quiet = [str(p) for p in paths if execute_notebooks.asserts_timing(p)]
    if write and not busy and quiet:  # its margins would come from a quiet machine
        print(f"{', '.join(quiet)} asserts a timing: its sweep must run beside busy "
              "processes, as make robust runs it; add --busy 2 (make sweep does)", file=sys.stderr)
        return 2
    status = 0
    with tempfile.TemporaryDirectory(prefix="sweep-") as temporary:
        out_dir = keep or Path(temporary)
        out_dir.mkdir(parents=True, exist_ok=True)
        ipython_dir = gpu_settings_ipython(Path(temporary)) if gpu_settings else None
        for path in paths:
            load = busy if execute_notebooks.asserts_timing(path) else 0  # timing claims: on a busy machine
            measured = fingerprint(json.loads(path.read_text()))  # the code the runs will execute
            with execute_notebooks.busy_machine(0 if source else load):
                runs = (kept_runs(path, offsets, source) if source
                        else sweep(path.resolve(), offsets, jobs, out_dir, ipython_dir))
            if not runs:
                print(f"no kept runs of {path} in {source}", file=sys.stderr)
                status = 1
                continue
            print("\n" + report(path, runs, all_lines), flush=True)
            if write:
                print(f"sweep kept in {write_sweep(path.resolve(), runs, gpu_settings, load, measured)}", flush=True)
            status |= any(run.failure for run in runs)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
