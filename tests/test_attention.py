import math

import pytest
import torch
import torch.nn.functional as F
from attnbook import (
    AdditiveAttention,
    causal_mask,
    masked_softmax,
    memory_efficient_attention,
    padding_mask,
    scaled_dot_product_attention,
)

SHAPES = [  # (batch dims, Tq, Tk, d, dv)
    ((), 1, 1, 1, 1),
    ((), 3, 3, 2, 2),
    ((2,), 5, 7, 8, 3),
    ((2, 3), 4, 9, 16, 16),
    ((1, 2, 2), 6, 2, 5, 11),
]


def reference(q, k, v, mask=None):
    """PyTorch's fused attention, fed our mask convention (True = blocked)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = ~mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("batch, tq, tk, d, dv", SHAPES)
def test_matches_pytorch_without_mask(batch, tq, tk, d, dv):
    torch.manual_seed(0)
    q, k, v = torch.randn(*batch, tq, d), torch.randn(*batch, tk, d), torch.randn(*batch, tk, dv)
    out, weights = scaled_dot_product_attention(q, k, v)
    assert out.shape == (*batch, tq, dv) and weights.shape == (*batch, tq, tk)
    torch.testing.assert_close(out, reference(q, k, v), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(*batch, tq))
    fast, none = scaled_dot_product_attention(q, k, v, need_weights=False)
    assert none is None
    torch.testing.assert_close(fast, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_shape", [(4, 6), (1, 6), (2, 1, 4, 6), (3, 4, 6), (2, 3, 1, 6)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_matches_pytorch_with_broadcast_masks(mask_shape, kind):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 5)
    mask = torch.rand(mask_shape) < 0.4
    mask[..., 0] = False  # keep one key per row so the reference has no fully blocked row
    if kind == "float":
        mask = torch.randn(mask_shape).masked_fill(mask, float("-inf"))
    expected = reference(q, k, v, mask)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    fast, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=False)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    if kind == "bool":
        assert bool((weights.masked_select(mask.expand_as(weights)) == 0).all())


def test_brief_worked_example():
    X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    out, weights = scaled_dot_product_attention(X, X, X, causal_mask(3))
    expected_weights = torch.tensor([[1.0, 0.0, 0.0], [0.330, 0.670, 0.0], [0.248, 0.248, 0.503]])
    expected_out = torch.tensor([[1.0, 0.0], [0.330, 0.670], [0.752, 0.752]])
    torch.testing.assert_close(weights, expected_weights, atol=6e-4, rtol=0)
    torch.testing.assert_close(out, expected_out, atol=6e-4, rtol=0)
    # exact values from the formula
    e = math.exp(1 / math.sqrt(2))
    assert weights[1, 1].item() == pytest.approx(e / (1 + e), abs=1e-6)
    assert weights[2, 2].item() == pytest.approx(e / (2 + e), abs=1e-6)


def test_fully_blocked_row_gives_zeros_not_nan():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    mask = torch.zeros(2, 3, 5, dtype=torch.bool)
    mask[0, 1] = True  # query 1 of batch 0 sees nothing
    for need_weights in (True, False):
        out, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
        assert torch.isfinite(out).all()
        assert torch.equal(out[0, 1], torch.zeros(6))
        if need_weights:
            assert torch.equal(weights[0, 1], torch.zeros(5))
            torch.testing.assert_close(weights[1].sum(-1), torch.ones(3))
    float_mask = torch.zeros(3, 5).masked_fill(mask[0], float("-inf"))
    out, weights = scaled_dot_product_attention(q, k, v, float_mask)
    assert torch.equal(out[0, 1], torch.zeros(6)) and torch.isfinite(out).all()


def test_masked_softmax_rows_sum_to_one_or_zero():
    scores = torch.randn(4, 6)
    mask = padding_mask([6, 3, 1, 0], max_len=6)
    weights = masked_softmax(scores, mask)
    torch.testing.assert_close(weights.sum(-1), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert bool((weights[mask] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_scores_stay_finite(dtype):
    # scores of +-1e4: q . k / sqrt(d) with d = 4 and entries 100 -> 4 * 100 * 100 / 2 = 2e4
    q = torch.full((1, 2, 4), 100.0, dtype=dtype)
    q[0, 1] = -100.0
    k = torch.full((1, 3, 4), 100.0, dtype=dtype)
    k[0, 2] = -100.0
    v = torch.randn(1, 3, 2).to(dtype)
    out, weights = scaled_dot_product_attention(q, k, v, causal_mask(3)[:2])
    assert out.dtype == dtype and weights.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(1, 2), atol=1e-2, rtol=0)
    scores = torch.tensor([[1e4, -1e4, 0.0]], dtype=dtype)
    assert torch.isfinite(masked_softmax(scores)).all()


def test_bad_inputs_raise_clear_errors():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        scaled_dot_product_attention(q, k, v, torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 4\).*\(2, 3, 5\)"):
        scaled_dot_product_attention(q, k, v, torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"same feature size d.*\(2, 5, 3\)"):
        scaled_dot_product_attention(q, torch.randn(2, 5, 3), v)
    with pytest.raises(ValueError, match=r"at least 2 dims.*\(4,\)"):
        scaled_dot_product_attention(torch.randn(4), k, v)
    with pytest.raises(ValueError, match="same number of tokens"):
        scaled_dot_product_attention(q, k, torch.randn(2, 4, 6))
    with pytest.raises(ValueError, match="do not broadcast"):
        scaled_dot_product_attention(q, torch.randn(3, 5, 4), torch.randn(3, 5, 6))
    with pytest.raises(TypeError, match="floating-point"):
        scaled_dot_product_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        scaled_dot_product_attention(q, k, v, [[True]])


def test_additive_attention_with_different_query_and_key_sizes():
    torch.manual_seed(0)
    attention = AdditiveAttention(query_size=20, key_size=2, hidden_size=8)
    q, k, v = torch.randn(2, 1, 20), torch.randn(2, 10, 2), torch.randn(2, 10, 4)
    mask = padding_mask([2, 6], max_len=10)[:, None, :]
    with torch.no_grad():
        out, weights = attention(q, k, v, mask)
    assert out.shape == (2, 1, 4) and weights.shape == (2, 1, 10)
    # the formula w_v^T tanh(W_q q + W_k k), written out for each unpadded key of sequence 1
    W_q, W_k, w_v = attention.W_q.weight.detach(), attention.W_k.weight.detach(), attention.w_v.weight.detach()
    scores = torch.stack([(w_v @ torch.tanh(W_q @ q[1, 0] + W_k @ k[1, j])).squeeze() for j in range(6)])
    torch.testing.assert_close(weights[1, 0, :6], torch.softmax(scores, 0))
    assert bool((weights[1, 0, 6:] == 0).all())
    torch.testing.assert_close(out[1, 0], weights[1, 0] @ v[1])
    with pytest.raises(ValueError, match="query must end in 20"):
        attention(torch.randn(2, 1, 3), k, v)
    with pytest.raises(ValueError, match="key must end in 2"):
        attention(q, torch.randn(2, 10, 3), v)
    with pytest.raises(ValueError, match="hidden_size"):
        AdditiveAttention(2, 2, 0)


@pytest.mark.parametrize("tq, tk, block", [(16, 16, 4), (10, 13, 4), (7, 30, 8), (33, 5, 1), (5, 5, 64)])
@pytest.mark.parametrize("masked", [None, "causal", "random", "float"])
def test_memory_efficient_attention_equals_naive(tq, tk, block, masked):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 3, tq, 8), torch.randn(2, 3, tk, 8), torch.randn(2, 3, tk, 6)
    mask = None
    if masked == "causal":
        mask = torch.ones(tq, tk, dtype=torch.bool).triu(1)
    elif masked == "random":
        mask = torch.rand(2, 1, tq, tk) < 0.5
        mask[0, 0, 0] = True  # a fully blocked row
    elif masked == "float":
        mask = torch.randn(tq, tk)
    expected, _ = scaled_dot_product_attention(q, k, v, mask)
    out = memory_efficient_attention(q, k, v, mask, block_size=block)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_memory_efficient_attention_bad_block_size():
    q = torch.randn(4, 2)
    with pytest.raises(ValueError, match="block_size"):
        memory_efficient_attention(q, q, q, block_size=0)


# ----------------------------------------------------------------------------- is_causal, numerics (issue 12)


def bottom_right_causal(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1)


@pytest.mark.parametrize("tq, tk", [(1, 1), (6, 6), (3, 8), (1, 5), (8, 3)])
@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal_equals_the_explicit_causal_mask(tq, tk, need_weights):
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 3, tq, 8), torch.randn(2, 3, tk, 8), torch.randn(2, 3, tk, 5)
    explicit, _ = scaled_dot_product_attention(q, k, v, bottom_right_causal(tq, tk))
    flagged, weights = scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=need_weights)
    torch.testing.assert_close(flagged, explicit, atol=1e-5, rtol=1e-5)
    if tq == tk:  # square: PyTorch's is_causal (top left) is the same mask
        torch.testing.assert_close(flagged, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                   atol=1e-5, rtol=1e-5)
    padding = torch.zeros(2, 1, 1, tk, dtype=torch.bool)
    padding[1, ..., 0] = True
    both, _ = scaled_dot_product_attention(q, k, v, padding, is_causal=True, need_weights=need_weights)
    expected, _ = scaled_dot_product_attention(q, k, v, padding | bottom_right_causal(tq, tk))
    torch.testing.assert_close(both, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tq, tk, block, query_block", [(16, 16, 4, None), (10, 13, 4, 3), (7, 30, 8, 16),
                                                        (33, 5, 2, 7), (64, 64, 16, 32), (9, 4, 3, 2)])
def test_memory_efficient_is_causal_equals_the_explicit_mask(tq, tk, block, query_block):
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 3, tq, 8), torch.randn(2, 3, tk, 8), torch.randn(2, 3, tk, 6)
    expected, _ = scaled_dot_product_attention(q, k, v, bottom_right_causal(tq, tk))
    out = memory_efficient_attention(q, k, v, is_causal=True, block_size=block, query_block_size=query_block)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    padding = torch.rand(2, 1, 1, tk) < 0.3
    expected, _ = scaled_dot_product_attention(q, k, v, padding | bottom_right_causal(tq, tk))
    out = memory_efficient_attention(q, k, v, padding, is_causal=True, block_size=block, query_block_size=query_block)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_memory_efficient_skips_future_blocks():
    """With is_causal, the key blocks after a query block's last token are never multiplied."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(1, 1, 64, 8) for _ in range(3))
    counts = {}
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            memory_efficient_attention(q, k, v, is_causal=causal, block_size=16)
        counts[causal] = counter.get_total_flops()
    # 4 x 4 blocks, of which 1 + 2 + 3 + 4 = 10 are computed with the causal mask; the FLOPs of the naive version
    assert counts[False] == 4 * 64 * 64 * 8
    assert counts[True] * 16 == counts[False] * 10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_memory_efficient_low_precision(dtype):
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 40, 16).to(dtype) for _ in range(3))
    out = memory_efficient_attention(q, k, v, is_causal=True, block_size=16)
    assert out.dtype == dtype
    expected, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_masked_softmax_without_mask_is_softmax():
    scores = torch.randn(3, 4, 5)
    torch.testing.assert_close(masked_softmax(scores), torch.softmax(scores, -1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_gradients_through_a_fully_blocked_row_are_finite(dtype, kind, need_weights):
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 4, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    blocked = torch.zeros(4, 4, dtype=torch.bool)
    blocked[1] = True  # query 1 sees nothing
    blocked[2, 0] = True
    mask = blocked if kind == "bool" else torch.zeros(4, 4).masked_fill(blocked, float("-inf"))
    out, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    assert bool((out[:, 1] == 0).all())
    out.float().pow(2).sum().backward()
    for t in (q, k, v):
        assert bool(torch.isfinite(t.grad).all())
    assert bool((q.grad[:, 1] == 0).all())  # the blocked query has no influence on anything
    if dtype == torch.float32:  # gradients of the other rows as without the blocked row
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        keep = torch.tensor([0, 2, 3])
        ref = F.scaled_dot_product_attention(q2[:, keep], k2, v2, attn_mask=~blocked[keep])
        ref.pow(2).sum().backward()
        torch.testing.assert_close(k.grad, k2.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.grad, v2.grad, atol=1e-5, rtol=1e-5)


def test_masked_softmax_gradient_finite_for_float_mask():
    scores = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    mask[0] = float("-inf")
    weights = masked_softmax(scores, mask)
    (weights * torch.randn(3, 4)).sum().backward()
    assert bool(torch.isfinite(scores.grad).all()) and bool((scores.grad[0] == 0).all())


def test_fully_blocked_row_decided_after_the_cast_to_the_query_dtype():
    """-1e5 is finite in fp32 but -inf in fp16: a row of it is blocked for fp16 queries, on both paths."""
    q, k, v = (torch.randn(1, 3, 4).half() for _ in range(3))
    mask = torch.zeros(3, 3)
    mask[0] = -1e5
    for need_weights in (True, False):
        out, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
        assert bool(torch.isfinite(out).all()) and bool((out[:, 0] == 0).all())
    assert bool((memory_efficient_attention(q, k, v, mask)[:, 0] == 0).all())


def test_dtype_and_device_mismatch_errors_name_both():
    q = torch.randn(2, 3, 4)
    with pytest.raises(TypeError, match="q is torch.float32 but k is torch.float64"):
        scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(TypeError, match="q is torch.float32 but v is torch.float16"):
        memory_efficient_attention(q, q, q.half())
    meta = torch.randn(2, 3, 4, device="meta")
    with pytest.raises(ValueError, match="q is on cpu but k is on meta"):
        scaled_dot_product_attention(q, meta, q)
    with pytest.raises(ValueError, match="mask is on meta but q is on cpu"):
        scaled_dot_product_attention(q, q, q, torch.zeros(3, 3, dtype=torch.bool, device="meta"))


def test_dropout_weights_are_returned_after_dropout():
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 5, 4) for _ in range(3))
    torch.manual_seed(8)
    out, weights = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(out, weights @ v)
    assert bool((weights == 0).any())  # some weights dropped, the rest scaled by 2
    plain, clean = scaled_dot_product_attention(q, k, v)
    kept = weights != 0
    torch.testing.assert_close(weights[kept], 2 * clean[kept])
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.0)
