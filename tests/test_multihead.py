"""MultiHeadAttention, its head split/merge, the KV cache, the wide and rotary variants,
each checked against nn.MultiheadAttention or a value computed by hand."""

import re

import pytest
import torch
from attnbook import (
    KVCache,
    MultiHeadAttention,
    RotaryMultiHeadAttention,
    WideMultiHeadAttention,
    causal_mask,
    merge_heads,
    padding_mask,
    split_heads,
)
from attnbook.multihead import attention_mask_for_heads
from torch import nn

TOL = {"atol": 1e-5, "rtol": 1e-5}


def pair(d_model, num_heads, bias=True, seed=0):
    """An nn.MultiheadAttention (random weights and biases) and our module with its weights copied."""
    torch.manual_seed(seed)
    reference = nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True).eval()
    if bias:  # nn initialises the biases to zero: make them random so copying them is tested
        with torch.no_grad():
            reference.in_proj_bias.normal_()
            reference.out_proj.bias.normal_()
    ours = MultiHeadAttention(d_model, num_heads, bias=bias).eval().load_from_torch(reference)
    return reference, ours


def compare(reference, ours, query, key, value, mask=None, key_padding_mask=None, reference_mask=None):
    """Outputs and per-head weights of both modules, then our fast path, all equal to 1e-5."""
    reference_mask = mask if reference_mask is None else reference_mask
    reference_padding = key_padding_mask
    if key_padding_mask is not None and reference_mask is not None and reference_mask.is_floating_point():
        # nn wants both masks of one type; ours takes a bool key padding mask with a float mask
        reference_padding = torch.zeros(key_padding_mask.shape).masked_fill(key_padding_mask, float("-inf"))
    expected, expected_weights = reference(
        query, key, value, attn_mask=reference_mask, key_padding_mask=reference_padding,
        need_weights=True, average_attn_weights=False,
    )
    out, weights = ours(query, key, value, mask, key_padding_mask=key_padding_mask)
    B, h, Tq, Tk = query.shape[0], ours.num_heads, query.shape[1], key.shape[1]
    assert out.shape == (B, Tq, ours.d_model) and weights.shape == (B, h, Tq, Tk)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, h, Tq), **TOL)
    fast, none = ours(query, key, value, mask, key_padding_mask=key_padding_mask, need_weights=False)
    assert none is None
    torch.testing.assert_close(fast, expected, **TOL)
    return weights


# ---------------------------------------------------------------------------------------------
# equality with nn.MultiheadAttention


@pytest.mark.parametrize("d_model, num_heads", [(8, 1), (8, 2), (12, 3), (16, 4), (32, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_matches_nn(d_model, num_heads, bias):
    reference, ours = pair(d_model, num_heads, bias)
    x = torch.randn(3, 5, d_model)
    with torch.no_grad():
        compare(reference, ours, x, x, x)


@pytest.mark.parametrize("tq, tk", [(1, 7), (4, 9), (6, 2)])
def test_cross_attention_matches_nn(tq, tk):
    reference, ours = pair(16, 4)
    query, memory = torch.randn(2, tq, 16), torch.randn(2, tk, 16)
    with torch.no_grad():
        compare(reference, ours, query, memory, memory)
        # key and value need not be the same tensor
        compare(reference, ours, query, memory, torch.randn(2, tk, 16))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_causal_mask_matches_nn(num_heads):
    reference, ours = pair(16, num_heads)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        weights = compare(reference, ours, x, x, x, causal_mask(6))
    assert bool((weights[..., causal_mask(6)] == 0).all())  # nothing from the future


def test_key_padding_mask_matches_nn():
    reference, ours = pair(16, 4)
    query, memory = torch.randn(3, 4, 16), torch.randn(3, 7, 16)
    key_padding_mask = padding_mask([7, 3, 1])
    with torch.no_grad():
        weights = compare(reference, ours, query, memory, memory, key_padding_mask=key_padding_mask)
    assert bool((weights.masked_select(key_padding_mask[:, None, None, :].expand_as(weights)) == 0).all())


def test_causal_and_key_padding_masks_together_match_nn():
    reference, ours = pair(16, 2)
    x = torch.randn(3, 6, 16)
    with torch.no_grad():
        compare(reference, ours, x, x, x, causal_mask(6), key_padding_mask=padding_mask([6, 4, 2]))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_3d_per_batch_mask_matches_nn(kind):
    """Our (B, Tq, Tk) mask is the same for every head; nn wants (B*h, Tq, Tk), batch-major."""
    num_heads = 4
    reference, ours = pair(16, num_heads)
    query, memory = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    mask = torch.rand(3, 5, 7) < 0.5
    mask[..., 0] = False  # every query keeps a key (nn gives NaN for a fully blocked row)
    if kind == "float":
        mask = torch.randn(3, 5, 7).masked_fill(mask, float("-inf"))
    with torch.no_grad():
        compare(reference, ours, query, memory, memory, mask,
                reference_mask=mask.repeat_interleave(num_heads, dim=0))
        # and combined with a key padding mask
        key_padding_mask = padding_mask([7, 5, 2])
        compare(reference, ours, query, memory, memory, mask, key_padding_mask=key_padding_mask,
                reference_mask=mask.repeat_interleave(num_heads, dim=0))


def test_4d_per_head_mask_matches_nn():
    num_heads = 2
    reference, ours = pair(8, num_heads)
    x = torch.randn(2, 5, 8)
    mask = torch.rand(2, num_heads, 5, 5) < 0.5
    mask[..., 0] = False
    with torch.no_grad():
        compare(reference, ours, x, x, x, mask, reference_mask=mask.reshape(2 * num_heads, 5, 5))


def test_float_mask_matches_nn():
    reference, ours = pair(16, 4)
    x = torch.randn(2, 5, 16)
    float_mask = torch.randn(5, 5)  # added to the scores
    with torch.no_grad():
        compare(reference, ours, x, x, x, float_mask)
        causal_float = torch.zeros(5, 5).masked_fill(causal_mask(5), float("-inf"))
        compare(reference, ours, x, x, x, causal_float)
        compare(reference, ours, x, x, x, causal_float, key_padding_mask=padding_mask([5, 3]))


def test_mask_shapes_broadcast_to_heads():
    B, h, Tq, Tk = 2, 3, 4, 5
    two_d, three_d, four_d = torch.zeros(Tq, Tk).bool(), torch.zeros(B, Tq, Tk).bool(), torch.zeros(B, h, Tq, Tk).bool()
    assert attention_mask_for_heads(None, None, B, Tq, Tk) is None
    assert attention_mask_for_heads(two_d, None, B, Tq, Tk).shape == (Tq, Tk)
    assert attention_mask_for_heads(three_d, None, B, Tq, Tk).shape == (B, 1, Tq, Tk)
    assert attention_mask_for_heads(four_d, None, B, Tq, Tk).shape == (B, h, Tq, Tk)
    kpm = padding_mask([5, 2])
    combined = attention_mask_for_heads(two_d, kpm, B, Tq, Tk)
    assert combined.shape == (B, 1, Tq, Tk)
    assert torch.equal(combined[1, 0], kpm[1].expand(Tq, Tk))
    float_combined = attention_mask_for_heads(torch.zeros(Tq, Tk), kpm, B, Tq, Tk)
    assert float_combined.dtype == torch.float32
    assert torch.equal(torch.isinf(float_combined[1, 0]), kpm[1].expand(Tq, Tk))
    with pytest.raises(ValueError, match=r"3-D mask.*B=2.*\(3, 4, 5\)"):
        attention_mask_for_heads(torch.zeros(3, Tq, Tk).bool(), None, B, Tq, Tk)
    with pytest.raises(ValueError, match="key_padding_mask.*torch.float32"):
        attention_mask_for_heads(None, torch.zeros(B, Tk), B, Tq, Tk)
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(3, 5\)"):
        attention_mask_for_heads(None, torch.zeros(3, Tk).bool(), B, Tq, Tk)


def test_a_padding_mask_passed_as_mask_is_refused():
    """A (B, Tk) padding mask is not a (Tq, Tk) mask: it must go in key_padding_mask. Before, it failed deep in
    the broadcast check (B != Tq) with no hint, or was silently read as (Tq, Tk) when it happened to fit."""
    B, Tq, Tk, d = 2, 3, 5, 8
    attention = MultiHeadAttention(d, 2)
    x, memory = torch.randn(B, Tq, d), torch.randn(B, Tk, d)
    padding = padding_mask([5, 3])  # (B, Tk)
    with pytest.raises(ValueError, match=r"2-D mask is \(Tq, Tk\) = \(3, 5\).*key_padding_mask"):
        attention(x, memory, memory, padding)
    out, _ = attention(x, memory, memory, key_padding_mask=padding)  # the right way
    assert out.shape == (B, Tq, d)
    attention(x, memory, memory, torch.zeros(1, Tk, dtype=torch.bool))  # (1, Tk) broadcasts over queries
    attention(x, memory, memory, torch.zeros(Tq, 1, dtype=torch.bool))


def test_matches_nn_at_a_realistic_size():
    reference, ours = pair(96, 12)
    x = torch.randn(2, 10, 96)
    with torch.no_grad():
        compare(reference, ours, x, x, x, causal_mask(10))


def test_gradients_flow_like_nn():
    reference, ours = pair(16, 4)
    x = torch.randn(2, 5, 16)
    reference(x, x, x, attn_mask=causal_mask(5))[0].square().sum().backward()
    ours(x, x, x, causal_mask(5))[0].square().sum().backward()
    q_grad, k_grad, v_grad = reference.in_proj_weight.grad.chunk(3)
    torch.testing.assert_close(ours.q_proj.weight.grad, q_grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.k_proj.weight.grad, k_grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.v_proj.weight.grad, v_grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.out_proj.weight.grad, reference.out_proj.weight.grad, atol=1e-4, rtol=1e-4)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    attention.eval()
    with torch.no_grad():
        first, _ = attention(x, x, x)
        torch.testing.assert_close(attention(x, x, x)[0], first)
        attention.train()
        assert not torch.allclose(attention(x, x, x)[0], first)


def test_fixed_submodule_names():
    attention = MultiHeadAttention(16, 4)
    assert {name for name, _ in attention.named_children()} == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert all(isinstance(getattr(attention, name), nn.Linear) for name in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert attention.head_dim == 4


# ---------------------------------------------------------------------------------------------
# parameter counts


def count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("d_model", [96, 768])
@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 12])
def test_parameter_count_is_independent_of_heads(d_model, num_heads):
    attention = MultiHeadAttention(d_model, num_heads)
    assert count(attention) == 4 * (d_model**2 + d_model)
    assert count(MultiHeadAttention(d_model, num_heads, bias=False)) == 4 * d_model**2
    reference = nn.MultiheadAttention(d_model, num_heads, batch_first=True)
    assert count(attention) == count(reference)


def test_parameter_count_of_the_paper_layer():
    assert count(MultiHeadAttention(512, 8)) == 1_050_624  # 4 * (512^2 + 512)


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 12])
def test_wide_parameter_count_grows_with_heads(num_heads):
    d = 96
    assert count(WideMultiHeadAttention(d, num_heads)) == 4 * num_heads * d**2 + 3 * num_heads * d + d
    if num_heads > 1:
        assert count(WideMultiHeadAttention(d, num_heads)) > count(WideMultiHeadAttention(d, num_heads // 2))
        assert count(WideMultiHeadAttention(d, num_heads)) > count(MultiHeadAttention(d, num_heads))
    else:
        assert count(WideMultiHeadAttention(d, 1)) == count(MultiHeadAttention(d, 1))


# ---------------------------------------------------------------------------------------------
# the wide variant


def test_wide_equals_independent_full_width_heads():
    """Each of the h heads projects to the full d, attends, and out_proj mixes their concatenation."""
    torch.manual_seed(0)
    d, h = 8, 3
    wide = WideMultiHeadAttention(d, h).eval()
    query, memory = torch.randn(2, 4, d), torch.randn(2, 6, d)
    mask = causal_mask(6)[:4]
    with torch.no_grad():
        out, weights = wide(query, memory, memory, mask)
        heads = []
        for i in range(h):
            rows = slice(i * d, (i + 1) * d)
            q = query @ wide.q_proj.weight[rows].T + wide.q_proj.bias[rows]
            k = memory @ wide.k_proj.weight[rows].T + wide.k_proj.bias[rows]
            v = memory @ wide.v_proj.weight[rows].T + wide.v_proj.bias[rows]
            scores = (q @ k.transpose(1, 2) / d**0.5).masked_fill(mask, float("-inf"))
            w = scores.softmax(-1)
            torch.testing.assert_close(weights[:, i], w, **TOL)
            heads.append(w @ v)
        expected = wide.out_proj(torch.cat(heads, dim=-1))
    assert out.shape == (2, 4, d) and weights.shape == (2, h, 4, 6)
    torch.testing.assert_close(out, expected, **TOL)
    fast, none = wide(query, memory, memory, mask, need_weights=False)
    assert none is None
    torch.testing.assert_close(fast, expected, **TOL)


def test_wide_with_key_padding_mask():
    torch.manual_seed(0)
    wide = WideMultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        _, weights = wide(x, x, x, key_padding_mask=padding_mask([5, 2]))
    assert bool((weights[1, :, :, 2:] == 0).all())
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5))


# ---------------------------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize("d_model, num_heads", [(10, 3), (768, 7), (96, 5)])
def test_indivisible_heads_raise_naming_both(d_model, num_heads):
    with pytest.raises(ValueError, match=rf"d_model={d_model}.*num_heads={num_heads}"):
        MultiHeadAttention(d_model, num_heads)


@pytest.mark.parametrize("d_model, num_heads", [(0, 1), (8, 0), (-8, 2), (8.0, 2), (8, "2")])
def test_non_positive_or_non_int_sizes_raise(d_model, num_heads):
    with pytest.raises(ValueError, match="must be a positive int"):
        MultiHeadAttention(d_model, num_heads)


def test_wrong_d_model_raises_with_shape():
    attention = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"query.*d_model=16.*\(2, 5, 12\)"):
        attention(torch.randn(2, 5, 12), x, x)
    with pytest.raises(ValueError, match=r"key.*d_model=16.*\(2, 5, 8\)"):
        attention(x, torch.randn(2, 5, 8), x)
    with pytest.raises(ValueError, match=r"value.*d_model=16.*\(2, 5, 15\)"):
        attention(x, x, torch.randn(2, 5, 15))
    with pytest.raises(ValueError, match=r"query.*\(5, 16\)"):  # missing batch dimension
        attention(torch.randn(5, 16), x, x)


def test_mismatched_batch_raises():
    attention = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="batch size.*2, 3, 3"):
        attention(torch.randn(2, 5, 16), torch.randn(3, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match="batch size.*2, 2, 1"):
        attention(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(1, 5, 16))


def test_mismatched_key_value_length_raises():
    attention = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="key and value.*same length.*7 and 6"):
        attention(torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.randn(2, 6, 16))


def test_bad_mask_raises():
    attention = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"\(5, 4\)"):
        attention(x, x, x, torch.zeros(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="int64"):
        attention(x, x, x, torch.zeros(5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(x, x, x, key_padding_mask=torch.zeros(3, 5, dtype=torch.bool))


@pytest.mark.parametrize("embed_dim, num_heads", [(32, 4), (16, 2), (16, 8)])
def test_load_from_torch_with_wrong_sizes_raises(embed_dim, num_heads):
    ours = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=rf"embed_dim={embed_dim}, num_heads={num_heads}.*d_model=16, num_heads=4"):
        ours.load_from_torch(nn.MultiheadAttention(embed_dim, num_heads, batch_first=True))


def test_load_from_torch_with_separate_key_value_sizes_raises():
    ours = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="kdim == vdim == embed_dim"):
        ours.load_from_torch(nn.MultiheadAttention(16, 4, kdim=8, vdim=8, batch_first=True))


@pytest.mark.parametrize("extra", [{"add_bias_kv": True}, {"add_zero_attn": True}])
def test_load_from_torch_refuses_an_extra_key_and_value(extra):
    """add_bias_kv / add_zero_attn append a key and value this module does not have: copying the other weights
    would give outputs about 0.1 off without a word, so the copy is refused."""
    reference = nn.MultiheadAttention(16, 4, batch_first=True, **extra)
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        MultiHeadAttention(16, 4).load_from_torch(reference)


def test_load_from_torch_copies_every_weight():
    reference, ours = pair(16, 4)
    q, k, v = reference.in_proj_weight.chunk(3)
    qb, kb, vb = reference.in_proj_bias.chunk(3)
    assert torch.equal(ours.q_proj.weight, q) and torch.equal(ours.q_proj.bias, qb)
    assert torch.equal(ours.k_proj.weight, k) and torch.equal(ours.k_proj.bias, kb)
    assert torch.equal(ours.v_proj.weight, v) and torch.equal(ours.v_proj.bias, vb)
    assert torch.equal(ours.out_proj.weight, reference.out_proj.weight)
    assert torch.equal(ours.out_proj.bias, reference.out_proj.bias)
    # a copy, not a shared tensor
    assert ours.q_proj.weight.data_ptr() != reference.in_proj_weight.data_ptr()


# ---------------------------------------------------------------------------------------------
# split_heads / merge_heads


@pytest.mark.parametrize("B, T, d, h", [(1, 1, 4, 1), (2, 5, 12, 3), (3, 7, 16, 4), (2, 4, 8, 8)])
def test_split_and_merge_are_inverse(B, T, d, h):
    x = torch.randn(B, T, d)
    heads = split_heads(x, h)
    assert heads.shape == (B, h, T, d // h)
    assert torch.equal(heads, x.view(B, T, h, d // h).transpose(1, 2))
    assert torch.equal(merge_heads(heads), x)
    y = torch.randn(B, h, T, d // h)
    assert torch.equal(split_heads(merge_heads(y), h), y)


def test_split_heads_slices_each_token_vector():
    B, T, d, h = 2, 3, 8, 4
    x = torch.randn(B, T, d)
    heads = split_heads(x, h)
    for head in range(h):
        for t in range(T):
            assert torch.equal(heads[:, head, t], x[:, t, head * 2 : (head + 1) * 2])


def test_naive_view_differs_and_mixes_tokens():
    """view(B, h, T, d/h) reinterprets memory: a head's "tokens" are slices of several real tokens."""
    B, T, d, h = 1, 4, 8, 2
    # encode every entry as 100 * token + feature, so each value names where it came from
    x = (100 * torch.arange(T)[:, None] + torch.arange(d)[None, :]).float().expand(B, T, d)
    right = split_heads(x.contiguous(), h)
    naive = x.contiguous().view(B, h, T, d // h)
    assert right.shape == naive.shape
    assert not torch.equal(right, naive)
    # the right split: every row of every head comes from one token
    assert all(len(set((right[0, i, t] // 100).tolist())) == 1 for i in range(h) for t in range(T))
    assert set((right[0, 0] // 100).flatten().tolist()) == {0, 1, 2, 3}  # head 0 sees all 4 tokens
    # the naive view: head 0 holds only tokens 0 and 1 (all 8 features each), head 1 tokens 2 and 3
    assert set((naive[0, 0] // 100).flatten().tolist()) == {0, 1}
    assert set((naive[0, 1] // 100).flatten().tolist()) == {2, 3}
    # and "token" 1 of naive head 0 is really features 4..7 of token 0: features of a token split over rows
    assert torch.equal(naive[0, 0, 1], x[0, 0, 4:])


def test_naive_split_changes_the_attention_output():
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 2).eval()

    def naive(x):  # the wrong split, view(B, h, T, d/h), and its mirror image for the merge
        q, k, v = (proj(x).view(1, 2, 4, 4) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
        w = (q @ k.transpose(-1, -2) / 2).masked_fill(causal_mask(4), float("-inf")).softmax(-1)
        return attention.out_proj((w @ v).reshape(1, 4, 8))

    x = torch.randn(1, 4, 8)
    x2 = x.clone()
    x2[0, 0] += 1.0  # change token 0 only
    with torch.no_grad():
        right, right2 = attention(x, x, x, causal_mask(4))[0], attention(x2, x2, x2, causal_mask(4))[0]
        wrong, wrong2 = naive(x), naive(x2)
    assert (right - wrong).abs().max() > 1e-2
    # token 2 must see token 0 (causal mask allows it): with the right split its output moves
    assert not torch.allclose(right2[0, 2], right[0, 2])
    # with the naive view, "head 1" holds only tokens 2 and 3, so token 2 is blind to token 0
    torch.testing.assert_close(wrong2[0, 2], wrong[0, 2])


def test_merge_heads_concatenates_heads():
    y = torch.randn(2, 3, 5, 4)
    merged = merge_heads(y)
    assert merged.shape == (2, 5, 12)
    torch.testing.assert_close(merged, torch.cat([y[:, i] for i in range(3)], dim=-1))


# ---------------------------------------------------------------------------------------------
# KV cache


def test_kv_cache_appends_in_place():
    cache = KVCache(2, 4, 10, 8)
    keys_ptr, values_ptr = cache.keys.data_ptr(), cache.values.data_ptr()
    assert cache.length == 0 and cache.max_len == 10 and cache.keys.shape == (2, 4, 10, 8)
    k1, v1 = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    keys, values = cache.append(k1, v1)
    assert cache.length == 3 and keys.shape == (2, 4, 3, 8)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    k2, v2 = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    keys, values = cache.append(k2, v2)
    assert cache.length == 4
    assert torch.equal(keys, torch.cat([k1, k2], dim=2)) and torch.equal(values, torch.cat([v1, v2], dim=2))
    # no reallocation: the same storage before and after, and the returned tensors are views of it
    assert cache.keys.data_ptr() == keys_ptr and cache.values.data_ptr() == values_ptr
    assert keys.data_ptr() == keys_ptr and values.data_ptr() == values_ptr
    assert bool((cache.keys[:, :, 4:] == 0).all())


def test_kv_cache_fills_exactly_then_overflow_raises():
    cache = KVCache(1, 2, 4, 3)
    cache.append(torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3))
    assert cache.length == 4
    with pytest.raises(ValueError, match="holds 4 tokens.*add 1.*4 stored"):
        cache.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3))
    cache = KVCache(1, 2, 4, 3)
    cache.append(torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3))
    with pytest.raises(ValueError, match="holds 4 tokens.*add 2.*3 stored"):
        cache.append(torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3))
    assert cache.length == 3  # a failed append changes nothing


@pytest.mark.parametrize("B, h, max_len, head_dim, dtype", [
    (1, 1, 1, 1, torch.float32), (2, 4, 16, 8, torch.float32), (3, 12, 100, 64, torch.float16),
    (2, 2, 7, 5, torch.float64), (1, 8, 32, 16, torch.bfloat16),
])
def test_kv_cache_nbytes(B, h, max_len, head_dim, dtype):
    cache = KVCache(B, h, max_len, head_dim, dtype=dtype)
    element_size = torch.tensor([], dtype=dtype).element_size()
    assert cache.nbytes() == 2 * B * h * max_len * head_dim * element_size
    assert cache.keys.dtype == dtype and cache.values.dtype == dtype


@pytest.mark.parametrize("max_len", [0, -1])
def test_kv_cache_non_positive_length_raises(max_len):
    with pytest.raises(ValueError, match=f"max_len must be a positive int, got {max_len}"):
        KVCache(1, 1, max_len, 4)


@pytest.mark.parametrize("attention_class", [MultiHeadAttention, RotaryMultiHeadAttention])
@pytest.mark.parametrize("prompt", [0, 1, 4])
def test_cached_decoding_equals_full_causal_attention(attention_class, prompt):
    """A prompt (with its causal mask), then one token at a time (no mask: the one new query may
    see every cached key) gives the same outputs as causal self-attention over the whole sequence."""
    torch.manual_seed(0)
    B, T, d, h = 2, 9, 16, 4
    attention = attention_class(d, h).eval()
    x = torch.randn(B, T, d)
    with torch.no_grad():
        full, full_weights = attention(x, x, x, causal_mask(T))
        cache = KVCache(B, h, T, d // h)
        pieces = []
        if prompt:
            mask = causal_mask(prompt) if prompt > 1 else None
            out, _ = attention(x[:, :prompt], x[:, :prompt], x[:, :prompt], mask, cache=cache)
            pieces.append(out)
        keys_ptr = cache.keys.data_ptr()
        for t in range(prompt, T):
            token = x[:, t : t + 1]
            out, weights = attention(token, token, token, cache=cache)
            assert weights.shape == (B, h, 1, t + 1)
            torch.testing.assert_close(weights[:, :, 0], full_weights[:, :, t, : t + 1], **TOL)
            pieces.append(out)
        assert cache.length == T and cache.keys.data_ptr() == keys_ptr
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


def test_cached_decoding_with_fast_path():
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        full, _ = attention(x, x, x, causal_mask(6))
        cache = KVCache(1, 4, 6, 4)
        steps = [attention(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache, need_weights=False)
                 for t in range(6)]
    assert all(weights is None for _, weights in steps)
    torch.testing.assert_close(torch.cat([out for out, _ in steps], dim=1), full, **TOL)


def test_cache_overflow_through_attention_raises():
    attention = MultiHeadAttention(8, 2)
    cache = KVCache(1, 2, 2, 4)
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="holds 2 tokens"):
        attention(x, x, x, causal_mask(3), cache=cache)


def test_static_cache_computes_cross_attention_keys_once():
    torch.manual_seed(0)
    B, S, d, h = 2, 7, 16, 4
    attention = MultiHeadAttention(d, h).eval()
    memory = torch.randn(B, S, d)
    calls = {"k": 0, "v": 0}
    attention.k_proj.register_forward_hook(lambda *_: calls.__setitem__("k", calls["k"] + 1))
    attention.v_proj.register_forward_hook(lambda *_: calls.__setitem__("v", calls["v"] + 1))
    cache = KVCache(B, h, S, d // h, static=True)
    with torch.no_grad():
        for step in range(4):
            query = torch.randn(B, 1, d)
            expected, expected_weights = attention(query, memory, memory)  # no cache: computes k, v
            out, weights = attention(query, memory, memory, cache=cache)
            torch.testing.assert_close(out, expected, **TOL)
            torch.testing.assert_close(weights, expected_weights, **TOL)
            assert cache.length == S  # filled once, never appended to again
            assert calls == {"k": step + 2, "v": step + 2}  # step + 1 uncached calls, 1 that filled the cache
    # 4 uncached calls + 1 call that filled the cache
    assert calls == {"k": 5, "v": 5}


def test_static_cache_does_not_touch_the_projections_once_filled():
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 2).eval()
    memory = torch.randn(1, 5, 8)
    cache = KVCache(1, 2, 5, 4, static=True)
    query = torch.randn(1, 1, 8)
    with torch.no_grad():
        first, _ = attention(query, memory, memory, cache=cache)

        def refuse(*_):
            raise AssertionError("keys recomputed")

        attention.k_proj.register_forward_hook(refuse)
        attention.v_proj.register_forward_hook(refuse)
        again, _ = attention(query, memory, memory, cache=cache)
        torch.testing.assert_close(again, first)
        # it also answers new queries from the stored keys and values
        attention(torch.randn(1, 3, 8), memory, memory, cache=cache)


# ---------------------------------------------------------------------------------------------
# rotary multi-head attention


def test_rotary_differs_from_plain_but_shares_weights():
    torch.manual_seed(0)
    plain = MultiHeadAttention(16, 4).eval()
    rotary = RotaryMultiHeadAttention(16, 4).eval()
    rotary.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        a, _ = plain(x, x, x)
        b, weights = rotary(x, x, x)
    assert not torch.allclose(a, b)
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    # a one-token sequence sits at position 0 where RoPE is the identity: both agree
    with torch.no_grad():
        torch.testing.assert_close(rotary(x[:, :1], x[:, :1], x[:, :1])[0], plain(x[:, :1], x[:, :1], x[:, :1])[0])


def test_rotary_scores_depend_on_relative_position_only():
    """Shift the whole sequence by s positions (cache offset): RoPE weights stay the same."""
    torch.manual_seed(0)
    attention = RotaryMultiHeadAttention(16, 4).eval()
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        _, at_zero = attention(x, x, x, causal_mask(5))
        cache = KVCache(1, 4, 20, 4)
        cache.length = 11  # pretend 11 earlier tokens, then block them out: positions start at 11
        mask = torch.zeros(5, 16, dtype=torch.bool)
        mask[:, :11] = True
        mask[:, 11:] = causal_mask(5)
        _, shifted = attention(x, x, x, mask, cache=cache)
    torch.testing.assert_close(shifted[..., 11:], at_zero, **TOL)


def test_rotary_rejects_cross_attention():
    attention = RotaryMultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="self-attention"):
        attention(torch.randn(1, 3, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8))


def test_rotary_needs_even_head_dim():
    attention = RotaryMultiHeadAttention(9, 3)  # head_dim 3: no sin/cos pairs
    x = torch.randn(1, 2, 9)
    with pytest.raises(ValueError, match="even"):
        attention(x, x, x)


# ---------------------------------------------------------------------------------------------
# bad inputs to the helpers and variants


@pytest.mark.parametrize("shape, num_heads", [((2, 3, 10), 3), ((3, 12), 4), ((1, 2, 3, 8), 2)])
def test_split_heads_bad_shapes_raise(shape, num_heads):
    with pytest.raises(ValueError, match=rf"num_heads={num_heads}.*{re.escape(str(shape))}"):
        split_heads(torch.randn(shape), num_heads)


@pytest.mark.parametrize("k_shape, v_shape", [
    ((1, 2, 1, 4), (1, 2, 1, 4)),  # batch 1 into a batch-2 cache: must not broadcast silently
    ((2, 3, 1, 4), (2, 3, 1, 4)),  # wrong number of heads
    ((2, 2, 1, 3), (2, 2, 1, 3)),  # wrong head_dim
    ((2, 2, 1, 4), (2, 2, 2, 4)),  # keys and values of different lengths
    ((2, 2, 4), (2, 2, 4)),  # missing a dimension
])
def test_kv_cache_wrong_shapes_raise(k_shape, v_shape):
    cache = KVCache(2, 2, 5, 4)
    with pytest.raises(ValueError, match=r"B=2, h=2, t, head_dim=4"):
        cache.append(torch.randn(k_shape), torch.randn(v_shape))
    assert cache.length == 0


def test_attention_with_a_cache_of_another_batch_size_raises():
    attention = MultiHeadAttention(8, 2)
    x = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match=r"KVCache expects.*B=2.*\(1, 2, 1, 4\)"):
        attention(x, x, x, cache=KVCache(2, 2, 5, 4))


@pytest.mark.parametrize("ours_bias, reference_bias", [(False, True), (True, False)])
def test_load_from_torch_with_bias_mismatch_raises(ours_bias, reference_bias):
    ours = MultiHeadAttention(8, 2, bias=ours_bias)
    reference = nn.MultiheadAttention(8, 2, bias=reference_bias, batch_first=True)
    with pytest.raises(ValueError, match=f"reference has bias={reference_bias}; this module has bias={ours_bias}"):
        ours.load_from_torch(reference)


def test_wide_bad_inputs_raise():
    with pytest.raises(ValueError, match="must be a positive int"):
        WideMultiHeadAttention(8, 0)
    wide = WideMultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"query.*d_model=8.*\(2, 3, 6\)"):
        wide(torch.randn(2, 3, 6), x, x)
    with pytest.raises(ValueError, match="batch size"):
        wide(x, torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="same length"):
        wide(x, x, torch.randn(2, 4, 8))


# ---------------------------------------------------------------------------------------------
# issue 12: is_causal, dropout as one computation


def test_is_causal_equals_the_causal_mask_and_pytorch():
    torch.manual_seed(11)
    reference = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    ours = MultiHeadAttention(16, 4).load_from_torch(reference).eval()
    x = torch.randn(2, 7, 16)
    expected, expected_weights = reference(x, x, x, attn_mask=causal_mask(7), average_attn_weights=False)
    for need_weights in (True, False):
        out, weights = ours(x, x, x, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        if need_weights:
            torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=1e-5)


def test_dropout_matches_nn_multihead_attention_and_returns_dropped_weights():
    """Same seed, same dropout mask: PyTorch drops the (B, h, Tq, Tk) weights once, as we do."""
    torch.manual_seed(12)
    reference = nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)
    ours = MultiHeadAttention(16, 4, dropout=0.5).load_from_torch(reference)
    x = torch.randn(2, 5, 16)
    torch.manual_seed(13)
    expected, expected_weights = reference(x, x, x, average_attn_weights=False)
    torch.manual_seed(13)
    out, weights = ours(x, x, x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=1e-5)
    assert bool((weights == 0).any()) and weights.max() > 1 / 5  # dropped and rescaled by 1 / (1 - p)
    out, none = ours(x, x, x, need_weights=False)  # the fused kernel's dropout: no weights
    assert none is None and out.shape == (2, 5, 16)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(16, 4, dropout=1.5)
