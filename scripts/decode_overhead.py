"""How close to the floor can a GPT built of modules decode? An experiment, not a tool.

``python -m attnbook.bench --profile`` shows that one cached step of our GPT runs the
same PyTorch operators as the floor (``attnbook.bench.floor_generate``) and about 500
more Python calls. This script asks what removing them would buy. It times one cached
step at position 256 (the benchmark's GPT, one thread, the two interleaved, median of
``--steps``) three ways, each against the floor in the same run:

1. the library as it is;
2. with every module call made directly (``nn.Module.__call__`` patched to call
   ``forward``, and ``nn.Linear``, ``nn.LayerNorm``, ``nn.GELU`` and ``nn.Identity``
   patched to their ``F.*`` call): what PyTorch's module machinery costs;
3. as 2, and with the input checks of the step patched out too (token ids, block width,
   attention inputs, cache keys, the per-head mask): what is left is the structure
   itself (blocks, attention, caches, masks as functions calling functions).

The patches are undone on exit. The third ratio is the lower bound of a decoding step
that keeps the library's structure: a bar below it needs a second, flattened path.

    python scripts/decode_overhead.py [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from attnbook import blocks, caches, models, multihead
from attnbook.bench import decode_steps
from attnbook.measure import num_threads
from torch import nn

POSITION = 256


@contextlib.contextmanager
def patched(patches):
    """Set ``(owner, name, value)`` attributes for the block; restore them after."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


DIRECT_CALLS = [
    (nn.Module, "__call__", lambda self, *args, **kw: self.forward(*args, **kw)),
    (nn.Linear, "__call__", lambda self, x: F.linear(x, self.weight, self.bias)),
    (
        nn.LayerNorm,
        "__call__",
        lambda self, x: F.layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps
        ),
    ),
    (nn.GELU, "__call__", lambda self, x: F.gelu(x, approximate=self.approximate)),
    (nn.Identity, "__call__", lambda self, x: x),
]


def _no_check(*args, **kwargs):
    return None


NO_CHECKS = [
    (models, "check_token_ids", _no_check),
    (blocks, "_check_width", _no_check),
    (multihead.MultiHeadAttention, "_check_inputs", _no_check),
    (caches._Cache, "_accept", _no_check),
    (multihead, "attention_mask_for_heads", lambda mask, *args: mask),
]


@torch.no_grad()
def step_ratio(steps: int) -> tuple[float, float]:
    """Median time of one cached step of ours and of the floor's (microseconds)."""
    ours, floor = decode_steps(POSITION)
    ours_times, floor_times = [], []
    with num_threads(1):
        for _ in range(steps):
            for step, times in ((ours, ours_times), (floor, floor_times)):
                begin = time.perf_counter()
                step()
                times.append(time.perf_counter() - begin)
    return statistics.median(ours_times) * 1e6, statistics.median(floor_times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    steps = parser.parse_args().steps
    for label, patches in (
        ("the library as it is", []),
        ("module calls made directly", DIRECT_CALLS),
        ("... and no input checks", DIRECT_CALLS + NO_CHECKS),
    ):
        with patched(patches):
            ours, floor = step_ratio(steps)
        print(
            f"{label:28s} ours {ours:5.0f} us, floor {floor:5.0f} us, "
            f"ratio {ours / floor:.2f}"
        )


if __name__ == "__main__":
    main()
