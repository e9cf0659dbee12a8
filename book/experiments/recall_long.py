"""Chapter 20's associative recall at 20,000 steps, over three times recall_budget's:
Mamba with 2, 8 and 16 numbers of state per channel, each at four learning rates around
the best of recall_budget's (with N = 8, whose best was the lowest, at a fifth below),
and softmax and linear attention at the rates recall_budget chose for them, three seeds
each, recall on the validation sequences every 2,000 steps. The page chooses Mamba's
rate for each state size by its mean validation recall at the end. `make experiment
NAME=recall_long` records it; book/20_recall.ipynb is to read it (drafted)."""

from attnbook.experiments import grid
from experiments._recall_runs import run  # noqa: F401  (run: the experiment)

STEPS = 20_000
SEEDS = (0, 1, 2)
MAMBA_RATES = (3e-3, 6e-3, 1.2e-2, 2.4e-2)  # recall_budget's best was 3e-3 or 1e-2
ATTENTION_RATES = {"softmax": 1e-2, "linear": 3e-3}  # chosen on validation there
GRID = [
    *(
        {"mixer": mixer, "state": 0, "lr": lr, "steps": STEPS}
        for mixer, lr in ATTENTION_RATES.items()
    ),
    *grid(mixer=["mamba"], state=[2, 8, 16], lr=list(MAMBA_RATES), steps=[STEPS]),
    # with N = 8 the best of the four was the lowest: a rate below it
    {"mixer": "mamba", "state": 8, "lr": 1.5e-3, "steps": STEPS},
]


def COST(point):  # proportional to a run's time: Mamba's scan is the slow part
    return {0: 1, 2: 2.3, 8: 3.0, 16: 3.8}[point["state"]]
