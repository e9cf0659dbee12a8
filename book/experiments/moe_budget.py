"""Chapter 19's comparison: a mixture of experts against dense models of equal active
and of equal total parameters, trained for 4,000 steps at four learning rates over five
seeds, the validation loss measured every 500 steps. The page chooses each model's rate
by its mean validation loss and compares the models on the test half at the chosen
rates. `make experiment NAME=moe_budget` records it; book/19_mixture_of_experts.ipynb
reads it."""

from attnbook.experiments import grid
from experiments._moe_budget import MODELS, run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2, 3, 4)
RATES = (1e-3, 2e-3, 4e-3, 8e-3)
GRID = grid(model=list(MODELS), lr=list(RATES))
