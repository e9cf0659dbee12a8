"""Chapter 9's resolution page: a ViT pretrained at 28 x 28 and moved to 56 x 56 in nine
ways (its position table interpolated bicubically or by nearest neighbour, fresh,
shuffled, random rows, not moved; a fixed sin-cos table interpolated two ways; the patch
embedding resized instead), each fine-tuned at four learning rates over five seeds; and
each table's pretraining rate. `make experiment NAME=vit_resolution`
records it; book/09_vit_resolution.ipynb reads it."""

from attnbook.experiments import grid
from experiments._vit_resolution import STARTS, TABLES, run  # noqa: F401

SEEDS = tuple(range(5))
PRETRAIN_RATES = (3e-3, 1e-2, 3e-2)
RATES = (1e-3, 3e-3, 1e-2, 3e-2)
# every start but the recomputed sin-cos table, which the page looks at untuned only
FINE_TUNED = [start for start in STARTS if start != "sin-cos, recomputed"]
GRID = [
    *grid(stage=["pretrain"], table=list(TABLES), lr=list(PRETRAIN_RATES)),
    *grid(stage=["finetune"], start=FINE_TUNED, lr=list(RATES)),
]


def COST(point):  # proportional to a run's time
    return 1.0 if point["stage"] == "pretrain" else 2.0
