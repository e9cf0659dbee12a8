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


def test_is_causal_uses_the_one_causal_mask():
    """attention.py has no causal mask of its own: is_causal goes through masks.causal_mask."""
    import attnbook.attention as attention_module

    assert not hasattr(attention_module, "_causal_mask")
    assert attention_module.causal_mask is causal_mask


def test_attention_mask_for_heads_lives_in_masks():
    from attnbook.masks import attention_mask_for_heads
    from attnbook.multihead import attention_mask_for_heads as reexported

    assert reexported is attention_mask_for_heads
    padding = padding_mask([2, 3], 3)
    combined = attention_mask_for_heads(causal_mask(3), padding, 2, 3, 3)
    assert torch.equal(combined, causal_mask(3) | padding[:, None, None, :])
