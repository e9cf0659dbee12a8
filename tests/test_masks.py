import pytest
import torch
from attnbook import causal_mask, combine_masks, padding_mask


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_causal_mask_blocks_the_future_and_leaves_n_n_plus_1_over_2(n):
    mask = causal_mask(n)
    assert mask.dtype == torch.bool and mask.shape == (n, n)
    assert int((~mask).sum()) == n * (n + 1) // 2
    for i in range(n):
        for j in range(n):
            assert bool(mask[i, j]) == (j > i)


def test_causal_mask_matches_pytorch_generator():
    reference = torch.nn.Transformer.generate_square_subsequent_mask(5)  # float, -inf = blocked
    assert torch.equal(causal_mask(5), torch.isneginf(reference))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_causal_mask_rejects_bad_n(bad):
    with pytest.raises(ValueError, match="positive int"):
        causal_mask(bad)


def test_padding_mask_hand_computed():
    mask = padding_mask([3, 1, 4], max_len=5)
    expected = torch.tensor(
        [
            [False, False, False, True, True],
            [False, True, True, True, True],
            [False, False, False, False, True],
        ]
    )
    assert torch.equal(mask, expected)
    assert padding_mask(torch.tensor([2, 2])).shape == (2, 2)  # max_len defaults to the longest


def test_padding_mask_bad_inputs():
    with pytest.raises(ValueError, match="max_len=2"):
        padding_mask([3, 1], max_len=2)
    with pytest.raises(ValueError, match=">= 0"):
        padding_mask([3, -1])
    with pytest.raises(TypeError, match="integers"):
        padding_mask(torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        padding_mask(torch.ones(2, 2, dtype=torch.long))


def test_combine_masks_is_a_broadcast_or():
    causal = causal_mask(3)
    pad = padding_mask([2, 3])[:, None, :]  # (B, 1, Tk)
    both = combine_masks(causal, None, pad)
    assert both.shape == (2, 3, 3)
    assert torch.equal(both[0], causal | torch.tensor([False, False, True]))
    assert torch.equal(both[1], causal)
    assert combine_masks(None, None) is None
    with pytest.raises(TypeError, match="bool"):
        combine_masks(causal, torch.zeros(3, 3))


def test_causal_mask_with_key_len_is_the_bottom_right_block_of_the_causal_mask():
    for start, new in [(0, 3), (4, 2), (5, 4), (7, 1)]:
        assert torch.equal(causal_mask(new, key_len=start + new), causal_mask(start + new)[start:])
    assert causal_mask(3, key_len=2).tolist() == [[True, True], [False, True], [False, False]]
    with pytest.raises(ValueError, match="key_len must be a positive int"):
        causal_mask(3, key_len=0)


@pytest.mark.parametrize("query_len, key_len", [(1, 1), (3, 3), (2, 7), (7, 2), (5, 9)])
def test_the_position_arithmetic_by_hand(query_len, key_len):
    """key_minus_query, the key stop and the first query, against loops over the definition: query
    row t is token key_len - query_len + t (bottom right); every mask and tiled loop builds on these."""
    from attnbook.masks import causal_first_query, causal_key_stop, key_minus_query

    offset = key_len - query_len
    by_hand = torch.tensor([[j - (offset + i) for j in range(key_len)] for i in range(query_len)])
    assert torch.equal(key_minus_query(query_len, key_len), by_hand)
    for query_start in range(query_len):  # a tile of the queries and keys
        for key_start in range(key_len):
            tile = key_minus_query(query_len, key_len, query_start=query_start, rows=1,
                                   key_start=key_start, cols=key_len - key_start)
            assert torch.equal(tile, by_hand[query_start : query_start + 1, key_start:])
    causal = causal_mask(query_len, key_len=key_len)
    for stop in range(1, query_len + 1):  # keys seen by the rows before stop: the last row's
        seen = (~causal[:stop]).any(0).nonzero().flatten().tolist()
        assert causal_key_stop(stop, query_len, key_len) == (max(seen) + 1 if seen else 0)
    for key in range(key_len):
        rows = (~causal[:, key]).nonzero().flatten().tolist()
        assert causal_first_query(key, query_len, key_len) == (min(rows) if rows else query_len)


def test_attention_mask_for_heads_lives_in_masks():
    from attnbook.masks import attention_mask_for_heads
    from attnbook.multihead import attention_mask_for_heads as reexported

    assert reexported is attention_mask_for_heads
    padding = padding_mask([2, 3], 3)
    combined = attention_mask_for_heads(causal_mask(3), padding, 2, 3, 3)
    assert torch.equal(combined, causal_mask(3) | padding[:, None, None, :])
