"""Audio: the log-mel front end against librosa (and its cached filterbank), WAV files, and Griffin-Lim."""

import json
import math
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from attnbook import audio
from conftest import require

librosa = require("librosa")

CLIPS = Path(__file__).resolve().parents[1] / "book" / "data" / "speech"


def librosa_log_mel(samples: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """Whisper's recipe written with librosa's STFT and mel filters, in float64."""
    filters = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels, dtype=np.float64)
    stft = librosa.stft(samples.astype(np.float64), n_fft=400, hop_length=160, window="hann", center=True,
                        pad_mode="reflect")
    mel = filters @ np.abs(stft[:, :-1]) ** 2
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


# --- front end ------------------------------------------------------------------------------------


def test_mel_scale_matches_librosa_slaney():
    frequencies = np.array([0.0, 100.0, 999.0, 1000.0, 1001.0, 4000.0, 8000.0])
    np.testing.assert_allclose(audio.hz_to_mel(frequencies), librosa.hz_to_mel(frequencies), rtol=1e-12)
    mels = np.linspace(0, 40, 9)
    np.testing.assert_allclose(audio.mel_to_hz(mels), librosa.mel_to_hz(mels), rtol=1e-12)
    np.testing.assert_allclose(audio.mel_to_hz(audio.hz_to_mel(frequencies)), frequencies, atol=1e-9)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filterbank_matches_librosa(n_mels):
    ours = audio.mel_filterbank(16000, 400, n_mels)
    theirs = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)
    assert ours.shape == (n_mels, 201)
    np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-8)


def test_log_mel_matches_librosa_on_a_clip_padded_to_30_s():
    clip, rate = audio.read_wav(CLIPS / "clip1.wav")
    assert rate == 16000
    ours = audio.log_mel_spectrogram(clip, padding=audio.N_SAMPLES - clip.numel())
    assert ours.shape == (80, 3000)
    theirs = librosa_log_mel(audio.pad_or_trim(clip).numpy())
    assert np.abs(ours.numpy() - theirs).max() < 1e-4


def test_log_mel_matches_transformers_whisper_feature_extractor():
    transformers = require("transformers")
    # built offline with Whisper's settings: 80 bands; 16 kHz, n_fft 400, hop 160 and 30 s are its defaults
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    assert (extractor.sampling_rate, extractor.n_fft, extractor.hop_length, extractor.n_samples) == \
        (16000, 400, 160, audio.N_SAMPLES)
    np.testing.assert_allclose(extractor.mel_filters.T, audio.mel_filterbank().numpy(), atol=1e-8)
    for name in ("clip1.wav", "clip4.wav"):
        clip, _ = audio.read_wav(CLIPS / name)
        theirs = extractor(clip.numpy(), sampling_rate=16000, return_tensors="np").input_features[0]
        ours = audio.log_mel_spectrogram(audio.pad_or_trim(clip))
        assert theirs.shape == ours.shape == (80, 3000)
        # 1e-4 of the scaled log is 0.09 % of a band's power; both compute in float32
        assert np.abs(ours.numpy() - theirs).max() < 1e-4


def test_log_mel_matches_librosa_on_noise_without_padding():
    clip = torch.randn(16000, generator=torch.Generator().manual_seed(0)) * 0.1
    ours = audio.log_mel_spectrogram(clip)
    assert ours.shape == (80, 100)  # 100 frames a second
    assert np.abs(ours.numpy() - librosa_log_mel(clip.numpy())).max() < 1e-4


def test_log_mel_floor_is_8_below_the_maximum_before_scaling():
    clip = torch.zeros(16000)
    clip[4000:4400] = torch.sin(torch.arange(400) * 0.3)
    log_mel = audio.log_mel_spectrogram(clip)
    assert math.isclose(float(log_mel.max() - log_mel.min()), 2.0, rel_tol=1e-6)  # 8 / 4 after scaling


def test_log_mel_rejects_bad_input():
    with pytest.raises(ValueError, match="16000"):
        audio.log_mel_spectrogram(torch.zeros(1000), sample_rate=8000)
    with pytest.raises(ValueError, match="empty"):
        audio.log_mel_spectrogram(torch.zeros(0))
    with pytest.raises(ValueError, match="1D"):
        audio.log_mel_spectrogram(torch.zeros(2, 1000))
    with pytest.raises(TypeError, match="float"):
        audio.log_mel_spectrogram(torch.zeros(1000, dtype=torch.int16))
    with pytest.raises(TypeError, match="tensor"):
        audio.log_mel_spectrogram([0.0] * 1000)
    with pytest.raises(ValueError, match="more than 200"):
        audio.log_mel_spectrogram(torch.zeros(100))
    with pytest.raises(ValueError, match="padding"):
        audio.log_mel_spectrogram(torch.zeros(1000), padding=-1)
    with pytest.raises(ValueError, match="f_min"):
        audio.mel_filterbank(16000, 400, 80, f_max=9000)
    with pytest.raises(ValueError, match="n_mels"):
        audio.mel_filterbank(16000, 400, 0)


def test_log_mel_builds_each_filterbank_once(monkeypatch):
    # issue 22, bug 4: the filterbank was rebuilt on every call (mel_to_hz ran once per call)
    audio._cached_filterbank.cache_clear()
    builds = []
    mel_to_hz = audio.mel_to_hz
    monkeypatch.setattr(audio, "mel_to_hz", lambda mel: builds.append(1) or mel_to_hz(mel))
    clip = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    first = audio.log_mel_spectrogram(clip, n_mels=37)
    second = audio.log_mel_spectrogram(clip, n_mels=37)
    assert len(builds) == 1
    assert audio._cached_filterbank.cache_info().hits == 1
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_filterbank_hands_out_copies_of_the_cache():
    first, second = audio.mel_filterbank(), audio.mel_filterbank()
    assert first.data_ptr() != second.data_ptr()
    first.zero_()  # a caller changing its filters in place ...
    torch.testing.assert_close(audio.mel_filterbank(), second, rtol=0, atol=0)  # ... changes nobody else's
    assert audio.mel_filterbank(device="cpu").device.type == "cpu"


def test_sizes_accept_numpy_ints_and_reject_bools():
    torch.testing.assert_close(audio.mel_filterbank(np.int64(16000), np.int64(400), np.int64(80)),
                               audio.mel_filterbank(16000, 400, 80))
    with pytest.raises(ValueError, match="n_mels must be a positive int, got True"):
        audio.mel_filterbank(16000, 400, True)
    with pytest.raises(ValueError, match="n_fft"):
        audio.mel_filterbank(16000, 0, 80)
    with pytest.raises(ValueError, match="hop_length"):
        audio.griffin_lim(torch.rand(201, 10), hop_length=0)
    with pytest.raises(ValueError, match="length"):
        audio.pad_or_trim(torch.ones(4), 0)


def test_pad_or_trim():
    assert audio.pad_or_trim(torch.ones(10), 16).tolist() == [1.0] * 10 + [0.0] * 6
    assert audio.pad_or_trim(torch.ones(20), 16).shape == (16,)
    assert audio.pad_or_trim(torch.ones(10)).shape == (audio.N_SAMPLES,)


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
    clip, rate = audio.read_wav(tmp_path / "a.wav")
    assert rate == 22050 and clip.dtype == torch.float32
    assert clip.tolist() == [0.0, 0.5, -1.0, 32767 / 32768]


def test_read_wav_rejects_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="no WAV"):
        audio.read_wav(tmp_path / "missing.wav")
    _write_wav(tmp_path / "stereo.wav", np.zeros(8, dtype="<i2"), channels=2)
    with pytest.raises(ValueError, match="mono 16-bit"):
        audio.read_wav(tmp_path / "stereo.wav")
    _write_wav(tmp_path / "eight.wav", np.zeros(8, dtype="u1"), width=1)
    with pytest.raises(ValueError, match="mono 16-bit"):
        audio.read_wav(tmp_path / "eight.wav")
    (tmp_path / "text.wav").write_text("not a wav")
    with pytest.raises(ValueError, match="not a readable WAV"):
        audio.read_wav(tmp_path / "text.wav")


def test_committed_clips_are_16_khz_mono_and_have_texts():
    texts = dict(line.split("|", 1) for line in (CLIPS / "texts.txt").read_text().splitlines())
    assert 4 <= len(texts) <= 6
    for name in texts:
        clip, rate = audio.read_wav(CLIPS / f"{name}.wav")
        assert rate == 16000 and 1.0 < clip.numel() / rate < 10.0


def test_word_clips_and_their_true_intervals():
    truth = json.loads((CLIPS / "words.json").read_text())
    assert set(truth) == {"words1", "words2"}
    for name, clip_truth in truth.items():
        clip, rate = audio.read_wav(CLIPS / f"{name}.wav")
        assert rate == 16000 and 4.0 < clip.numel() / rate < 6.0
        words = clip_truth["words"]
        assert [word for word, _, _ in words] == clip_truth["text"].split()
        previous_end = 0.0
        for word, start, end in words:
            assert previous_end + 0.1 < start < end <= clip.numel() / rate, (name, word)
            gap = clip[round(previous_end * rate) + 2 : round(start * rate) - 2]
            assert gap.abs().max() == 0, (name, word)  # the silences are digital zeros
            sounding = clip[round(start * rate) : round(end * rate)]
            assert sounding.abs().max() > 0.05 and sounding[:3].abs().max() > 0, (name, word)
            previous_end = end
        assert clip[round(previous_end * rate) + 2 :].abs().max() == 0


# --- noise ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("snr_db", [30, 10, 0, -5])
def test_add_noise_reaches_the_signal_to_noise_ratio(snr_db):
    clip, _ = audio.read_wav(CLIPS / "clip2.wav")
    noisy = audio.add_noise(clip, snr_db, torch.Generator().manual_seed(0))
    noise = noisy - clip
    measured = 10 * math.log10(float(clip.double().pow(2).mean() / noise.double().pow(2).mean()))
    assert abs(measured - snr_db) < 0.05  # 72,000 samples: the noise power is within ~1 % of its mean
    assert abs(float(noise.mean())) < 0.01 * float(noise.std())  # white noise: no offset
    again = audio.add_noise(clip, snr_db, torch.Generator().manual_seed(0))
    assert torch.equal(again, noisy) and noisy.dtype == clip.dtype


def test_add_noise_rejects_bad_input():
    clip = torch.ones(100)
    with pytest.raises(ValueError, match="snr_db"):
        audio.add_noise(clip, float("inf"))
    with pytest.raises(ValueError, match="snr_db"):
        audio.add_noise(clip, "20")
    with pytest.raises(ValueError, match="silent"):
        audio.add_noise(torch.zeros(100), 10)
    with pytest.raises(TypeError, match="generator"):
        audio.add_noise(clip, 10, generator=0)
    with pytest.raises(ValueError, match="1D"):
        audio.add_noise(torch.ones(2, 100), 10)


# --- Griffin-Lim ----------------------------------------------------------------------------------


def test_mel_to_linear_reproduces_the_mel_spectrogram():
    filters = audio.mel_filterbank()
    power = torch.rand(201, 7, generator=torch.Generator().manual_seed(0))  # (201, 7) a power spectrogram
    mel = filters @ power  # (80, 7)
    estimate = audio.mel_to_linear(mel, filters)  # (201, 7)
    inverse = np.linalg.pinv(filters.double().numpy())  # (201, 80)
    least_squares = inverse @ mel.double().numpy()  # (201, 7), may dip below 0
    np.testing.assert_allclose(filters.double().numpy() @ least_squares, mel.numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(estimate.numpy(), np.maximum(least_squares, 0), rtol=1e-4, atol=1e-6)
    assert np.linalg.norm(least_squares) < np.linalg.norm(power.numpy())  # the smallest such spectrum
    with pytest.raises(ValueError, match="n_mels"):
        audio.mel_to_linear(torch.rand(40, 7), filters)


def test_spectral_convergence():
    target = torch.tensor([[3.0, 4.0]])
    assert audio.spectral_convergence(target, target) == 0.0
    assert math.isclose(audio.spectral_convergence(target, torch.zeros(1, 2)), 1.0)
    with pytest.raises(ValueError, match="same shape"):
        audio.spectral_convergence(target, torch.zeros(2, 2))


def test_griffin_lim_recovers_a_consistent_magnitude():
    clip, _ = audio.read_wav(CLIPS / "clip1.wav")
    window = torch.hann_window(400)
    magnitude = torch.stft(clip, 400, 160, window=window, return_complex=True).abs()  # (201, frames)
    waveform, history = audio.griffin_lim(magnitude, num_iters=30, length=clip.numel(),
                                           generator=torch.Generator().manual_seed(0))
    assert waveform.shape == clip.shape and history.shape == (30,)
    assert history[-1] < 0.5 * history[0]
    rebuilt = torch.stft(waveform, 400, 160, window=window, return_complex=True).abs()
    assert audio.spectral_convergence(magnitude, rebuilt) < 0.25


def test_griffin_lim_rejects_bad_input():
    with pytest.raises(ValueError, match="201"):
        audio.griffin_lim(torch.rand(100, 10))
    with pytest.raises(ValueError, match="num_iters"):
        audio.griffin_lim(torch.rand(201, 10), num_iters=0)
    with pytest.raises(ValueError, match="momentum"):
        audio.griffin_lim(torch.rand(201, 10), momentum=1.0)
