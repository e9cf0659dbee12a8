"""Chapter 17's ladder: each rung's learning rate at 150 steps, over five seeds; the
page chooses each rung's rate by its mean validation loss. `make experiment
NAME=ladder_rates` records it; book/17_ladder.ipynb reads it."""

from attnbook.experiments import grid
from experiments._ladder import RUNGS, run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2, 3, 4)
RATES = (1e-3, 3e-3, 1e-2, 3e-2)
GRID = grid(rung=list(RUNGS), lr=RATES)
