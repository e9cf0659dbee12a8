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
from .masks import causal_mask
from .multihead import KVCache
from .positions import LearnedPositions, SinusoidalPositions


def _check_ids(idx: torch.Tensor, vocab_size: int, max_len: int, start: int = 0) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
        raise ValueError(f"token ids must be a (B, T) LongTensor, got {getattr(idx, 'dtype', type(idx))} "
                         f"{tuple(getattr(idx, 'shape', ()))}")
    if start + idx.shape[1] > max_len:
        raise ValueError(f"sequence of {start + idx.shape[1]} tokens exceeds max_len={max_len}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got range [{int(idx.min())}, {int(idx.max())}]")


def _device_and_dtype(model: nn.Module, device, dtype):
    parameter = next(model.parameters())
    return (parameter.device if device is None else device), (parameter.dtype if dtype is None else dtype)


def causal_mask_after(start: int, new: int, device=None) -> torch.Tensor | None:
    """Mask for ``new`` queries at positions ``start .. start+new-1`` over ``start + new`` keys (True = blocked).

    ``None`` when a single new token may see every key (the usual cached generation step).
    """
    if new == 1:
        return None
    return torch.ones(new, start + new, dtype=torch.bool, device=device).triu(diagonal=start + 1)


def _token_embedding(vocab_size: int, d_model: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab_size, d_model)
    nn.init.normal_(embedding.weight, std=0.02)  # as GPT-2: the same scale as the learned positions
    return embedding


def _encoder_stack(num_layers, d_model, num_heads, hidden, dropout, activation, norm) -> nn.ModuleList:
    return nn.ModuleList(EncoderBlock(d_model, num_heads, hidden, dropout, activation, norm) for _ in range(num_layers))


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

    def forward(self, idx: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        start = caches[0].length if caches else 0
        _check_ids(idx, self.vocab_size, self.max_len, start)
        T = idx.shape[1]
        x = self.dropout(self.positions(self.token_embedding(idx), start))  # (B, T, d)
        mask = causal_mask(T, device=idx.device) if caches is None else causal_mask_after(start, T, idx.device)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache=None if caches is None else caches[i])  # (B, T, d)
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
        self.vocab_size, self.max_len = vocab_size, max_len
        self.token_embedding = _token_embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = _encoder_stack(num_layers, d_model, num_heads, hidden, dropout, activation, norm)
        self.final_norm = _final_norm(norm, d_model)
        self.mlm_head = nn.Linear(d_model, vocab_size)
        self.classifier = nn.Linear(d_model, num_classes) if num_classes else None

    def forward(self, idx, key_padding_mask=None):
        _check_ids(idx, self.vocab_size, self.max_len)
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

    ``forward(src (B, S), tgt (B, T), src_padding_mask=None) -> logits (B, T, tgt_vocab_size)``;
    :meth:`encode` gives the memory ``(B, S, d)`` once, :meth:`decode` runs the decoder on it
    (with per-layer self-attention and cross-attention caches from :meth:`make_caches`).
    """

    def __init__(self, src_vocab_size, tgt_vocab_size, d_model, num_heads, num_encoder_layers, num_decoder_layers,
                 max_len, *, hidden=None, dropout=0.0, norm="pre", activation="gelu"):
        super().__init__()
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
        self.max_len, self.num_heads = max_len, num_heads
        self.src_embedding = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model)
        for embedding in (self.src_embedding, self.tgt_embedding):  # std d^-1/2, so after the sqrt(d) scale
            nn.init.normal_(embedding.weight, std=d_model**-0.5)  # tokens and positions are both of size ~1
        self.positions = SinusoidalPositions(d_model)
        self.scale = d_model**0.5  # embeddings scaled by sqrt(d) before adding positions, as in the original
        self.dropout = nn.Dropout(dropout)
        self.encoder_blocks = _encoder_stack(num_encoder_layers, d_model, num_heads, hidden, dropout, activation, norm)
        self.decoder_blocks = nn.ModuleList(
            DecoderBlock(d_model, num_heads, hidden, dropout, activation, norm) for _ in range(num_decoder_layers)
        )
        self.encoder_norm = _final_norm(norm, d_model)
        self.decoder_norm = _final_norm(norm, d_model)
        self.lm_head = nn.Linear(d_model, tgt_vocab_size, bias=False)

    def encode(self, src, src_padding_mask=None):
        _check_ids(src, self.src_vocab_size, self.max_len)
        x = self.dropout(self.positions(self.src_embedding(src) * self.scale))  # (B, S, d)
        for block in self.encoder_blocks:
            x = block(x, key_padding_mask=src_padding_mask)
        return self.encoder_norm(x)  # memory (B, S, d)

    def decode(self, tgt, memory, src_padding_mask=None, caches=None):
        start = caches[0][0].length if caches else 0
        _check_ids(tgt, self.tgt_vocab_size, self.max_len, start)
        T = tgt.shape[1]
        x = self.dropout(self.positions(self.tgt_embedding(tgt) * self.scale, start))  # (B, T, d)
        mask = causal_mask(T, device=tgt.device) if caches is None else causal_mask_after(start, T, tgt.device)
        for i, block in enumerate(self.decoder_blocks):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = block(x, memory, mask, memory_key_padding_mask=src_padding_mask,
                      self_cache=self_cache, cross_cache=cross_cache)
        return self.lm_head(self.decoder_norm(x))  # (B, T, tgt_vocab)

    def forward(self, src, tgt, src_padding_mask=None):
        return self.decode(tgt, self.encode(src, src_padding_mask), src_padding_mask)

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per decoder layer: a self-attention cache (grows) and a static cross-attention cache (filled once)."""
        device, dtype = _device_and_dtype(self, device, dtype)
        head_dim = self.tgt_embedding.embedding_dim // self.num_heads
        return [(KVCache(batch_size, self.num_heads, self.max_len, head_dim, device=device, dtype=dtype),
                 KVCache(batch_size, self.num_heads, memory_len, head_dim, device=device, dtype=dtype, static=True))
                for _ in self.decoder_blocks]
