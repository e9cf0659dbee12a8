"""Chapter 13's library pieces: ALiBi, RoPE scaling (linear, NTK, YaRN), sliding-window masks and the
rolling KV cache, and the GPT's position schemes."""

import math

import attnbook
import pytest
import torch
from attnbook import (
    GPT,
    RollingKVCache,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    causal_mask,
    rope_angles,
    sliding_window_mask,
    yarn_attention_factor,
)
from attnbook.positions import yarn_ramp

SCHEMES = ("learned", "sinusoidal", "rope", "alibi", "none")


# --- ALiBi ------------------------------------------------------------------------------------------


def test_alibi_slopes_for_eight_heads_are_halves():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 12, 16])
def test_alibi_slopes_follow_the_papers_rule(num_heads):
    def reference(n):  # the rule of Press et al.'s released code
        def power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]
        if math.log2(n).is_integer():
            return power_of_2(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_2(closest) + reference(2 * closest)[0::2][: n - closest]

    torch.testing.assert_close(alibi_slopes(num_heads), torch.tensor(reference(num_heads)))


@pytest.mark.parametrize("query_len,key_len", [(5, 5), (1, 7), (3, 8)])
def test_alibi_bias_is_minus_slope_times_distance(query_len, key_len):
    bias = alibi_bias(4, query_len, key_len)
    assert bias.shape == (4, query_len, key_len) and bias.dtype == torch.float32
    slopes = alibi_slopes(4)
    for t in range(query_len):
        i = key_len - query_len + t  # bottom-right aligned
        for j in range(key_len):
            torch.testing.assert_close(bias[:, t, j], -slopes * (i - j))
    assert (bias[:, -1, -1] == 0).all() and not torch.signbit(bias[:, -1, -1]).any()


def test_alibi_bias_depends_on_distance_only():
    bias = alibi_bias(8, 12, 12)
    for offset in range(-11, 12):
        diagonal = bias.diagonal(offset=offset, dim1=1, dim2=2)  # (h, n) entries with j - i = offset
        assert (diagonal == diagonal[:, :1]).all()


@pytest.mark.parametrize("args,match", [((0, 4, 4), "num_heads"), ((-1, 4, 4), "num_heads"),
                                        ((2.5, 4, 4), "num_heads"), ((4, 0, 4), "query_len"),
                                        ((4, 4, 0), "key_len")])
def test_alibi_bad_sizes_raise(args, match):
    with pytest.raises(ValueError, match=match):
        alibi_bias(*args)


# --- RoPE scaling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_scale_one_is_plain_rope_for_every_method(method):
    positions = torch.arange(100)
    theta = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    assert torch.equal(rope_angles(positions, 16, scale=1.0, method=method, original_length=32),
                       positions.float()[:, None] * theta)
    x = torch.randn(2, 3, 20, 16)
    assert torch.equal(apply_rope(x, 5, scale=1.0, method=method, original_length=32), apply_rope(x, 5))


def transformers_inverse_frequencies(rope_type, dim, original_length, seq_len=None, **parameters):
    """transformers' RoPE initialisation (what its Llama-family models rotate by), for one head of
    ``dim``: ``(inverse frequencies (dim/2,), attention factor)``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=dim, num_attention_heads=1, head_dim=dim,
                         max_position_embeddings=original_length,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": rope_type, **parameters})
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("scale", [2.0, 4, 8.0])
def test_linear_scaling_matches_transformers(scale):
    """Position interpolation: transformers divides the frequencies by the factor, we the positions."""
    inverse, factor = transformers_inverse_frequencies("linear", 64, 256, factor=float(scale))
    positions = torch.arange(0, 300)
    torch.testing.assert_close(rope_angles(positions, 64, scale=scale, method="linear"),
                               positions.float()[:, None] * inverse, rtol=1e-6, atol=1e-5)
    assert factor == 1.0


@pytest.mark.parametrize("scale", [2.0, 4.0, 8.0])
def test_ntk_scaling_matches_transformers_dynamic_ntk_at_its_length(scale):
    """NTK-aware scaling (bloc97) raises the base to base * s^(d/(d-2)). transformers implements only
    its dynamic form, base * (s T / L - (s - 1))^(d/(d-2)) at sequence length T; the two agree where
    the multiplier equals s, at T = L (2 - 1/s)."""
    dim, original = 64, 256
    inverse, _ = transformers_inverse_frequencies("dynamic", dim, original, factor=scale,
                                                  seq_len=round(original * (2 - 1 / scale)))
    theta = rope_angles(torch.ones(1), dim, scale=scale, method="ntk")[0]
    torch.testing.assert_close(theta, inverse, rtol=1e-6, atol=0)
    plain = rope_angles(torch.ones(1), dim)[0]
    assert theta[0] == plain[0]  # the fastest pair is unchanged
    torch.testing.assert_close(theta[-1], plain[-1] / scale)  # the slowest is interpolated by s
    assert torch.equal(rope_angles(torch.arange(5), 2, scale=scale, method="ntk"), rope_angles(torch.arange(5), 2))


def test_yarn_matches_transformers_where_the_paper_and_it_agree():
    """YaRN keeps the frequency of the pairs that turn more than beta = 32 times within the trained
    length and interpolates (divides by s) those that turn less than alpha = 1 time; both do, and both
    multiply the attention by 0.1 ln s + 1. In between they differ: the paper ramps linearly in the
    number of turns r, gamma = (r - 1) / 31, while transformers ramps linearly in the pair's index
    (that is, in log r) and widens the ramp to whole pairs (truncate=True); both stay between theta / s
    and theta."""
    dim, scale, original = 64, 4.0, 256
    inverse, factor = transformers_inverse_frequencies("yarn", dim, original, factor=scale,
                                                       original_max_position_embeddings=original)
    assert factor == pytest.approx(yarn_attention_factor(scale))
    ours = rope_angles(torch.ones(1), dim, scale=scale, method="yarn", original_length=original)[0]
    theta = rope_angles(torch.ones(1), dim)[0]  # (dim/2,)
    turns = original * theta / (2 * math.pi)
    fast, slow = turns > 32, turns < 1
    assert fast.sum() >= 1 and slow.sum() >= 10
    torch.testing.assert_close(ours[fast], inverse[fast])  # kept
    torch.testing.assert_close(ours[slow], inverse[slow])  # interpolated: theta / s
    torch.testing.assert_close(ours[slow], theta[slow] / scale)
    middle = ~fast & ~slow
    for angles in (ours, inverse):
        assert ((angles[middle] <= theta[middle]) & (angles[middle] >= theta[middle] / scale)).all()
    # the paper's ramp, linear in the turns: gamma = (r - 1) / 31
    gamma = ((turns[middle] - 1) / 31).clamp(0, 1)
    torch.testing.assert_close(ours[middle], (1 - gamma) * theta[middle] / scale + gamma * theta[middle])
    assert (ours[middle] - inverse[middle]).abs().max() > 0.05 * theta[middle].min()  # they differ


def test_yarn_ramp_and_attention_factor():
    torch.testing.assert_close(yarn_ramp(torch.tensor([0.0, 1.0, 16.5, 32.0, 100.0])),
                               torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))
    assert yarn_attention_factor(1.0) == 1.0
    assert yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4) + 1)
    x = torch.randn(1, 2, 10, 8)
    plain = apply_rope(x, 0, scale=4.0, method="yarn", original_length=16)
    norms_ratio = plain.norm(dim=-1) / x.norm(dim=-1)  # a rotation times the factor
    torch.testing.assert_close(norms_ratio, torch.full_like(norms_ratio, yarn_attention_factor(4.0)))


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn"])
def test_scaled_rope_scores_still_depend_on_distance_only(method):
    q, k = torch.randn(16), torch.randn(16)
    kwargs = dict(scale=4.0, method=method, original_length=32)
    score = (apply_rope(q[None], 40, **kwargs) * apply_rope(k[None], 33, **kwargs)).sum()
    shifted = (apply_rope(q[None], 140, **kwargs) * apply_rope(k[None], 133, **kwargs)).sum()
    torch.testing.assert_close(score, shifted, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=0.5), "scale must be a finite number >= 1"),
    (dict(scale=0.0), "scale must be a finite number >= 1"),
    (dict(scale=float("inf")), "scale must be"),
    (dict(scale=True), "scale must be"),
    (dict(scale="2"), "scale must be"),
    (dict(scale=2.0, method="dynamic"), r"method must be one of \('linear', 'ntk', 'yarn'\), got 'dynamic'"),
    (dict(scale=1.0, method="ntk-by-parts"), "method must be one of"),
    (dict(scale=2.0, method="yarn"), "original_length"),
    (dict(scale=2.0, method="linear", original_length=0), "original_length must be a positive int"),
])
def test_bad_rope_scaling_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_angles(torch.arange(4), 8, **kwargs)
    with pytest.raises(ValueError, match=match):
        apply_rope(torch.randn(4, 8), **kwargs)


def test_rotary_attention_scaling_default_and_bad_values():
    attention = attnbook.RotaryMultiHeadAttention(32, 4)
    assert attention.rotary.scale == 1.0 and attention.rope_base == 10000.0
    x = torch.randn(2, 6, 32)
    before = attention(x, x, x, is_causal=True)[0]
    attention.rotary.set_scaling(4.0, "ntk")
    assert not torch.allclose(attention(x, x, x, is_causal=True)[0], before)
    attention.rotary.set_scaling()  # back to plain RoPE
    assert torch.equal(attention(x, x, x, is_causal=True)[0], before)
    with pytest.raises(ValueError, match="method must be one of"):
        attention.rotary.set_scaling(2.0, "log")
    with pytest.raises(ValueError, match=">= 1"):
        attention.rotary.set_scaling(0.25)


def test_rotary_is_apply_rope_with_its_scaling():
    """One home for RoPE's scaling: the module rotates as apply_rope with the same arguments."""
    x = torch.randn(2, 3, 7, 8)
    rotary = attnbook.Rotary(500.0)
    assert torch.equal(rotary(x, 5), apply_rope(x, 5, 500.0))
    rotary.set_scaling(4.0, "yarn", original_length=16)
    assert torch.equal(rotary(x, 5), apply_rope(x, 5, 500.0, scale=4.0, method="yarn", original_length=16))
    assert "scale=4.0" in repr(rotary)
    with pytest.raises(ValueError, match="rope_base must be a number > 1"):
        attnbook.Rotary(1.0)


# --- sliding windows and the rolling cache ----------------------------------------------------------


@pytest.mark.parametrize("query_len,key_len,window", [(6, 6, 1), (6, 6, 3), (3, 9, 4), (1, 5, 2), (5, 5, 10)])
def test_sliding_window_mask_matches_its_definition(query_len, key_len, window):
    mask = sliding_window_mask(query_len, key_len, window)
    assert mask.shape == (query_len, key_len) and mask.dtype == torch.bool
    for t in range(query_len):
        i = key_len - query_len + t
        for j in range(key_len):
            assert bool(mask[t, j]) == (not i - window < j <= i)


@pytest.mark.parametrize("n,key_len", [(5, None), (3, 7)])
def test_a_window_as_long_as_the_keys_is_the_causal_mask(n, key_len):
    keys = n if key_len is None else key_len
    assert torch.equal(sliding_window_mask(n, key_len, keys), causal_mask(n, key_len=keys))
    assert torch.equal(sliding_window_mask(n, key_len, 100), causal_mask(n, key_len=keys))


@pytest.mark.parametrize("window", [0, -3, 2.0, None, True])
def test_sliding_window_bad_window_raises(window):
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(4, 4, window)


def test_rolling_cache_keeps_the_last_window_entries():
    cache = RollingKVCache(1, 2, 4, 3)
    keys = torch.arange(10.0)[None, None, :, None].expand(1, 2, 10, 3)
    k, _ = cache.append(keys[:, :, :6], keys[:, :, :6])  # a prompt of 6: all 6 returned (queries need them)
    assert k.shape[2] == 6 == cache.length and cache.held == 4
    assert cache.keys[0, 0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert cache.key_len(1) == 4
    k, _ = cache.append(keys[:, :, 6:7], keys[:, :, 6:7])  # one new token sees itself and 3 before it
    assert k[0, 0, :, 0].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert cache.length == 7 and cache.keys[0, 0, :, 0].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert cache.nbytes() == 2 * 1 * 2 * 4 * 3 * 4
    with pytest.raises(ValueError, match="head_dim=3"):
        cache.append(torch.zeros(1, 2, 1, 5), torch.zeros(1, 2, 1, 5))
    with pytest.raises(ValueError, match="window"):
        RollingKVCache(1, 2, 0, 3)


# --- the GPT's position schemes ---------------------------------------------------------------------


@pytest.mark.parametrize("positions", SCHEMES)
@pytest.mark.parametrize("window", [None, 1, 4])
def test_gpt_cached_equals_uncached_for_every_scheme(positions, window):
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 48, positions=positions, window=window).eval()
    tokens = torch.randint(0, 13, (2, 30))
    caches = model.make_caches(2)
    with torch.no_grad():
        steps = [model(tokens[:, :9], caches)] + [model(tokens[:, t : t + 1], caches) for t in range(9, 30)]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(tokens), atol=1e-5, rtol=1e-5)
    prompt = tokens[:, :5]
    cached = attnbook.generate(model, prompt, 40, use_cache=True)
    assert torch.equal(cached, attnbook.generate(model, prompt, 40, use_cache=False))
    sampled = [attnbook.generate(model, prompt, 40, use_cache=c, temperature=1.0, generator=attnbook.generator(3))
               for c in (True, False)]
    assert torch.equal(*sampled)


def test_gpt_rolling_cache_memory_is_the_windows():
    model = GPT(13, 32, 4, 3, 100, positions="rope", window=8)
    caches = model.make_caches(2)
    assert all(isinstance(cache, RollingKVCache) for cache in caches)
    assert sum(c.nbytes() for c in caches) == attnbook.cost.kv_cache_bytes(3, 8, 32, 4, batch_size=2)
    with torch.no_grad():
        model(torch.randint(0, 13, (2, 50)), caches)
    assert caches[0].length == 50 and caches[0].held == 8


@pytest.mark.parametrize("positions", SCHEMES)
def test_gpt_window_longer_than_the_input_changes_nothing(positions):
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 24, positions=positions).eval()
    windowed = GPT(13, 32, 4, 2, 24, positions=positions, window=24).eval()
    windowed.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 13, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(windowed(tokens), model(tokens))
        windowed.window = 3
        assert not torch.allclose(windowed(tokens), model(tokens))


def test_gpt_schemes_differ_in_parameters_and_position_sensitivity():
    counts = {p: sum(t.numel() for t in GPT(13, 32, 4, 2, 24, positions=p).parameters()) for p in SCHEMES}
    assert counts["learned"] == counts["none"] + 24 * 32
    assert counts["sinusoidal"] == counts["rope"] == counts["alibi"] == counts["none"]
    torch.manual_seed(0)
    nope = GPT(13, 32, 4, 1, 24, positions="none").eval()
    same = torch.full((1, 6), 3)
    with torch.no_grad():  # NoPE: identical tokens get identical outputs at every position
        logits = nope(same)
    torch.testing.assert_close(logits, logits[:, :1].expand_as(logits))


def test_gpt_default_is_the_learned_table_and_raises_past_it():
    model = GPT(13, 32, 4, 1, 8)
    assert model.position_scheme == "learned" and isinstance(model.positions, attnbook.LearnedPositions)
    assert model.window is None
    with pytest.raises(ValueError, match="exceeds max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions up to 8 requested.*rows only for 0\.\.7"):
        model.positions(torch.zeros(1, 9, 32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(positions="alibi2"), "positions must be one of"),
    (dict(positions=None), "positions must be one of"),
    (dict(window=0), "window must be a positive int"),
    (dict(window=-2), "window"),
    (dict(num_heads=0), "num_heads"),
])
def test_gpt_bad_position_arguments_raise(kwargs, match):
    sizes = dict(vocab_size=13, d_model=32, num_heads=4, num_layers=1, max_len=8) | kwargs
    with pytest.raises(ValueError, match=match):
        GPT(**sizes)


def test_gpt_rope_scaling_only_for_rope():
    with pytest.raises(ValueError, match="positions='rope'"):
        GPT(13, 32, 4, 1, 8, positions="alibi").set_rope_scaling(2.0)
    model = GPT(13, 32, 4, 2, 64, positions="rope", num_kv_heads=2)  # grouped heads' RoPE too
    model.set_rope_scaling(3.0, "ntk")
    assert all(block.self_attention.rotary.scale == 3.0 for block in model.blocks)
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 64, positions="rope").eval()
    tokens = torch.randint(0, 13, (1, 64))
    with torch.no_grad():
        plain = model(tokens)
        model.set_rope_scaling(2.0, "yarn", original_length=32)
        stretched = model(tokens)
        model.set_rope_scaling(1.0)
        assert torch.equal(model(tokens), plain)
    assert not torch.allclose(stretched, plain)
    caches = model.set_rope_scaling(4.0, "linear").make_caches(1)
    with torch.no_grad():  # the cache continues the scaled positions
        steps = torch.cat([model(tokens[:, :10], caches)] + [model(tokens[:, t : t + 1], caches)
                                                              for t in range(10, 64)], dim=1)
        torch.testing.assert_close(steps, model(tokens), atol=1e-5, rtol=1e-5)


# --- issue 36: streaming past max_len with a window; one cache validator ------------------------


@pytest.mark.parametrize("positions", ["rope", "alibi", "none"])
def test_a_windowed_gpt_without_a_position_table_streams_past_max_len(positions):
    """With a window and positions that need no table, the rolling caches hold ``window`` entries
    however long the text grows: generate runs 10x max_len, cached and uncached alike."""
    torch.manual_seed(0)
    gpt = GPT(vocab_size=11, d_model=16, num_heads=2, num_layers=2, max_len=16, positions=positions,
              window=4).eval()
    assert gpt.max_sequence_len is None
    cached = attnbook.generate(gpt, torch.tensor([[1, 2, 3]]), 160)
    assert cached.shape == (1, 163)
    torch.testing.assert_close(cached, attnbook.generate(gpt, torch.tensor([[1, 2, 3]]), 160, use_cache=False),
                               rtol=0, atol=0)
    with torch.no_grad():
        # the forward pass too. Every scheme here depends on distances only, and two layers of
        # window 4 see 2 * 3 + 1 = 7 tokens: position 100's logits from those 7 alone
        full = gpt(cached)[0, 100]
        alone = gpt(cached[:, 94:101])[0, -1]
    torch.testing.assert_close(full, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_a_position_table_still_bounds_a_windowed_gpt(positions):
    gpt = GPT(vocab_size=11, d_model=16, num_heads=2, num_layers=1, max_len=16, positions=positions, window=4)
    assert gpt.max_sequence_len == 16
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        attnbook.generate(gpt, torch.tensor([[1, 2, 3]]), 14)


def test_speculative_decoding_refuses_rolling_caches_up_front():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=11, d_model=16, num_heads=2, num_layers=1, max_len=32, positions="rope", window=4)
    with pytest.raises(ValueError, match="a RollingKVCache cannot"):
        attnbook.speculative_generate(gpt, gpt, torch.tensor([[1, 2]]), 8)
    with pytest.raises(ValueError, match="cannot truncate"):
        gpt.make_caches(1)[0].truncate(0)


@pytest.mark.parametrize("cache_class", [attnbook.KVCache, RollingKVCache])
def test_every_cache_refuses_a_second_dtype_and_mixed_keys_and_values(cache_class):
    cache = cache_class(1, 2, 4, 3)
    half = torch.zeros(1, 2, 1, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="keys and values must share dtype"):
        cache.append(half, half.float())
    cache.append(half, half)  # the first keys decide: the empty cache follows them
    assert cache.keys.dtype == torch.float16
    with pytest.raises(ValueError, match="KVCache holds torch.float16 on cpu, got torch.float32"):
        cache.append(half.float(), half.float())
    with pytest.raises(ValueError, match=r"KVCache expects keys \(B=1, h=2, t, head_dim=3\) and values"):
        cache.append(torch.zeros(1, 2, 1, 4, dtype=torch.float16), torch.zeros(1, 2, 1, 4, dtype=torch.float16))


@pytest.mark.parametrize("cache_class", [attnbook.KVCache, RollingKVCache])
def test_beam_surgery_repeats_and_reorders_the_filled_rows(cache_class):
    cache = cache_class(1, 1, 4, 2)
    cache.append(torch.arange(6.0).view(1, 1, 3, 2), torch.arange(6.0).view(1, 1, 3, 2))
    cache.repeat(3)
    assert cache.keys.shape[0] == 3 and torch.equal(cache.keys[2], cache.keys[0])
    cache.keys[1] += 100  # beam 1's own prefix
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.keys[:, 0, 0, 0].tolist() == [100.0, 100.0, 0.0]
    with pytest.raises(ValueError, match="repeat widens a cache of batch 1, this one has 3"):
        cache.repeat(2)
