"""Chapter 18's frontier: multi-head, grouped-query and multi-query attention and
multi-head latent attention at four latent sizes, at close to equal parameters, trained
for 3,000 steps at four learning rates over three seeds, the validation loss measured
every 500 steps. The page chooses each model's rate by its mean validation loss and
places every model at its chosen rate by test loss against cache bytes.
`make experiment NAME=kv_frontier` records it; book/18_kv_economics.ipynb reads it."""

from attnbook.experiments import grid
from experiments._kv_frontier import MODELS, run  # noqa: F401  (run: the experiment)

SEEDS = (0, 1, 2)
RATES = (1e-3, 2e-3, 4e-3, 8e-3)
GRID = grid(model=list(MODELS), lr=list(RATES))
