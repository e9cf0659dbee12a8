"""Measuring: timing (interleaved, median or fastest, wall clock or one thread's CPU
time) and peak memory.

:func:`measure` / :func:`measure_interleaved` time functions, :func:`fit_power_law` fits
``t = c x^a`` on log-log axes, :func:`num_threads` fixes PyTorch's CPU threads for a
block, :func:`synchronize` waits for queued GPU work, :func:`peak_memory` measures the
peak memory a function allocates (CUDA's allocator, or a :class:`TensorMemoryTracker`
elsewhere), :func:`flop_counter` counts the FLOPs that run, and
:func:`time_by_operation` splits a function's CPU time among the operations it runs.
The chapters and ``python -m attnbook.bench`` use them; :mod:`attnbook.cost` holds the
formulas they are compared with.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from .utils import check_non_negative_int, check_positive_int

# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (CUDA or MPS) so a timer measures it; nothing to do on
    the CPU."""
    kind = torch.device(device).type if device is not None else None
    if (
        kind in (None, "cuda")
        and torch.cuda.is_available()
        and torch.cuda.is_initialized()
    ):
        torch.cuda.synchronize()
    if (
        kind in (None, "mps")
        and getattr(torch.backends, "mps", None) is not None
        and torch.backends.mps.is_available()
    ):
        torch.mps.synchronize()


@contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """Run the ``with`` body with ``torch.set_num_threads(threads)``, then restore the
    previous number.

    Timing on one CPU thread measures the arithmetic rather than how well a thread pool
    splits small problems, and is far steadier on a machine other programs are also
    using."""
    threads = check_positive_int("threads", threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _check_repeats(repeats: int, warmup: int) -> tuple[int, int]:
    return check_positive_int("repeats", repeats), check_non_negative_int(
        "warmup", warmup
    )


SUMMARIES = {"median": statistics.median, "min": min}
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def measure(
    fn: Callable[[], object],
    repeats: int = 5,
    warmup: int = 1,
    summary: str = "median",
    clock: str = "wall",
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs.

    See :func:`measure_interleaved` for ``summary`` and ``clock``."""
    return measure_interleaved([fn], repeats, warmup, summary, clock)[0]


def measure_interleaved(
    fns: Sequence[Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    summary: str = "median",
    clock: str = "wall",
) -> list[float]:
    """Seconds per call of each function in ``fns``, timed in turn ``A, B, A, B, ...``;
    one number each.

    Interleaving spreads slow and fast moments of a busy machine over all the functions,
    so a ratio of two medians is steadier than timing ``A`` many times and then ``B``
    many times.

    - ``summary="median"`` (default) or ``"min"``: the fastest run, since other programs
      only add time.
    - ``clock="wall"`` (default): ``time.perf_counter``, with the GPU synchronized
      before and after each run. ``clock="thread"``: ``time.thread_time``, the CPU time
      of this thread only, which leaves out the time other programs ran; it is right
      only for CPU work on one thread, so it requires ``torch.get_num_threads() == 1``
      (see :func:`num_threads`).
    """
    if callable(fns) or not len(fns) or not all(callable(fn) for fn in fns):
        raise TypeError(f"fns must be a non-empty sequence of callables, got {fns!r}")
    repeats, warmup = _check_repeats(repeats, warmup)
    if summary not in SUMMARIES:
        raise ValueError(f"summary must be one of {sorted(SUMMARIES)}, got {summary!r}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "thread" and torch.get_num_threads() != 1:
        raise ValueError(
            "clock='thread' counts only this thread's CPU time; PyTorch uses "
            f"{torch.get_num_threads()} threads "
            "(wrap the timing in measure.num_threads(1))"
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
    """The exponent ``a`` of the least-squares fit ``y = c x^a``: the slope of ``log y``
    against ``log x``."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or len(x) < 2:
        raise ValueError(
            f"xs and ys must be 1-D of the same length >= 2, got shapes {x.shape} and "
            f"{y.shape}"
        )
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError(
            "xs and ys must be positive to fit a power law on a log-log scale"
        )
    if np.ptp(np.log(x)) == 0:
        raise ValueError("xs must not all be equal")
    slope, _ = np.polyfit(np.log(x), np.log(y), 1)
    return float(slope)


# --------------------------------------------------------------------------- peak
# memory


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while it is active, and the peak
    of their sum.

    Every PyTorch operation passes through :meth:`__torch_dispatch__`; a new output
    storage (not one of the operation's inputs, so views and in-place results are not
    counted twice) adds its bytes; a storage that has since been freed (its weak
    reference expired) subtracts them. The peak is the largest total seen after any
    operation. Tensors that existed before the tracker started are not counted: ``peak``
    is the *extra* memory the code allocated. Workspace an operation frees before it
    returns is not seen.
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
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
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


def peak_memory(
    fn: Callable[[], object], device: torch.device | str | None = None
) -> int:
    """Peak bytes of memory that ``fn()`` allocates above what was allocated when it
    started.

    On CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's own count).
    Elsewhere (CPU, MPS): a :class:`TensorMemoryTracker`, which adds up the tensors
    ``fn`` creates while they are alive. The result of ``fn`` counts while it is being
    built, then is dropped.
    """
    if not callable(fn):
        raise TypeError(
            f"fn must be callable with no arguments, got {type(fn).__name__}"
        )
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


# --------------------------------------------------------------------------- FLOPs


def _fused_attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """``Q K^T`` and ``A V`` of fused attention, q ``(B, h, Tq, d)``, k ``(B, h, Tk,
    d)``, v ``(B, h, Tk, dv)``: ``2 B h Tq Tk (d + dv)``."""
    *batch, n_q, d = query_shape
    n_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * int(np.prod(batch)) * n_q * n_k * (d + d_v)


def _fused_attention_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs
) -> int:
    """Its backward: the scores again, then the gradients of the weights, ``V``, ``Q``
    and ``K``: ``2 B h Tq Tk (3 d + 2 dv)``, PyTorch's own count for its GPU kernels."""
    *batch, n_q, d = query_shape
    n_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * int(np.prod(batch)) * n_q * n_k * (3 * d + 2 * d_v)


def flop_counter() -> FlopCounterMode:
    """PyTorch's ``FlopCounterMode`` (quiet) that also counts fused attention on a CPU.

    PyTorch's table has formulas for its GPU attention kernels but not for the one
    ``F.scaled_dot_product_attention`` runs on a CPU, which it then counts as 0 FLOPs
    (forward and backward): a ViT's or a GPT's attention would vanish from the count.
    ``with flop_counter() as counter: ...``, then ``counter.get_total_flops()``."""
    aten = torch.ops.aten
    return FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: _fused_attention_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: (
                _fused_attention_backward_flops
            ),
        },
    )


# --------------------------------------------------------------------------- profile


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for a block (the profiler's C++ side logs
    a line there each time it starts and stops)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def time_by_operation(fn: Callable[[], object]) -> dict[str, float]:
    """CPU seconds of one call ``fn()`` spent in each PyTorch operation, by name
    (``"aten::bmm"``; a custom autograd function under its class name), from
    ``torch.profiler``: each operation's self time, without the operations it calls
    (what ``key_averages()`` reports as self CPU time, computed here from the raw
    events: some 25 times faster than it when there are 100,000 of them).

    Time spent in Python between operations is counted in the enclosing autograd
    function's entry (or nowhere, outside one). The profiler adds a small fixed cost to
    every operation it records, so with many tiny operations the sum exceeds an
    unprofiled run's time."""
    if not callable(fn):
        raise TypeError(
            f"fn must be callable with no arguments, got {type(fn).__name__}"
        )
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():
        profiler.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            profiler.stop()
    events = sorted(
        (e.start_thread_id(), e.start_ns(), -e.duration_ns(), e.name())
        for e in profiler.profiler.kineto_results.events()
    )  # by thread, then by start; at equal starts the longer (the caller) first
    seconds: dict[str, float] = {}
    stack: list[tuple[int, int, str]] = []  # (thread, end, name) of open operations
    for thread, start, minus_duration, name in events:
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            stack.pop()  # operations that ended before this one started
        duration = -minus_duration / 1e9
        seconds[name] = seconds.get(name, 0.0) + duration
        if stack:  # the caller's self time excludes this call
            seconds[stack[-1][2]] -= duration
        stack.append((thread, start - minus_duration, name))
    return seconds


__all__ = [
    "CLOCKS",
    "SUMMARIES",
    "TensorMemoryTracker",
    "fit_power_law",
    "flop_counter",
    "measure",
    "measure_interleaved",
    "num_threads",
    "peak_memory",
    "synchronize",
    "time_by_operation",
]
