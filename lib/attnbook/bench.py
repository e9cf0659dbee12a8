"""The library's speed and memory bars, measured: ``python -m attnbook.bench [--quick]``.

Prints one line per figure, ``name: value``. Each figure is a ratio of two things measured in
this run (median of several repetitions, the two timed in turn ``A, B, A, B, ...``), so it does
not depend on how fast the machine is, only on how the two compare:

- ``attention_fast_vs_torch``: our ``scaled_dot_product_attention(..., need_weights=False)`` time
  / ``F.scaled_dot_product_attention`` time (B=8, h=8, n=512, d/h=64, fp32). Bar: <= 1.1.
- ``mha_vs_torch``: our ``MultiHeadAttention`` (``need_weights=False``) / ``nn.MultiheadAttention``
  (``need_weights=False``, batch-first, same weights), eval, inference mode. Bar: <= 1.1.
- ``kv_cache_speedup_512``: time to generate 512 tokens from a 16-token prompt without a cache /
  with one, for ``GPT(vocab_size=256, d_model=256, num_heads=4, num_layers=4, max_len=1024)`` on the
  CPU, fp32, batch 1, greedy; ``kv_cache_tokens_identical`` says whether both produced the same
  tokens. Bar: >= 15 and identical.
- ``efficient_attention_peak_memory_8192``: peak memory of ``memory_efficient_attention`` / that of
  the naive ``scaled_dot_product_attention`` (which stores the weights), n=8192, B=h=1, d=64.
  Bar: <= 0.10.

``--clock thread`` (with ``--threads 1``, CPU only) times with ``time.thread_time``, the CPU time of
the one thread doing the work, which leaves out the time other programs ran.

``--threads N`` sets PyTorch's CPU threads. On a machine busier than its cores, PyTorch's thread
pool can spend tens of milliseconds in one tiny operation waiting for a descheduled thread, which
swamps the per-token cost of cached generation; one thread avoids that.

``--quick`` uses fewer repetitions and generates 128 tokens instead of 512 (the names stay the same;
a ``mode`` line says so). Attention and memory run on :func:`attnbook.device`; generation on the CPU.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.nn.functional as F
from torch import nn

from .attention import memory_efficient_attention, scaled_dot_product_attention
from .cost import measure_interleaved, peak_memory
from .generation import generate
from .models import GPT
from .multihead import MultiHeadAttention
from .utils import device as default_device

BARS = {  # name: (comparison, bound)
    "attention_fast_vs_torch": ("<=", 1.1),
    "mha_vs_torch": ("<=", 1.1),
    "kv_cache_speedup_512": (">=", 15.0),
    "efficient_attention_peak_memory_8192": ("<=", 0.10),
}


def attention_fast_vs_torch(device, repeats: int, clock="wall", batch=8, heads=8, n=512, head_dim=64) -> float:
    """Our fused fast path / PyTorch's ``F.scaled_dot_product_attention``, same inputs."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=generator).to(device) for _ in range(3))
    with torch.inference_mode():
        ours, torch_time = measure_interleaved(
            [lambda: scaled_dot_product_attention(q, k, v, need_weights=False),
             lambda: F.scaled_dot_product_attention(q, k, v)],
            repeats=repeats, warmup=2, clock=clock,
        )
    return ours / torch_time


def mha_vs_torch(device, repeats: int, clock="wall", batch=8, n=512, d_model=512, heads=8) -> tuple[float, bool]:
    """Our ``MultiHeadAttention`` / ``nn.MultiheadAttention``, both without weights; and whether outputs match."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(d_model, heads, batch_first=True).to(device).eval()
    ours = MultiHeadAttention(d_model, heads).to(device).eval()
    ours.load_from_torch(reference)
    x = torch.randn(batch, n, d_model, device=device)
    with torch.inference_mode():
        match = torch.allclose(ours(x, x, x, need_weights=False)[0], reference(x, x, x, need_weights=False)[0],
                               atol=1e-4, rtol=1e-4)
        ours_time, torch_time = measure_interleaved(
            [lambda: ours(x, x, x, need_weights=False), lambda: reference(x, x, x, need_weights=False)],
            repeats=repeats, warmup=2, clock=clock,
        )
    return ours_time / torch_time, match


def kv_cache_speedup(new_tokens: int, repeats: int, clock="wall", prompt_len=16) -> tuple[float, bool]:
    """Uncached / cached time to generate ``new_tokens`` on the CPU; and whether the tokens are identical."""
    torch.manual_seed(0)
    model = GPT(vocab_size=256, d_model=256, num_heads=4, num_layers=4, max_len=1024).eval()
    prompt = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    outputs = {}

    def run(use_cache):
        outputs[use_cache] = generate(model, prompt, new_tokens, use_cache=use_cache)

    uncached, cached = measure_interleaved([lambda: run(False), lambda: run(True)], repeats=repeats, warmup=1,
                                           clock=clock)
    return uncached / cached, torch.equal(outputs[True], outputs[False])


def efficient_attention_peak_memory(device, n=8192, head_dim=64) -> tuple[float, int, int]:
    """Peak memory of memory-efficient / naive attention (B = h = 1); also both peaks in bytes."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, head_dim, generator=generator).to(device) for _ in range(3))
    with torch.inference_mode():
        naive = peak_memory(lambda: scaled_dot_product_attention(q, k, v), device)
        efficient = peak_memory(lambda: memory_efficient_attention(q, k, v), device)
    return efficient / naive, efficient, naive


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # not available on this platform
        return "n/a"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnbook.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 128 generated tokens instead of 512")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch (default: its own choice); 1 is steadiest on a busy machine")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="wall: elapsed time (default); thread: this thread's CPU time (CPU only, --threads 1)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and (torch.get_num_threads() != 1 or default_device().type != "cpu"):
        parser.error("--clock thread counts one CPU thread's time: use it with --threads 1 on a CPU-only machine")
    device = default_device()
    repeats, new_tokens, gen_repeats = (5, 128, 1) if args.quick else (21, 512, 3)
    print(f"device: {device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"torch: {torch.__version__}")
    print(f"clock: {args.clock}")
    if args.quick:
        print(f"mode: quick ({repeats} repetitions; kv_cache_speedup_512 measured at {new_tokens} new tokens)")
    print(f"load_average_start: {_load()}", flush=True)

    figures = {}
    figures["attention_fast_vs_torch"] = attention_fast_vs_torch(device, repeats, args.clock)
    print(f"attention_fast_vs_torch: {figures['attention_fast_vs_torch']:.3f}", flush=True)
    figures["mha_vs_torch"], match = mha_vs_torch(device, repeats, args.clock)
    print(f"mha_vs_torch: {figures['mha_vs_torch']:.3f}")
    print(f"mha_outputs_match: {match}", flush=True)
    figures["kv_cache_speedup_512"], identical = kv_cache_speedup(new_tokens, gen_repeats, args.clock)
    print(f"kv_cache_speedup_512: {figures['kv_cache_speedup_512']:.1f}")
    print(f"kv_cache_tokens_identical: {identical}", flush=True)
    ratio, efficient, naive = efficient_attention_peak_memory(device)
    figures["efficient_attention_peak_memory_8192"] = ratio
    print(f"efficient_attention_peak_memory_8192: {ratio:.4f}")
    print(f"peak_bytes_8192: efficient {efficient} naive {naive}")
    print(f"load_average_end: {_load()}")

    missed = [name for name, (op, bound) in BARS.items()
              if not (figures[name] <= bound if op == "<=" else figures[name] >= bound)]
    if not identical:
        missed.append("kv_cache_tokens_identical")
    print(f"bars_missed: {', '.join(missed) if missed else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
