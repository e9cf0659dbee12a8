"""Chapter 17's ladder: every rung, and multi-query attention beside it, trained for
4,000 steps at four learning rates over five seeds, the validation loss measured every
500 steps. The page chooses each rung's rate by its mean validation loss and compares
the rungs on the test half at the chosen rates. `make experiment NAME=ladder` records
it; book/17_ladder.ipynb reads it."""

from attnbook.experiments import grid
from experiments._ladder import RUNGS, run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2, 3, 4)
RATES = (1e-3, 2e-3, 4e-3, 8e-3)
GRID = grid(rung=[*RUNGS, "MQA"], lr=list(RATES))
