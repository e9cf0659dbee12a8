"""The three families, built from the library's blocks.

- :class:`EncoderOnlyModel` (BERT-like): bidirectional self-attention; a masked-language-model head
  and a classification head. For understanding tasks (classification, tagging).
- :class:`GPT` (decoder-only): causal self-attention and a next-token head. For generation.
- :class:`EncoderDecoderModel` (T5/BART-like): an encoder reads the source; a decoder generates the
  target with causal self-attention and cross-attention to the encoder's outputs.

Token ids ``idx`` are ``(B, T)`` LongTensors; hidden states ``(B, T, d_model)``; logits
``(B, T, vocab_size)``. Pre-norm by default (``norm="post"`` for the original layout).
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import DecoderBlock, EncoderBlock
from .masks import causal_mask_after  # noqa: F401  (its home is masks; speech and chapter 8 import it here)
from .multihead import KVCache
from .positions import LearnedPositions, SinusoidalPositions
from .utils import check_positive_int, check_token_ids


def _check_sizes(**sizes) -> None:
    """Raise a ``ValueError`` naming the first size that is not a positive int, before any layer is built."""
    for name, value in sizes.items():
        check_positive_int(name, value)


def _device_and_dtype(model: nn.Module, device, dtype):
    parameter = next(model.parameters())
    return (parameter.device if device is None else device), (parameter.dtype if dtype is None else dtype)


def _token_embedding(vocab_size: int, d_model: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab_size, d_model)
    nn.init.normal_(embedding.weight, std=0.02)  # as GPT-2: the same scale as the learned positions
    return embedding


def _encoder_stack(num_layers, d_model, num_heads, hidden, dropout, activation, norm) -> nn.ModuleList:
    return nn.ModuleList(EncoderBlock(d_model, num_heads, hidden, dropout, activation=activation, norm=norm)
                         for _ in range(num_layers))


def _final_norm(norm: str, d_model: int) -> nn.Module:
    """A pre-norm stack ends with a LayerNorm (its residual stream is never normalised otherwise)."""
    return nn.LayerNorm(d_model) if norm == "pre" else nn.Identity()


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, causal blocks, next-token head.

    ``forward(idx (B, T), caches=None) -> logits (B, T, vocab_size)``. With ``caches`` (from
    :meth:`make_caches`), ``idx`` holds only the new tokens; their keys and values are appended to
    each layer's cache and only they are computed.
    """

    def __init__(self, vocab_size, d_model, num_heads, num_layers, max_len, *, hidden=None, dropout=0.0,
                 norm="pre", activation="gelu"):
        super().__init__()
        _check_sizes(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                     max_len=max_len)
        self.vocab_size, self.max_len, self.num_heads = vocab_size, max_len, num_heads
        self.token_embedding = _token_embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = _encoder_stack(num_layers, d_model, num_heads, hidden, dropout, activation, norm)
        self.final_norm = _final_norm(norm, d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def make_caches(self, batch_size: int, device=None, dtype=None) -> list[KVCache]:
        """One preallocated :class:`KVCache` per layer, for up to ``max_len`` tokens
        (on the model's device and in its dtype unless given)."""
        device, dtype = _device_and_dtype(self, device, dtype)
        head_dim = self.token_embedding.embedding_dim // self.num_heads
        return [KVCache(batch_size, self.num_heads, self.max_len, head_dim, device=device, dtype=dtype)
                for _ in self.blocks]

    def forward(self, idx: torch.Tensor, caches: list[KVCache] | None = None, *,
                check_ids: bool = True) -> torch.Tensor:
        """``check_ids=False`` skips the range check of the ids (which reads them back to the host);
        :func:`~attnbook.generation.generate` uses it for the tokens it picked itself."""
        start = caches[0].length if caches else 0
        check_token_ids(idx, self.vocab_size, self.max_len, start=start, check_range=check_ids)
        T = idx.shape[1]
        x = self.dropout(self.positions(self.token_embedding(idx), start))  # (B, T, d)
        for i, block in enumerate(self.blocks):  # causal: the T new queries see the start + T keys up to them
            x = block(x, cache=None if caches is None else caches[i], is_causal=T > 1)  # (B, T, d)
        return self.lm_head(self.final_norm(x))  # (B, T, vocab)


class EncoderOnlyModel(nn.Module):
    """Encoder-only (BERT-like) transformer: every token attends to every other token.

    ``forward(idx (B, T), key_padding_mask=None) -> hidden (B, T, d)``;
    :meth:`mlm_logits` -> ``(B, T, vocab_size)`` (predict masked tokens);
    :meth:`classify` -> ``(B, num_classes)`` from the mean of the non-padding hidden states.
    """

    def __init__(self, vocab_size, d_model, num_heads, num_layers, max_len, *, num_classes=None, hidden=None,
                 dropout=0.0, norm="pre", activation="gelu"):
        super().__init__()
        _check_sizes(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                     max_len=max_len)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.token_embedding = _token_embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = _encoder_stack(num_layers, d_model, num_heads, hidden, dropout, activation, norm)
        self.final_norm = _final_norm(norm, d_model)
        self.mlm_head = nn.Linear(d_model, vocab_size)
        self.classifier = nn.Linear(d_model, num_classes) if num_classes else None

    def forward(self, idx, key_padding_mask=None):
        check_token_ids(idx, self.vocab_size, self.max_len)
        x = self.dropout(self.positions(self.token_embedding(idx)))  # (B, T, d)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)  # (B, T, d): no causal mask
        return self.final_norm(x)

    def mlm_logits(self, idx, key_padding_mask=None):
        return self.mlm_head(self(idx, key_padding_mask))  # (B, T, vocab)

    def classify(self, idx, key_padding_mask=None):
        if self.classifier is None:
            raise ValueError("this model was built without num_classes; pass num_classes=... to classify")
        hidden = self(idx, key_padding_mask)  # (B, T, d)
        if key_padding_mask is None:
            key_padding_mask = torch.zeros_like(idx, dtype=torch.bool)
        keep = (~key_padding_mask).to(hidden.dtype)  # (B, T): 1 for real tokens
        pooled = (hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1)  # (B, d)
        return self.classifier(pooled)  # (B, num_classes)


class EncoderDecoderModel(nn.Module):
    """Encoder–decoder (T5/BART-like) transformer with sinusoidal positions.

    ``forward(source (B, S), target (B, T), source_padding_mask=None) -> logits (B, T, target_vocab_size)``;
    :meth:`encode` gives the memory ``(B, S, d)`` once, :meth:`decode` runs the decoder on it
    (with per-layer self-attention and cross-attention caches from :meth:`make_caches`).
    """

    def __init__(self, source_vocab_size, target_vocab_size, d_model, num_heads, num_encoder_layers,
                 num_decoder_layers, max_len, *, hidden=None, dropout=0.0, norm="pre", activation="gelu"):
        super().__init__()
        _check_sizes(source_vocab_size=source_vocab_size, target_vocab_size=target_vocab_size, d_model=d_model,
                     num_heads=num_heads, num_encoder_layers=num_encoder_layers,
                     num_decoder_layers=num_decoder_layers, max_len=max_len)
        self.source_vocab_size, self.target_vocab_size = source_vocab_size, target_vocab_size
        self.max_len, self.num_heads = max_len, num_heads
        self.source_embedding = nn.Embedding(source_vocab_size, d_model)
        self.target_embedding = nn.Embedding(target_vocab_size, d_model)
        for embedding in (self.source_embedding, self.target_embedding):  # std d^-1/2, so after the sqrt(d) scale
            nn.init.normal_(embedding.weight, std=d_model**-0.5)  # tokens and positions are both of size ~1
        self.positions = SinusoidalPositions(d_model)
        self.scale = d_model**0.5  # embeddings scaled by sqrt(d) before adding positions, as in the original
        self.dropout = nn.Dropout(dropout)
        self.encoder_blocks = _encoder_stack(num_encoder_layers, d_model, num_heads, hidden, dropout, activation, norm)
        self.decoder_blocks = nn.ModuleList(
            DecoderBlock(d_model, num_heads, hidden, dropout, activation=activation, norm=norm)
            for _ in range(num_decoder_layers)
        )
        self.encoder_norm = _final_norm(norm, d_model)
        self.decoder_norm = _final_norm(norm, d_model)
        self.lm_head = nn.Linear(d_model, target_vocab_size, bias=False)

    def encode(self, source, source_padding_mask=None):
        check_token_ids(source, self.source_vocab_size, self.max_len, name="source ids")
        x = self.dropout(self.positions(self.source_embedding(source) * self.scale))  # (B, S, d)
        for block in self.encoder_blocks:
            x = block(x, key_padding_mask=source_padding_mask)
        return self.encoder_norm(x)  # memory (B, S, d)

    def decode(self, target, memory, source_padding_mask=None, caches=None, *, check_ids: bool = True):
        """Decoder logits ``(B, T, target_vocab)`` for ``target (B, T)`` (only the new tokens with ``caches``)."""
        start = caches[0][0].length if caches else 0
        check_token_ids(target, self.target_vocab_size, self.max_len, start=start, check_range=check_ids,
                        name="target ids")
        T = target.shape[1]
        x = self.dropout(self.positions(self.target_embedding(target) * self.scale, start))  # (B, T, d)
        for i, block in enumerate(self.decoder_blocks):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = block(x, memory, memory_key_padding_mask=source_padding_mask, self_cache=self_cache,
                      cross_cache=cross_cache, is_causal=T > 1)
        return self.lm_head(self.decoder_norm(x))  # (B, T, target_vocab)

    def forward(self, source, target, source_padding_mask=None):
        return self.decode(target, self.encode(source, source_padding_mask), source_padding_mask)

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per decoder layer: a self-attention cache (grows) and a static cross-attention cache (filled once)."""
        device, dtype = _device_and_dtype(self, device, dtype)
        head_dim = self.target_embedding.embedding_dim // self.num_heads
        return [(KVCache(batch_size, self.num_heads, self.max_len, head_dim, device=device, dtype=dtype),
                 KVCache(batch_size, self.num_heads, memory_len, head_dim, device=device, dtype=dtype, static=True))
                for _ in self.decoder_blocks]
