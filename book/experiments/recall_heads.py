"""Chapter 20's state against the number of heads, at recall_budget's 6,000 steps:
linear attention with 1, 2, 4 and 8 heads (at equal parameters, its state shrinks as
the heads grow) and softmax attention with the same heads (its cache does not), each at
four learning rates (linear attention with 8 heads at two more) over three seeds, recall
on the validation sequences every 600 steps. The page chooses each model's rate by its
mean validation recall at the end. `make experiment NAME=recall_heads` records it;
book/20_recall_state.ipynb reads it."""

from attnbook.experiments import grid
from experiments._recall_runs import run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2)
RATES = (1e-3, 3e-3, 1e-2, 3e-2)  # recall_budget's, where both attentions chose inside
GRID = [
    *grid(
        mixer=["linear", "softmax"], heads=[1, 2, 4, 8], lr=list(RATES), steps=[6_000]
    ),
    # linear attention with 8 heads did best at the top rate: rates beyond it, until one
    # does worse
    *grid(mixer=["linear"], heads=[8], lr=[1e-1, 3e-1], steps=[6_000]),
]
