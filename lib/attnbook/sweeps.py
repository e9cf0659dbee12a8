"""Sweeps: what a notebook measured under other seeds and other CPUs, kept beside it.

A threshold on a trained model is only as good as the runs it was set from. The book's
sweep script runs a notebook under ten seed offsets, on two families of CPU kernels, and
writes ``book/sweeps/<notebook>.json``: for every run, its offset, its kernels, whether
every assert held, and every value the notebook glued for its prose (``myst_nb.glue``),
together with a :func:`fingerprint` of the notebook's code. A notebook that rests a
threshold on a sweep reads it with :func:`load_sweep`, shows the spread on the page and
asserts that its threshold lies outside it; a test fails when a sweep's fingerprint no
longer matches its notebook (the sweep measured another program).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

SWEEP_READER = "load_sweep("  # cells that read a sweep are not part of what it measured
# a run's CPU kernels -> its family of instructions: the default kernels use the older,
# narrower vector instructions (SSE4.2), avx2 the wider ones
INSTRUCTIONS = {"default": "narrow", "avx2": "wide"}


def fingerprint(notebook: dict) -> str:
    """SHA-256 of the notebook's code (a parsed ``.ipynb``): every code cell's source,
    in order, except the cells that read a sweep (they show it, they do not measure)
    and the setup cell (tagged ``setup``: it fetches the book outside its folder and
    does nothing inside it)."""
    sources = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        if "setup" in cell.get("metadata", {}).get("tags", []):
            continue
        source = cell["source"]
        source = "".join(source) if isinstance(source, list) else source
        if SWEEP_READER not in source:
            sources.append(source)
    return hashlib.sha256("\n\0".join(sources).encode()).hexdigest()


@dataclass(frozen=True)
class Sweep:
    """One notebook's sweep. ``runs``: one dict per run, ``{"offset", "kernels", "ok",
    "failure", "glued"}`` (``glued``: glue name -> value; ``failure``: the failing
    cell and message, or None)."""

    notebook: str
    fingerprint: str
    runs: tuple[dict, ...]

    @property
    def offsets(self) -> list[int]:
        return [run["offset"] for run in self.runs]

    @property
    def failures(self) -> list[dict]:
        """The runs in which an assert (or anything else) failed."""
        return [run for run in self.runs if not run["ok"]]

    def values(self, name: str, instructions: str | None = None) -> list[float]:
        """The glued value ``name`` of every run that reached it, in run order; with
        ``instructions="narrow"`` or ``"wide"`` only the runs on that family of CPU
        instructions (:data:`INSTRUCTIONS`)."""
        if instructions is not None and instructions not in INSTRUCTIONS.values():
            raise ValueError(
                f"instructions must be one of {sorted(INSTRUCTIONS.values())}, got "
                f"{instructions!r}"
            )
        found = [
            run["glued"][name]
            for run in self.runs
            if name in run["glued"]
            and instructions in (None, INSTRUCTIONS.get(run["kernels"]))
        ]
        if not found:
            raise KeyError(
                f"no run of the {self.notebook} sweep glued {name!r}; glued: "
                f"{sorted({key for run in self.runs for key in run['glued']})}"
            )
        return found

    def spread(self, name: str) -> tuple[float, float]:
        """``(min, max)`` of :meth:`values`."""
        values = self.values(name)
        return min(values), max(values)

    def margin(self, name: str, *, above=None, below=None) -> float:
        """How far every run of ``name`` cleared a threshold it must stay ``above`` (the
        lowest run minus it) or ``below`` (it minus the highest run); negative when a
        run fell on the wrong side. Give exactly one of the two."""
        if (above is None) == (below is None):
            raise ValueError("give one threshold: above= or below=")
        low, high = self.spread(name)
        return low - above if below is None else below - high

    def thresholds(self, rows, this_run: dict, width: int = 34) -> dict[str, float]:
        """Print one line per threshold, ``rows`` of ``(name, label, "above" or "below",
        threshold)``: this run's value (``this_run[name]``), the runs' range and the
        margin of the worst run (:meth:`margin`). Returns ``{name: margin}``; a figure
        bounded on both sides (two rows) gets the smaller of its two margins."""
        print(
            f"{'':{width}} {'this run':>9} {'runs: min':>9} {'max':>9}  "
            f"{'must be':<12} {'margin':>7}"
        )
        margins = {}
        for name, label, side, threshold in rows:
            if side not in ("above", "below"):
                raise ValueError(f"side must be 'above' or 'below', got {side!r}")
            low, high = self.spread(name)
            margin = self.margin(name, **{side: threshold})
            # a figure bounded on both sides: the smaller of its two margins
            margins[name] = min(margin, margins.get(name, margin))
            bound = f"{side} {threshold:.3g}"
            print(
                f"{label:{width}} {this_run[name]:>9.3g} {low:>9.3g} {high:>9.3g}  "
                f"{bound:<12} {margin:>+7.2g}"
            )
        return margins


class Figures(dict):
    """The figures a notebook measured, by name, for :meth:`Sweep.thresholds`: each
    figure a threshold rests on is kept here and glued for the prose (``myst_nb.glue``),
    so that a sweep records it too."""

    def keep(self, name: str, value) -> float:
        """Glue ``value`` (a finite number) as ``name`` and keep it as a float; returns
        the float."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if isinstance(value, bool) or not math.isfinite(value := float(value)):
            raise ValueError(f"{name}: a figure must be a finite number, got {value!r}")
        from myst_nb import glue  # the book's dependency, not the library's

        glue(name, value, display=False)
        self[name] = value
        return value


def load_sweep(notebook: str, folder=None) -> Sweep:
    """The sweep of ``notebook`` (its file name without ``.ipynb``), from ``folder``
    (default ``sweeps/`` under the working directory, which is ``book/`` when a
    notebook runs)."""
    path = Path("sweeps" if folder is None else folder) / f"{notebook}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no sweep of {notebook} at {path.resolve()}")
    data = json.loads(path.read_text())
    missing = {"notebook", "fingerprint", "runs"} - set(data)
    if missing:
        raise ValueError(f"{path} is not a sweep: it lacks {sorted(missing)}")
    return Sweep(data["notebook"], data["fingerprint"], tuple(data["runs"]))


__all__ = ["Figures", "Sweep", "fingerprint", "load_sweep"]
