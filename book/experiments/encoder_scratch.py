"""Chapter 6's encoder: does masked-LM pretraining help the classifier of real against
shuffled lines, or does the model from scratch only need more steps? The pretrained
encoder (800 masked-LM steps) fine-tuned for 200 steps, against the same encoder from
scratch trained for 200, 1,000 (the pretrained model's 800 + 200) and 2,000 steps, each
at three learning rates, five seeds. `make experiment NAME=encoder_scratch` records
it; book/06_encoder_only.ipynb reads it."""

from attnbook.experiments import grid
from experiments._encoder import run_start

SEEDS = (0, 1, 2, 3, 4)
RATES = (5e-4, 2e-3, 8e-3)
GRID = grid(start=["pretrained"], steps=[200], lr=list(RATES)) + grid(
    start=["scratch"], steps=[200, 1000, 2000], lr=list(RATES)
)


def run(point, seed):
    """One classifier: its accuracy on the validation and the test lines."""
    return run_start(point["start"], point["lr"], point["steps"], seed)
