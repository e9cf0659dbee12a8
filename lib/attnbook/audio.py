"""Audio for speech models: Whisper's log-mel front end, and back from a spectrogram to
a waveform.

- :func:`read_wav` reads the book's committed clips (mono 16-bit PCM) with Python's
  ``wave`` module.
- :func:`log_mel_spectrogram` is Whisper's front end: a 25 ms Hann window (``n_fft=400``
  at 16 kHz), a 10 ms hop (160 samples), 80 Slaney mel filters (:func:`mel_filterbank`,
  built once per size and cached), ``log10`` clamped at ``1e-10``, floored at the
  maximum minus 8 and scaled as ``(x + 4) / 4``;
  :func:`pad_or_trim` cuts or pads audio to Whisper's 30 s window.
- :func:`add_noise` adds white Gaussian noise at a chosen signal-to-noise ratio (for
  robustness tests).
- :func:`griffin_lim` rebuilds a waveform from a magnitude spectrogram (e.g. one
  recovered from a mel spectrogram by :func:`mel_to_linear`);
  :func:`spectral_convergence` measures how well it fits.

Shapes: audio ``(N,)`` samples at 16 kHz; a power or magnitude spectrogram ``(n_fft // 2
+ 1, frames)``; a mel filterbank ``(n_mels, n_fft // 2 + 1)``; a log-mel spectrogram
``(n_mels, frames)``.
"""

from __future__ import annotations

import functools
import math
import wave
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .utils import check_non_negative_int, check_positive_int

SAMPLE_RATE = 16000  # Hz, the only rate Whisper's front end is defined for
N_FFT = 400  # 25 ms window
HOP_LENGTH = 160  # 10 ms hop: 100 frames a second
CHUNK_SECONDS = 30  # Whisper reads 30 s windows
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples
# 3000 mel frames -> 1500 encoder positions after the stride-2 conv
N_FRAMES = N_SAMPLES // HOP_LENGTH


# --- audio files
# ----------------------------------------------------------------------------------


def read_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """Read a mono 16-bit PCM WAV file with Python's ``wave`` module: ``(audio (N,)
    float32 in [-1, 1), rate)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no WAV file at {path}")
    try:
        with wave.open(str(path), "rb") as f:
            channels, width, rate, count = (
                f.getnchannels(),
                f.getsampwidth(),
                f.getframerate(),
                f.getnframes(),
            )
            frames = f.readframes(count)
    except (wave.Error, EOFError) as error:
        raise ValueError(f"{path} is not a readable WAV file: {error}") from error
    if channels != 1 or width != 2:
        raise ValueError(
            f"{path}: expected mono 16-bit PCM, got {channels} channel(s) of "
            f"{8 * width}-bit samples"
        )
    samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0  # (N,)
    return torch.from_numpy(samples.copy()), rate


# --- the log-mel front end
# ------------------------------------------------------------------------


def hz_to_mel(frequency):
    """Slaney's mel scale (librosa's default): linear below 1 kHz (3 mel per 200 Hz),
    logarithmic above."""
    frequency = np.asarray(frequency, dtype=np.float64)
    linear = frequency * 3.0 / 200.0
    log_step = math.log(6.4) / 27.0
    logarithmic = 15.0 + np.log(np.maximum(frequency, 1e-10) / 1000.0) / log_step
    return np.where(frequency >= 1000.0, logarithmic, linear)


def mel_to_hz(mel):
    """The inverse of :func:`hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(
        mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * 200.0 / 3.0
    )


@functools.lru_cache(maxsize=16)
def _cached_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float
) -> torch.Tensor:
    """The filters of :func:`mel_filterbank` as a CPU tensor, computed once per size.
    Never handed out as it is (a caller could change it in place):
    :func:`mel_filterbank` returns a copy."""
    # (F,) Hz of each STFT bin
    fft_frequencies = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    # (n_mels + 2,) Hz
    edges = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))
    widths = np.diff(edges)  # (n_mels + 1,)
    ramps = edges[:, None] - fft_frequencies[None, :]  # (n_mels + 2, F)
    rising = -ramps[:-2] / widths[:-1, None]  # (n_mels, F)
    falling = ramps[2:] / widths[1:, None]  # (n_mels, F)
    weights = np.maximum(0.0, np.minimum(rising, falling))  # (n_mels, F) triangles
    # Slaney normalisation: equal area
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights).float()


def mel_filterbank(
    sample_rate: int = SAMPLE_RATE,
    n_fft: int = N_FFT,
    n_mels: int = 80,
    f_min: float = 0.0,
    f_max: float | None = None,
    *,
    device=None,
) -> torch.Tensor:
    """``(n_mels, n_fft // 2 + 1)`` triangular filters, evenly spaced on the Slaney mel
    scale and area-normalised (each filter's weights times ``2 / bandwidth``), as
    ``librosa.filters.mel``.

    Row ``m`` times a power spectrum ``(n_fft // 2 + 1,)`` is the power in mel band
    ``m``. The filters are computed once per size and cached; each call returns a fresh
    copy on ``device`` (default CPU).
    """
    sample_rate = check_positive_int("sample_rate", sample_rate)
    n_fft = check_positive_int("n_fft", n_fft)
    n_mels = check_positive_int("n_mels", n_mels)
    f_max = sample_rate / 2 if f_max is None else f_max
    if not 0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(
            f"need 0 <= f_min < f_max <= sample_rate / 2 = {sample_rate / 2}, got "
            f"{f_min}, {f_max}"
        )
    # (n_mels, F) on the CPU
    filters = _cached_filterbank(sample_rate, n_fft, n_mels, float(f_min), float(f_max))
    # a copy: the cache stays intact
    return filters.to(device="cpu" if device is None else device, copy=True)


def _check_audio(audio, name: str = "audio") -> torch.Tensor:
    if isinstance(audio, np.ndarray):
        audio = torch.from_numpy(audio)
    if not isinstance(audio, torch.Tensor):
        raise TypeError(
            f"{name} must be a 1D float tensor of samples, got {type(audio).__name__}"
        )
    if audio.dim() != 1:
        raise ValueError(
            f"{name} must be 1D (mono samples), got shape {tuple(audio.shape)}"
        )
    if audio.numel() == 0:
        raise ValueError(f"{name} is empty: expected at least one sample")
    if not audio.is_floating_point():
        raise TypeError(
            f"{name} must hold float samples in [-1, 1], got dtype {audio.dtype}"
        )
    return audio


def _check_sample_rate(sample_rate) -> None:
    if sample_rate != SAMPLE_RATE:
        raise ValueError(
            f"sample_rate must be {SAMPLE_RATE} Hz (Whisper's front end), got "
            f"{sample_rate!r}; "
            "resample the audio first"
        )


def log_mel_spectrogram(
    audio: torch.Tensor,
    sample_rate: int = SAMPLE_RATE,
    n_mels: int = 80,
    padding: int = 0,
) -> torch.Tensor:
    """Whisper's log-mel spectrogram of ``audio (N,)``: ``(n_mels, (N + padding) //
    160)``, in float32.

    ``padding`` zeros are appended first (Whisper pads to 30 s, so the maximum, and with
    it the floor at ``max - 8``, is taken over the padded signal). The STFT is centred
    (reflect padding); its last frame is dropped, as Whisper does. A model in another
    dtype casts it where it enters.
    """
    audio = _check_audio(audio)
    _check_sample_rate(sample_rate)
    padding = check_non_negative_int("padding", padding)
    if audio.numel() + padding <= N_FFT // 2:
        raise ValueError(
            f"audio needs more than {N_FFT // 2} samples (with padding), got "
            f"{audio.numel() + padding}"
        )
    audio = F.pad(audio.float(), (0, padding))  # (N + padding,)
    window = torch.hann_window(N_FFT, device=audio.device)  # (400,)
    # (201, frames + 1)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[:, :-1].abs() ** 2  # (201, frames)
    # (n_mels, 201), cached
    filters = mel_filterbank(SAMPLE_RATE, N_FFT, n_mels, device=audio.device)
    mel = filters @ power  # (n_mels, frames)
    log_mel = torch.clamp(mel, min=1e-10).log10()
    # an 80 dB range below the loudest bin
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0  # roughly in [-1, 1.5]


def pad_or_trim(audio: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """Zero-pad or cut ``audio (N,)`` to ``length`` samples (Whisper's 30 s window)."""
    audio = _check_audio(audio)
    length = check_positive_int("length", length)
    if audio.numel() >= length:
        return audio[:length]
    return F.pad(audio, (0, length - audio.numel()))


def add_noise(
    audio: torch.Tensor, snr_db: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``audio (N,)`` plus white Gaussian noise at a signal-to-noise ratio of ``snr_db``
    decibels.

    The noise's power (mean square) is the audio's divided by ``10 ** (snr_db / 10)``: 0
    dB is noise as loud as the signal, 20 dB noise a hundredth of its power. The audio's
    power is its mean square over all ``N`` samples (pauses included). The noise is
    drawn on the CPU from ``generator`` (e.g. :func:`attnbook.generator`) and moved to
    the audio's device; nothing is clipped.
    """
    audio = _check_audio(audio)
    if (
        isinstance(snr_db, bool)
        or not isinstance(snr_db, (int, float))
        or not math.isfinite(snr_db)
    ):
        raise ValueError(f"snr_db must be a finite number of decibels, got {snr_db!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            "generator must be a torch.Generator or None, got "
            f"{type(generator).__name__}"
        )
    power = audio.double().pow(2).mean()  # the signal's mean square
    if power == 0:
        raise ValueError(
            "audio is silent (all zeros): a signal-to-noise ratio needs a signal"
        )
    # (N,) unit power
    noise = torch.randn(audio.shape, generator=generator, dtype=torch.float64)
    noise = noise * torch.sqrt(power.cpu() / 10 ** (snr_db / 10))
    return audio + noise.to(device=audio.device, dtype=audio.dtype)


# --- from a spectrogram back to a waveform
# --------------------------------------------------------


def mel_to_linear(mel_power: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """Estimate a power spectrogram ``(F, frames)`` from a mel power spectrogram
    ``(n_mels, frames)`` with the pseudo-inverse of the filterbank ``(n_mels, F)``,
    clamped at 0 (power is never negative).

    The mel filters merge many frequency bins into one band; the pseudo-inverse spreads
    each band's power back over its bins (the least-squares solution of smallest norm),
    so detail within a band is lost.
    """
    if (
        mel_power.dim() != 2
        or filters.dim() != 2
        or filters.shape[0] != mel_power.shape[0]
    ):
        raise ValueError(
            "need mel_power (n_mels, frames) and filters (n_mels, F) with the same "
            "n_mels, got "
            f"{tuple(mel_power.shape)} and {tuple(filters.shape)}"
        )
    inverse = torch.linalg.pinv(filters.double().to(mel_power.device))  # (F, n_mels)
    # (F, frames)
    return (inverse @ mel_power.double()).clamp_min(0).to(mel_power.dtype)


def _stft(x, n_fft, hop_length, window):
    # (F, frames)
    return torch.stft(x, n_fft, hop_length, window=window, return_complex=True)


def spectral_convergence(target: torch.Tensor, estimate: torch.Tensor) -> float:
    """``||target - estimate||_F / ||target||_F`` for two magnitude spectrograms (0 is a
    perfect fit)."""
    if target.shape != estimate.shape:
        raise ValueError(
            f"spectrograms must have the same shape, got {tuple(target.shape)} "
            f"and {tuple(estimate.shape)}"
        )
    return float(
        torch.linalg.norm(target - estimate)
        / torch.linalg.norm(target).clamp_min(1e-12)
    )


def griffin_lim(
    magnitude: torch.Tensor,
    *,
    n_fft: int = N_FFT,
    hop_length: int = HOP_LENGTH,
    num_iters: int = 32,
    momentum: float = 0.99,
    length: int | None = None,
    generator: torch.Generator | None = None,
):
    """Griffin and Lim's algorithm: find a waveform whose STFT magnitude is close to
    ``magnitude (F, frames)``.

    Start from random phases; repeat: inverse STFT with the target magnitude and the
    current phases, STFT again, keep only the new phases. ``momentum`` (the "fast"
    variant of Perraudin et al., as in torchaudio) extrapolates the phases; 0 gives the
    original algorithm. Returns ``(waveform (N,), spectral_convergence per iteration
    (num_iters,))``.
    """
    n_fft = check_positive_int("n_fft", n_fft)
    hop_length = check_positive_int("hop_length", hop_length)
    num_iters = check_positive_int("num_iters", num_iters)
    if length is not None:
        length = check_positive_int("length", length)
    if magnitude.dim() != 2 or magnitude.shape[0] != n_fft // 2 + 1:
        raise ValueError(
            f"magnitude must be (n_fft // 2 + 1 = {n_fft // 2 + 1}, frames), got "
            f"{tuple(magnitude.shape)}"
        )
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
    magnitude = magnitude.float()
    window = torch.hann_window(n_fft, device=magnitude.device)  # (n_fft,)
    # (F, frames)
    phase = (
        torch.rand(magnitude.shape, generator=generator).to(magnitude.device)
        * 2
        * math.pi
    )
    # (F, frames) unit complex numbers
    angles = torch.polar(torch.ones_like(magnitude), phase)
    previous = torch.zeros_like(angles)
    history = []
    for _ in range(num_iters):
        # (N,)
        waveform = torch.istft(
            magnitude * angles, n_fft, hop_length, window=window, length=length
        )
        rebuilt = _stft(waveform, n_fft, hop_length, window)  # (F, frames)
        history.append(spectral_convergence(magnitude, rebuilt.abs()))
        angles = rebuilt - previous * (momentum / (1 + momentum))
        angles = angles / angles.abs().clamp_min(1e-16)
        previous = rebuilt
    # (N,)
    waveform = torch.istft(
        magnitude * angles, n_fft, hop_length, window=window, length=length
    )
    return waveform, torch.tensor(history)


__all__ = [
    "add_noise",
    "griffin_lim",
    "hz_to_mel",
    "log_mel_spectrogram",
    "mel_filterbank",
    "mel_to_hz",
    "mel_to_linear",
    "pad_or_trim",
    "read_wav",
    "spectral_convergence",
]
