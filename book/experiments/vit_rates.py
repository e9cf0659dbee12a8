"""Chapter 9's first page: each model's learning rate at 200 steps, for the ViT, the CNN
and the ViT without positions, over five seeds; the page chooses each rate by its mean
validation accuracy. `make experiment NAME=vit_rates` records it; book/09_vit.ipynb
reads it."""

from attnbook.experiments import grid
from experiments._vit_rates import run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2, 3, 4)
RATES = {
    "ViT": (1e-3, 3e-3, 1e-2, 3e-2),
    "CNN": (6e-3, 2e-2, 6e-2, 2e-1),
    "no positions": (1e-3, 3e-3, 1e-2, 3e-2),
}
GRID = [p for kind, rates in RATES.items() for p in grid(model=[kind], lr=rates)]


def COST(point):  # proportional to a run's time: ViT steps take longer on a CPU
    return 1.5 if point["model"] != "CNN" else 1.0
