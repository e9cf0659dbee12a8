"""The library's speed and memory bars, measured: ``python -m attnbook.bench [--quick] [--check]``.

Prints the machine (CPU model, PyTorch's threads, torch version), then one line per figure,
``name: value (bar ...: met|MISSED)``. Each figure is a ratio of two things measured in this run
(median of several repetitions, the two timed in turn ``A, B, A, B, ...``), so it depends on how
the two compare rather than on how fast the machine is:

- ``efficient_attention_vs_torch_4096``: our :func:`~attnbook.attention.memory_efficient_attention`
  / ``F.scaled_dot_product_attention``, B=1, h=8, n=4096, d/h=64, fp32. Bar: <= 2.5.
- ``efficient_causal_attention_vs_torch_4096``: the same with ``is_causal=True`` on both. Bar: <= 3.0.
- ``efficient_attention_peak_memory_8192``: peak memory of ``memory_efficient_attention`` / that of a
  naive attention that stores exactly one ``n x n`` matrix (scores, turned into weights in place),
  B=h=1, n=8192, d=64. Bar: <= 0.05.
- ``kv_cache_speedup_512``: time to generate 512 tokens from a 16-token prompt without a cache / with
  one, ``GPT(vocab_size=256, d_model=256, num_heads=4, num_layers=4, max_len=1024)`` on the CPU,
  fp32, batch 1, greedy, on **one thread** (steadiest); ``kv_cache_tokens_identical`` says whether
  both produced the same tokens. Bar: >= 15 and identical.
- ``generate_vs_transformers``: our cached greedy :func:`~attnbook.generation.generate` / the
  ``generate`` (``use_cache=True``, greedy) of transformers' ``GPT2LMHeadModel`` of the same sizes
  (vocab 256, d 256, 4 heads, 4 layers, 1024 positions; built from a local ``GPT2Config``, nothing
  downloaded), 512 new tokens from 16, on one CPU thread. Bar: <= 0.6.
- ``train_step_vs_transformers``: forward + backward + AdamW step of our ``GPT`` / that GPT-2, B=8,
  T=256, dropout 0 in both, cross-entropy of the next token, on one CPU thread. Bar: <= 1.0.
- ``mha_vs_torch``: our ``MultiHeadAttention`` (``need_weights=False``) / ``nn.MultiheadAttention``
  (``need_weights=False``, batch-first, same weights), eval, inference mode, B=8, n=512, d=512, h=8.
  Bar: <= 1.1.

``--quick`` uses smaller sizes and fewer repetitions; every name then carries the size it was
measured at (e.g. ``kv_cache_speedup_128``), and the bar of the full figure is shown beside it.
``--check`` exits with status 1 when a bar is missed. ``--threads N`` sets PyTorch's CPU threads for
the attention figures; the generation and training figures always run on one CPU thread (steadiest:
a thread pool on a busy machine can stall for milliseconds on each of their many small operations).
Attention, memory and ``mha_vs_torch`` run on :func:`attnbook.device`; generation and training on the CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .attention import memory_efficient_attention
from .generation import generate
from .measure import measure_interleaved, num_threads, peak_memory
from .models import GPT
from .multihead import MultiHeadAttention
from .utils import device as default_device

BARS = {  # figure (without its size): (comparison, bound)
    "efficient_attention_vs_torch": ("<=", 2.5),
    "efficient_causal_attention_vs_torch": ("<=", 3.0),
    "efficient_attention_peak_memory": ("<=", 0.05),
    "kv_cache_speedup": (">=", 15.0),
    "generate_vs_transformers": ("<=", 0.6),
    "train_step_vs_transformers": ("<=", 1.0),
    "mha_vs_torch": ("<=", 1.1),
}
GPT_SIZES = dict(vocab_size=256, d_model=256, num_heads=4, num_layers=4, max_len=1024)


def cpu_model() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _qkv(n: int, heads: int, head_dim: int, device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, n, head_dim, generator=generator).to(device) for _ in range(3)]


def efficient_attention_vs_torch(device, repeats: int, n: int = 4096, heads: int = 8, head_dim: int = 64,
                                 is_causal: bool = False) -> tuple[float, bool]:
    """Our memory-efficient attention / ``F.scaled_dot_product_attention``; and whether they agree."""
    q, k, v = _qkv(n, heads, head_dim, device)
    with torch.inference_mode():
        match = torch.allclose(memory_efficient_attention(q, k, v, is_causal=is_causal),
                               F.scaled_dot_product_attention(q, k, v, is_causal=is_causal), atol=1e-4, rtol=1e-4)
        ours, theirs = measure_interleaved(
            [lambda: memory_efficient_attention(q, k, v, is_causal=is_causal),
             lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)],
            repeats=repeats, warmup=1,
        )
    return ours / theirs, match


def naive_attention(q, k, v):
    """Attention that stores exactly one ``n x n`` matrix: the scores, turned into the weights in place."""
    weights = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)  # (..., n, n): the one matrix
    weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()
    weights.div_(weights.sum(dim=-1, keepdim=True))
    return weights @ v  # (..., n, dv)


def efficient_attention_peak_memory(device, n: int = 8192, head_dim: int = 64) -> tuple[float, int, int]:
    """Peak memory of memory-efficient / naive one-matrix attention (B = h = 1); also both peaks in bytes."""
    q, k, v = _qkv(n, 1, head_dim, device)
    with torch.inference_mode():
        naive = peak_memory(lambda: naive_attention(q, k, v), device)
        efficient = peak_memory(lambda: memory_efficient_attention(q, k, v), device)
    return efficient / naive, efficient, naive


def mha_vs_torch(device, repeats: int, batch=8, n=512, d_model=512, heads=8) -> tuple[float, bool]:
    """Our ``MultiHeadAttention`` / ``nn.MultiheadAttention``, both without weights; and whether outputs match."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(d_model, heads, batch_first=True).to(device).eval()
    ours = MultiHeadAttention(d_model, heads).to(device).eval().load_from_torch(reference)
    x = torch.randn(batch, n, d_model, device=device)
    with torch.inference_mode():
        match = torch.allclose(ours(x, x, x, need_weights=False)[0], reference(x, x, x, need_weights=False)[0],
                               atol=1e-4, rtol=1e-4)
        ours_time, torch_time = measure_interleaved(
            [lambda: ours(x, x, x, need_weights=False), lambda: reference(x, x, x, need_weights=False)],
            repeats=repeats, warmup=2,
        )
    return ours_time / torch_time, match


def _prompt(prompt_len: int = 16) -> torch.Tensor:
    return torch.randint(0, GPT_SIZES["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))


def kv_cache_speedup(new_tokens: int, repeats: int) -> tuple[float, bool]:
    """Uncached / cached time to generate ``new_tokens`` on one CPU thread; and whether the tokens are identical."""
    torch.manual_seed(0)
    model = GPT(**GPT_SIZES).eval()
    prompt = _prompt()
    outputs = {}

    def run(use_cache):
        outputs[use_cache] = generate(model, prompt, new_tokens, use_cache=use_cache)

    with num_threads(1):
        uncached, cached = measure_interleaved([lambda: run(False), lambda: run(True)], repeats=repeats, warmup=1)
    return uncached / cached, torch.equal(outputs[True], outputs[False])


def transformers_gpt2():
    """transformers' ``GPT2LMHeadModel`` with our GPT's sizes (exact GELU as ours, no dropout), built locally."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging

        logging.set_verbosity_error()
        config = GPT2Config(vocab_size=GPT_SIZES["vocab_size"], n_embd=GPT_SIZES["d_model"],
                            n_head=GPT_SIZES["num_heads"], n_layer=GPT_SIZES["num_layers"],
                            n_positions=GPT_SIZES["max_len"], activation_function="gelu", resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                            pad_token_id=0)
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)


def generate_vs_transformers(new_tokens: int, repeats: int) -> float:
    """Our cached greedy ``generate`` / ``GPT2LMHeadModel.generate`` (use_cache, greedy), both on the CPU."""
    torch.manual_seed(0)
    ours = GPT(**GPT_SIZES).eval()
    theirs = transformers_gpt2().eval()
    prompt = _prompt()
    attention_mask = torch.ones_like(prompt)

    def run_theirs():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = theirs.generate(prompt, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, use_cache=True, num_beams=1,
                                  pad_token_id=0)
        if out.shape[1] != prompt.shape[1] + new_tokens:
            raise RuntimeError(f"GPT2LMHeadModel.generate stopped after {out.shape[1] - prompt.shape[1]} tokens")

    with num_threads(1):
        ours_time, theirs_time = measure_interleaved(
            [lambda: generate(ours, prompt, new_tokens), run_theirs], repeats=repeats, warmup=1)
    return ours_time / theirs_time


def train_step_vs_transformers(repeats: int, batch: int = 8, length: int = 256) -> float:
    """One forward + backward + AdamW step of our GPT / of transformers' GPT-2 of the same sizes."""
    torch.manual_seed(0)
    ours = GPT(**GPT_SIZES).train()
    theirs = transformers_gpt2().train()
    ids = torch.randint(0, GPT_SIZES["vocab_size"], (batch, length + 1), generator=torch.Generator().manual_seed(2))
    x, y = ids[:, :-1], ids[:, 1:]

    def stepper(model, logits_of):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = F.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        return step

    with num_threads(1):
        ours_time, theirs_time = measure_interleaved(
            [stepper(ours, lambda model, x: model(x)), stepper(theirs, lambda model, x: model(x).logits)],
            repeats=repeats, warmup=1,
        )
    return ours_time / theirs_time


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # not available on this platform
        return "n/a"


def _met(kind: str, value: float) -> bool:
    op, bound = BARS[kind]
    return value <= bound if op == "<=" else value >= bound


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnbook.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (names say the size)")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a bar is missed")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch (default: its own choice); kv_cache_speedup always uses 1")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = default_device()
    if args.quick:
        n_attention, n_memory, new_tokens, repeats, slow_repeats = 1024, 2048, 128, 3, 1
    else:
        n_attention, n_memory, new_tokens, repeats, slow_repeats = 4096, 8192, 512, 5, 3
    print(f"machine: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"device {device.type}")
    print(f"mode: {'quick' if args.quick else 'full'}")
    print(f"load_average_start: {_load()}", flush=True)

    results: list[tuple[str, str, float]] = []  # (name, kind, value)
    missed: list[str] = []

    def report(kind: str, size: int | None, value: float, digits: int = 3) -> None:
        name = kind if size is None else f"{kind}_{size}"
        op, bound = BARS[kind]
        met = _met(kind, value)
        results.append((name, kind, value))
        if not met:
            missed.append(name)
        print(f"{name}: {value:.{digits}f} (bar {op} {bound}: {'met' if met else 'MISSED'})", flush=True)

    ratio, match = efficient_attention_vs_torch(device, repeats, n_attention)
    report("efficient_attention_vs_torch", n_attention, ratio)
    ratio, causal_match = efficient_attention_vs_torch(device, repeats, n_attention, is_causal=True)
    report("efficient_causal_attention_vs_torch", n_attention, ratio)
    print(f"efficient_attention_outputs_match: {match and causal_match}", flush=True)
    ratio, efficient, naive = efficient_attention_peak_memory(device, n_memory)
    report("efficient_attention_peak_memory", n_memory, ratio, digits=4)
    print(f"peak_bytes_{n_memory}: efficient {efficient} naive {naive}", flush=True)
    speedup, identical = kv_cache_speedup(new_tokens, slow_repeats)
    report("kv_cache_speedup", new_tokens, speedup, digits=1)
    print(f"kv_cache_tokens_identical: {identical}", flush=True)
    if not identical:
        missed.append("kv_cache_tokens_identical")
    report("generate_vs_transformers", new_tokens, generate_vs_transformers(new_tokens, slow_repeats))
    report("train_step_vs_transformers", None, train_step_vs_transformers(repeats))
    ratio, mha_match = mha_vs_torch(device, repeats)
    report("mha_vs_torch", None, ratio)
    print(f"mha_outputs_match: {mha_match}")
    if not (match and causal_match and mha_match):
        missed.append("outputs_match")
    print(f"load_average_end: {_load()}")
    print(f"bars_missed: {', '.join(missed) if missed else 'none'}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
