"""Property-based tests (hypothesis) of attnbook's public API.

Random shapes, batch sizes, masks (bool True = blocked, float additive, fully blocked rows) and dtypes:
every valid input must match its reference (a float64 computation by hand, PyTorch's own function or
layer with the same weights, the uncached generation), every invalid one must raise ``TypeError`` or
``ValueError`` and nothing else.

The examples are derandomized, so CI sees the same cases on every run. Tensors are drawn from a seed
(one ``torch.Generator`` per example), so a failing example prints as a short dict of sizes and seeds.
``ATTNBOOK_HYPOTHESIS_SCALE=10 pytest tests/test_properties.py`` runs ten times as many examples;
``--hypothesis-show-statistics`` prints how many ran.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import (
    GPT,
    DecoderBlock,
    EncoderBlock,
    EncoderDecoderModel,
    MultiHeadAttention,
    causal_mask,
    generate,
    memory_efficient_attention,
    padding_mask,
    scaled_dot_product_attention,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

settings.register_profile(
    "attnbook",
    deadline=None,  # CPU timings vary too much (shared CI machines, other kernel families)
    derandomize=True,  # the same examples on every run: CI is reproducible
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile("attnbook")
SCALE = float(os.environ.get("ATTNBOOK_HYPOTHESIS_SCALE", "1"))


def examples(n: int) -> settings:
    """The profile with ``n`` examples (times ATTNBOOK_HYPOTHESIS_SCALE)."""
    return settings(PROFILE, max_examples=max(1, round(n * SCALE)))


def _cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU build runs the ops attention needs (matmul, softmax, the fused kernel) in ``dtype``."""
    try:
        x = torch.ones(1, 2, 2, dtype=dtype)
        torch.softmax(x @ x.transpose(-2, -1), dim=-1)
        F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(2, 2, dtype=torch.bool))
    except RuntimeError:
        return False
    return True


LOW_PRECISION = [dtype for dtype in (torch.float16, torch.bfloat16) if _cpu_supports(dtype)]
DTYPES = [torch.float32, torch.float64, *LOW_PRECISION]
TOL = {  # output and weights against the float64 reference (inputs rounded to the dtype are shared)
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
}
INVALID = (TypeError, ValueError)
seeds = st.integers(0, 2**31 - 1)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, factor: float = 1.0) -> None:
    tol = {key: value * factor for key, value in TOL[dtype].items()}
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


def hand_causal(n_q: int, n_k: int) -> torch.Tensor:
    """Query ``i`` is token ``n_k - n_q + i``; True = blocked (the future)."""
    return torch.tensor([[j > n_k - n_q + i for j in range(n_k)] for i in range(n_q)], dtype=torch.bool)


# ---------------------------------------------------------------- strategies: sizes and masks as plain dicts


def shrink(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``shape``: some dims set to 1, some leading dims dropped."""
    dims = [draw(st.sampled_from((size, 1))) for size in shape]
    return tuple(dims[draw(st.integers(0, len(dims))):])


@st.composite
def mask_specs(draw, scores_shape: tuple[int, ...], dtype: torch.dtype, shape=None) -> dict:
    """A mask that broadcasts to ``scores_shape``: None, bool or float (finite values and -inf), with a
    random fraction blocked and maybe one fully blocked row."""
    return dict(
        mask=draw(st.sampled_from((None, "bool", "float"))),
        mask_shape=shrink(draw, scores_shape) if shape is None else shape,
        p_block=draw(st.sampled_from((0.0, 0.25, 0.6, 1.0))),
        full_row=draw(st.none() | st.integers(0, 7)),
        mask_dtype=draw(st.sampled_from((torch.float32, torch.float64, dtype))),
        mask_seed=draw(seeds),
    )


def build_mask(spec: dict, keep_first_key: bool = False) -> torch.Tensor | None:
    if spec["mask"] is None:
        return None
    gen = torch.Generator().manual_seed(spec["mask_seed"])
    shape = spec["mask_shape"]
    blocked = torch.rand(shape, generator=gen) < spec["p_block"]
    if spec["full_row"] is not None:
        if len(shape) >= 2:
            blocked[..., spec["full_row"] % shape[-2], :] = True
        else:
            blocked[...] = True
    if keep_first_key and len(shape) >= 1:
        blocked[..., 0] = False  # every query sees key 0: no fully blocked row (PyTorch gives NaN there)
    if spec["mask"] == "bool":
        return blocked
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    return values.masked_fill(blocked, float("-inf")).to(spec["mask_dtype"])


@st.composite
def attention_specs(draw, dtypes=tuple(DTYPES)) -> dict:
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    dtype = draw(st.sampled_from(dtypes))
    spec = dict(
        dtype=dtype, tq=draw(st.integers(1, 7)), tk=draw(st.integers(1, 7)), d=draw(st.integers(1, 8)),
        dv=draw(st.integers(1, 8)), q_batch=shrink(draw, batch), k_batch=shrink(draw, batch),
        v_batch=shrink(draw, batch), scale=draw(st.sampled_from((0.5, 1.0, 3.0))), seed=draw(seeds),
    )
    scores_shape = torch.broadcast_shapes(spec["q_batch"], spec["k_batch"]) + (spec["tq"], spec["tk"])
    spec.update(draw(mask_specs(tuple(scores_shape), dtype)))
    return spec


def build_attention(spec: dict):
    event(f"dtype {str(spec['dtype']).removeprefix('torch.')}, mask {spec['mask']}")  # --hypothesis-show-statistics
    gen = torch.Generator().manual_seed(spec["seed"])

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * spec["scale"]).to(spec["dtype"])

    q = randn(*spec["q_batch"], spec["tq"], spec["d"])
    k = randn(*spec["k_batch"], spec["tk"], spec["d"])
    v = (torch.randn(*spec["v_batch"], spec["tk"], spec["dv"], generator=gen)).to(spec["dtype"])
    return q, k, v, build_mask(spec)


def reference_attention(q, k, v, mask=None, is_causal=False):
    """Attention in float64, by hand. Returns output, weights, the blocked entries and the fully blocked rows."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (..., Tq, Tk)
    blocked = torch.zeros(scores.shape, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            blocked = blocked | mask
        else:
            added = mask.to(q.dtype).double()  # the library decides what is -inf in q's dtype
            blocked = blocked | torch.isneginf(added)
            scores = scores + added.masked_fill(torch.isneginf(added), 0.0)
    if is_causal:
        blocked = blocked | hand_causal(n_q, n_k)
    scores = scores.masked_fill(blocked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    exp = (scores - row_max).exp()
    total = exp.sum(dim=-1, keepdim=True)
    weights = torch.where(total > 0, exp / total.clamp_min(1e-300), torch.zeros_like(exp))  # 0 in blocked rows
    return weights @ v.double(), weights, blocked, blocked.all(dim=-1, keepdim=True)


def torch_attention(q, k, v, mask, blocked):
    """``F.scaled_dot_product_attention`` with our mask inverted (True = keep) and the causal part included."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    if mask is None or mask.dtype == torch.bool:
        attn_mask = ~blocked
    else:
        attn_mask = mask.to(q.dtype).expand(blocked.shape).masked_fill(blocked, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


# ---------------------------------------------------------------- scaled_dot_product_attention


@examples(250)
@given(spec=attention_specs(), need_weights=st.booleans(), is_causal=st.booleans())
def test_sdpa_matches_float64_reference_and_pytorch(spec, need_weights, is_causal):
    q, k, v, mask = build_attention(spec)
    dtype = spec["dtype"]
    out, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights, is_causal=is_causal)
    ref_out, ref_weights, blocked, blocked_row = reference_attention(q, k, v, mask, is_causal)
    event(f"fully blocked rows: {bool(blocked_row.any())}")
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert torch.isfinite(out).all()
    close(out, ref_out, dtype)
    assert (out.masked_select(blocked_row.expand(out.shape)) == 0).all()  # fully blocked rows: exactly 0
    if need_weights:
        assert weights.dtype == dtype and weights.shape == ref_weights.shape
        close(weights, ref_weights, dtype)
        assert (weights.masked_select(blocked) == 0).all()  # blocked entries get exactly 0
    else:
        assert weights is None
    expected = torch_attention(q, k, v, mask, blocked)  # NaN in fully blocked rows: compare the others
    rows = (~blocked_row).expand(out.shape)
    close(out.masked_select(rows), expected.masked_select(rows), dtype, factor=2.0)


@examples(40)
@given(spec=attention_specs(dtypes=(torch.float32, torch.float64)), dropout_p=st.sampled_from((0.1, 0.5, 0.9)))
def test_sdpa_dropout_zeroes_or_rescales_each_weight(spec, dropout_p):
    q, k, v, mask = build_attention(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p=dropout_p)
    _, ref_weights, _, _ = reference_attention(q, k, v, mask)
    kept = weights != 0
    close(weights.masked_select(kept), ref_weights.masked_select(kept) / (1 - dropout_p), spec["dtype"])
    close(out, weights.double() @ v.double(), spec["dtype"])  # the output uses the weights returned


# ---------------------------------------------------------------- memory_efficient_attention


@examples(200)
@given(spec=attention_specs(), block_size=st.integers(1, 8), query_block_size=st.none() | st.integers(1, 8),
       is_causal=st.booleans())
def test_memory_efficient_matches_naive(spec, block_size, query_block_size, is_causal):
    q, k, v, mask = build_attention(spec)
    dtype = spec["dtype"]
    out = memory_efficient_attention(q, k, v, mask, block_size=block_size, query_block_size=query_block_size,
                                     is_causal=is_causal)
    naive, _ = scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    ref_out, _, _, blocked_row = reference_attention(q, k, v, mask, is_causal)
    assert out.dtype == dtype and out.shape == naive.shape
    assert torch.isfinite(out).all()
    close(out, ref_out, dtype)
    close(out, naive, dtype, factor=2.0)
    assert (out.masked_select(blocked_row.expand(out.shape)) == 0).all()


@pytest.mark.parametrize("mask_shape", [(), (3,)])
def test_fused_path_takes_masks_of_fewer_dims(mask_shape):
    q, mask = torch.randn(2, 2, 3, 4), torch.zeros(mask_shape, dtype=torch.bool)
    expected, _ = scaled_dot_product_attention(q, q, q, mask)
    torch.testing.assert_close(scaled_dot_product_attention(q, q, q, mask, need_weights=False)[0], expected)


@pytest.mark.parametrize("q_batch, v_batch", [((), (1,)), ((1, 1), (1, 2))])
def test_memory_efficient_broadcasts_batch_dims_of_v(q_batch, v_batch):
    q, k, v = torch.randn(*q_batch, 1, 1), torch.randn(*q_batch, 1, 1), torch.randn(*v_batch, 1, 1)
    expected, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(memory_efficient_attention(q, k, v), expected)


# ---------------------------------------------------------------- invalid attention inputs

ATTENTION_ERRORS = ("mask_int", "mask_shape", "mask_extra_dim", "d_mismatch", "tk_mismatch", "dtype_mismatch",
                    "int_q", "one_dim_q", "batch_mismatch", "not_tensor", "mask_not_tensor", "dropout")


def corrupt_attention(spec: dict, error: str, draw_value):
    """Valid q, k, v, mask from ``spec`` with exactly one thing made invalid."""
    q, k, v, mask = build_attention(spec)
    scores_shape = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (spec["tq"], spec["tk"])
    kwargs = {}
    if error == "mask_int":
        mask = torch.zeros(spec["mask_shape"], dtype=draw_value(st.sampled_from((torch.int64, torch.int32,
                                                                                 torch.uint8))))
    elif error == "mask_shape":  # one dim one too long: never broadcasts
        dim = draw_value(st.integers(0, len(scores_shape) - 1))
        shape = list(scores_shape)
        shape[dim] += 1
        mask = torch.zeros(shape, dtype=torch.bool)
    elif error == "mask_extra_dim":  # more dims than the scores
        mask = torch.zeros(2, *scores_shape, dtype=torch.bool)
    elif error == "d_mismatch":
        k = torch.randn(*k.shape[:-1], k.shape[-1] + 1).to(k.dtype)
    elif error == "tk_mismatch":
        v = torch.randn(*v.shape[:-2], v.shape[-2] + 1, v.shape[-1]).to(v.dtype)
    elif error == "dtype_mismatch":
        k = k.to(torch.float64 if k.dtype != torch.float64 else torch.float32)
    elif error == "int_q":
        q = torch.ones(q.shape, dtype=torch.long)
    elif error == "one_dim_q":
        q = q.reshape(-1)[: spec["d"]]
    elif error == "batch_mismatch":
        q = torch.randn(2, spec["tq"], spec["d"]).to(q.dtype)
        k = torch.randn(3, spec["tk"], spec["d"]).to(k.dtype)
        v = torch.randn(3, spec["tk"], spec["dv"]).to(v.dtype)
    elif error == "not_tensor":
        q = q.tolist()
    elif error == "mask_not_tensor":
        mask = torch.zeros(scores_shape[-2:], dtype=torch.bool).tolist()
    elif error == "dropout":
        kwargs["dropout_p"] = draw_value(st.sampled_from((-0.1, 1.0, 1.5, True, "0.1", None)))
    return q, k, v, mask, kwargs


@examples(150)
@given(spec=attention_specs(), error=st.sampled_from(ATTENTION_ERRORS), need_weights=st.booleans(),
       is_causal=st.booleans(), data=st.data())
def test_sdpa_rejects_invalid_inputs(spec, error, need_weights, is_causal, data):
    q, k, v, mask, kwargs = corrupt_attention(spec, error, data.draw)
    with pytest.raises(INVALID):
        scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights, is_causal=is_causal, **kwargs)


@examples(100)
@given(spec=attention_specs(), error=st.sampled_from(ATTENTION_ERRORS[:-1] + ("block_size", "query_block_size")),
       is_causal=st.booleans(), data=st.data())
def test_memory_efficient_rejects_invalid_inputs(spec, error, is_causal, data):
    q, k, v, mask, kwargs = corrupt_attention(spec, error, data.draw)
    if error in ("block_size", "query_block_size"):
        kwargs[error] = data.draw(st.sampled_from((0, -1, 2.5, True, "4")))
    with pytest.raises(INVALID):
        memory_efficient_attention(q, k, v, mask, is_causal=is_causal, **kwargs)


# ---------------------------------------------------------------- causal_mask, padding_mask

bad_sizes = st.integers(-5, 0) | st.sampled_from((2.0, 3.5, True, False, "3", None, float("nan")))


@examples(60)
@given(n=st.integers(1, 40), as_numpy=st.booleans())
def test_causal_mask_matches_hand_built(n, as_numpy):
    mask = causal_mask(np.int64(n) if as_numpy else n)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, hand_causal(n, n))
    assert int((~mask).sum()) == n * (n + 1) // 2


@examples(40)
@given(n=bad_sizes)
def test_causal_mask_rejects_bad_sizes(n):
    with pytest.raises(INVALID):
        causal_mask(n)


@examples(100)
@given(lengths=st.lists(st.integers(0, 10), min_size=1, max_size=6), extra=st.none() | st.integers(0, 4),
       form=st.sampled_from(("list", "tuple", "tensor", "int32", "numpy")))
def test_padding_mask_matches_hand_built(lengths, extra, form):
    max_len = None if extra is None else max(lengths) + extra
    arg = {"list": lengths, "tuple": tuple(lengths), "tensor": torch.tensor(lengths),
           "int32": torch.tensor(lengths, dtype=torch.int32), "numpy": np.array(lengths)}[form]
    mask = padding_mask(arg, max_len)
    width = max(lengths) if max_len is None else max_len
    expected = torch.tensor([[position >= length for position in range(width)] for length in lengths],
                            dtype=torch.bool).reshape(len(lengths), width)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


@examples(80)
@given(lengths=st.lists(st.integers(0, 10), min_size=1, max_size=6),
       error=st.sampled_from(("negative", "short", "float", "bool", "empty", "two_dims", "strings")),
       data=st.data())
def test_padding_mask_rejects_invalid_inputs(lengths, error, data):
    max_len = None
    if error == "negative":
        lengths = [*lengths, -data.draw(st.integers(1, 5))]
    elif error == "short":
        lengths = [*lengths, 1]
        max_len = max(lengths) - data.draw(st.integers(1, 3))
    elif error == "float":
        lengths = [length + 0.5 for length in lengths]
    elif error == "bool":
        lengths = [bool(length % 2) for length in lengths]
    elif error == "empty":
        lengths = []
    elif error == "two_dims":
        lengths = [lengths]
    elif error == "strings":
        lengths = [str(length) for length in lengths]
    with pytest.raises(INVALID):
        padding_mask(lengths, max_len)


@pytest.mark.parametrize("max_len", [3.5, True])
def test_padding_mask_rejects_non_positive_int_max_len(max_len):
    with pytest.raises(INVALID):
        padding_mask([0, 1], max_len)


# ---------------------------------------------------------------- MultiHeadAttention vs nn.MultiheadAttention


def perturb_vectors(module: nn.Module, gen: torch.Generator) -> None:
    """PyTorch starts biases at 0 and LayerNorm at (1, 0): move every 1-D parameter so they are tested."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=gen, dtype=parameter.dtype))


@st.composite
def mha_specs(draw) -> dict:
    num_heads, batch = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    self_attention = draw(st.booleans())
    tq = draw(st.integers(1, 6))
    tk = tq if self_attention else draw(st.integers(1, 6))
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    mask_shape = draw(st.sampled_from(((tq, tk), (batch, tq, tk), (1, tq, tk), (batch, num_heads, tq, tk),
                                       (1, num_heads, tq, tk), (batch, 1, tq, tk))))
    spec = dict(num_heads=num_heads, d_model=num_heads * draw(st.integers(1, 4)), batch=batch, tq=tq, tk=tk,
                self_attention=self_attention, bias=draw(st.booleans()), dtype=dtype,
                lengths=draw(st.none() | st.lists(st.integers(0, tk), min_size=batch, max_size=batch)),
                is_causal=draw(st.booleans()), need_weights=draw(st.booleans()), seed=draw(seeds))
    spec.update(draw(mask_specs((), dtype, shape=mask_shape)))
    return spec


def hand_padding(lengths, width: int) -> torch.Tensor:
    return torch.tensor([[position >= length for position in range(width)] for length in lengths], dtype=torch.bool)


def torch_masks(mask, key_padding_mask, is_causal, batch, num_heads, tq, tk, dtype):
    """Our masks as ``nn.MultiheadAttention`` takes them: attn_mask ``(B*h, Tq, Tk)`` with the causal part,
    key_padding_mask float when the attn_mask is (PyTorch wants both of one kind), and what is blocked."""
    if mask is None:
        mask = torch.zeros(tq, tk, dtype=torch.bool)
    if mask.dim() == 3:
        mask = mask[:, None]  # (B, 1, Tq, Tk): the same for every head
    mask = mask.expand(batch, num_heads, tq, tk)
    if mask.dtype == torch.bool:
        blocked = mask
    else:
        mask = mask.to(dtype)
        blocked = torch.isneginf(mask)
    if is_causal:
        causal = hand_causal(tq, tk)
        blocked = blocked | causal
        mask = mask | causal if mask.dtype == torch.bool else mask.masked_fill(causal, float("-inf"))
    kpm = None
    if key_padding_mask is not None:
        blocked = blocked | key_padding_mask[:, None, None, :]
        kpm = key_padding_mask
        if mask.dtype != torch.bool:
            kpm = torch.zeros(kpm.shape, dtype=dtype).masked_fill(kpm, float("-inf"))
    return mask.reshape(batch * num_heads, tq, tk), kpm, blocked  # blocked: (B, h, Tq, Tk)


@examples(120)
@given(spec=mha_specs())
def test_multihead_matches_pytorch(spec):
    h, d, B, tq, tk, dtype = (spec[key] for key in ("num_heads", "d_model", "batch", "tq", "tk", "dtype"))
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        reference = nn.MultiheadAttention(d, h, bias=spec["bias"], batch_first=True, dtype=dtype).eval()
        ours = MultiHeadAttention(d, h, bias=spec["bias"]).to(dtype).eval()
    perturb_vectors(reference, gen)
    ours.load_from_torch(reference)
    query = torch.randn(B, tq, d, generator=gen, dtype=dtype)
    key = query if spec["self_attention"] else torch.randn(B, tk, d, generator=gen, dtype=dtype)
    value = query if spec["self_attention"] else torch.randn(B, tk, d, generator=gen, dtype=dtype)
    mask = build_mask(spec)
    kpm = None if spec["lengths"] is None else hand_padding(spec["lengths"], tk)
    out, weights = ours(query, key, value, mask, key_padding_mask=kpm, need_weights=spec["need_weights"],
                        is_causal=spec["is_causal"])
    attn_mask, torch_kpm, blocked = torch_masks(mask, kpm, spec["is_causal"], B, h, tq, tk, dtype)
    expected, expected_weights = reference(query, key, value, attn_mask=attn_mask, key_padding_mask=torch_kpm,
                                           need_weights=True, average_attn_weights=False)
    assert out.shape == (B, tq, d) and out.dtype == dtype and torch.isfinite(out).all()
    row_blocked = blocked.all(dim=-1)  # (B, h, Tq)
    rows = ~row_blocked.any(dim=1)  # (B, Tq): PyTorch gives NaN where any head has no key left
    close(out[rows], expected[rows], dtype, factor=5.0)
    empty = row_blocked.all(dim=1)  # (B, Tq): no head sees anything: the output is out_proj's bias
    bias = ours.out_proj.bias if spec["bias"] else torch.zeros(d, dtype=dtype)
    close(out[empty], bias.detach().expand(int(empty.sum()), d), dtype)
    if spec["need_weights"]:
        assert weights.shape == (B, h, tq, tk)
        head_rows = ~row_blocked[..., None].expand(B, h, tq, tk)
        close(weights[head_rows & rows[:, None, :, None]], expected_weights[head_rows & rows[:, None, :, None]],
              dtype, factor=5.0)
        assert (weights[blocked] == 0).all()
    else:
        assert weights is None


MHA_ERRORS = ("not_divisible", "size", "dropout", "width", "batch", "kv_length", "mask_dtype", "mask_shape",
              "mask_3d_batch", "kpm_dtype", "kpm_shape")


@examples(120)
@given(spec=mha_specs(), error=st.sampled_from(MHA_ERRORS), data=st.data())
def test_multihead_rejects_invalid_inputs(spec, error, data):
    h, d, B, tq, tk, dtype = (spec[key] for key in ("num_heads", "d_model", "batch", "tq", "tk", "dtype"))
    if error == "not_divisible":
        heads = data.draw(st.integers(2, 6))
        width = heads * data.draw(st.integers(1, 4)) + data.draw(st.integers(1, heads - 1))
        with pytest.raises(INVALID):
            MultiHeadAttention(width, heads)
        return
    if error == "size":
        bad = data.draw(bad_sizes)
        with pytest.raises(INVALID):
            MultiHeadAttention(bad, h) if data.draw(st.booleans()) else MultiHeadAttention(d, bad)
        return
    if error == "dropout":
        with pytest.raises(INVALID):
            MultiHeadAttention(d, h, dropout=data.draw(st.sampled_from((-0.5, 1.0, 2, True, "0.1", None))))
        return
    module = MultiHeadAttention(d, h, bias=spec["bias"]).to(dtype)
    query, key, value = torch.randn(B, tq, d, dtype=dtype), torch.randn(B, tk, d, dtype=dtype), None
    value = torch.randn(B, tk, d, dtype=dtype)
    mask, kpm = build_mask(spec), None
    if error == "width":
        query = torch.randn(B, tq, d + 1, dtype=dtype)
    elif error == "batch":
        key, value = torch.randn(B + 1, tk, d, dtype=dtype), torch.randn(B + 1, tk, d, dtype=dtype)
    elif error == "kv_length":
        value = torch.randn(B, tk + 1, d, dtype=dtype)
    elif error == "mask_dtype":
        mask = torch.zeros(tq, tk, dtype=data.draw(st.sampled_from((torch.int64, torch.uint8, torch.int32))))
    elif error == "mask_shape":
        mask = torch.zeros(data.draw(st.sampled_from(((tq + 1, tk), (tq, tk + 1), (B, h + 1, tq, tk),
                                                      (B + 1, h, tq, tk), (2, B, h, tq, tk)))), dtype=torch.bool)
    elif error == "mask_3d_batch":
        mask = torch.zeros(B + 1, tq, tk, dtype=torch.bool)
    elif error == "kpm_dtype":
        kpm = torch.zeros(B, tk, dtype=data.draw(st.sampled_from((torch.float32, torch.int64))))
    elif error == "kpm_shape":
        kpm = torch.zeros(data.draw(st.sampled_from(((B + 1, tk), (B, tk + 1), (tk,), (B, 1, tk)))), dtype=torch.bool)
    with pytest.raises(INVALID):
        module(query, key, value, mask, key_padding_mask=kpm, need_weights=spec["need_weights"],
               is_causal=spec["is_causal"])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_multihead_rejects_key_padding_of_wrong_length(mask_dtype):
    module, x = MultiHeadAttention(4, 2), torch.randn(1, 2, 4)
    with pytest.raises(INVALID):
        module(x, x, x, torch.zeros(2, 2, dtype=mask_dtype), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))


# ---------------------------------------------------------------- EncoderBlock / DecoderBlock vs PyTorch layers


@st.composite
def block_specs(draw) -> dict:
    num_heads, batch = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    t, s = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    spec = dict(num_heads=num_heads, d_model=num_heads * draw(st.integers(1, 4)), hidden=draw(st.integers(1, 12)),
                activation=draw(st.sampled_from(("relu", "gelu"))), norm=draw(st.sampled_from(("pre", "post"))),
                batch=batch, t=t, s=s, dtype=dtype, causal=draw(st.sampled_from((None, "mask", "is_causal"))),
                lengths=draw(st.none() | st.lists(st.integers(1, s), min_size=batch, max_size=batch)),
                seed=draw(seeds))
    spec.update(draw(mask_specs((), dtype, shape=(t, t))))
    spec["memory_mask"] = draw(mask_specs((), dtype, shape=(t, s)))
    return spec


def block_masks(spec, width: int):
    """Our self-attention mask, PyTorch's (with the causal part when ours has ``is_causal=True``), a memory
    mask and a key padding mask of ``width`` keys, none blocking key 0 (PyTorch's layers give NaN in fully
    blocked rows); float ones in the model's dtype."""
    mask = build_mask(spec, keep_first_key=True)
    mask, memory_mask = (m if m is None or m.dtype == torch.bool else m.to(spec["dtype"])
                         for m in (mask, build_mask(spec["memory_mask"], keep_first_key=True)))
    torch_mask = mask
    if spec["causal"]:
        causal = hand_causal(spec["t"], spec["t"])
        torch_mask = causal if mask is None else (mask | causal if mask.dtype == torch.bool
                                                  else mask.masked_fill(causal, float("-inf")))
        if spec["causal"] == "mask":
            mask = torch_mask
    kpm = None if spec["lengths"] is None else hand_padding([min(n, width) for n in spec["lengths"]], width)
    return mask, torch_mask, memory_mask, kpm


def torch_kpm(kpm, attn_mask, dtype):
    """PyTorch wants the key padding mask of the same kind as the attention mask."""
    if kpm is None or attn_mask is None or attn_mask.dtype == torch.bool:
        return kpm
    return torch.zeros(kpm.shape, dtype=dtype).masked_fill(kpm, float("-inf"))


@examples(60)
@given(spec=block_specs())
def test_encoder_block_matches_pytorch(spec):
    d, h, dtype = spec["d_model"], spec["num_heads"], spec["dtype"]
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        reference = nn.TransformerEncoderLayer(d, h, spec["hidden"], dropout=0.0, activation=spec["activation"],
                                               batch_first=True, norm_first=spec["norm"] == "pre", dtype=dtype).eval()
        ours = EncoderBlock(d, h, spec["hidden"], activation=spec["activation"], norm=spec["norm"]).to(dtype).eval()
    perturb_vectors(reference, gen)
    ours.load_from_torch(reference)
    x = torch.randn(spec["batch"], spec["t"], d, generator=gen, dtype=dtype)
    mask, torch_mask, _, kpm = block_masks(spec, spec["t"])
    out = ours(x, mask, key_padding_mask=kpm, is_causal=spec["causal"] == "is_causal")
    expected = reference(x, src_mask=torch_mask, src_key_padding_mask=torch_kpm(kpm, torch_mask, dtype))
    assert out.shape == x.shape and out.dtype == dtype
    close(out, expected, dtype, factor=20.0)


@examples(60)
@given(spec=block_specs())
def test_decoder_block_matches_pytorch(spec):
    d, h, dtype = spec["d_model"], spec["num_heads"], spec["dtype"]
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        reference = nn.TransformerDecoderLayer(d, h, spec["hidden"], dropout=0.0, activation=spec["activation"],
                                               batch_first=True, norm_first=spec["norm"] == "pre", dtype=dtype).eval()
        ours = DecoderBlock(d, h, spec["hidden"], activation=spec["activation"], norm=spec["norm"]).to(dtype).eval()
    perturb_vectors(reference, gen)
    ours.load_from_torch(reference)
    x = torch.randn(spec["batch"], spec["t"], d, generator=gen, dtype=dtype)
    memory = torch.randn(spec["batch"], spec["s"], d, generator=gen, dtype=dtype)
    mask, torch_mask, memory_mask, kpm = block_masks(spec, spec["s"])
    out = ours(x, memory, mask, memory_mask, key_padding_mask=kpm, is_causal=spec["causal"] == "is_causal")
    expected = reference(x, memory, tgt_mask=torch_mask, memory_mask=memory_mask,
                         memory_key_padding_mask=torch_kpm(kpm, memory_mask, dtype))
    assert out.shape == x.shape and out.dtype == dtype
    close(out, expected, dtype, factor=20.0)


BLOCK_ERRORS = ("not_divisible", "norm", "activation", "hidden", "dropout", "width", "both_widths", "memory_batch",
                "mask_dtype", "mask_shape", "memory_mask_shape")


@examples(80)
@given(spec=block_specs(), decoder=st.booleans(), error=st.sampled_from(BLOCK_ERRORS), data=st.data())
def test_blocks_reject_invalid_inputs(spec, decoder, error, data):
    d, h, B, t, s = (spec[key] for key in ("d_model", "num_heads", "batch", "t", "s"))
    block_class = DecoderBlock if decoder else EncoderBlock
    kwargs = dict(hidden=spec["hidden"], activation=spec["activation"], norm=spec["norm"])
    construction = {
        "not_divisible": lambda: block_class(h * 4 + 1, h * 4 + 2, **kwargs),
        "norm": lambda: block_class(d, h, **{**kwargs, "norm": data.draw(st.sampled_from(("mid", "Pre", None, 1)))}),
        "activation": lambda: block_class(d, h, **{**kwargs, "activation": data.draw(st.sampled_from(("tanh", None)))}),
        "hidden": lambda: block_class(d, h, **{**kwargs, "hidden": data.draw(bad_sizes.filter(lambda v: v is not
                                                                                                None))}),
        "dropout": lambda: block_class(d, h, **kwargs, dropout=data.draw(st.sampled_from((-0.1, 1.0, True)))),
    }
    if error in construction:
        with pytest.raises(INVALID):
            construction[error]()
        return
    block = block_class(d, h, **kwargs)
    x, memory = torch.randn(B, t, d), torch.randn(B, s, d)
    mask = memory_mask = None
    if error in ("width", "both_widths"):  # x too wide; for "both_widths" the memory too
        x = torch.randn(B, t, d + 1)
        if error == "both_widths":
            memory = torch.randn(B, s, d + 1)
    elif error == "memory_batch":
        memory = torch.randn(B + 1, s, d)
        if not decoder:
            return  # an encoder block has no memory
    elif error == "mask_dtype":
        mask = torch.zeros(t, t, dtype=torch.int64)
    elif error == "mask_shape":
        mask = torch.zeros(t + 1, t, dtype=torch.bool)
    elif error == "memory_mask_shape":
        if not decoder:
            return
        memory_mask = torch.zeros(t, s + 1, dtype=torch.bool)
    with pytest.raises(INVALID):
        block(x, memory, mask, memory_mask) if decoder else block(x, mask)


@pytest.mark.parametrize("decoder", [False, True])
def test_pre_norm_block_rejects_wrong_width(decoder):
    x = torch.randn(1, 2, 3)  # d_model is 4
    with pytest.raises(INVALID):
        DecoderBlock(4, 2, norm="pre")(x, x) if decoder else EncoderBlock(4, 2, norm="pre")(x)


# ---------------------------------------------------------------- generate: the cache never changes the tokens


@st.composite
def gpt_specs(draw) -> dict:
    num_heads = draw(st.integers(1, 2))
    max_len = draw(st.integers(2, 12))
    prompt_len = draw(st.integers(1, max_len))
    return dict(vocab_size=draw(st.integers(2, 12)), num_heads=num_heads, d_model=num_heads * draw(st.integers(2, 4)),
                num_layers=draw(st.integers(1, 2)), max_len=max_len, norm=draw(st.sampled_from(("pre", "post"))),
                activation=draw(st.sampled_from(("relu", "gelu"))), batch=draw(st.integers(1, 3)),
                prompt_len=prompt_len, new=draw(st.integers(0, max_len - prompt_len)),
                temperature=draw(st.sampled_from((0.0, 0.0, 0.8))), seed=draw(seeds))


def build_gpt(spec: dict) -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = GPT(spec["vocab_size"], spec["d_model"], spec["num_heads"], spec["num_layers"], spec["max_len"],
                    norm=spec["norm"], activation=spec["activation"])
        with torch.no_grad():  # larger weights than the init's, so greedy choices are not near-ties
            model.token_embedding.weight.mul_(30.0)
    return model.double().eval()  # float64: cached and uncached logits agree to ~1e-15, far below any gap


@examples(50)
@given(spec=gpt_specs())
def test_generate_cached_equals_uncached(spec):
    model = build_gpt(spec)
    gen = torch.Generator().manual_seed(spec["seed"])
    prompt = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["prompt_len"]), generator=gen)
    runs = [generate(model, prompt, spec["new"], use_cache=use_cache, temperature=spec["temperature"],
                     generator=torch.Generator().manual_seed(spec["seed"]))
            for use_cache in (True, False)]
    cached, uncached = runs
    assert cached.shape == (spec["batch"], spec["prompt_len"] + spec["new"]) and cached.dtype == torch.long
    assert torch.equal(cached[:, : spec["prompt_len"]], prompt)
    assert ((cached >= 0) & (cached < spec["vocab_size"])).all()
    assert torch.equal(cached, uncached)
    if spec["temperature"] == 0:  # greedy: the argmax of the full model at every step
        tokens = prompt
        with torch.no_grad():
            for _ in range(spec["new"]):
                tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(cached, tokens)
    if spec["batch"] == 1:  # a 1-D prompt is one sequence
        assert torch.equal(generate(model, prompt[0], spec["new"], temperature=spec["temperature"],
                                    generator=torch.Generator().manual_seed(spec["seed"])), cached)


@examples(25)
@given(spec=gpt_specs(), source_len=st.integers(1, 6), padded=st.booleans())
def test_generate_encoder_decoder_cached_equals_uncached(spec, source_len, padded):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = EncoderDecoderModel(7, spec["vocab_size"], 2 * spec["d_model"], spec["num_heads"], 1,
                                    spec["num_layers"], spec["max_len"], norm=spec["norm"],
                                    activation=spec["activation"]).double().eval()
    gen = torch.Generator().manual_seed(spec["seed"])
    prompt = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["prompt_len"]), generator=gen)
    source = torch.randint(0, 7, (spec["batch"], min(source_len, spec["max_len"])), generator=gen)
    lengths = torch.randint(1, source.shape[1] + 1, (spec["batch"],), generator=gen)
    key_padding_mask = hand_padding(lengths.tolist(), source.shape[1]) if padded else None
    cached, uncached = (generate(model, prompt, spec["new"], use_cache=use_cache, source=source,
                                 key_padding_mask=key_padding_mask, temperature=spec["temperature"],
                                 generator=torch.Generator().manual_seed(spec["seed"]))
                        for use_cache in (True, False))
    assert cached.shape == (spec["batch"], spec["prompt_len"] + spec["new"])
    assert torch.equal(cached, uncached)


GENERATE_ERRORS = ("too_long", "id_too_big", "id_negative", "new_negative", "new_not_int", "temperature", "empty",
                   "three_dims", "float_prompt", "not_a_model")


@examples(60)
@given(spec=gpt_specs(), error=st.sampled_from(GENERATE_ERRORS), use_cache=st.booleans(), data=st.data())
def test_generate_rejects_invalid_inputs(spec, error, use_cache, data):
    model = build_gpt(spec)
    vocab, max_len = spec["vocab_size"], spec["max_len"]
    prompt = torch.randint(0, vocab, (spec["batch"], spec["prompt_len"]),
                           generator=torch.Generator().manual_seed(spec["seed"]))
    new, kwargs = max(1, spec["new"]) if spec["prompt_len"] < max_len else 0, {}
    if error == "too_long":
        extra = data.draw(st.integers(1, 5))
        if data.draw(st.booleans()):
            prompt = torch.zeros(spec["batch"], max_len + extra, dtype=torch.long)
            new = 0
        else:
            new = max_len - spec["prompt_len"] + extra
    elif error in ("id_too_big", "id_negative"):
        if new == 0:
            prompt, new = prompt[:, :-1], 1
            if prompt.shape[1] == 0:
                prompt = torch.zeros(spec["batch"], 1, dtype=torch.long)
        position = data.draw(st.integers(0, prompt.shape[1] - 1))
        prompt = prompt.clone()
        prompt[0, position] = vocab + data.draw(st.integers(0, 3)) if error == "id_too_big" else -1
    elif error == "new_negative":
        new = data.draw(st.integers(-5, -1))
    elif error == "new_not_int":
        new = data.draw(st.sampled_from((1.0, True, "2", None)))
    elif error == "temperature":
        kwargs["temperature"] = data.draw(st.sampled_from((-1.0, -0.1, float("nan"), float("inf"), "1")))
    elif error == "empty":
        prompt = torch.zeros(spec["batch"], 0, dtype=torch.long)
    elif error == "three_dims":
        prompt = prompt[None]
    elif error == "float_prompt":
        prompt = prompt.to(data.draw(st.sampled_from((torch.float32, torch.bool))))
    elif error == "not_a_model":
        model = model.blocks[0]
    with pytest.raises(INVALID):
        generate(model, prompt, new, use_cache=use_cache, **kwargs)


@examples(40)
@given(sizes=st.fixed_dictionaries(dict(vocab_size=st.integers(2, 9), d_model=st.integers(1, 4),
                                        num_heads=st.integers(1, 4), num_layers=st.integers(1, 2),
                                        max_len=st.integers(1, 9))),
       name=st.sampled_from(("d_model", "num_heads", "max_len", "not_divisible")), bad=bad_sizes)
def test_gpt_rejects_bad_sizes(sizes, name, bad):
    if name == "not_divisible":
        sizes["d_model"], sizes["num_heads"] = 2 * sizes["d_model"] + 1, 2  # odd width, two heads
    else:
        sizes[name] = bad
    with pytest.raises(INVALID):
        GPT(**sizes)


@pytest.mark.parametrize("prompt", [[[7]], [[-1]]])
def test_generate_checks_ids_even_without_new_tokens(prompt):
    model = GPT(5, 8, 2, 1, 8)
    with pytest.raises(INVALID):
        generate(model, prompt, 0)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("kwargs", [dict(vocab_size=0), dict(vocab_size=-1), dict(num_layers=0), dict(d_model=-2)])
def test_gpt_rejects_zero_sizes(kwargs):
    sizes = dict(vocab_size=5, d_model=8, num_heads=2, num_layers=1, max_len=8) | kwargs
    with pytest.raises(INVALID):
        GPT(**sizes)
