"""Chapter 20's associative recall at a budget where Mamba learns: softmax attention,
linear attention and Mamba with 2, 8 and 16 numbers of state per channel, each trained
for 6,000 steps at four learning rates over three seeds, recall on the validation
sequences every 1,000 steps. The page chooses each model's rate by its mean
validation recall at the end. `make experiment NAME=recall_budget` records it;
book/20_recall.ipynb reads it."""

from attnbook.experiments import grid
from experiments._recall import run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2)
RATES = {  # Mamba learns at larger rates than attention (a short run on one seed)
    "softmax": (1e-3, 3e-3, 1e-2, 3e-2),
    "linear": (1e-3, 3e-3, 1e-2, 3e-2),
    "mamba": (3e-3, 1e-2, 3e-2, 6e-2),
}
GRID = [
    *grid(mixer=["softmax"], state=[0], lr=list(RATES["softmax"])),
    *grid(mixer=["linear"], state=[0], lr=list(RATES["linear"])),
    *grid(mixer=["mamba"], state=[2, 8, 16], lr=list(RATES["mamba"])),
]


def COST(point):  # proportional to a run's time: Mamba's scan is the slow part
    return 3 if point["mixer"] == "mamba" else 1
