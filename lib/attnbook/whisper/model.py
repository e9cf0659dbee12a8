"""Whisper as an encoder–decoder of the library's blocks: an :class:`AudioEncoder` (the
book's :class:`~attnbook.speech.SpeechEncoder`: two 1D convolutions with GELU, the
second with stride 2, :func:`whisper_sinusoids`, pre-norm encoder blocks) and the
library's :class:`~attnbook.models.TransformerDecoder`, with the
decoding interface of :mod:`attnbook.models`."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models import TransformerDecoder
from ..speech import SpeechEncoder
from ..utils import check_positive_int, eval_mode


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


class AudioEncoder(SpeechEncoder):
    """Whisper's encoder: ``mel (B, n_mels, 2S) -> (B, S, d)``.

    The :class:`~attnbook.speech.SpeechEncoder` with two 1D convolutions in its stem
    (kernel 3, GELU after each; the second with stride 2 halves the frame rate to 50 a
    second) and :func:`whisper_sinusoids` for positions; no padding (Whisper pads every
    clip to 30 s).
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
        super().__init__(
            n_mels,
            d_model,
            num_heads,
            num_layers,
            strides=(1, 2),
            positions=whisper_sinusoids(
                check_positive_int("max_frames", max_frames), d_model
            ),
            dropout=dropout,
        )
        self.n_mels, self.max_frames = n_mels, max_frames

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
        return super().forward(mel)  # (B, S, d): every frame attends to every frame


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
        weight = self.encoder.stem.convs[0].weight
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


__all__ = [
    "AudioEncoder",
    "Whisper",
    "whisper_sinusoids",
]
