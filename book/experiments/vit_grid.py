"""Chapter 9's data, steps and compute page: the ViT and the CNN of 09_vit on 350,
1,050 and all 3,500 training images, for 120 to 960 steps, each at four learning
rates, over three seeds; the ViT also for as many steps as give it the CNN's training
FLOPs at each of those budgets; and on the 350 images, both models with every batch
shifted by up to 1 or 2 pixels. The page chooses each cell's rate (and shift) by the
mean validation accuracy. `make experiment NAME=vit_grid` records it;
book/09_vit_data.ipynb reads it."""

from attnbook.experiments import grid
from experiments._vit_grid import run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2)
IMAGES = (350, 1050, 3500)  # 10 %, 30 % and all of the training images
STEPS = (120, 240, 480, 960)
# A ViT step (7 x 7 patches) costs 0.288 GFLOPs, a CNN step 0.684 (counted on the page,
# which checks these): the ViT's steps for the CNN's FLOPs at each of STEPS
MATCHED = (285, 570, 1140, 2280)
RATES = {
    "ViT": (1e-3, 3e-3, 1e-2, 3e-2),
    "CNN": (2e-3, 6e-3, 2e-2, 6e-2, 2e-1, 6e-1),
}
GRID = [
    *(p for m, r in RATES.items() for p in grid(model=[m], images=list(IMAGES),
                                                 steps=list(STEPS), lr=list(r),
                                                 shift=[0])),
    *grid(model=["ViT"], images=list(IMAGES), steps=list(MATCHED),
          lr=list(RATES["ViT"]), shift=[0]),
    *(p for m, r in RATES.items() for p in grid(model=[m], images=[350],
                                                 steps=list(STEPS), lr=list(r),
                                                 shift=[1, 2])),
]  # fmt: skip


def COST(point):  # proportional to a run's time
    return point["steps"]
