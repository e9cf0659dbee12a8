"""The three families, built from the library's blocks, and the decoding interface they
share.

- :class:`EncoderOnlyModel` (BERT-like): bidirectional self-attention; a
  masked-language-model head and a classification head. For understanding tasks
  (classification, tagging).
- :class:`GPT` (decoder-only): causal self-attention and a next-token head. For
  generation.
- :class:`EncoderDecoderModel` (T5/BART-like): an encoder reads the source; a
  :class:`TransformerDecoder` generates the target with causal self-attention and
  cross-attention to the encoder's outputs. The same decoder class is Whisper's and
  chapter 10's.

Token ids are ``(B, T)`` LongTensors; hidden states ``(B, T, d_model)``; logits ``(B, T,
vocab_size)``. Pre-norm by default (``norm="post"`` for the original layout).

Every model that generates offers the same small interface to :func:`attnbook.generate`:
``max_len`` and ``vocab_size`` (of the tokens it writes), ``decoding_context(batch_size,
**inputs)`` (what the decoder reads, computed once: ``None`` for a GPT, the encoder's
output otherwise), ``decoding_caches(batch_size, context)`` (one KV cache per layer) and
``decode_step(tokens, context, caches) -> logits (B, T, vocab_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import convert
from .blocks import (
    DecoderBlock,
    DecoderOnlyBlock,
    FeedForward,
    dropout_layer,
    stack_blocks,
)
from .caches import make_caches
from .experts import moe_feed_forward
from .latent import MultiHeadLatentAttention
from .masks import check_sink_tokens, padded_positions
from .modern import GroupedQueryAttention, RMSNorm, SwiGLU
from .multihead import MultiHeadAttention, RotaryMultiHeadAttention
from .positions import (
    LearnedPositions,
    SinusoidalPositions,
    decoder_attention_mask,
    scale_rope,
)
from .utils import check_eps, check_positive_int, check_token_ids, copy_weights


def _check_sizes(**sizes) -> None:
    """Raise a ``ValueError`` naming the first size that is not a positive int, before
    any layer is built."""
    for name, value in sizes.items():
        check_positive_int(name, value)


def _device_and_dtype(model: nn.Module, device, dtype):
    parameter = next(model.parameters())
    return (parameter.device if device is None else device), (
        parameter.dtype if dtype is None else dtype
    )


def _token_embedding(vocab_size: int, d_model: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab_size, d_model)
    # as GPT-2: the same scale as the learned positions
    nn.init.normal_(embedding.weight, std=0.02)
    return embedding


def _final_norm(norm: str, d_model: int, eps: float | None = None) -> nn.Module:
    """A pre-norm stack ends with a LayerNorm, or an RMSNorm with ``norm="rms"`` (its
    residual stream is never normalised otherwise)."""
    if norm == "rms":
        return RMSNorm(d_model, 1e-6 if eps is None else eps)
    if norm == "pre":
        return nn.LayerNorm(d_model) if eps is None else nn.LayerNorm(d_model, eps=eps)
    return nn.Identity()


def mean_pool(
    hidden: torch.Tensor, key_padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean of the real tokens' vectors: ``hidden (B, T, d)``, ``key_padding_mask
    (B, T)`` (``True`` at padding, the library's convention) -> ``(B, d)``. Padding does
    not change a sequence's mean."""
    if hidden.dim() != 3 or (
        key_padding_mask is not None and key_padding_mask.shape != hidden.shape[:2]
    ):
        padding_shape = (
            None if key_padding_mask is None else tuple(key_padding_mask.shape)
        )
        raise ValueError(
            "mean_pool needs hidden (B, T, d) and key_padding_mask (B, T) or None, "
            "got "
            f"{tuple(hidden.shape)} and {padding_shape}"
        )
    if key_padding_mask is None:
        return hidden.mean(dim=1)
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(
            "key_padding_mask must be bool (True at padding), got "
            f"{key_padding_mask.dtype}"
        )
    # (B, T, 1): 1 for real tokens
    keep = (~key_padding_mask).to(hidden.dtype)[..., None]
    return (hidden * keep).sum(1) / keep.sum(1).clamp_min(1)  # (B, d)


GPT_POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")


@dataclass
class GPTConfig:
    """What a :class:`GPT` is: its sizes and the pieces of its blocks (the keywords of
    ``GPT(...)``, which builds one of these).

    ``norm``: ``"post"``, ``"pre"`` or ``"rms"`` (pre-norm with RMSNorm, chapter 17);
    ``activation``: ``"relu"``, ``"gelu"`` or ``"swiglu"`` (``hidden`` is its width,
    ``8 d / 3`` by default); ``positions``: one of ``GPT_POSITIONS`` (chapter 13
    compares them); ``window`` and ``sink_tokens``: sliding-window attention and its
    attention sinks (chapters 13, 18); ``norm_eps`` (1e-5 for LayerNorm, 1e-6 for
    RMSNorm and QK-norm by default), ``num_kv_heads``, ``qk_norm``, ``rope_base``,
    ``bias``, ``tie_embeddings``: today's decoders (chapter 17); ``mla``: the keywords
    of a :class:`~attnbook.latent.MultiHeadLatentAttention` (chapter 18); ``experts``:
    those of a :class:`~attnbook.experts.MoEFeedForward` (chapter 19). Checked when
    built: a bad value raises a ``ValueError`` naming it.
    """

    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    max_len: int
    hidden: int | None = None
    dropout: float = 0.0
    norm: str = "pre"
    activation: str = "gelu"
    positions: str = "learned"
    window: int | None = None
    sink_tokens: int = 0
    norm_eps: float | None = None
    num_kv_heads: int | None = None
    qk_norm: bool = False
    rope_base: float = 10000.0
    bias: bool = True
    tie_embeddings: bool = False
    mla: dict | None = None
    experts: dict | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "max_len"):
            check_positive_int(name, getattr(self, name))
        if self.positions not in GPT_POSITIONS:
            raise ValueError(
                f"positions must be one of {GPT_POSITIONS}, got {self.positions!r}"
            )
        if self.window is not None:
            self.window = check_positive_int("window", self.window)
        self.sink_tokens = _check_sinks(self.sink_tokens, self.window, self.positions)
        if self.norm not in ("post", "pre", "rms"):
            raise ValueError(f"norm must be 'post', 'pre' or 'rms', got {self.norm!r}")
        if self.activation not in ("relu", "gelu", "swiglu"):
            raise ValueError(
                "activation must be one of ['gelu', 'relu', 'swiglu'], got "
                f"{self.activation!r}"
            )
        if self.norm_eps is not None:
            self.norm_eps = check_eps(self.norm_eps, "norm_eps")
        if self.positions != "rope" and self.rope_base != 10000.0:
            raise ValueError(
                f"rope_base needs positions='rope', this GPT has "
                f"positions={self.positions!r}"
            )
        if self.mla is not None:
            _check_latent(self)

    @property
    def layer_norm_eps(self) -> float:
        """The blocks' and the final norm's eps."""
        return self.norm_eps or (1e-6 if self.norm == "rms" else 1e-5)


def _check_sinks(sink_tokens, window, positions) -> int:
    """``sink_tokens`` checked: an int in ``[0, window)``, and none without a window or
    with ALiBi (whose distances the rolling cache's gap after the sinks would hide)."""
    if window is None or (positions == "alibi" and sink_tokens):
        if sink_tokens == 0 and not isinstance(sink_tokens, bool):
            return 0
        raise ValueError(
            f"sink_tokens={sink_tokens!r} needs a window and positions other than "
            f"'alibi', got window={window}, positions={positions!r}"
        )
    return check_sink_tokens(sink_tokens, window)


def _check_latent(config: GPTConfig) -> None:
    """Latent attention needs RoPE (its decoupled RoPE key) and takes no grouped heads,
    QK-norm or window."""
    if not isinstance(config.mla, dict):
        raise TypeError(
            f"mla must be a dict of keywords, got {type(config.mla).__name__}"
        )
    if config.positions != "rope":
        raise ValueError(
            "mla needs positions='rope' (its decoupled RoPE key), got "
            f"{config.positions!r}"
        )
    if config.window is not None or config.num_kv_heads is not None or config.qk_norm:
        raise ValueError(
            "mla shares one latent across the heads and caches every token: build it "
            f"with window=None, num_kv_heads=None, qk_norm=False (got "
            f"window={config.window}, num_kv_heads={config.num_kv_heads}, "
            f"qk_norm={config.qk_norm})"
        )


def decoder_attention(config: GPTConfig) -> nn.Module:
    """The self-attention of a GPT's block: chapter 3's
    :class:`~attnbook.multihead.MultiHeadAttention`, RoPE's
    (:class:`~attnbook.multihead.RotaryMultiHeadAttention`), grouped-query with QK-norm
    (:class:`~attnbook.modern.GroupedQueryAttention`) or latent
    (:class:`~attnbook.latent.MultiHeadLatentAttention`)."""
    c = config
    options = dict(bias=c.bias, dropout=c.dropout)
    rope_base = c.rope_base if c.positions == "rope" else None
    if c.mla is not None:  # chapter 18
        return MultiHeadLatentAttention(
            c.d_model, c.num_heads, rope_base=c.rope_base, **options, **c.mla
        )
    if c.num_kv_heads is not None or c.qk_norm:  # chapter 17
        return GroupedQueryAttention(
            c.d_model, c.num_heads, num_kv_heads=c.num_kv_heads, qk_norm=c.qk_norm,
            qk_norm_eps=c.norm_eps or 1e-6, rope_base=rope_base, **options,
        )  # fmt: skip
    if rope_base is not None:  # chapter 4
        return RotaryMultiHeadAttention(
            c.d_model, c.num_heads, rope_base=rope_base, **options
        )
    return MultiHeadAttention(c.d_model, c.num_heads, **options)


def decoder_feed_forward(config: GPTConfig) -> nn.Module:
    """The feed-forward network of a GPT's block: chapter 5's
    :class:`~attnbook.blocks.FeedForward` (without its biases unless ``bias``), a
    :class:`~attnbook.modern.SwiGLU` or a mixture of them
    (:func:`~attnbook.experts.moe_feed_forward`)."""
    c = config
    if c.experts is not None:  # chapter 19
        return moe_feed_forward(
            c.d_model, c.hidden, c.experts, c.activation, c.bias, c.dropout
        )
    if c.activation == "swiglu":  # chapter 17: the parameters of a 4 d MLP
        hidden = 8 * c.d_model // 3 if c.hidden is None else c.hidden
        return SwiGLU(c.d_model, hidden, bias=c.bias, dropout=c.dropout)
    feed_forward = FeedForward(c.d_model, c.hidden, c.activation, c.dropout)
    if not c.bias:  # the same MLP without its two bias vectors
        feed_forward.fc1.bias = feed_forward.fc2.bias = None
    return feed_forward


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rms":
        return RMSNorm(config.d_model, config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


def decoder_block(config: GPTConfig) -> DecoderOnlyBlock:
    """One block of a GPT: the attention, feed-forward network and norms ``config``
    names, composed into a :class:`~attnbook.blocks.DecoderOnlyBlock`."""
    position = "post" if config.norm == "post" else "pre"  # RMSNorm: pre-norm
    return DecoderOnlyBlock(
        decoder_attention(config),
        decoder_feed_forward(config),
        _norm(config),
        _norm(config),
        norm_position=position,
        dropout=config.dropout,
    )


class GPTDecoding:
    """The decoding interface of a :class:`GPT` (chapter 8; see the module docstring):
    its KV caches and the three calls :func:`~attnbook.generation.generate` makes."""

    def make_caches(
        self,
        batch_size: int,
        device=None,
        dtype=None,
        *,
        kv_bits: int | tuple[int, int] | None = None,
        group_size: int = 32,
    ):
        """One cache per layer for up to ``max_len`` tokens
        (:func:`~attnbook.caches.make_caches`), on the model's device and in its dtype
        unless given (the first keys decide in the end): a
        :class:`~attnbook.caches.KVCache` of ``num_kv_heads`` heads; with a ``window``,
        a :class:`~attnbook.caches.RollingKVCache` of ``window`` entries; with ``mla``,
        a :class:`~attnbook.caches.LatentKVCache`; with ``kv_bits`` (``bits`` or
        ``(key_bits, value_bits)``, 2, 4 or 8), a
        :class:`~attnbook.caches.QuantizedKVCache` (KIVI's: keys per channel, values
        per token, in groups of ``group_size``)."""
        device, dtype = _device_and_dtype(self, device, dtype)
        mla = self.config.mla
        latent = None if mla is None else (mla["kv_lora_rank"], mla["qk_rope_head_dim"])
        return make_caches(
            len(self.blocks), batch_size, self.num_kv_heads, self.max_len,
            self.config.d_model // self.num_heads, window=self.window,
            sink_tokens=self.sink_tokens, latent=latent, kv_bits=kv_bits,
            group_size=group_size, device=device, dtype=dtype,
        )  # fmt: skip

    @property
    def max_sequence_len(self) -> int | None:
        """How long a sequence this GPT can run: ``max_len``, or no limit (``None``)
        with a ``window`` and positions that need no table (``"rope"``, ``"alibi"``,
        ``"none"``): its rolling caches hold ``window`` entries however long the text
        grows, and it streams."""
        if self.window is not None and self.positions is None:
            return None
        return self.max_len

    def decoding_context(self, batch_size: int, key_padding_mask=None, **inputs):
        """``key_padding_mask (B, T0)`` of a left-padded prompt, or ``None``."""
        if inputs:
            raise ValueError(
                "a GPT generates from its prompt (and its key_padding_mask) alone; got "
                f"extra inputs {sorted(inputs)}"
            )
        return key_padding_mask

    def decoding_caches(self, batch_size: int, context):
        return self.make_caches(batch_size)

    def decode_step(self, tokens, context, caches):
        padding = None
        if context is not None:  # the prompt's padding; no new token is padding
            total = (caches[0].length if caches else 0) + tokens.shape[1]
            padding = nn.functional.pad(context, (0, total - context.shape[1]))
        return self(tokens, caches, key_padding_mask=padding, check_ids=False)

    def left_padding(self, key_padding_mask, start: int, query_len: int, key_len: int):
        """A left-padded batch's positions ``(B, query_len)`` and the padding of the
        keys the queries see ``(B, key_len)`` (:func:`~attnbook.masks.
        padded_positions`); attention sinks would be padding, and raise."""
        if self.sink_tokens:
            raise ValueError(
                f"a left-padded batch cannot keep sink_tokens={self.sink_tokens}: a "
                "row's first tokens would be its padding"
            )
        padding = key_padding_mask.to(self.token_embedding.weight.device)
        return padded_positions(padding, start, query_len, key_len)


class GPT(GPTDecoding, nn.Module):
    """Decoder-only transformer (GPT-2's layout): token embedding plus positions, a
    stack of causal blocks, a final norm, a next-token head.

    ``GPT(vocab_size, d_model, num_heads, num_layers, max_len, **options)`` builds the
    model ``config``, a :class:`GPTConfig` of those fields, describes: by default
    learned positions, pre-norm, GELU, biases. ``forward(tokens (B, T), caches=None)
    -> logits (B, T, vocab_size)``; with ``caches`` (chapter 8, :meth:`make_caches`)
    ``tokens`` holds only the new tokens, whose keys and values are appended to each
    layer's cache. ``key_padding_mask (B, start + T)`` (every token so far, ``True`` at
    padding) runs a batch of left-padded prompts: each row's positions count from its
    first real token and no query reads a padded key, so each row's logits are its
    prompt's alone. ``check_ids=False`` skips the ids' range check (which reads them
    back to the host). With ``positions="rope"`` or ``"alibi"`` the positions act in
    the attention, and with a ``window`` in its mask (:meth:`attention_mask`); the
    decoding interface (caches, :func:`~attnbook.generation.generate`) is
    :class:`GPTDecoding`'s.
    """

    def __init__(self, vocab_size, d_model, num_heads, num_layers, max_len, **options):
        super().__init__()
        sizes = (vocab_size, d_model, num_heads, num_layers, max_len)
        config = self.config = GPTConfig(*sizes, **options)
        self.vocab_size, self.max_len, self.num_heads = vocab_size, max_len, num_heads
        self.num_kv_heads = config.num_kv_heads or num_heads
        self.position_scheme, self.window = config.positions, config.window
        self.sink_tokens = config.sink_tokens
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.token_embedding.weight, std=0.02)  # GPT-2's scale
        self.positions = _position_table(config.positions, max_len, d_model)
        self.dropout = dropout_layer(config.dropout)
        self.blocks = nn.ModuleList(decoder_block(config) for _ in range(num_layers))
        self.final_norm = _final_norm(config.norm, d_model, config.norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if config.tie_embeddings:  # the head is the token embedding (Qwen3-0.6B)
            self.lm_head.weight = self.token_embedding.weight

    def forward(self, tokens, caches=None, *, key_padding_mask=None, check_ids=True):
        start = caches[0].length if caches else 0
        check_token_ids(
            tokens, self.vocab_size, self.max_sequence_len, start=start,
            check_range=check_ids,
        )  # fmt: skip
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(
                f"need one cache per block ({len(self.blocks)}), got {len(caches)}"
            )
        T = tokens.shape[1]
        key_len = caches[0].key_len(T) if caches else T  # the keys the queries see
        positions, padding = start, None
        if key_padding_mask is not None:  # (B, T) positions, (B, key_len) padding
            positions, padding = self.left_padding(key_padding_mask, start, T, key_len)
        x = self.token_embedding(tokens)  # (B, T, d)
        if self.positions is not None:
            x = self.positions(x, positions)  # (B, T, d): learned or sinusoidal
        x = self.dropout(x)
        mask = self.attention_mask(T, key_len, tokens.device)  # window and/or ALiBi
        layer_caches = caches or [None] * len(self.blocks)
        for block, cache in zip(self.blocks, layer_caches, strict=True):
            x = block(x, mask, key_padding_mask=padding, cache=cache)  # (B, T, d)
        return self.lm_head(self.final_norm(x))  # (B, T, vocab)

    def attention_mask(self, query_len: int, key_len: int, device=None):
        """What every layer adds to causal attention: ``None``, the window's bool mask
        ``(Tq, Tk)``, ALiBi's bias ``(1, h, Tq, Tk)``, or both
        (:func:`~attnbook.positions.decoder_attention_mask`)."""
        alibi_heads = self.num_heads if self.position_scheme == "alibi" else None
        return decoder_attention_mask(
            query_len, key_len, window=self.window, sink_tokens=self.sink_tokens,
            alibi_heads=alibi_heads, device=device,
        )  # fmt: skip

    def set_rope_scaling(self, scale=1.0, method="linear", original_length=None):
        """Stretch RoPE in every layer (:func:`~attnbook.positions.scale_rope`, chapter
        13); ``scale=1.0`` undoes it."""
        return scale_rope(self, scale, method, original_length)

    @classmethod
    def from_transformers(cls, model) -> GPT:
        """A GPT with the weights of a transformers Llama, Qwen3, Mistral, Mixtral or
        dense DeepSeek-V3 (:mod:`attnbook.convert`), computing the same logits; in
        eval mode, on the model's device and in its dtype."""
        gpt = cls(**convert.gpt_arguments(model))
        parameter = next(model.parameters())
        gpt.to(device=parameter.device, dtype=parameter.dtype)
        return copy_weights(gpt, convert.gpt_weights(model)).eval()


def _position_table(positions: str, max_len: int, d_model: int) -> nn.Module | None:
    """A table added to the embeddings, or ``None`` (RoPE and ALiBi act inside
    attention; NoPE has none)."""
    if positions == "learned":
        return LearnedPositions(max_len, d_model)
    if positions == "sinusoidal":
        return SinusoidalPositions(d_model, max_len)
    return None


class EncoderOnlyModel(nn.Module):
    """Encoder-only (BERT-like) transformer: every token attends to every other token.

    ``forward(tokens (B, T), key_padding_mask=None) -> hidden (B, T, d)``;
    :meth:`mlm_logits` -> ``(B, T, vocab_size)`` (predict masked tokens);
    :meth:`classify` -> ``(B, num_classes)`` from the mean of the non-padding hidden
    states.
    """

    def __init__(self, vocab_size, d_model, num_heads, num_layers, max_len, *,
                 num_classes=None, hidden=None, dropout=0.0, norm="pre",
                 activation="gelu"):  # fmt: skip
        super().__init__()
        _check_sizes(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads,
                     num_layers=num_layers, max_len=max_len)  # fmt: skip
        self.vocab_size, self.max_len = vocab_size, max_len
        self.token_embedding = _token_embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.dropout = dropout_layer(dropout)
        self.blocks = stack_blocks(num_layers, d_model, num_heads, hidden, dropout,
                                   activation=activation, norm=norm)  # fmt: skip
        self.final_norm = _final_norm(norm, d_model)
        self.mlm_head = nn.Linear(d_model, vocab_size)
        self.classifier = nn.Linear(d_model, num_classes) if num_classes else None

    def forward(self, tokens, key_padding_mask=None):
        check_token_ids(tokens, self.vocab_size, self.max_len)
        x = self.dropout(self.positions(self.token_embedding(tokens)))  # (B, T, d)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)  # (B, T, d): no causal mask
        return self.final_norm(x)

    def mlm_logits(self, tokens, key_padding_mask=None):
        return self.mlm_head(self(tokens, key_padding_mask))  # (B, T, vocab)

    def classify(self, tokens, key_padding_mask=None):
        if self.classifier is None:
            raise ValueError(
                "this model was built without num_classes; pass num_classes=... to "
                "classify"
            )
        # (B, num_classes)
        return self.classifier(
            mean_pool(self(tokens, key_padding_mask), key_padding_mask)
        )


class TransformerDecoder(nn.Module):
    """The decoder of every encoder–decoder in the book: ``tokens (B, T)`` and the
    encoder's ``memory (B, S, d)`` -> ``logits (B, T, vocab_size)``.

    Token embedding (times ``embedding_scale``) plus positions (``"learned"`` or
    ``"sinusoidal"``), :class:`~attnbook.blocks.DecoderBlock` s (causal self-attention,
    aligned to the bottom right as with a cache; cross-attention whose queries come
    from the text and whose keys and values come from ``memory``; the feed-forward
    network), the final norm of a pre-norm stack, and an output head: ``lm_head``
    (``nn.Linear``), or with ``tied_head=True`` the token embedding transposed
    (Whisper). ``key_padding_mask (B, S)`` is True at the memory's padding. With
    ``caches`` (from :meth:`make_caches`) ``tokens`` holds only the new tokens.
    """

    def __init__(self, vocab_size, d_model, num_heads, num_layers, max_len, *,
                 hidden=None, dropout=0.0, norm="pre", activation="gelu",
                 positions="learned", embedding_scale=1.0, tied_head=False,
                 head_bias=False):  # fmt: skip
        super().__init__()
        _check_sizes(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads,
                     num_layers=num_layers, max_len=max_len)  # fmt: skip
        if positions not in ("learned", "sinusoidal"):
            raise ValueError(
                f"positions must be 'learned' or 'sinusoidal', got {positions!r}"
            )
        self.vocab_size, self.max_len, self.num_heads = vocab_size, max_len, num_heads
        self.embedding_scale = embedding_scale
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.positions = _position_table(positions, max_len, d_model)
        self.dropout = dropout_layer(dropout)
        self.blocks = stack_blocks(
            num_layers, d_model, num_heads, hidden, dropout, block=DecoderBlock,
            activation=activation, norm=norm,
        )  # fmt: skip
        self.norm = _final_norm(norm, d_model)
        self.lm_head = (
            None if tied_head else nn.Linear(d_model, vocab_size, bias=head_bias)
        )

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per block: a self-attention cache (grows) and a static cross-attention cache
        of ``memory_len`` keys (filled once)."""
        device, dtype = _device_and_dtype(self, device, dtype)
        head_dim = self.token_embedding.embedding_dim // self.num_heads
        return make_caches(
            len(self.blocks), batch_size, self.num_heads, self.max_len, head_dim,
            memory_len=memory_len, device=device, dtype=dtype,
        )  # fmt: skip

    def forward(self, tokens, memory, key_padding_mask=None, caches=None, *,
                check_ids: bool = True):  # fmt: skip
        start = caches[0][0].length if caches else 0
        check_token_ids(tokens, self.vocab_size, self.max_len, start=start,
                        check_range=check_ids, name="tokens")  # fmt: skip
        if tokens.shape[0] != memory.shape[0]:
            raise ValueError(
                f"tokens {tuple(tokens.shape)} and memory {tuple(memory.shape)} differ "
                "in batch size"
            )
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(
                f"need one (self, cross) cache pair per block ({len(self.blocks)}), "
                f"got {len(caches)}"
            )
        embedded = self.token_embedding(tokens)  # (B, T, d)
        if self.embedding_scale != 1.0:
            embedded = embedded * self.embedding_scale
        x = self.dropout(self.positions(embedded, start))  # (B, T, d)
        layer_caches = caches or [(None, None)] * len(self.blocks)
        for block, (own, cross) in zip(self.blocks, layer_caches, strict=True):
            x = block(x, memory, key_padding_mask=key_padding_mask, is_causal=True,
                      self_cache=own, cross_cache=cross)  # fmt: skip
        x = self.norm(x)  # (B, T, d)
        if self.lm_head is None:  # the output projection is the embedding
            return x @ self.token_embedding.weight.T  # (B, T, vocab)
        return self.lm_head(x)  # (B, T, vocab)


class EncoderDecoderModel(nn.Module):
    """Encoder–decoder (T5/BART-like) transformer with sinusoidal positions.

    ``forward(source (B, S), target (B, T), key_padding_mask=None) -> logits (B, T,
    target_vocab_size)``, where ``key_padding_mask (B, S)`` is True at the source's
    padding: the keys that both the encoder's self-attention and the decoder's
    cross-attention must not read; :meth:`encode` gives the memory ``(B, S, d)`` once,
    :meth:`decode` runs the :class:`TransformerDecoder` on it (with per-layer
    self-attention and cross-attention caches from :meth:`make_caches`).
    """

    def __init__(self, source_vocab_size, target_vocab_size, d_model, num_heads,
                 num_encoder_layers, num_decoder_layers, max_len, *, hidden=None,
                 dropout=0.0, norm="pre", activation="gelu"):  # fmt: skip
        super().__init__()
        _check_sizes(source_vocab_size=source_vocab_size,
                     target_vocab_size=target_vocab_size, d_model=d_model,
                     num_heads=num_heads, num_encoder_layers=num_encoder_layers,
                     num_decoder_layers=num_decoder_layers,
                     max_len=max_len)  # fmt: skip
        self.source_vocab_size = source_vocab_size
        self.target_vocab_size, self.max_len = target_vocab_size, max_len
        self.num_heads = num_heads
        # embeddings scaled by sqrt(d) before adding positions, as in the original
        self.scale = d_model**0.5
        self.source_embedding = nn.Embedding(source_vocab_size, d_model)
        self.positions = SinusoidalPositions(d_model, max_len)
        self.dropout = dropout_layer(dropout)
        layers = dict(hidden=hidden, dropout=dropout, norm=norm, activation=activation)
        self.encoder_blocks = stack_blocks(
            num_encoder_layers, d_model, num_heads, **layers
        )
        self.encoder_norm = _final_norm(norm, d_model)
        self.decoder = TransformerDecoder(
            target_vocab_size, d_model, num_heads, num_decoder_layers, max_len,
            positions="sinusoidal", embedding_scale=self.scale, **layers,
        )  # fmt: skip
        # std d^-1/2: after the sqrt(d), tokens and positions are both of size ~1
        for embedding in (self.source_embedding, self.decoder.token_embedding):
            nn.init.normal_(embedding.weight, std=d_model**-0.5)

    @property
    def vocab_size(self) -> int:
        """The vocabulary of the tokens it writes (the target's)."""
        return self.target_vocab_size

    def encode(self, source, key_padding_mask=None):
        check_token_ids(source, self.source_vocab_size, self.max_len, name="source ids")
        # (B, S, d)
        x = self.dropout(self.positions(self.source_embedding(source) * self.scale))
        for block in self.encoder_blocks:
            x = block(x, key_padding_mask=key_padding_mask)
        return self.encoder_norm(x)  # memory (B, S, d)

    def decode(self, target, memory, key_padding_mask=None, caches=None, *,
               check_ids: bool = True):  # fmt: skip
        """Decoder logits ``(B, T, target_vocab)`` for ``target (B, T)`` (only the new
        tokens with ``caches``)."""
        return self.decoder(
            target, memory, key_padding_mask, caches, check_ids=check_ids
        )

    def forward(self, source, target, key_padding_mask=None):
        memory = self.encode(source, key_padding_mask)
        return self.decode(target, memory, key_padding_mask)

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per decoder layer: a self-attention cache (grows) and a static
        cross-attention cache (filled once)."""
        return self.decoder.make_caches(batch_size, memory_len, device, dtype)

    # the decoding interface (see the module docstring)
    def decoding_context(self, batch_size: int, source=None, key_padding_mask=None):
        """``(memory (B, S, d), key_padding_mask (B, S) or None)`` for ``source (B,
        S)`` token ids (:func:`_source_inputs`)."""
        device = next(self.parameters()).device
        source, key_padding_mask = _source_inputs(
            source, key_padding_mask, batch_size, device
        )
        return self.encode(source, key_padding_mask), key_padding_mask

    def decoding_caches(self, batch_size: int, context):
        return self.make_caches(batch_size, context[0].shape[1])

    def decode_step(self, tokens, context, caches):
        memory, key_padding_mask = context
        return self.decode(tokens, memory, key_padding_mask, caches, check_ids=False)


def _source_inputs(source, key_padding_mask, batch_size: int, device):
    """An encoder–decoder's ``source (B, S)`` ids (``(S,)`` is one) and its
    ``key_padding_mask`` (or ``None``), checked against the prompt's ``batch_size``
    and moved to ``device`` as long and bool tensors."""
    if source is None:
        raise ValueError(
            "an EncoderDecoderModel needs source=(B, S) token ids to generate from"
        )
    source = torch.as_tensor(source)
    source = (source[None] if source.dim() == 1 else source).to(device, torch.long)
    if source.shape[0] != batch_size:
        raise ValueError(
            f"source has batch size {source.shape[0]} but the prompt has {batch_size}"
        )
    if key_padding_mask is None:
        return source, None
    key_padding_mask = torch.as_tensor(key_padding_mask)
    if key_padding_mask.dim() == 1:
        key_padding_mask = key_padding_mask[None]
    if key_padding_mask.shape != source.shape:
        raise ValueError(
            f"key_padding_mask {tuple(key_padding_mask.shape)} must have the source's "
            f"shape {tuple(source.shape)}"
        )
    return source, key_padding_mask.to(device, torch.bool)


__all__ = [
    "EncoderDecoderModel",
    "EncoderOnlyModel",
    "GPT",
    "GPTConfig",
    "GPTDecoding",
    "TransformerDecoder",
    "decoder_attention",
    "decoder_block",
    "decoder_feed_forward",
    "mean_pool",
]
