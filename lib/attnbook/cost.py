"""What attention costs: FLOP and memory formulas, and helpers to time and measure memory.

Counting convention: one multiply-add is **2 FLOPs**, so a matrix product ``(n, a) @ (a, b)``
costs ``2 n a b`` FLOPs. Softmax, layer norm, biases and activations are ``O(n^2 h)`` or ``O(n d)``
element-wise work and are left out of the formulas (they are small next to the products).

Shapes, for one sequence of ``n`` tokens of width ``d`` (``h`` heads of width ``d / h``):

========================  ===============================  ==========================
piece                     what is multiplied               FLOPs
========================  ===============================  ==========================
Q, K, V, output proj.     4 x ``(n, d) @ (d, d)``          ``4 * 2 n d^2 = 8 n d^2``
scores ``Q K^T``          h x ``(n, d/h) @ (d/h, n)``      ``2 n^2 d``
weighted sum ``A V``      h x ``(n, n) @ (n, d/h)``        ``2 n^2 d``
feed-forward              ``(n, d) @ (d, H)``, back        ``2 * 2 n d H`` (``16 n d^2`` at ``H = 4d``)
recurrent (Elman) layer   n x (``W_x x_t + W_h h_{t-1}``)  ``n (2 d d_in + 2 d^2)``
========================  ===============================  ==========================

So self-attention's own work grows as ``n^2 d`` and a recurrent layer's as ``n d^2``; the two are
equal at ``n = d`` (:func:`crossover_length`, the comparison of Vaswani et al.'s Table 1). Whole layers,
per token: attention ``8 d^2 + 4 n d`` against ``4 gates d^2``: never cheaper than an Elman RNN, equal to
a GRU at ``n = d`` and to an LSTM at ``n = 2d`` (:func:`layer_crossover_length`). Attention needs
``O(1)`` sequential steps; a recurrent layer needs ``n`` of them, one per token.

Memory: the attention weights are ``h n^2`` numbers per layer and sequence
(:func:`attention_weights_bytes`); a KV cache of ``T`` tokens is ``2 * layers * T * d`` numbers per
sequence (:func:`kv_cache_bytes`).

Measuring: :func:`measure` / :func:`measure_interleaved` time functions (median or fastest run, wall
clock or one thread's CPU time), :func:`fit_power_law` fits ``t = c x^a`` on log-log axes,
:func:`num_threads` fixes PyTorch's CPU threads for a block, and :func:`peak_memory` measures the
peak memory a function allocates (CUDA's allocator, or a :class:`TensorMemoryTracker` elsewhere).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LAYER_KINDS = ("self-attention", "recurrent")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------- FLOPs


def attention_projection_flops(n: int, d: int) -> int:
    """FLOPs of the four ``d x d`` projections (queries, keys, values, output) on ``n`` tokens:
    ``4 * 2 n d^2 = 8 n d^2``. The same for any number of heads."""
    n, d = _positive_int("n", n), _positive_int("d", d)
    return 4 * 2 * n * d * d


def attention_score_flops(n: int, d: int, n_keys: int | None = None) -> int:
    """FLOPs of the scores ``Q K^T``: ``2 n m d`` for ``n`` queries and ``m`` keys (``m = n`` by default).

    Split into ``h`` heads of width ``d / h`` it is ``h * 2 n m (d / h)``: the same total."""
    n, d = _positive_int("n", n), _positive_int("d", d)
    m = n if n_keys is None else _positive_int("n_keys", n_keys)
    return 2 * n * m * d


def attention_weighted_sum_flops(n: int, d: int, n_keys: int | None = None) -> int:
    """FLOPs of the weighted sum of the values ``A V``, ``(n, m) @ (m, d)``: ``2 n m d``."""
    n, d = _positive_int("n", n), _positive_int("d", d)
    m = n if n_keys is None else _positive_int("n_keys", n_keys)
    return 2 * n * m * d


def attention_core_flops(n: int, d: int) -> int:
    """FLOPs of attention itself (scores and weighted sum, no projections): ``4 n^2 d``, the ``O(n^2 d)`` term."""
    return attention_score_flops(n, d) + attention_weighted_sum_flops(n, d)


def attention_layer_flops(n: int, d: int) -> int:
    """FLOPs of a whole self-attention layer on ``n`` tokens of width ``d``: ``8 n d^2 + 4 n^2 d``."""
    return attention_projection_flops(n, d) + attention_core_flops(n, d)


def ffn_flops(n: int, d: int, hidden: int | None = None) -> int:
    """FLOPs of the position-wise feed-forward network ``d -> hidden -> d`` on ``n`` tokens:
    ``2 * (2 n d hidden) = 4 n d hidden``; ``16 n d^2`` at the default ``hidden = 4 d``."""
    n, d = _positive_int("n", n), _positive_int("d", d)
    hidden = 4 * d if hidden is None else _positive_int("hidden", hidden)
    return 2 * 2 * n * d * hidden


def recurrent_flops(n: int, d: int, input_size: int | None = None, gates: int = 1) -> int:
    """FLOPs of a recurrent layer with hidden size ``d`` over ``n`` tokens of width ``input_size``
    (default ``d``): each step computes ``W_x x_t + W_h h_{t-1}`` for every gate, so
    ``n * gates * (2 d input_size + 2 d^2)``; ``4 n d^2`` for an Elman RNN (``gates=1``),
    ``3x`` that for a GRU (``gates=3``), ``4x`` for an LSTM (``gates=4``). This is ``O(n d^2)``."""
    n, d = _positive_int("n", n), _positive_int("d", d)
    input_size = d if input_size is None else _positive_int("input_size", input_size)
    gates = _positive_int("gates", gates)
    return n * gates * (2 * d * input_size + 2 * d * d)


def crossover_length(d: int) -> int:
    """The length ``n`` where attention's own ``4 n^2 d`` equals an Elman RNN's ``4 n d^2``: ``n = d``.

    This is the comparison of Vaswani et al.'s Table 1: it leaves out attention's ``8 n d^2`` of
    projections. For whole layers see :func:`layer_crossover_length`."""
    return _positive_int("d", d)


def layer_crossover_length(d: int, gates: int) -> int | None:
    """The length ``n`` where a whole self-attention layer costs as many FLOPs as a recurrent layer.

    Per token, ``8 d^2 + 4 n d`` (:func:`attention_layer_flops` / ``n``) against ``gates * 4 d^2``
    (:func:`recurrent_flops` / ``n``), equal at ``n = (gates - 2) d``: ``d`` for a GRU (``gates=3``),
    ``2d`` for an LSTM (``gates=4``); shorter sequences make attention the cheaper layer. ``None``
    for ``gates <= 2``: attention's projections alone cost ``8 d^2`` per token, as much as a
    two-gate step and twice an Elman step (``gates=1``), so attention is never the cheaper layer."""
    d, gates = _positive_int("d", d), _positive_int("gates", gates)
    return (gates - 2) * d if gates > 2 else None


def sequential_steps(kind: str, n: int) -> int:
    """Operations that must run one after another: 1 for ``"self-attention"`` (all tokens at once),
    ``n`` for ``"recurrent"`` (step ``t`` needs ``h_{t-1}``)."""
    n = _positive_int("n", n)
    if kind == "self-attention":
        return 1
    if kind == "recurrent":
        return n
    raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")


def max_path_length(kind: str, n: int) -> int:
    """Longest path a signal travels between two of ``n`` tokens in one layer: 1 for
    ``"self-attention"`` (every token sees every token), ``n - 1`` for ``"recurrent"`` (token 1
    reaches token ``n`` through ``n - 1`` hidden-state updates)."""
    n = _positive_int("n", n)
    if kind == "self-attention":
        return 1
    if kind == "recurrent":
        return n - 1
    raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")


# --------------------------------------------------------------------------- memory


def attention_weights_bytes(n: int, num_heads: int = 1, bytes_per_element: int = 4, *, n_keys: int | None = None,
                            batch_size: int = 1) -> int:
    """Bytes of the attention weights: ``batch_size * h * n * m * bytes`` (one ``n x m`` matrix per head;
    ``m = n`` keys by default). 4 bytes per element in fp32, 2 in fp16/bf16."""
    n, h = _positive_int("n", n), _positive_int("num_heads", num_heads)
    m = n if n_keys is None else _positive_int("n_keys", n_keys)
    size = _positive_int("bytes_per_element", bytes_per_element)
    return _positive_int("batch_size", batch_size) * h * n * m * size


def kv_cache_bytes(num_layers: int, seq_len: int, d_model: int, bytes_per_element: int = 4, *,
                   batch_size: int = 1) -> int:
    """Bytes of a KV cache holding ``seq_len`` tokens: ``2 * layers * T * d * bytes`` per sequence.

    The 2 is keys and values; each layer stores, for every token, one key and one value of width
    ``d_model`` (``h`` heads of ``d_model / h``), i.e. tensors ``(B, h, T, d/h)`` twice per layer."""
    layers, T = _positive_int("num_layers", num_layers), _positive_int("seq_len", seq_len)
    d, size = _positive_int("d_model", d_model), _positive_int("bytes_per_element", bytes_per_element)
    return _positive_int("batch_size", batch_size) * 2 * layers * T * d * size


def num_patches(image_size: int | tuple[int, int], patch_size: int) -> int:
    """Tokens of a ViT: an ``H x W`` image cut into ``p x p`` patches gives ``(H / p)(W / p)`` tokens
    (``image_size`` is ``H`` for a square image, or ``(H, W)``). ``H`` and ``W`` must be multiples of ``p``."""
    height, width = (image_size, image_size) if not isinstance(image_size, (tuple, list)) else image_size
    height, width = _positive_int("image height", height), _positive_int("image width", width)
    p = _positive_int("patch_size", patch_size)
    if height % p or width % p:
        raise ValueError(f"image size {height}x{width} is not a multiple of patch_size={p}")
    return (height // p) * (width // p)


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (CUDA or MPS) so a timer measures it; nothing to do on the CPU."""
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if kind in (None, "mps") and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.synchronize()


@contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """Run the ``with`` body with ``torch.set_num_threads(threads)``, then restore the previous number.

    Timing on one CPU thread measures the arithmetic rather than how well a thread pool splits
    small problems, and is far steadier on a machine other programs are also using."""
    threads = _positive_int("threads", threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _check_repeats(repeats: int, warmup: int) -> None:
    _positive_int("repeats", repeats)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")


SUMMARIES = {"median": statistics.median, "min": min}
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def measure(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, summary: str = "median",
            clock: str = "wall") -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs.

    See :func:`measure_interleaved` for ``summary`` and ``clock``."""
    return measure_interleaved([fn], repeats, warmup, summary, clock)[0]


def measure_interleaved(fns: Sequence[Callable[[], object]], repeats: int = 5, warmup: int = 1,
                        summary: str = "median", clock: str = "wall") -> list[float]:
    """Seconds per call of each function in ``fns``, timed in turn ``A, B, A, B, ...``; one number each.

    Interleaving spreads slow and fast moments of a busy machine over all the functions, so a
    ratio of two medians is steadier than timing ``A`` many times and then ``B`` many times.

    - ``summary="median"`` (default) or ``"min"``: the fastest run, since other programs only add time.
    - ``clock="wall"`` (default): ``time.perf_counter``, with the GPU synchronized before and after
      each run. ``clock="thread"``: ``time.thread_time``, the CPU time of this thread only, which
      leaves out the time other programs ran; it is right only for CPU work on one thread, so it
      requires ``torch.get_num_threads() == 1`` (see :func:`num_threads`).
    """
    if callable(fns) or not len(fns) or not all(callable(fn) for fn in fns):
        raise TypeError(f"fns must be a non-empty sequence of callables, got {fns!r}")
    _check_repeats(repeats, warmup)
    if summary not in SUMMARIES:
        raise ValueError(f"summary must be one of {sorted(SUMMARIES)}, got {summary!r}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "thread" and torch.get_num_threads() != 1:
        raise ValueError(
            f"clock='thread' counts only this thread's CPU time; PyTorch uses {torch.get_num_threads()} threads "
            "(wrap the timing in cost.num_threads(1))"
        )
    now = CLOCKS[clock]
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, record in zip(fns, times, strict=True):
            synchronize()
            start = now()
            fn()
            synchronize()
            record.append(now() - start)
    return [SUMMARIES[summary](record) for record in times]


def fit_power_law(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The exponent ``a`` of the least-squares fit ``y = c x^a``: the slope of ``log y`` against ``log x``."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or len(x) < 2:
        raise ValueError(f"xs and ys must be 1-D of the same length >= 2, got shapes {x.shape} and {y.shape}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("xs and ys must be positive to fit a power law on a log-log scale")
    if np.ptp(np.log(x)) == 0:
        raise ValueError("xs must not all be equal")
    slope, _ = np.polyfit(np.log(x), np.log(y), 1)
    return float(slope)


# --------------------------------------------------------------------------- peak memory


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while it is active, and the peak of their sum.

    Every PyTorch operation passes through :meth:`__torch_dispatch__`; a new output storage (not
    one of the operation's inputs, so views and in-place results are not counted twice) adds its
    bytes; a storage that has since been freed (its weak reference expired) subtracts them. The
    peak is the largest total seen after any operation. Tensors that existed before the tracker
    started are not counted: ``peak`` is the *extra* memory the code allocated. Workspace an
    operation frees before it returns is not seen.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _release_freed(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        self._release_freed()
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            nbytes = storage.nbytes()
            self._live[key] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
        self.peak = max(self.peak, self.current)
        return out


def peak_memory(fn: Callable[[], object], device: torch.device | str | None = None) -> int:
    """Peak bytes of memory that ``fn()`` allocates above what was allocated when it started.

    On CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's own count). Elsewhere
    (CPU, MPS): a :class:`TensorMemoryTracker`, which adds up the tensors ``fn`` creates while
    they are alive. The result of ``fn`` counts while it is being built, then is dropped.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {type(fn).__name__}")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with TensorMemoryTracker() as tracker:
        fn()
    return tracker.peak


__all__ = [
    "LAYER_KINDS",
    "TensorMemoryTracker",
    "attention_core_flops",
    "attention_layer_flops",
    "attention_projection_flops",
    "attention_score_flops",
    "attention_weighted_sum_flops",
    "attention_weights_bytes",
    "crossover_length",
    "ffn_flops",
    "fit_power_law",
    "kv_cache_bytes",
    "layer_crossover_length",
    "max_path_length",
    "measure",
    "measure_interleaved",
    "num_patches",
    "num_threads",
    "peak_memory",
    "recurrent_flops",
    "sequential_steps",
    "synchronize",
]
