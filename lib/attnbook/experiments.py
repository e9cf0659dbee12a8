"""Recorded experiments: the runs a page's budget cannot hold, made once and kept.

A page re-runs in a minute or so; a fair experiment (a grid of data sizes, steps and
learning rates, a model trained until every seed has learned) can take hours. Such an
experiment is a module under ``book/experiments/`` that declares

- ``GRID``: its points, a list of dicts of parameters (:func:`grid` builds one from
  axes);
- ``SEEDS``: the seeds every point is trained with;
- ``run(point, seed) -> dict``: one training, returning its figures by name (floats).

``make experiment NAME=<module>`` (``scripts/run_experiment.py``) runs every point at
every seed, two at a time, resumable, and writes ``book/experiments/<module>.json``: the
figures of every run and their provenance (the commit, the torch version, the CPU, the
threads, the dates and the wall time). It also records which functions of the library
(and of the experiment's own modules) the runs executed, and a hash of each of them, of
the classes that hold them and of their modules' own statements (:func:`code_units`):
``tests/test_experiments.py`` fails, naming what changed and the command that refreshes
it, when one of them changes, while a change elsewhere in the library, in the same
module too, leaves the record valid.

A page reads the record with :func:`load_record` for its figures, tables and asserts,
and runs one grid point again on every run of the page: :meth:`Record.pick` chooses it
from the clock, the page runs the module's own ``run`` on it, and :meth:`Record.check`
asserts that the figures land inside the recorded spread of that point, widened by a
stated tolerance.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (lib/attnbook/ -> ..)


def grid(**axes) -> list[dict]:
    """Every combination of the ``axes`` (name -> list of values), the last axis
    varying fastest: ``grid(a=[1, 2], b=["x"])`` is ``[{"a": 1, "b": "x"}, {"a": 2,
    "b": "x"}]``."""
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise ValueError(f"axis {name!r} must be a list of values, got {values!r}")
        if not list(values):
            raise ValueError(f"axis {name!r} has no values")
    names = list(axes)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(
        *(list(axes[name]) for name in names)
    )]


ANONYMOUS = ("<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _strip_docstring(node: ast.AST) -> ast.AST:
    body = getattr(node, "body", None)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:] or [ast.Pass()]
    return node


def _named_parts(qualname: str) -> list[str]:
    """The named functions and classes of a qualname, outermost first: lambdas and
    comprehensions belong to the function that holds them (``f.<locals>.<lambda>`` ->
    ``["f"]``)."""
    parts = [part for part in qualname.split(".") if part != "<locals>"]
    while parts and parts[-1] in ANONYMOUS:
        parts.pop()
    return parts


def _sorted_all(node):
    """``node``, or a copy with the names of an ``__all__ = [...]`` assignment sorted:
    the order in which a module lists its public names changes nothing that runs."""
    if not isinstance(node, ast.Assign):
        return node
    targets = [target.id for target in node.targets if isinstance(target, ast.Name)]
    if "__all__" not in targets or not isinstance(node.value, (ast.List, ast.Tuple)):
        return node
    node = copy.deepcopy(node)
    node.value.elts.sort(key=lambda element: ast.dump(element))
    return node


def code_units(
    path: Path | str, qualnames, source: str | None = None
) -> dict[str, str]:
    """A hash of each piece of ``path``'s code that ``qualnames`` (functions that ran,
    as ``co_qualname`` names them) depend on: each named function's definition (its
    docstring left out), the statements of each class that holds one (other than its
    methods), and the module's own statements (other than its functions and classes):
    ``{"Class.method": hash, "Class": hash, "<module>": hash}``. A function that is no
    longer there hashes as ``"gone"``. Comments, docstrings and code elsewhere in the
    file do not count, nor the order of the names in ``__all__``. ``source``: the
    file's text as it was imported (default: as it is on disk now)."""
    tree = ast.parse(Path(path).read_text() if source is None else source)

    def digest(node) -> str:
        text = ast.dump(_strip_docstring(copy.deepcopy(node)), include_attributes=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def skeleton(body) -> str:
        kept = [_sorted_all(n) for n in body if not isinstance(
            n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        return digest(ast.Module(body=kept, type_ignores=[]))

    units = {"<module>": skeleton(_strip_docstring(copy.deepcopy(tree)).body)}
    for qualname in qualnames:
        parts = _named_parts(qualname)
        node, scope = tree, []
        for part in parts:
            found = next((n for n in ast.iter_child_nodes(node) if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name == part), None)
            if found is None:
                units[".".join(parts)] = "gone"
                break
            node = found
            scope.append(part)
            if isinstance(node, ast.ClassDef):  # its bases, decorators, attributes
                bases = [ast.Expr(base) for base in node.bases]
                header = ast.Module(body=bases, type_ignores=[])
                units[".".join(scope)] = skeleton(node.body) + digest(header)
        else:
            if parts:
                units[".".join(parts)] = digest(node)
    return units


def fingerprint(code: dict, root: Path | str = ROOT) -> str:
    """SHA-256 of the code a record's runs executed, from ``code``: file (relative to
    ``root``) -> the qualnames that ran there. Each file contributes
    :func:`code_units`, so a change elsewhere in a file leaves the fingerprint alone. A
    missing file raises a ``FileNotFoundError`` naming it."""
    return hashlib.sha256(
        json.dumps(current_units(code, root), sort_keys=True).encode()
    ).hexdigest()


def current_units(
    code: dict, root: Path | str = ROOT, sources: dict | None = None
) -> dict[str, dict[str, str]]:
    """:func:`code_units` of every file of ``code`` (file -> qualnames), as the files
    are now, or as ``sources`` (file -> text) holds them."""
    units = {}
    for name in sorted(code):
        path = Path(root) / name
        if sources is not None and name in sources:
            units[name] = code_units(path, code[name], sources[name])
            continue
        if not path.is_file():
            raise FileNotFoundError(f"a recorded experiment ran {name}, which is gone")
        units[name] = code_units(path, code[name])
    return units


def point_key(point: dict) -> str:
    """A point as one canonical string (its parameters, sorted), for lookups."""
    return json.dumps(point, sort_keys=True)


@dataclass(frozen=True)
class Run:
    """One recorded training: its grid ``point``, its ``seed``, its figures
    (``metrics``: name -> float) and its time in ``seconds``."""

    point: dict
    seed: int
    metrics: dict
    seconds: float


@dataclass(frozen=True)
class Record:
    """A recorded experiment (:func:`load_record`): its ``name``; the ``code`` its runs
    executed (file -> the functions that ran there), the hash of each piece of it
    (``units``, :func:`current_units`) and their ``fingerprint``; its ``provenance`` and
    its ``runs`` in grid order."""

    name: str
    fingerprint: str
    code: dict
    units: dict
    provenance: dict
    runs: tuple[Run, ...]

    @property
    def files(self) -> list[str]:
        return sorted(self.code)

    @property
    def points(self) -> list[dict]:
        """The grid's points, each once, in the order they were declared."""
        seen = {}
        for run in self.runs:
            seen.setdefault(point_key(run.point), run.point)
        return list(seen.values())

    @property
    def seeds(self) -> list[int]:
        return sorted({run.seed for run in self.runs})

    def select(self, **where) -> list[Run]:
        """The runs whose point has every parameter of ``where`` at that value."""
        if where:
            known = {name for run in self.runs for name in run.point}
            unknown = sorted(set(where) - known)
            if unknown:
                raise KeyError(
                    f"{self.name} has no parameter {unknown}; its parameters: "
                    f"{sorted(known)}"
                )
        return [
            run for run in self.runs
            if all(run.point.get(name) == value for name, value in where.items())
        ]

    def values(self, metric: str, **where) -> list[float]:
        """Figure ``metric`` of every run matching ``where`` (:meth:`select`), in seed
        order within grid order."""
        runs = self.select(**where)
        if not runs:
            raise KeyError(f"no run of {self.name} has {where}")
        missing = [run for run in runs if metric not in run.metrics]
        if missing:
            raise KeyError(
                f"{self.name} recorded no {metric!r}; it recorded "
                f"{sorted(missing[0].metrics)}"
            )
        return [run.metrics[metric] for run in runs]

    def spread(self, metric: str, **where) -> tuple[float, float]:
        """``(min, max)`` of :meth:`values`."""
        values = self.values(metric, **where)
        return min(values), max(values)

    def pick(self, where=None, clock: int | None = None) -> tuple[dict, int]:
        """A ``(point, seed)`` to run again, chosen from the clock (``time.time_ns()``,
        or ``clock``), so every run of the page checks another one. ``where``, a
        function of a point, limits the choice (to the points a page's budget allows,
        say)."""
        runs = [run for run in self.runs if where is None or where(run.point)]
        if not runs:
            raise ValueError(f"no point of {self.name} satisfies the condition given")
        clock = time.time_ns() if clock is None else clock
        chosen = runs[(clock // 1000) % len(runs)]
        return dict(chosen.point), chosen.seed

    def check(self, point: dict, metrics: dict, tolerance: dict) -> list[tuple]:
        """Assert that each figure of ``metrics`` (a run of ``point`` made again) lies
        inside the recorded spread of that point, widened by ``tolerance[name]`` on each
        side; returns the rows ``(name, this run, recorded min, recorded max,
        tolerance)``. A figure outside raises an ``AssertionError`` that says by how
        much; a name without a tolerance raises a ``ValueError``."""
        rows = []
        runs = [run for run in self.runs if point_key(run.point) == point_key(point)]
        if not runs:
            raise KeyError(f"{point} is not a point of {self.name}")
        for name, value in metrics.items():
            if name not in tolerance:
                raise ValueError(f"no tolerance given for {name!r}")
            low, high = self.spread(name, **point)
            slack = float(tolerance[name])
            rows.append((name, float(value), low, high, slack))
            if not (low - slack <= value <= high + slack) or math.isnan(value):
                raise AssertionError(
                    f"{self.name} at {point}: {name} = {value:.4g} lies outside the "
                    f"recorded [{low:.4g}, {high:.4g}] widened by {slack:g}"
                )
        return rows


def staleness(name: str, folder: Path | str | None = None) -> str | None:
    """Why the record of ``name`` no longer describes its code (a function its runs
    executed, the class or module statements around it, changed or is gone), naming
    what changed and the command that refreshes it; ``None`` while it does."""
    record = load_record(name, folder)
    try:
        now = current_units(record.code, ROOT)
    except FileNotFoundError as error:
        changed = [str(error)]
    else:
        changed = [
            f"{file}: {unit}"
            for file in sorted(set(record.units) | set(now))
            for unit in sorted(set(record.units.get(file, {})) | set(now.get(file, {})))
            if record.units.get(file, {}).get(unit) != now.get(file, {}).get(unit)
        ]
    if not changed:
        return None
    return (
        f"the record of the experiment {name} was measured on other code: "
        f"{'; '.join(changed)} changed since; refresh it with `make experiment "
        f"NAME={name}`"
    )


def load_record(name: str, folder: Path | str | None = None) -> Record:
    """The record of experiment ``name`` from ``folder`` (default ``experiments/``
    under the working directory, which is ``book/`` when a notebook runs)."""
    path = Path("experiments" if folder is None else folder) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no record of the experiment {name} at {path.resolve()}: run `make "
            f"experiment NAME={name}`"
        )
    data = json.loads(path.read_text())
    missing = {"name", "fingerprint", "code", "units", "provenance", "runs"} - set(data)
    if missing:
        raise ValueError(f"{path} is not a record: it lacks {sorted(missing)}")
    runs = tuple(
        Run(run["point"], run["seed"], run["metrics"], run["seconds"])
        for run in data["runs"]
    )
    return Record(
        data["name"], data["fingerprint"], data["code"], data["units"],
        data["provenance"], runs
    )


__all__ = [
    "Record",
    "Run",
    "code_units",
    "current_units",
    "fingerprint",
    "grid",
    "load_record",
    "point_key",
    "staleness",
]
