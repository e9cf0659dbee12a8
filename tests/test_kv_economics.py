"""Chapter 18's KV-cache economics: quantised caches (KIVI), paged caches (vLLM) and
attention sinks (StreamingLLM)."""

import attnbook
import pytest
import torch
from attnbook import (
    GPT,
    BlockPool,
    EncoderDecoderModel,
    KVCache,
    PagedKVCache,
    QuantizedKVCache,
    QuantizedTensor,
    RollingKVCache,
    dequantize_kv,
    generate,
    generate_paged,
    make_caches,
    paged_memory_waste,
    quantize_kv,
    sliding_window_mask,
)


def spread(quantized: QuantizedTensor) -> torch.Tensor:
    """Each entry's scale: the group's scale repeated over its group_size entries."""
    return quantized.scale.repeat_interleave(quantized.group_size, dim=quantized.axis)


# --- quantize_kv and dequantize_kv ----------------------------------------------------------------


def test_quantize_kv_by_hand():
    x = torch.tensor([[0.0, 0.5, 1.0, 7.5], [2.0, 2.0, 2.0, 2.0]])
    q = quantize_kv(x, 4, axis=-1)  # one group a row: 15 steps of (max - min) / 15
    assert q.codes.dtype == torch.uint8 and q.axis == 1 and q.group_size == 4
    assert q.codes.tolist() == [[0, 1, 2, 15], [0, 0, 0, 0]]
    assert q.scale.tolist() == [[0.5], [0.0]] and q.offset.tolist() == [[0.0], [2.0]]
    assert torch.equal(dequantize_kv(q), x)  # on the grid, and a constant row: exact
    q8 = quantize_kv(x, 8, axis=1, group_size=2)  # two groups a row, 255 steps each
    assert q8.scale.shape == (2, 2) and q8.offset.tolist() == [[0.0, 1.0], [2.0, 2.0]]
    assert q8.codes.tolist() == [[0, 255, 0, 255], [0, 0, 0, 0]]
    torch.testing.assert_close(q8.scale, torch.tensor([[0.5 / 255, 6.5 / 255], [0.0, 0.0]]))
    q2 = quantize_kv(torch.tensor([[0.0, 1.1, 2.4, 3.0]]), 2, axis=1)  # 3 steps of 1.0
    assert q2.codes.tolist() == [[0, 1, 2, 3]] and q2.scale.tolist() == [[1.0]]
    assert q2.nbytes() == 1 + 2 * 4  # four 2-bit codes in one byte, a scale, an offset


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis,group_size", [(2, 4), (2, None), (3, None), (-1, 2), (0, 2)])
def test_dequantized_within_half_a_step(bits, axis, group_size):
    x = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
    x[:, :, :, 1] *= 40  # an outlier channel
    q = quantize_kv(x, bits, axis, group_size)
    groups = x.shape[axis] // (group_size or x.shape[axis])
    expected = list(x.shape)
    expected[axis] = groups
    assert q.scale.shape == q.offset.shape == tuple(expected) and q.codes.shape == x.shape
    assert int(q.codes.max()) <= 2**bits - 1
    error = (dequantize_kv(q) - x).abs()
    assert (error <= spread(q) / 2 + 1e-12).all()
    assert (error.amax() > 0) and (spread(q) > 0).all()
    x32 = x.float()  # float32: half a step up to float32's rounding
    q32 = quantize_kv(x32, bits, axis, group_size)
    assert q32.scale.dtype == torch.float32
    assert ((dequantize_kv(q32) - x32).abs() <= spread(q32) / 2 * (1 + 1e-5) + 1e-6).all()


def test_constant_groups_come_back_exact_without_dividing_by_zero():
    x = torch.randn(1, 2, 8, 4)
    x[:, :, :4, 2] = 3.25  # a constant group of keys (channel 2, tokens 0..3)
    x[0, 1] = -1.5  # a whole head constant
    q = quantize_kv(x, 4, axis=2, group_size=4)
    assert q.scale[0, 0, 0, 2] == 0 and (q.scale[0, 1] == 0).all()
    assert (q.codes[0, 1] == 0).all() and q.codes[0, 0, :4, 2].eq(0).all()
    out = dequantize_kv(q)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 0, :4, 2], x[0, 0, :4, 2]) and torch.equal(out[0, 1], x[0, 1])


def test_per_channel_key_quantisation_handles_an_outlier_channel():
    # KIVI's reason: keys have outlier channels; per-token statistics spread one channel's
    # range over every channel of the token
    keys = torch.randn(1, 1, 32, 16, generator=torch.Generator().manual_seed(0))
    keys[..., 3] += 30.0
    per_channel = (dequantize_kv(quantize_kv(keys, 4, axis=2, group_size=8)) - keys).abs().mean()
    per_token = (dequantize_kv(quantize_kv(keys, 4, axis=3)) - keys).abs().mean()
    assert per_channel < per_token / 5


def test_quantized_tensor_nbytes_counts_packed_codes_and_statistics():
    x = torch.randn(1, 2, 8, 4, dtype=torch.float16)
    q = quantize_kv(x, 4, axis=2, group_size=4)  # 64 codes, 2 * 4 groups per head
    assert q.nbytes() == 64 * 4 // 8 + 2 * (1 * 2 * 2 * 4) * 2 == 96
    q = quantize_kv(x, 8, axis=3)  # 64 codes, one group per token and head
    assert q.nbytes() == 64 + 2 * (1 * 2 * 8) * 2 == 128


@pytest.mark.parametrize(
    "x,bits,axis,group_size,match",
    [
        (torch.randn(2, 4), 3, 0, None, "bits must be one of"),
        (torch.randn(2, 4), 16, 0, None, "bits"),
        (torch.randn(2, 4), True, 0, None, "bits"),
        (torch.randn(2, 4), 8, 2, None, r"axis must be an int in \[-2, 2\)"),
        (torch.randn(2, 4), 8, -3, None, "axis"),
        (torch.randn(2, 4), 8, 1.0, None, "axis"),
        (torch.arange(8).reshape(2, 4), 8, 0, None, "floating-point"),
        ([[1.0, 2.0]], 8, 0, None, "floating-point"),
        (torch.randn(2, 4), 8, 1, 3, "group_size=3 must divide"),
        (torch.randn(2, 4), 8, 1, 0, "group_size must be a positive int"),
        (torch.randn(2, 0), 8, 1, None, "must divide"),
    ],
)
def test_quantize_kv_rejects_bad_input(x, bits, axis, group_size, match):
    with pytest.raises(ValueError, match=match):
        quantize_kv(x, bits, axis, group_size)


def test_dequantize_kv_takes_a_quantized_tensor():
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize_kv(torch.zeros(3))


# --- QuantizedKVCache -------------------------------------------------------------------------------


def test_quantized_cache_by_hand():
    """Keys 8-bit per channel, values 4-bit per token, groups of 4 tokens, float32."""
    cache = QuantizedKVCache(1, 2, 16, 4, key_bits=8, value_bits=4, group_size=4)
    k, v = torch.randn(2, 1, 2, 10, 4, generator=torch.Generator().manual_seed(0))
    keys, values = cache.append(k[:, :, :6], v[:, :, :6])  # a prompt of 6
    assert torch.equal(keys, k[:, :, :6]) and torch.equal(values, v[:, :, :6])  # fresh: exact
    assert (cache.length, cache.held, cache.quantized_keys.codes.shape[2]) == (6, 2, 4)
    for t in range(6, 10):
        assert cache.key_len(1) == t + 1
        keys, values = cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    # 8 tokens quantised (two groups), 2 in the residual, in full precision
    assert (cache.length, cache.held) == (10, 2) and keys.shape == (1, 2, 10, 4)
    assert torch.equal(keys[:, :, 8:], k[:, :, 8:10]) and torch.equal(values[:, :, 8:], v[:, :, 8:10])
    key_steps = spread(cache.quantized_keys)  # (1, 2, 8, 4): per channel, per 4 tokens
    value_steps = spread(cache.quantized_values)  # (1, 2, 8, 4): per token
    assert cache.quantized_keys.scale.shape == (1, 2, 2, 4) and cache.quantized_values.scale.shape == (1, 2, 8, 1)
    assert ((keys[:, :, :8] - k[:, :, :8]).abs() <= key_steps / 2 * (1 + 1e-5) + 1e-7).all()
    assert ((values[:, :, :8] - v[:, :, :8]).abs() <= value_steps / 2 * (1 + 1e-5) + 1e-7).all()
    # bytes: keys 64 codes of 1 byte + 16 groups x (scale, offset) x 4 bytes; values 64
    # codes of half a byte + 16 groups x 2 x 4; residual 2 tokens x 2 heads x 4 x 4 bytes x 2
    assert cache.packed_nbytes() == (64 + 16 * 2 * 4) + (32 + 16 * 2 * 4) + 2 * 2 * 4 * 4 * 2 == 480
    # held in memory here: a byte a code, the statistics, the residual buffers of 4 tokens
    assert cache.nbytes() == (64 + 16 * 2 * 4) * 2 + 2 * (2 * 4 * 4 * 4) == 640
    full = KVCache(1, 2, 10, 4)
    full.append(k, v)
    assert full.nbytes() == 640


def test_quantized_cache_beam_surgery_moves_the_quantised_tokens_too():
    cache = QuantizedKVCache(1, 1, 16, 4, group_size=4)
    k = torch.randn(1, 1, 7, 4)
    cache.append(k[:, :, :6], k[:, :, :6])
    twin = QuantizedKVCache(1, 1, 16, 4, group_size=4)
    twin.append(k[:, :, :6], k[:, :, :6])
    cache.repeat(3)
    cache.reorder(torch.tensor([2, 0, 1]))
    keys, _ = cache.append(k[:, :, 6:].expand(3, -1, -1, -1), k[:, :, 6:].expand(3, -1, -1, -1))
    expected, _ = twin.append(k[:, :, 6:], k[:, :, 6:])
    assert keys.shape == (3, 1, 7, 4) and all(torch.equal(row[None], expected) for row in keys)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_gpt_with_a_quantized_cache_gives_logits_close_to_the_float_cache(positions):
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 64, positions=positions, num_kv_heads=2).eval()
    tokens = torch.randint(0, 13, (2, 40))
    errors = {}
    with torch.no_grad():
        reference = model(tokens)
        for bits in (8, 4):
            caches = model.make_caches(2, kv_bits=bits, group_size=8)
            assert all(isinstance(c, QuantizedKVCache) and c.keys.shape[1] == 2 for c in caches)
            steps = [model(tokens[:, :5], caches)] + [model(tokens[:, t : t + 1], caches) for t in range(5, 40)]
            errors[bits] = (torch.cat(steps, dim=1) - reference).abs().max().item()
    assert 0 < errors[8] < 0.02 and errors[8] < errors[4] < 0.3, errors


def test_rotary_inverse_turns_each_pair_back():
    x = torch.randn(2, 3, 7, 8, generator=torch.Generator().manual_seed(3))
    for scaling in (dict(), dict(scale=4.0), dict(scale=4.0, method="yarn", original_length=16)):
        rotary = attnbook.Rotary(100.0).set_scaling(**scaling)
        torch.testing.assert_close(rotary.inverse(rotary(x, 5), 5), x)
        torch.testing.assert_close(rotary(rotary.inverse(x, 5), 5), x)
    # by hand: a pair (theta_0 = 1) at position 2 that reads (cos 2, sin 2) was (1, 0)
    pair = torch.zeros(3, 2)
    pair[2] = torch.tensor([2.0, 2.0]).cos()
    pair[2, 1] = torch.tensor(2.0).sin()
    torch.testing.assert_close(attnbook.Rotary().inverse(pair)[2], torch.tensor([1.0, 0.0]))


def test_quantized_cache_before_rope_quantises_the_unrotated_keys():
    rotary = attnbook.Rotary(10.0)
    k_plain, v = torch.randn(2, 1, 2, 12, 4, generator=torch.Generator().manual_seed(1))
    k = rotary(k_plain)  # what attention hands the cache: rotated keys
    cache = QuantizedKVCache(1, 2, 16, 4, key_bits=2, value_bits=8, group_size=4, pre_rope=rotary)
    cache.append(k[:, :, :6], v[:, :, :6])
    keys, _ = cache.append(k[:, :, 6:], v[:, :, 6:])  # 12 tokens: three groups quantised
    assert (cache.length, cache.held) == (12, 0)
    by_hand = rotary(dequantize_kv(quantize_kv(k_plain, 2, axis=2, group_size=4)))
    torch.testing.assert_close(cache.append(k[:, :, :0], v[:, :, :0])[0], by_hand)
    # the second step saw the first group quantised, the residual and its own keys exact
    torch.testing.assert_close(keys[:, :, :4], by_hand[:, :, :4])
    assert torch.equal(keys[:, :, 4:], k[:, :, 4:])
    after = QuantizedKVCache(1, 2, 16, 4, key_bits=2, value_bits=8, group_size=4)
    after.append(k, v)
    post = after.append(k[:, :, :0], v[:, :, :0])[0]  # quantised after RoPE: other keys
    assert (post - by_hand).abs().max() > 0.01
    with pytest.raises(TypeError, match="pre_rope must be the attention's Rotary"):
        QuantizedKVCache(1, 2, 8, 4, pre_rope=attnbook.apply_rope)


def test_quantized_cache_rejects_bad_input():
    for options, match in [
        (dict(key_bits=3), "key_bits must be one of"),
        (dict(value_bits=1), "value_bits"),
        (dict(key_axis="head"), "key_axis must be one of"),
        (dict(value_axis=None), "value_axis"),
        (dict(group_size=0), "group_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            QuantizedKVCache(1, 2, 8, 4, **options)
    cache = QuantizedKVCache(1, 2, 8, 4, group_size=4)
    cache.append(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="holds 8 tokens"):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(4)
    with pytest.raises(ValueError, match="one dtype"):
        cache.append(torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="without a window"):
        make_caches(2, 1, 2, 8, 4, window=4, kv_bits=8)


# --- paged caches --------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_generate_paged_is_token_identical_to_generating_each_prompt_alone(positions):
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 48, positions=positions, num_kv_heads=2).eval()
    prompts = [torch.randint(0, 13, (n,)) for n in (3, 7, 12)]
    pool = BlockPool(24, 4, 2, 2, 8)
    out = generate_paged(model, prompts, 20, pool=pool)
    for tokens, prompt in zip(out, prompts, strict=True):
        assert tokens.shape == (len(prompt) + 20,)
        assert torch.equal(tokens, generate(model, prompt, 20)[0])
    assert sorted(pool.free_blocks) == list(range(24))  # finished sequences freed their blocks
    default = generate_paged(model, prompts, 20, block_size=5)  # a pool of just enough blocks
    assert all(torch.equal(a, b) for a, b in zip(out, default, strict=True))


def test_paged_cache_tables_blocks_and_frees_them():
    pool = BlockPool(4, 4, 1, 1, 2)
    assert pool.block_nbytes() == 2 * 4 * 2 * 4 == 64 and pool.nbytes() == 256
    a, b = PagedKVCache(pool), PagedKVCache(pool)
    x = torch.arange(20.0).reshape(1, 1, 10, 2)  # token p's key is (2p, 2p + 1)
    keys, values = a.layers[0].append(x[:, :, :5], -x[:, :, :5])  # 5 tokens: 2 blocks
    assert a.block_table == [0, 1] and a.length == 5 and a.nbytes() == 128
    assert torch.equal(keys, x[:, :, :5]) and torch.equal(values, -x[:, :, :5])
    assert torch.equal(pool.keys[0, 1, 0, 0], x[0, 0, 4])  # token 4: block 1, slot 0
    b.layers[0].append(x[:, :, 5:8], x[:, :, 5:8])
    assert b.block_table == [2]
    a.free()  # the blocks go back and the table is cleared
    assert a.block_table == [] and a.length == 0 and pool.free_blocks == [3, 1, 0]
    c = PagedKVCache(pool)
    c.layers[0].append(x[:, :, :6], x[:, :, :6])
    assert c.block_table == [0, 1]  # a's old blocks, reused
    # a appends afresh: a new block, its own token only, and c's tokens stay as they were
    keys, _ = a.layers[0].append(x[:, :, 9:], x[:, :, 9:])
    assert a.block_table == [3] and torch.equal(keys, x[:, :, 9:])
    again, _ = c.layers[0].append(x[:, :, 6:7], x[:, :, 6:7])
    assert torch.equal(again, x[:, :, :7])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([2, 2])


def test_block_pool_exhaustion_and_bad_sizes_raise():
    pool = BlockPool(2, 4, 1, 1, 2)
    sequence = PagedKVCache(pool)
    sequence.layers[0].append(torch.zeros(1, 1, 8, 2), torch.zeros(1, 1, 8, 2))
    with pytest.raises(RuntimeError, match="exhausted: all 2 blocks"):
        sequence.layers[0].append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    with pytest.raises(ValueError, match="h=1, t, head_dim=2"):
        PagedKVCache(pool).layers[0].append(torch.zeros(2, 1, 1, 2), torch.zeros(2, 1, 1, 2))
    with pytest.raises(ValueError, match="float32"):
        PagedKVCache(pool).layers[0].append(torch.zeros(1, 1, 1, 2).double(), torch.zeros(1, 1, 1, 2).double())
    for block_size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            BlockPool(4, block_size, 1, 1, 2)
    with pytest.raises(TypeError, match="BlockPool"):
        PagedKVCache("pool")
    model = GPT(13, 16, 2, 1, 32).eval()
    with pytest.raises(ValueError, match="block_size"):
        generate_paged(model, [torch.tensor([1, 2])], 3, block_size=0)
    with pytest.raises(RuntimeError, match="exhausted"):
        generate_paged(model, [torch.tensor([1, 2]), torch.tensor([3])], 5, pool=BlockPool(2, 4, 1, 2, 8))
    with pytest.raises(ValueError, match="at least one prompt"):
        generate_paged(model, [], 3)
    with pytest.raises(TypeError, match="decoder-only"):
        generate_paged(EncoderDecoderModel(5, 5, 16, 2, 1, 1, 16), [torch.tensor([1])], 2)


def test_paged_memory_waste_by_hand():
    # lengths 5, 9, 16 in blocks of 4: the paged cache's last blocks hold 3, 3 and 0 empty slots
    assert paged_memory_waste([5, 9, 16], 4) == (11 + 7 + 0, 3 + 3 + 0)
    assert paged_memory_waste([5, 9, 16], 4, max_len=32, bytes_per_token=10) == (660, 60)
    # bytes per token of a 2-layer cache with 2 heads of 8 in float32
    per_token = 2 * 2 * 2 * 8 * 4
    assert paged_memory_waste([1], 16, bytes_per_token=per_token) == (0, 15 * per_token)
    for lengths, options, match in [
        ([], {}, "at least one"),
        ([3, -1], {}, "each length"),
        ([3, 9], dict(max_len=8), "max_len=8 is shorter"),
    ]:
        with pytest.raises(ValueError, match=match):
            paged_memory_waste(lengths, 4, **options)


# --- attention sinks -------------------------------------------------------------------------------


@pytest.mark.parametrize("query_len,key_len,window,sinks", [(8, 8, 4, 1), (8, 8, 5, 2), (2, 9, 4, 2), (9, 9, 3, 0)])
def test_sink_mask_matches_its_definition(query_len, key_len, window, sinks):
    mask = sliding_window_mask(query_len, key_len, window, sink_tokens=sinks)
    for t in range(query_len):
        i = key_len - query_len + t  # the query's position
        for j in range(key_len):
            visible = j <= i and (j < sinks or i - j < window - sinks)
            assert bool(mask[t, j]) != visible


def test_sink_mask_by_hand_and_without_sinks_as_before():
    mask = sliding_window_mask(6, 6, 4, sink_tokens=1)
    assert (~mask[5]).nonzero().flatten().tolist() == [0, 3, 4, 5]  # the sink, then 3
    assert torch.equal(sliding_window_mask(7, 9, 3, sink_tokens=0), sliding_window_mask(7, 9, 3))
    with pytest.raises(ValueError, match="sink_tokens=4 must be smaller than window=4"):
        sliding_window_mask(6, 6, 4, sink_tokens=4)
    with pytest.raises(ValueError, match="sink_tokens must be an int >= 0"):
        sliding_window_mask(6, 6, 4, sink_tokens=-1)


def test_rolling_cache_keeps_its_sinks():
    cache = RollingKVCache(1, 1, 4, 1, sink_tokens=1)
    x = torch.arange(8.0)[None, None, :, None]  # token p's key is p
    keys, _ = cache.append(x[:, :, :6], x[:, :, :6])  # a prompt of 6: every key returned
    assert keys.flatten().tolist() == [0, 1, 2, 3, 4, 5] and cache.held == 4
    assert cache.keys.flatten().tolist() == [0, 3, 4, 5]  # the sink and the last 3
    assert cache.key_len(1) == 4
    keys, _ = cache.append(x[:, :, 6:7], x[:, :, 6:7])
    assert keys.flatten().tolist() == [0, 4, 5, 6] and cache.keys.flatten().tolist() == [0, 4, 5, 6]
    assert cache.nbytes() == RollingKVCache(1, 1, 4, 1).nbytes()
    short = RollingKVCache(1, 1, 4, 1, sink_tokens=2)  # fewer tokens than sinks at first
    assert short.append(x[:, :, :1], x[:, :, :1])[0].flatten().tolist() == [0]
    with pytest.raises(ValueError, match="smaller than window"):
        RollingKVCache(1, 1, 4, 1, sink_tokens=4)


@pytest.mark.parametrize("positions", ["learned", "rope", "none"])
def test_gpt_with_sinks_cached_equals_uncached_past_the_window(positions):
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 48, positions=positions, window=6, sink_tokens=2).eval()
    tokens = torch.randint(0, 13, (2, 40))
    with torch.no_grad():
        full = model(tokens)
        for prompt_len in (1, 9):  # one token at a time from the start, or a prompt first
            caches = model.make_caches(2)
            assert all(c.sink_tokens == 2 and c.window == 6 for c in caches)
            steps = [model(tokens[:, :prompt_len], caches)]
            steps += [model(tokens[:, t : t + 1], caches) for t in range(prompt_len, 40)]
            torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
        plain = GPT(13, 32, 4, 2, 48, positions=positions, window=6).eval()
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(plain(tokens)[:, 6:], full[:, 6:])  # the sinks matter
        torch.testing.assert_close(plain(tokens)[:, :5], full[:, :5])  # ... past the window only
    cached = generate(model, tokens[:, :5], 40)
    assert torch.equal(cached, generate(model, tokens[:, :5], 40, use_cache=False))


def test_gpt_without_sinks_is_the_plain_window():
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 48, positions="rope", window=4, sink_tokens=0).eval()
    plain = GPT(13, 32, 4, 2, 48, positions="rope", window=4).eval()
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 13, (1, 20))
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))
    assert torch.equal(generate(model, tokens[:, :3], 30), generate(plain, tokens[:, :3], 30))


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(window=4, sink_tokens=4), "sink_tokens=4 must be smaller than window=4"),
        (dict(window=4, sink_tokens=9), "smaller than window"),
        (dict(sink_tokens=2), "needs a window"),
        (dict(window=4, sink_tokens=-1), "sink_tokens"),
        (dict(window=4, sink_tokens=1, positions="alibi"), "alibi"),
    ],
)
def test_gpt_rejects_bad_sinks(options, match):
    with pytest.raises(ValueError, match=match):
        GPT(13, 16, 2, 1, 32, **options)


def test_new_names_are_exported():
    for name in ("BlockPool", "PagedKVCache", "QuantizedKVCache", "QuantizedTensor", "dequantize_kv",
                 "generate_paged", "paged_memory_waste", "quantize_kv"):
        assert name in attnbook.__all__ and hasattr(attnbook, name)
    # the allocator and the quantisation in modules of their own, the caches on one base
    assert attnbook.BlockPool.__module__ == "attnbook.paging"
    assert attnbook.quantize_kv.__module__ == "attnbook.quantize"
    for cache in (KVCache, RollingKVCache, QuantizedKVCache, attnbook.LatentKVCache, attnbook.paging._PagedLayer):
        assert issubclass(cache, attnbook.caches.Cache)


def test_generate_paged_frees_the_callers_blocks_when_it_raises():
    torch.manual_seed(0)
    model = GPT(13, 16, 2, 1, 32).eval()
    pool = BlockPool(3, 4, 1, 2, 8)  # two prompts of 6 + 6 tokens need 6 blocks
    with pytest.raises(RuntimeError, match="exhausted"):
        generate_paged(model, [torch.arange(6), torch.arange(6)], 6, pool=pool)
    assert sorted(pool.free_blocks) == [0, 1, 2]  # none leaked: the pool serves again
    out = generate_paged(model, [torch.arange(4)], 4, pool=pool)
    assert torch.equal(out[0], generate(model, torch.arange(4), 4)[0])


def test_generate_paged_under_autocast_equals_generate():
    torch.manual_seed(0)
    model = GPT(13, 32, 4, 2, 48, positions="rope", num_kv_heads=2).eval()
    prompts = [torch.randint(0, 13, (n,)) for n in (3, 7)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate_paged(model, prompts, 8, block_size=4)
        for tokens, prompt in zip(out, prompts, strict=True):
            assert torch.equal(tokens, generate(model, prompt, 8)[0])
    pool = BlockPool(4, 4, 2, 2, 8)
    sequence = PagedKVCache(pool)
    sequence.layers[0].append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="one dtype"):  # a pool in use keeps its dtype
        sequence.layers[1].append(torch.zeros(1, 2, 1, 8).bfloat16(), torch.zeros(1, 2, 1, 8).bfloat16())


def test_a_quantized_cache_keeps_keys_per_channel_so_an_outlier_channel_costs_nothing():
    """KIVI's reason to quantise keys per channel: one channel 100 times larger than the others sets
    its own scale, not theirs. Per token, every key's scale would span the outlier."""
    keys = torch.randn(1, 1, 32, 8, generator=torch.Generator().manual_seed(0))
    keys[..., 3] *= 100  # an outlier channel
    cache = QuantizedKVCache(1, 1, 32, 8, key_bits=4, value_bits=4, group_size=32)
    cache.append(keys, keys)
    stored_keys, stored_values = cache.append(keys[:, :, :0], keys[:, :, :0])  # dequantised
    others = [c for c in range(8) if c != 3]
    key_error = (stored_keys - keys)[..., others].abs().max()
    assert key_error < 0.3  # half a step of the small channels' own range
    value_error = (stored_values - keys)[..., others].abs().max()
    assert value_error > 2  # values per token: the outlier's range swamps them
