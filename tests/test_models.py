"""The three families: shapes, what each position may see (causality), parameter counts, bad inputs."""

import pytest
import torch
from attnbook import GPT, EncoderDecoderModel, EncoderOnlyModel

V, D, H, L, MAX = 13, 16, 4, 2, 12
B, T, S = 3, 10, 7


def ids(*shape, vocab=V, seed=0):
    return torch.randint(vocab, shape, generator=torch.Generator().manual_seed(seed))


def count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(params=["pre", "post"])
def norm(request):
    return request.param


def make_gpt(norm="pre"):
    torch.manual_seed(0)
    return GPT(V, D, H, L, MAX, norm=norm).eval()


def make_encoder(norm="pre"):
    torch.manual_seed(0)
    return EncoderOnlyModel(V, D, H, L, MAX, num_classes=5, norm=norm).eval()


def make_seq2seq(norm="pre"):
    torch.manual_seed(0)
    return EncoderDecoderModel(V, V + 4, D, H, L, L, MAX, norm=norm).eval()


# ---------------------------------------------------------------------------------------------
# Shapes


def test_shapes(norm):
    x = ids(B, T)
    assert make_gpt(norm)(x).shape == (B, T, V)
    encoder = make_encoder(norm)
    assert encoder(x).shape == (B, T, D)
    assert encoder.mlm_logits(x).shape == (B, T, V)
    assert encoder.classify(x).shape == (B, 5)
    seq2seq = make_seq2seq(norm)
    src, tgt = ids(B, S, seed=1), ids(B, T, vocab=V + 4, seed=2)
    assert seq2seq.encode(src).shape == (B, S, D)
    assert seq2seq(src, tgt).shape == (B, T, V + 4)


def test_parameter_counts():
    """Each count follows from the blocks: the decoder block adds a cross-attention (4(d^2+d)) and a LayerNorm."""
    block = 4 * (D * D + D) + (8 * D * D + 5 * D) + 2 * 2 * D  # attention + FFN + two LayerNorms
    gpt = V * D + MAX * D + L * block + 2 * D + D * V  # tokens, positions, blocks, final norm, head (no bias)
    assert count(make_gpt()) == gpt
    assert count(make_encoder()) == gpt + V + (D * 5 + 5)  # the MLM head has a bias, plus the classifier
    decoder_block = block + 4 * (D * D + D) + 2 * D
    seq2seq = V * D + (V + 4) * D + L * block + L * decoder_block + 2 * 2 * D + D * (V + 4)
    assert count(make_seq2seq()) == seq2seq


# ---------------------------------------------------------------------------------------------
# Causality: change only the tokens after position t


def change_after(x, t, vocab=V):
    y = x.clone()
    y[:, t + 1 :] = (x[:, t + 1 :] + 1 + ids(*x[:, t + 1 :].shape, vocab=vocab - 1, seed=9)) % vocab  # all differ
    assert (y[:, t + 1 :] != x[:, t + 1 :]).all() and (y[:, : t + 1] == x[:, : t + 1]).all()
    return y


@pytest.mark.parametrize("t", [0, 4, T - 2])
def test_gpt_is_causal(norm, t):
    model, x = make_gpt(norm), ids(B, T)
    with torch.no_grad():
        a, b = model(x), model(change_after(x, t))
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])  # positions <= t cannot see the change
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().amax() > 1e-4  # later positions do


@pytest.mark.parametrize("t", [0, 4, T - 2])
def test_encoder_sees_the_future(norm, t):
    model, x = make_encoder(norm), ids(B, T)
    with torch.no_grad():
        a, b = model(x), model(change_after(x, t))
    assert (a[:, : t + 1] - b[:, : t + 1]).abs().amax(dim=-1).min() > 1e-4  # every position changes


@pytest.mark.parametrize("t", [0, 4, T - 2])
def test_seq2seq_decoder_is_causal_but_sees_all_of_the_source(norm, t):
    model = make_seq2seq(norm)
    src, tgt = ids(B, S, seed=1), ids(B, T, vocab=V + 4, seed=2)
    with torch.no_grad():
        a = model(src, tgt)
        b = model(src, change_after(tgt, t, vocab=V + 4))
        src2 = src.clone()
        src2[:, -1] = (src[:, -1] + 1) % V  # change only the last source token
        c = model(src2, tgt)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().amax() > 1e-4
    assert (a - c).abs().amax(dim=-1).min() > 1e-4  # every target position reads the whole source


def test_encoder_padding_does_not_leak():
    """What sits in padded positions does not change the real tokens' states or the pooled class logits."""
    model, x = make_encoder(), ids(B, T)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[:, 6:] = True
    y = x.clone()
    y[:, 6:] = (x[:, 6:] + 3) % V
    with torch.no_grad():
        torch.testing.assert_close(model(x, padding)[:, :6], model(y, padding)[:, :6])
        torch.testing.assert_close(model.classify(x, padding), model.classify(y, padding))


def test_cached_forward_matches_full_forward():
    model, x = make_gpt(), ids(B, T)
    caches = model.make_caches(B)
    with torch.no_grad():
        full = model(x)
        first = model(x[:, :4], caches)
        rest = torch.cat([model(x[:, t : t + 1], caches) for t in range(4, T)], dim=1)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad inputs


def test_sequence_longer_than_max_len_raises():
    with pytest.raises(ValueError, match="exceeds max_len=12"):
        make_gpt()(ids(B, MAX + 1))
    with pytest.raises(ValueError, match="exceeds max_len=12"):
        make_encoder()(ids(B, MAX + 1))
    with pytest.raises(ValueError, match="exceeds max_len=12"):
        make_seq2seq()(ids(B, MAX + 1), ids(B, 2))


@pytest.mark.parametrize("bad", [V, -1])
def test_token_id_out_of_range_raises(bad):
    x = ids(B, T)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=rf"\[0, {V}\)"):
        make_gpt()(x)
    with pytest.raises(ValueError, match=rf"\[0, {V}\)"):
        make_encoder()(x)


def test_wrong_dtype_or_rank_raises():
    with pytest.raises(ValueError, match="LongTensor"):
        make_gpt()(torch.zeros(B, T))
    with pytest.raises(ValueError, match="LongTensor"):
        make_gpt()(ids(T))


def test_classify_without_head_raises():
    model = EncoderOnlyModel(V, D, H, L, MAX)
    with pytest.raises(ValueError, match="num_classes"):
        model.classify(ids(B, T))
