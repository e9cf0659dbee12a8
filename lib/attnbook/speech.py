"""Chapter 10's "CTC vs seq2seq": two ways to turn a sequence of speech frames into a
label sequence whose alignment to the frames is unknown, on the same encoder (the CTC
algorithm itself is in :mod:`attnbook.ctc`).

- :class:`ConvStem`: the convolutional front end of every speech encoder in the book,
  this chapter's and Whisper's: 1D convolutions of kernel 3, each followed by GELU.
- :class:`SpeechEncoder`: that stem, a fixed position table, pre-norm encoder blocks
  and a final norm; Whisper's encoder is one, and so is
- :class:`FeatureEncoder`: ``features (B, T, n_features)`` -> one vector per output
  frame (a one-convolution stem, sinusoidal positions, the padding masked).
- :class:`CTCModel`: the encoder and one classification per frame over the classes plus
  a *blank*, trained with ``F.ctc_loss`` (PyTorch's fused version of
  :func:`~attnbook.ctc.ctc_loss`) and read by :func:`~attnbook.ctc.ctc_greedy_decode`.
- :class:`Seq2SeqSpeechModel`: the same encoder plus the library's
  :class:`~attnbook.models.TransformerDecoder`, which writes ``<bos> y1 y2 ... <eos>``
  one token at a time, reading the frames through cross-attention; trained with
  teacher-forced cross-entropy, decoded by :func:`attnbook.generate` (it has the
  decoding interface of :mod:`attnbook.models`).

Both read the spoken-digit task of :func:`attnbook.data.make_digit_sequences` and are
scored with :func:`attnbook.metrics.error_rate`. Decoding runs in eval mode without
gradients and restores the caller's mode.

Shapes: feature sequences ``(B, T, n_features)`` with ``lengths (B,)``; encoder output
``(B, T', d)`` with ``T' = (T - 1) // stride + 1``; CTC log-probabilities ``(B, T',
num_classes + 1)``; label tokens ``(B, U)``; seq2seq logits ``(B, U, num_classes + 2)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import stack_blocks
from .ctc import ctc_greedy_decode
from .generation import generate
from .masks import padding_mask
from .models import TransformerDecoder
from .positions import sinusoidal_encoding
from .utils import check_positive_int, eval_mode


class ConvStem(nn.Module):
    """``(B, n_in, T) -> (B, d_model, T')``: one 1D convolution per entry of
    ``strides`` (kernel 3, padding 1, the first from ``n_in`` channels, the others from
    ``d_model``), each followed by GELU. A stride of 2 halves the frame rate, so ``T'``
    is ``T`` after ``T -> (T - 1) // s + 1`` for each stride ``s``
    (:meth:`output_lengths`). Whisper's stem is ``strides=(1, 2)``; chapter 10's
    encoder has one convolution, ``strides=(2,)``.
    """

    def __init__(self, n_in: int, d_model: int, strides=(1, 2)):
        super().__init__()
        n_in, d_model = (
            check_positive_int("n_in", n_in),
            check_positive_int("d_model", d_model),
        )
        strides = tuple(strides)
        if not strides or any(s not in (1, 2) for s in strides):
            raise ValueError(
                f"strides must be a non-empty tuple of 1s and 2s, got {strides!r}"
            )
        self.strides = strides
        self.convs = nn.ModuleList(
            nn.Conv1d(
                n_in if i == 0 else d_model, d_model, kernel_size=3, stride=s, padding=1
            )
            for i, s in enumerate(strides)
        )

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many output frames ``lengths`` input frames give."""
        for s in self.strides:
            lengths = torch.div(lengths - 1, s, rounding_mode="floor") + 1
        return lengths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.gelu(conv(x))  # (B, d, T) at the frame rate so far
        return x


class SpeechEncoder(nn.Module):
    """The encoder of every speech model in the book, Whisper's and chapter 10's: ``x
    (B, n_in, T) -> (B, T', d)``.

    A :class:`ConvStem` with ``strides``, a fixed position table ``positions
    (max_frames, d)`` added, pre-norm encoder blocks (exact GELU, hidden ``4 d``) in
    which ``key_padding_mask (B, T')`` hides padded frames, and a final LayerNorm. ``x``
    is cast to the weights' dtype first (features and log-mels are float32; the model
    may be bf16).
    """

    def __init__(
        self,
        n_in: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        strides,
        positions: torch.Tensor,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.stem = ConvStem(n_in, d_model, strides)
        if positions.dim() != 2 or positions.shape[1] != d_model:
            raise ValueError(
                f"positions must be (max_frames, d_model={d_model}), got "
                f"{tuple(positions.shape)}"
            )
        # fixed: rebuilt with the model, not saved with its weights
        self.register_buffer("positions", positions, persistent=False)
        self.blocks = stack_blocks(
            num_layers,
            d_model,
            num_heads,
            4 * d_model,
            dropout,
            activation="gelu",
            norm="pre",
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, key_padding_mask=None) -> torch.Tensor:
        # (B, T', d)
        x = self.stem(x.to(self.stem.convs[0].weight.dtype)).transpose(1, 2)
        x = x + self.positions[: x.shape[1]].to(x.dtype)  # (B, T', d)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)  # (B, T', d)
        return self.norm(x)


class FeatureEncoder(SpeechEncoder):
    """``features (B, T, n_features)`` -> ``(B, T', d)``: the :class:`SpeechEncoder`
    with a one-convolution stem (kernel 3, GELU; with ``stride=2`` it halves the frame
    rate, as Whisper's stem does) and the sinusoidal encoding
    (:func:`~attnbook.positions.sinusoidal_encoding`, up to ``max_frames`` output
    frames), the padded frames zeroed before the stem and masked in every block. One
    vector per output frame.
    """

    def __init__(
        self,
        n_features: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        stride: int = 2,
        dropout: float = 0.0,
        max_frames: int = 1024,
    ):
        super().__init__(
            n_features,
            d_model,
            num_heads,
            num_layers,
            strides=(stride,),
            positions=sinusoidal_encoding(max_frames, d_model),
            dropout=dropout,
        )
        self.n_features, self.stride = n_features, stride

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many output frames ``lengths`` input frames give: ``(L - 1) // stride +
        1`` (the stem's count)."""
        return self.stem.output_lengths(lengths)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        """Returns ``(hidden (B, T', d), key_padding_mask (B, T'), output lengths
        (B,))``."""
        if not isinstance(features, torch.Tensor) or not features.is_floating_point():
            raise TypeError(
                f"features must be a float tensor (B, T, n_features), "
                f"got {getattr(features, 'dtype', type(features))}"
            )
        if features.dim() != 3 or features.shape[-1] != self.n_features:
            raise ValueError(
                f"features must be (B, T, n_features={self.n_features}), got "
                f"{tuple(features.shape)}"
            )
        if (
            not isinstance(lengths, torch.Tensor)
            or lengths.shape != features.shape[:1]
            or int(lengths.min()) < 1
            or int(lengths.max()) > features.shape[1]
        ):
            got = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
            raise ValueError(
                f"lengths must be (B={features.shape[0]},) in [1, "
                f"{features.shape[1]}], got {got}"
            )
        frames = int(self.output_lengths(torch.tensor(features.shape[1])))  # T'
        if frames > self.positions.shape[0]:
            raise ValueError(
                f"{features.shape[1]} frames give {frames} encoder positions, more "
                f"than the {self.positions.shape[0]} of max_frames"
            )
        # (B, T): True on real frames
        keep = ~padding_mask(lengths, features.shape[1]).to(features.device)
        lengths = self.output_lengths(lengths)  # (B,)
        # (B, T')
        key_padding_mask = padding_mask(lengths, frames).to(features.device)
        # (B, F, T) with the padded frames zeroed -> (B, T', d)
        hidden = super().forward(
            (features * keep[..., None]).transpose(1, 2), key_padding_mask
        )
        return hidden, key_padding_mask, lengths


class CTCModel(nn.Module):
    """A :class:`FeatureEncoder` and one classification per output frame over
    ``num_classes + 1`` outputs (0 is the CTC blank, class ``c`` is output ``c + 1``),
    trained with ``F.ctc_loss`` to sum over every alignment.

    ``forward(features (B, T, F), lengths (B,))`` returns ``(log_probs (B, T',
    num_classes + 1), output lengths (B,))``: float32 log-probabilities (whatever the
    model's dtype: the CTC loss sums them over every frame) and how many of the ``T'``
    frames are real in each sequence.
    """

    def __init__(
        self,
        n_features: int,
        num_classes: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        *,
        stride: int = 2,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.encoder = FeatureEncoder(
            n_features, d_model, num_heads, num_layers, stride=stride, dropout=dropout
        )
        self.head = nn.Linear(d_model, num_classes + 1)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        hidden, _, lengths = self.encoder(features, lengths)  # (B, T', d), (B,)
        # (B, T', C + 1) float32, (B,)
        return self.head(hidden).float().log_softmax(dim=-1), lengths

    def loss(self, features, lengths, targets, target_lengths) -> torch.Tensor:
        """CTC loss (mean over the batch of the per-sequence loss divided by its target
        length)."""
        log_probs, lengths = self(features, lengths)  # (B, T', C + 1)
        # (B, U): classes shifted past the blank; padding is ignored
        labels = (targets + 1).clamp_min(0)
        return F.ctc_loss(
            log_probs.transpose(0, 1),
            labels,
            lengths,
            target_lengths,
            blank=0,
            zero_infinity=True,
        )

    def decode(self, features, lengths) -> list[list[int]]:
        """Greedy CTC decoding; class ids ``0 .. num_classes - 1`` per sequence. Runs in
        eval mode without gradients (the caller's mode is restored)."""
        with eval_mode(self):
            log_probs, lengths = self(features, lengths)  # (B, T', C + 1), (B,)
        return [
            [c - 1 for c in path]
            for path in ctc_greedy_decode(log_probs, lengths, blank=0)
        ]


class Seq2SeqSpeechModel(nn.Module):
    """The same encoder, plus a :class:`~attnbook.models.TransformerDecoder` that writes
    the label sequence one token at a time, reading the frames through cross-attention:
    ``<bos> y1 y2 ... <eos>`` (``bos = num_classes``, ``eos = num_classes + 1``).

    ``forward(features (B, T, F), lengths (B,), tokens (B, U)) -> logits (B, U,
    num_classes + 2)``;
    :meth:`decode` writes the labels with :func:`attnbook.generate` (the decoding
    interface: ``features=, lengths=`` are its inputs).
    """

    def __init__(
        self,
        n_features: int,
        num_classes: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_encoder_layers: int = 2,
        num_decoder_layers: int = 1,
        max_len: int = 16,
        *,
        stride: int = 2,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.max_len, self.num_heads = check_positive_int("max_len", max_len), num_heads
        self.vocab_size = num_classes + 2  # the classes, <bos> and <eos>
        self.bos, self.eos = num_classes, num_classes + 1
        self.encoder = FeatureEncoder(
            n_features,
            d_model,
            num_heads,
            num_encoder_layers,
            stride=stride,
            dropout=dropout,
        )
        self.decoder = TransformerDecoder(
            num_classes + 2,
            d_model,
            num_heads,
            num_decoder_layers,
            max_len,
            hidden=4 * d_model,
            dropout=dropout,
            positions="learned",
            head_bias=True,
        )

    def forward(self, features, lengths, tokens) -> torch.Tensor:
        # (B, T', d), (B, T')
        memory, key_padding_mask, _ = self.encoder(features, lengths)
        return self.decoder(tokens, memory, key_padding_mask)  # (B, U, C + 2)

    def loss(self, features, lengths, targets, target_lengths) -> torch.Tensor:
        """Teacher-forced cross-entropy of ``y1 .. yU <eos>`` given ``<bos> y1 ..
        yU``."""
        B, U = targets.shape
        positions = torch.arange(U + 1, device=targets.device)[None, :]  # (1, U + 1)
        # (B, U + 1)
        outputs = torch.cat([targets, targets.new_full((B, 1), -1)], dim=1)
        # <eos> after the labels
        outputs = torch.where(positions == target_lengths[:, None], self.eos, outputs)
        # ignored padding
        outputs = torch.where(positions > target_lengths[:, None], -100, outputs)
        # (B, U + 1)
        inputs = torch.cat(
            [targets.new_full((B, 1), self.bos), outputs[:, :-1].clamp_min(0)], dim=1
        )
        logits = self(features, lengths, inputs)  # (B, U + 1, C + 2)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), outputs.flatten(), ignore_index=-100
        )

    # the decoding interface of attnbook.models, driven by attnbook.generate
    def decoding_context(self, batch_size: int, features=None, lengths=None):
        """``(memory (B, T', d), key_padding_mask (B, T'))`` for ``features (B, T, F)``,
        ``lengths (B,)``, moved to the model's device."""
        if features is None or lengths is None:
            raise ValueError(
                "Seq2SeqSpeechModel generates from speech: pass features=(B, T, F) and "
                "lengths=(B,)"
            )
        device = next(self.parameters()).device
        features, lengths = (
            torch.as_tensor(features).to(device),
            torch.as_tensor(lengths).to(device),
        )
        if features.shape[0] != batch_size:
            raise ValueError(
                f"features have batch size {features.shape[0]} but the prompt has "
                f"{batch_size}"
            )
        # (B, T', d), (B, T')
        memory, key_padding_mask, _ = self.encoder(features, lengths)
        return memory, key_padding_mask

    def decoding_caches(self, batch_size: int, context):
        return self.decoder.make_caches(batch_size, context[0].shape[1])

    def decode_step(self, tokens, context, caches) -> torch.Tensor:
        memory, key_padding_mask = context
        # (B, U, C + 2)
        return self.decoder(tokens, memory, key_padding_mask, caches, check_ids=False)

    def decode(
        self, features, lengths, max_new_tokens: int | None = None
    ) -> list[list[int]]:
        """Greedy decoding with the KV cache until ``<eos>`` (or ``max_new_tokens``, at
        most and by default ``max_len - 1``); class ids per sequence. Runs in eval mode
        without gradients (the caller's mode is restored)."""
        limit = self.max_len - 1  # the prompt <bos> takes one position
        max_new_tokens = (
            limit
            if max_new_tokens is None
            else check_positive_int("max_new_tokens", max_new_tokens)
        )
        if max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens must be at most max_len - 1 = {limit}, got "
                f"{max_new_tokens}"
            )
        device = next(self.parameters()).device
        # (B, 1)
        prompt = torch.full(
            (len(features), 1), self.bos, dtype=torch.long, device=device
        )
        with eval_mode(self):
            tokens = generate(
                self,
                prompt,
                max_new_tokens,
                end_token=self.eos,
                suppress=[self.bos],
                features=features,
                lengths=lengths,
            )  # (B, 1 + new)
        sequences = tokens[:, 1:].cpu().tolist()
        return [
            seq[: seq.index(self.eos)] if self.eos in seq else seq for seq in sequences
        ]


__all__ = [
    "CTCModel",
    "ConvStem",
    "FeatureEncoder",
    "Seq2SeqSpeechModel",
    "SpeechEncoder",
]
