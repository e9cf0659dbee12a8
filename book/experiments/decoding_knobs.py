"""Chapter 14's sampling rules, Holtzman et al.'s question: at the same diversity, does
cutting the tail (top-k, top-p) write better text than a lower temperature? The page's
target, trained from five seeds, sampled with each rule over a range of its knob:
temperature 0.3-1.4; top-k 2-40 and top-p 0.3-0.98 at temperature 1; greedy as the
end point. `make experiment NAME=decoding_knobs` records it; book/14_decoding.ipynb
reads it."""

from attnbook.experiments import grid
from experiments._decoding import measure, target

SEEDS = (0, 1, 2, 3, 4)
TEMPERATURES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.4)
TOP_K = (2, 3, 5, 10, 20, 40)
TOP_P = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
GRID = (
    [{"rule": "greedy", "temperature": 0.0}]
    + grid(rule=["temperature"], temperature=list(TEMPERATURES))
    + grid(rule=["top-k"], temperature=[1.0], top_k=list(TOP_K))
    + grid(rule=["top-p"], temperature=[1.0], top_p=list(TOP_P))
)


def run(point, seed):
    """The shares of real, repeated and distinct words in what the target trained
    from ``seed`` writes under ``point``."""
    return measure(target(seed), point, seed)
