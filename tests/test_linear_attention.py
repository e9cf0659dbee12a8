"""Chapter 20's linear attention: the parallel and recurrent forms agree, a tiny case computed by
hand, the multi-head layer inside a decoder block, the state's size, and bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from attnbook import (
    LinearAttention,
    MultiHeadAttention,
    linear_attention,
    linear_attention_recurrent,
)
from attnbook.blocks import DecoderOnlyBlock, FeedForward
from attnbook.linear import LinearAttentionState, linear_attention_state_bytes
from torch import nn

TOL = {"atol": 1e-5, "rtol": 1e-5}


def qkv(*batch, T=7, d=4, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*batch, T, d, generator=g), torch.randn(*batch, T, d, generator=g),
            torch.randn(*batch, T, dv, generator=g))


def test_hand_computed_tiny_case():
    """relu features of non-negative inputs are the inputs: weights phi(q).phi(k) by hand."""
    q = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # q.k_0 = 1, q.k_1 = 2
    v = torch.tensor([[1.0], [4.0]])
    expected = torch.tensor([[1.0], [(1 * 1 + 2 * 4) / 3]])  # out_0 = v_0, out_1 = (v_0 + 2 v_1) / 3
    torch.testing.assert_close(linear_attention(q, k, v, feature_map="relu", eps=1e-9), expected)
    both = torch.tensor([[3.0], [3.0]])  # non-causal: every query sees both keys
    torch.testing.assert_close(
        linear_attention(q, k, v, causal=False, feature_map="relu", eps=1e-9), both)


def test_equal_features_give_the_running_mean():
    """q = k = 0 gives phi = elu(0) + 1 = 1 everywhere: uniform weights, so causal linear
    attention is the running mean of the values and the non-causal one their mean."""
    v = torch.randn(2, 5, 3)
    zeros = torch.zeros(2, 5, 4)
    running = v.cumsum(1) / torch.arange(1, 6)[:, None]
    torch.testing.assert_close(linear_attention(zeros, zeros, v, eps=1e-9), running)
    torch.testing.assert_close(linear_attention(zeros, zeros, v, causal=False, eps=1e-9),
                               v.mean(1, keepdim=True).expand(2, 5, 3))


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_parallel_equals_recurrent(feature_map):
    q, k, v = qkv(2, 3)
    parallel = linear_attention(q, k, v, feature_map=feature_map)
    recurrent, state = linear_attention_recurrent(q, k, v, feature_map=feature_map)
    torch.testing.assert_close(recurrent, parallel, **TOL)
    assert state.S.shape == (2, 3, 4, 3) and state.z.shape == (2, 3, 4)
    phi = (lambda x: F.elu(x) + 1) if feature_map == "elu" else F.relu
    torch.testing.assert_close(state.S, phi(k).transpose(-2, -1) @ v, **TOL)  # sum of phi(k_j) v_j^T
    torch.testing.assert_close(state.z, phi(k).sum(-2), **TOL)


def test_a_decode_continues_from_the_state():
    q, k, v = qkv(2, T=9)
    full = linear_attention(q, k, v)
    first, state = linear_attention_recurrent(q[:, :4], k[:, :4], v[:, :4])
    outs = [first]
    for t in range(4, 9):  # one token at a time
        out, state = linear_attention_recurrent(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                                state=state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)


def test_causal_form_matches_masked_weights_and_aligns_to_the_bottom_right():
    q, k, v = qkv(3)
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    weights = (phi_q @ phi_k.transpose(-2, -1)).tril()
    weights = weights / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(linear_attention(q, k, v, eps=1e-12), weights @ v, **TOL)
    # the last two queries alone see what they saw in the whole sequence
    torch.testing.assert_close(linear_attention(q[:, -2:], k, v), linear_attention(q, k, v)[:, -2:],
                               **TOL)
    # non-causal: the dense weights, normalised over every key
    dense = phi_q @ phi_k.transpose(-2, -1)
    torch.testing.assert_close(linear_attention(q, k, v, causal=False, eps=1e-12),
                               dense / dense.sum(-1, keepdim=True) @ v, **TOL)


def test_low_precision_keeps_the_dtype():
    q, k, v = (t.bfloat16() for t in qkv(2))
    out = linear_attention(q, k, v)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), linear_attention(*qkv(2)), atol=0.05, rtol=0.05)


def test_layer_in_a_decoder_block_is_causal_and_steps():
    torch.manual_seed(0)
    block = DecoderOnlyBlock(LinearAttention(16, 4), FeedForward(16), nn.LayerNorm(16), nn.LayerNorm(16),
                             norm_position="pre").eval()
    x = torch.randn(2, 6, 16)
    y = block(x)
    assert y.shape == (2, 6, 16)
    changed = x.clone()
    changed[:, -1] += 1.0  # the last token changes: no earlier output may
    torch.testing.assert_close(block(changed)[:, :-1], y[:, :-1])
    y.sum().backward()  # it trains
    assert all(p.grad is not None for p in block.self_attention.parameters())
    # step (recurrent, in two chunks) equals forward's causal form
    layer = block.self_attention
    with torch.no_grad():
        full, _ = layer(x, x, x, is_causal=True)
        first, state = layer.step(x[:, :4])
        rest, state = layer.step(x[:, 4:], state)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, **TOL)
    assert isinstance(state, LinearAttentionState) and state.S.shape == (2, 4, 4, 4)


def test_projections_are_those_of_multi_head_attention():
    mha, lin = MultiHeadAttention(16, 4), LinearAttention(16, 4)
    lin.load_state_dict(mha.state_dict())  # same names, same shapes
    assert sum(p.numel() for p in lin.parameters()) == 4 * (16 * 16 + 16)


def test_state_size_does_not_depend_on_the_length():
    assert linear_attention_state_bytes(4, 3) == (4 * 3 + 4) * 4
    assert linear_attention_state_bytes(64, 64, batch_size=8, dtype=torch.bfloat16) == 8 * (
        64 * 64 + 64) * 2
    layer = LinearAttention(16, 4)
    for T in (1, 5, 12):
        _, state = layer.step(torch.randn(3, T, 16))
        assert state.S.nbytes + state.z.nbytes == layer.state_bytes(3) == 3 * 4 * (16 + 4) * 4


def test_bad_inputs_are_named():
    q, k, v = qkv(2)
    with pytest.raises(ValueError, match="same number of tokens"):
        linear_attention(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="same feature size"):
        linear_attention(q[..., :3], k, v)
    with pytest.raises(ValueError, match=r"\['elu', 'relu'\].*'softmax'"):
        linear_attention(q, k, v, feature_map="softmax")
    with pytest.raises(ValueError, match="eps"):
        linear_attention(q, k, v, eps=0)
    with pytest.raises(ValueError, match="one query per key"):
        linear_attention_recurrent(q[:, :3], k, v)
    with pytest.raises(ValueError, match="state must be"):
        linear_attention_recurrent(q, k, v, state=LinearAttentionState(torch.zeros(2, 4, 4),
                                                                       torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="divisible"):
        LinearAttention(10, 4)
    with pytest.raises(ValueError, match="feature_map"):
        LinearAttention(16, 4, feature_map="cos")
    layer, x = LinearAttention(16, 4), torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="no mask"):
        layer(x, x, x, torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="d_model=16"):
        layer(x[..., :8], x, x)
