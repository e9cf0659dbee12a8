"""scripts/execute_notebooks.py: notebooks run one at a time or several at once, each kernel with
the threads it was given, and a table of their times."""

from __future__ import annotations

import json
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


# --- scripts/sweep_notebooks.py ---------------------------------------------------------------

import sweep_notebooks  # noqa: E402


def write_seeded_notebook(path: Path) -> Path:
    # prints a score that depends on the seed offset and asserts a threshold that offset 2 misses
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("A claim about a score."),
        nbformat.v4.new_code_cell(
            "import os\n"
            "offset = int(os.environ['ATTNBOOK_SEED_OFFSET'])\n"
            "score = 0.5 + 0.1 * offset\n"
            "print(f'score {score:.2f} after 200 steps; kernels {os.environ[\"ATEN_CPU_CAPABILITY\"]}')"),
        nbformat.v4.new_code_cell("assert (\n    score < 0.65\n), score"),
        nbformat.v4.new_code_cell("print(f'after the assert {score:.1f}')", execution_count=3, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="after the assert 9.9\n")]),  # a committed output
    ])
    nbformat.write(nb, path)
    return path


def test_sweep_reports_the_failing_offset_and_the_spread(tmp_path, capsys):
    path = write_seeded_notebook(tmp_path / "01_seeded.ipynb")
    before = path.read_text()
    keep = tmp_path / "runs"
    assert sweep_notebooks.main(["--offsets", "0-2", "--keep", str(keep), str(path)]) == 1
    report = capsys.readouterr().out
    # kernels alternate: default at even offsets, avx2 at odd ones
    assert "| 0 | default |" in report and "| 1 | avx2 |" in report and "| 2 | default |" in report
    assert "## Failures: 1 of 3 runs" in report
    assert "- offset 2 (default): cell 2: AssertionError: 0.7" in report
    assert "at: assert ( score < 0.65 ), score" in report  # the whole statement, on one line
    # the score moved (min at offset 0, max at offset 2, mean 0.6); the step count did not
    assert "score {0.50@0..0.70@2 ~0.600} after 200 steps" in report
    # the last cell ran at offsets 0 and 1 only: offset 2's run does not keep the committed output
    assert "after the assert {0.5@0..0.6@1 ~0.55}" in report
    assert not nbformat.read(keep / "01_seeded.offset2.ipynb", as_version=4).cells[3].outputs
    assert path.read_text() == before  # the committed notebook is never touched
    assert sorted(p.name for p in keep.iterdir()) == [f"01_seeded.offset{i}.ipynb" for i in range(3)]


def test_sweep_keeps_its_runs_glued_figures_and_what_they_measured(tmp_path, capsys):
    from attnbook.utils import SEED_STRIDE

    path = tmp_path / "01_glued.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nfrom myst_nb import glue\n"
        "glue('score', 0.5 + int(os.environ['ATTNBOOK_SEED_OFFSET']), display=False)")]), path)
    assert sweep_notebooks.main(["--offsets", "2", "--write", str(path)]) == 0
    data = json.loads((tmp_path / "sweeps" / "01_glued.json").read_text())
    assert [(run["offset"], run["kernels"], run["ok"]) for run in data["runs"]] == [
        (1, "avx2", True), (2, "default", True)]
    assert [run["glued"]["score"] for run in data["runs"]] == [1.5, 2.5]
    assert data["seed_stride"] == SEED_STRIDE and len(data["commit"].split("+")[0]) == 40
    assert data["fingerprint"] == sweep_notebooks.fingerprint(json.loads(path.read_text()))
    capsys.readouterr()


def test_a_timing_notebook_is_not_written_from_a_quiet_machine(tmp_path, capsys):
    # its thresholds' margins must come from a busy machine, as make robust runs it
    path = tmp_path / "01_timed.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nb.metadata["attnbook"] = {"asserts_timing": True}
    nbformat.write(nb, path)
    assert sweep_notebooks.main(["--offsets", "1", "--write", str(path)]) == 2
    assert "asserts a timing" in capsys.readouterr().err
    assert not (tmp_path / "sweeps").exists()  # nothing ran, nothing written


def test_a_notebook_edited_during_its_sweep_keeps_the_fingerprint_of_the_code_that_ran(
    tmp_path, capsys, monkeypatch
):
    path = tmp_path / "01_edited.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), path)
    ran = sweep_notebooks.fingerprint(json.loads(path.read_text()))
    run_sweep = sweep_notebooks.sweep

    def sweep_then_edit(*args, **kwargs):  # the notebook changes while its runs execute
        runs = run_sweep(*args, **kwargs)
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 2")]), path)
        return runs

    monkeypatch.setattr(sweep_notebooks, "sweep", sweep_then_edit)
    assert sweep_notebooks.main(["--offsets", "1", "--write", str(path)]) == 0
    data = json.loads((tmp_path / "sweeps" / "01_edited.json").read_text())
    # the sweep measured x = 1: tests/test_sweeps.py must see it as stale against x = 2
    assert data["fingerprint"] == ran != sweep_notebooks.fingerprint(json.loads(path.read_text()))
    capsys.readouterr()


def test_sweep_passes_when_every_offset_holds(tmp_path, capsys):
    path = write_seeded_notebook(tmp_path / "01_seeded.ipynb")
    assert sweep_notebooks.main(["--offsets", "0,1", "--jobs", "1", str(path)]) == 0
    assert "## Failures: none" in capsys.readouterr().out


# a count starts at 1: offset 0 is the page's own run, not one of its sweep's
@pytest.mark.parametrize("text, offsets", [("3", [1, 2, 3]), ("3,7,11", [3, 7, 11]), ("7,", [7]),
                                           ("10-12,4", [10, 11, 12, 4])])
def test_sweep_offsets(text, offsets):
    assert sweep_notebooks.parse_offsets(text) == offsets


@pytest.mark.parametrize("argv", [["--offsets", "0"], ["--offsets", "a,b"], ["--jobs", "0", "x.ipynb"], [],
                                  ["no_such_notebook.ipynb"]])
def test_sweep_bad_arguments_are_refused(argv, capsys):
    assert sweep_notebooks.main(argv) == 2
    assert capsys.readouterr().err


def test_numbers_are_read_in_order():
    assert sweep_notebooks.numbers("layer1: 34% of 1,016 lines, loss -0.25 (1e-3), top-5") == [
        34, 1, 16, -0.25, 1e-3, 5]


def test_spread_matches_lines_by_their_text_when_the_counts_differ():
    def run(offset, text):
        cell = nbformat.v4.new_code_cell("print(...)", execution_count=1, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text=text)])
        return sweep_notebooks.Run(offset, sweep_notebooks.capability(offset),
                                   nb=nbformat.v4.new_notebook(cells=[cell]))

    runs = [run(0, "loss 2.50\nwins by 3.0%\n"), run(1, "loss 2.70\nno winner\n"), run(2, "loss 2.60\nwins by 1.0%\n")]
    lines = sweep_notebooks.spread_lines(runs, 0, all_lines=False)
    assert "  loss {2.50@0..2.70@1 ~2.600}" in lines
    assert "  wins by {1.0%@2..3.0%@0 ~2.00%}   [at offsets 0,2 only]" in lines


# --- make robust: one variant per notebook, alternating ----------------------------------------


def write_env_notebook(path: Path) -> Path:
    # prints the seed offset and the kernel settings its kernel was started with
    names = ["ATTNBOOK_SEED_OFFSET", *execute_notebooks.KERNEL_FAMILIES["avx2"]]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"import os\nprint(' '.join(os.environ.get(n, '-') for n in {names!r}))")])
    nbformat.write(nb, path)
    return path


def printed_env(path: Path) -> str:
    return nbformat.read(path, as_version=4).cells[0].outputs[0].text.strip()


@pytest.mark.parametrize("jobs", [1, 2])
def test_robust_alternates_offset_and_kernel_family_by_notebook(tmp_path, monkeypatch, jobs):
    for name in ("ATTNBOOK_SEED_OFFSET", *execute_notebooks.KERNEL_FAMILIES["avx2"]):
        monkeypatch.delenv(name, raising=False)
    paths = [write_env_notebook(tmp_path / f"0{i}_tiny.ipynb") for i in (1, 2, 3)]
    out = tmp_path / "out"
    assert execute_notebooks.main(["--robust", "--out", str(out), "--jobs", str(jobs), *map(str, paths)]) == 0
    # offsets beyond the sweeps' 1..10: seeds no sweep saw
    avx2 = "11 avx2 AVX2 AVX2"
    plain = "12 default SSE4_2 SSE41"
    assert [printed_env(out / f"0{i}_tiny.offset{o}.ipynb") for i, o in ((1, 11), (2, 12), (3, 11))] == [
        avx2, plain, avx2]
    assert sorted(p.name for p in out.glob("*.ipynb")) == [
        "01_tiny.offset11.ipynb", "02_tiny.offset12.ipynb", "03_tiny.offset11.ipynb"]
    assert "02_tiny.ipynb (12, default)" in (out / "timings.md").read_text()
    assert "ATTNBOOK_SEED_OFFSET" not in os.environ  # the variant was set for its run only


def test_robust_both_runs_every_notebook_under_both_variants(tmp_path):
    path = write_env_notebook(tmp_path / "01_tiny.ipynb")
    out = tmp_path / "out"
    assert execute_notebooks.main(["--robust", "--both", "--out", str(out), str(path)]) == 0
    assert printed_env(out / "01_tiny.offset11.ipynb") == "11 avx2 AVX2 AVX2"
    assert printed_env(out / "01_tiny.offset12.ipynb") == "12 default SSE4_2 SSE41"


def test_robust_never_writes_over_the_notebooks(tmp_path, capsys):
    path = write_env_notebook(tmp_path / "01_tiny.ipynb")
    assert execute_notebooks.main(["--robust", str(path)]) == 2
    assert "--out" in capsys.readouterr().err


def test_kernel_families_cap_the_matrix_products_too():
    # ATEN_CPU_CAPABILITY alone leaves MKL's and oneDNN's instructions as they are
    for family, env in execute_notebooks.KERNEL_FAMILIES.items():
        assert set(env) == {"ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"}, family
    assert [execute_notebooks.kernel_family(o) for o in range(4)] == ["default", "avx2", "default", "avx2"]
    assert sweep_notebooks.capability(3) == "avx2"


CPUINFO = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


@pytest.mark.skipif("avx512f" not in CPUINFO,
                    reason="the avx2 family changes the kernels only on a CPU with AVX-512")
def test_the_avx2_family_computes_otherwise_on_an_avx512_cpu():
    # PyTorch's own vectorised kernels (GELU here) change on every AVX-512 CPU; MKL's matrix products
    # change only on Intel's: MKL takes its AVX-512 paths there alone (an AMD EPYC with AVX-512 gets
    # MKL's AVX2 code either way)
    import subprocess

    code = ("import torch; g = torch.Generator().manual_seed(0); "
            "a, b = torch.randn(96, 257, generator=g), torch.randn(257, 133, generator=g); "
            "x = torch.randn(100_003, generator=g); "
            "print(hash((a @ b).numpy().tobytes()), hash(torch.nn.functional.gelu(x).numpy().tobytes()))")

    def product(env):
        return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED="0", **env),
                              capture_output=True, text=True, check=True).stdout.split()

    (own_product, own_gelu), (avx2_product, avx2_gelu) = product({}), product(
        execute_notebooks.KERNEL_FAMILIES["avx2"])
    assert avx2_gelu != own_gelu
    if "GenuineIntel" in CPUINFO:
        assert avx2_product != own_product


# --- make robust's busy machine -----------------------------------------------------------------


def write_load_notebook(path: Path, timed: bool) -> Path:
    # prints how many load processes this test's process started are running while it runs
    # (children of this process only: a sweep elsewhere on the machine runs loads of its own)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from pathlib import Path\n"
        "loads = 0\n"
        "for cmd in Path('/proc').glob('[0-9]*/cmdline'):\n"
        "    try:\n"
        "        parent = (cmd.parent / 'stat').read_text().rsplit(')', 1)[1].split()[1]\n"
        f"        ours = parent == '{os.getpid()}'\n"
        "        loads += ours and 'a /= np.abs(a).max()' in cmd.read_text()\n"
        "    except (OSError, IndexError):\n"
        "        pass\n"
        "print(loads)")])
    if timed:
        nb.metadata["attnbook"] = {"asserts_timing": True}
    nbformat.write(nb, path)
    return path


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_busy_runs_the_timed_notebooks_beside_the_load_and_stops_it(tmp_path):
    paths = [write_load_notebook(tmp_path / "01_plain.ipynb", False),
             write_load_notebook(tmp_path / "02_timed.ipynb", True)]
    out = tmp_path / "out"
    assert execute_notebooks.main(["--robust", "--busy", "2", "--out", str(out), *map(str, paths)]) == 0
    assert printed_env(out / "01_plain.offset11.ipynb") == "0"  # no load beside an untimed notebook
    assert printed_env(out / "02_timed.offset12.ipynb") == "2"  # two beside a timed one
    assert "02_timed.ipynb (12, default), beside 2 busy" in (out / "timings.md").read_text()
    with execute_notebooks.busy_machine(1, limit_s=60) as loads:
        assert loads[0].poll() is None  # running
    assert loads[0].poll() is not None  # stopped with the block
    with execute_notebooks.busy_machine(1, limit_s=0.5) as loads:
        loads[0].wait(timeout=30)  # and stops by itself after its limit
    assert execute_notebooks.main(["--busy", "-1", str(paths[0])]) == 2


@pytest.mark.parametrize("failure", [
    "Kernel died before replying to kernel_info",
    "Kernel didn't respond in 600 seconds",
])
def test_a_kernel_that_dies_before_it_starts_is_started_again(
    tmp_path, monkeypatch, failure
):
    # two kernels started at once can be handed the same port; the second dies before it
    # answers, before any cell ran: the notebook is run again in a new kernel
    path = tmp_path / "nb.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(nb, path)
    starts = []

    class Client:
        def __init__(self, nb, path):
            self.nb = nb

        def execute(self):
            starts.append(1)
            if len(starts) == 1:
                raise RuntimeError(failure)

    monkeypatch.setattr(execute_notebooks, "notebook_client", Client)
    assert execute_notebooks.execute(path) >= 0
    assert len(starts) == 2


def test_an_error_inside_a_notebook_is_not_retried(tmp_path, monkeypatch):
    path = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), path)
    starts = []

    class Client:
        def __init__(self, nb, path):
            pass

        def execute(self):
            starts.append(1)
            raise RuntimeError("a cell failed")

    monkeypatch.setattr(execute_notebooks, "notebook_client", Client)
    with pytest.raises(RuntimeError, match="a cell failed"):
        execute_notebooks.execute(path)
    assert len(starts) == 1
