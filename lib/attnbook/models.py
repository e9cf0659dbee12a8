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

import torch
from torch import nn

from .blocks import DecoderBlock, DecoderOnlyBlock, dropout_layer, stack_blocks
from .caches import make_caches
from .experts import gpt_arguments, gpt_weights
from .latent import MultiHeadLatentAttention
from .masks import check_sink_tokens, sliding_window_mask
from .modern import RMSNorm
from .multihead import MultiHeadAttention, RotaryMultiHeadAttention
from .positions import LearnedPositions, SinusoidalPositions, alibi_bias
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


def _block_options(positions, norm, norm_eps, num_kv_heads, qk_norm, rope_base, bias):
    """The :class:`~attnbook.blocks.DecoderOnlyBlock` keywords of a GPT's chapter-17
    options: norm eps (1e-5 for LayerNorm, 1e-6 for RMSNorm and QK-norm unless
    ``norm_eps``), biases, grouped-query attention, QK-norm, RoPE's base."""
    if norm_eps is not None:
        norm_eps = check_eps(norm_eps, "norm_eps")
    options = dict(
        layer_norm_eps=norm_eps or (1e-6 if norm == "rms" else 1e-5),
        bias=bias,
        num_kv_heads=num_kv_heads,
        qk_norm=qk_norm,
        qk_norm_eps=norm_eps or 1e-6,
    )
    if positions == "rope":
        options["rope_base"] = rope_base
    elif rope_base != 10000.0:
        raise ValueError(
            f"rope_base needs positions='rope', this GPT has positions={positions!r}"
        )
    return options


def _latent_options(options: dict, mla: dict, positions, window) -> dict:
    """The block keywords of a GPT with multi-head latent attention: ``mla``'s (the
    :class:`~attnbook.latent.MultiHeadLatentAttention` keywords) with the norms' eps,
    the biases and RoPE's base; grouped heads, QK-norm and a window are refused."""
    if not isinstance(mla, dict):
        raise TypeError(f"mla must be a dict of keywords, got {type(mla).__name__}")
    if positions != "rope":
        raise ValueError(
            f"mla needs positions='rope' (its decoupled RoPE key), got {positions!r}"
        )
    if window is not None or options["num_kv_heads"] is not None or options["qk_norm"]:
        raise ValueError(
            "mla shares one latent across the heads and caches every token: build it "
            f"with window=None, num_kv_heads=None, qk_norm=False (got window={window}, "
            f"num_kv_heads={options['num_kv_heads']}, qk_norm={options['qk_norm']})"
        )
    shared = {key: options[key] for key in ("layer_norm_eps", "bias", "rope_base")}
    return {**shared, **mla}


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


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, causal blocks,
    next-token head.

    ``forward(tokens (B, T), caches=None) -> logits (B, T, vocab_size)``. With
    ``caches`` (from
    :meth:`make_caches`), ``tokens`` holds only the new tokens; their keys and values
    are appended to each layer's cache and only they are computed.

    ``positions`` picks how tokens learn where they are (chapter 13 compares them past
    the trained length): ``"learned"`` (the default: a table of ``max_len`` rows added
    to the embeddings), ``"sinusoidal"`` (the fixed encoding, added), ``"rope"``
    (queries and keys rotated in every layer; :meth:`set_rope_scaling` stretches it),
    ``"alibi"`` (a distance penalty added to the scores,
    :func:`~attnbook.positions.alibi_bias`) or ``"none"`` (NoPE: causal attention
    alone). With ``window`` each token attends to itself and the ``window - 1`` tokens
    before it (:func:`~attnbook.masks.sliding_window_mask`), and :meth:`make_caches`
    gives rolling caches of ``window`` entries. ``sink_tokens=S`` (with a ``window``,
    ``S < window``; chapter 18) keeps StreamingLLM's attention sinks: every token also
    sees the first ``S`` tokens, and the window counts them (a token sees the sinks,
    itself and the ``window - S - 1`` tokens before it), so the rolling caches still
    hold ``window`` entries; keys keep their original positions.

    Today's decoders (chapter 17) differ by keywords: ``norm="rms"`` (pre-norm with
    RMSNorm, eps ``norm_eps``), ``activation="swiglu"`` (``hidden`` is its width),
    ``num_kv_heads`` (grouped-query attention: the caches hold that many heads),
    ``qk_norm``, ``rope_base``, ``bias=False`` (no bias in the attention and
    feed-forward layers) and ``tie_embeddings`` (the output head is the token
    embedding). :meth:`from_transformers` builds one from a Llama, Qwen3 or Mistral.

    ``mla=dict(kv_lora_rank=..., qk_rope_head_dim=..., qk_nope_head_dim=...,
    v_head_dim=..., q_lora_rank=None, mode="expanded")`` (chapter 18, with
    ``positions="rope"``) makes every layer's attention DeepSeek's
    :class:`~attnbook.latent.MultiHeadLatentAttention`, and :meth:`make_caches` gives
    :class:`~attnbook.caches.LatentKVCache` s; :meth:`from_transformers` builds one
    from a DeepSeek-V3 whose layers are all dense.

    ``experts=dict(num_experts=..., top_k=2, capacity_factor=None)`` (chapter 19, with
    ``activation="swiglu"``) makes every feed-forward network a
    :class:`~attnbook.experts.MoEFeedForward` of ``hidden``-wide SwiGLU experts
    (:func:`attnbook.experts.aux_loss` sums their load-balancing losses);
    :meth:`from_transformers` builds one from a Mixtral.
    """

    def __init__(
        self,
        vocab_size,
        d_model,
        num_heads,
        num_layers,
        max_len,
        *,
        hidden=None,
        dropout=0.0,
        norm="pre",
        activation="gelu",
        positions="learned",
        window=None,
        sink_tokens=0,
        norm_eps=None,
        num_kv_heads=None,
        qk_norm=False,
        rope_base=10000.0,
        bias=True,
        tie_embeddings=False,
        mla=None,
        experts=None,
    ):
        super().__init__()
        _check_sizes(
            vocab_size=vocab_size,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            max_len=max_len,
        )
        if positions not in GPT_POSITIONS:
            raise ValueError(
                f"positions must be one of {GPT_POSITIONS}, got {positions!r}"
            )
        self.window = None if window is None else check_positive_int("window", window)
        self.sink_tokens = _check_sinks(sink_tokens, self.window, positions)
        self.vocab_size, self.max_len, self.num_heads = vocab_size, max_len, num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.position_scheme = positions
        self.token_embedding = _token_embedding(vocab_size, d_model)
        if positions == "learned":
            self.positions = LearnedPositions(max_len, d_model)
        elif positions == "sinusoidal":
            self.positions = SinusoidalPositions(d_model, max_len)
        else:
            self.positions = None  # RoPE and ALiBi act inside attention; NoPE has none
        self.dropout = dropout_layer(dropout)
        attention_class = (
            RotaryMultiHeadAttention if positions == "rope" else MultiHeadAttention
        )
        options = _block_options(
            positions, norm, norm_eps, num_kv_heads, qk_norm, rope_base, bias
        )
        if mla is not None:  # multi-head latent attention (chapter 18)
            attention_class = MultiHeadLatentAttention
            options = _latent_options(options, mla, positions, window)
        self.mla = None if mla is None else dict(mla)
        self.blocks = stack_blocks(
            num_layers,
            d_model,
            num_heads,
            hidden,
            dropout,
            block=DecoderOnlyBlock,
            activation=activation,
            norm=norm,
            attention_class=attention_class,
            experts=experts,
            **options,
        )
        self.final_norm = _final_norm(norm, d_model, norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:  # the output head is the token embedding (GPT-2, Qwen3-0.6B)
            self.lm_head.weight = self.token_embedding.weight

    @classmethod
    def from_transformers(cls, model) -> GPT:
        """A GPT with the weights of a transformers ``LlamaForCausalLM``,
        ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``DeepseekV3ForCausalLM``
        (dense layers only) or ``MixtralForCausalLM``, computing the same logits; in
        eval mode, on the model's device and in its dtype. A config it cannot reproduce
        raises (see :func:`~attnbook.modern.gpt_arguments`,
        :func:`~attnbook.experts.gpt_arguments`)."""
        gpt = cls(**gpt_arguments(model))
        parameter = next(model.parameters())
        gpt.to(device=parameter.device, dtype=parameter.dtype)
        return copy_weights(gpt, gpt_weights(model)).eval()

    def set_rope_scaling(
        self,
        scale: float = 1.0,
        method: str = "linear",
        original_length: int | None = None,
    ):
        """Stretch RoPE in every layer (see :func:`~attnbook.positions.rope_angles`);
        ``scale=1.0`` undoes it."""
        if self.position_scheme != "rope":
            raise ValueError(
                f"set_rope_scaling needs a GPT with positions='rope', this one has "
                f"{self.position_scheme!r}"
            )
        for block in self.blocks:
            block.self_attention.set_rope_scaling(scale, method, original_length)
        return self

    def make_caches(
        self,
        batch_size: int,
        device=None,
        dtype=None,
        *,
        kv_bits: int | tuple[int, int] | None = None,
        group_size: int = 32,
    ):
        """One preallocated :class:`~attnbook.caches.KVCache` per layer, for up to
        ``max_len`` tokens (on the model's device and in its dtype unless given; the
        first keys decide in the end); with a ``window``, one
        :class:`~attnbook.caches.RollingKVCache` of ``window`` entries per layer; with
        ``mla``, one :class:`~attnbook.caches.LatentKVCache` per layer; with
        ``kv_bits`` (``bits`` or ``(key_bits, value_bits)``, 4 or 8), one
        :class:`~attnbook.caches.QuantizedKVCache` per layer (KIVI's: keys per channel,
        values per token, in groups of ``group_size`` tokens)."""
        if kv_bits is not None and self.mla is not None:
            raise ValueError("kv_bits quantises keys and values, not mla's latents")
        device, dtype = _device_and_dtype(self, device, dtype)
        if self.mla is not None:  # one LatentKVCache per layer
            return [
                block.self_attention.make_cache(
                    batch_size, self.max_len, device=device, dtype=dtype
                )
                for block in self.blocks
            ]
        head_dim = self.token_embedding.embedding_dim // self.num_heads
        return make_caches(
            len(self.blocks),
            batch_size,
            self.num_kv_heads,  # num_heads unless grouped
            self.max_len,
            head_dim,
            window=self.window,
            device=device,
            dtype=dtype,
            sink_tokens=self.sink_tokens,
            kv_bits=kv_bits,
            group_size=group_size,
        )

    @property
    def max_sequence_len(self) -> int | None:
        """How long a sequence this GPT can run: ``max_len``, or no limit (``None``)
        with a ``window`` and positions that need no table (``"rope"``, ``"alibi"``,
        ``"none"``): its rolling caches hold ``window`` entries however long the text
        grows, and it streams."""
        if self.window is not None and self.positions is None:
            return None
        return self.max_len

    def attention_mask(self, query_len: int, caches=None, device=None):
        """The mask every layer adds for ``query_len`` new tokens after ``caches``:
        ``None`` (causal attention alone), the sliding window's bool mask, ALiBi's bias
        ``(1, h, Tq, Tk)``, or both."""
        if self.window is None and self.position_scheme != "alibi":
            return None
        key_len = caches[0].key_len(query_len) if caches else query_len
        mask = (
            None
            if self.window is None
            else sliding_window_mask(
                query_len,
                key_len,
                self.window,
                sink_tokens=self.sink_tokens,
                device=device,
            )
        )
        if self.position_scheme != "alibi":
            return mask  # (Tq, Tk) bool
        # (1, h, Tq, Tk)
        bias = alibi_bias(self.num_heads, query_len, key_len, device=device)[None]
        return bias if mask is None else bias.masked_fill(mask, float("-inf"))

    def forward(
        self,
        tokens: torch.Tensor,
        caches=None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        check_ids: bool = True,
    ) -> torch.Tensor:
        """``key_padding_mask (B, start + T)`` (every key so far, ``True`` at padding)
        decodes a batch of left-padded prompts: each row's tokens take positions from 0
        at its first real token, and no query reads a padded key, so each row's logits
        are those of its prompt alone. ``check_ids=False`` skips the range check of the
        ids (which reads them back to the host);
        :func:`~attnbook.generation.generate` uses it for the tokens it picked
        itself."""
        start = caches[0].length if caches else 0
        check_token_ids(
            tokens,
            self.vocab_size,
            self.max_sequence_len,
            start=start,
            check_range=check_ids,
        )
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(
                f"need one cache per block ({len(self.blocks)}), got {len(caches)}"
            )
        x = self.token_embedding(tokens)  # (B, T, d)
        positions, padding = start, None
        if key_padding_mask is not None:  # (B, T) positions, (B, Tk) padded keys
            positions, padding = self._padding(key_padding_mask, tokens, caches)
        if self.positions is not None:
            # (B, T, d): learned or sinusoidal positions added
            x = self.positions(x, positions)
        x = self.dropout(x)
        # None, window and/or ALiBi
        mask = self.attention_mask(tokens.shape[1], caches, tokens.device)
        layer_caches = [None] * len(self.blocks) if caches is None else caches
        # causal: new queries see keys up to them
        for block, cache in zip(self.blocks, layer_caches, strict=True):
            x = block(x, mask, key_padding_mask=padding, cache=cache)  # (B, T, d)
        return self.lm_head(self.final_norm(x))  # (B, T, vocab)

    def _padding(self, key_padding_mask, tokens, caches):
        """Each new token's position ``(B, T)`` (counted from the row's first real
        token) and the padding of the keys the queries see ``(B, Tk)``."""
        (B, T), start = tokens.shape, caches[0].length if caches else 0
        if (
            not isinstance(key_padding_mask, torch.Tensor)
            or key_padding_mask.dtype != torch.bool
            or key_padding_mask.shape != (B, start + T)
        ):
            raise ValueError(
                f"key_padding_mask must be a bool (B={B}, {start + T}) tensor (every "
                f"key so far, True at padding), got {key_padding_mask!r:.80}"
            )
        if self.sink_tokens:
            raise ValueError(
                f"a padded batch moves each row's first tokens: sink_tokens="
                f"{self.sink_tokens} would keep the padding instead"
            )
        key_padding_mask = key_padding_mask.to(tokens.device)
        real = (~key_padding_mask).long().cumsum(-1)  # (B, start + T)
        positions = (real[:, start:] - 1).clamp_min(0)  # (B, T)
        key_len = caches[0].key_len(T) if caches else T  # a rolling cache's last ones
        return positions, key_padding_mask[:, -key_len:]

    # the decoding interface (see the module docstring)
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
            padding = torch.nn.functional.pad(
                context.to(tokens.device), (0, total - context.shape[1])
            )
        return self(tokens, caches, key_padding_mask=padding, check_ids=False)


class EncoderOnlyModel(nn.Module):
    """Encoder-only (BERT-like) transformer: every token attends to every other token.

    ``forward(tokens (B, T), key_padding_mask=None) -> hidden (B, T, d)``;
    :meth:`mlm_logits` -> ``(B, T, vocab_size)`` (predict masked tokens);
    :meth:`classify` -> ``(B, num_classes)`` from the mean of the non-padding hidden
    states.
    """

    def __init__(
        self,
        vocab_size,
        d_model,
        num_heads,
        num_layers,
        max_len,
        *,
        num_classes=None,
        hidden=None,
        dropout=0.0,
        norm="pre",
        activation="gelu",
    ):
        super().__init__()
        _check_sizes(
            vocab_size=vocab_size,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            max_len=max_len,
        )
        self.vocab_size, self.max_len = vocab_size, max_len
        self.token_embedding = _token_embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        self.dropout = dropout_layer(dropout)
        self.blocks = stack_blocks(
            num_layers,
            d_model,
            num_heads,
            hidden,
            dropout,
            activation=activation,
            norm=norm,
        )
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
    ``"sinusoidal"``),
    :class:`~attnbook.blocks.DecoderBlock` s (causal self-attention, aligned to the
    bottom right as with a cache; cross-attention whose queries come from the text and
    whose keys and values come from ``memory``; the feed-forward network), the final
    norm of a pre-norm stack, and an output head: ``lm_head`` (``nn.Linear``), or with
    ``tied_head=True`` the token embedding transposed (Whisper). ``key_padding_mask (B,
    S)`` is True at the memory's padding. With ``caches`` (from :meth:`make_caches`)
    ``tokens`` holds only the new tokens.
    """

    def __init__(
        self,
        vocab_size,
        d_model,
        num_heads,
        num_layers,
        max_len,
        *,
        hidden=None,
        dropout=0.0,
        norm="pre",
        activation="gelu",
        positions="learned",
        embedding_scale=1.0,
        tied_head=False,
        head_bias=False,
    ):
        super().__init__()
        _check_sizes(
            vocab_size=vocab_size,
            d_model=d_model,
            num_heads=num_heads,
            num_layers=num_layers,
            max_len=max_len,
        )
        if positions not in ("learned", "sinusoidal"):
            raise ValueError(
                f"positions must be 'learned' or 'sinusoidal', got {positions!r}"
            )
        self.vocab_size, self.max_len, self.num_heads = vocab_size, max_len, num_heads
        self.embedding_scale = embedding_scale
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.positions = (
            LearnedPositions(max_len, d_model)
            if positions == "learned"
            else SinusoidalPositions(d_model, max_len)
        )
        self.dropout = dropout_layer(dropout)
        self.blocks = stack_blocks(
            num_layers,
            d_model,
            num_heads,
            hidden,
            dropout,
            block=DecoderBlock,
            activation=activation,
            norm=norm,
        )
        self.norm = _final_norm(norm, d_model)
        self.lm_head = (
            None if tied_head else nn.Linear(d_model, vocab_size, bias=head_bias)
        )

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per block: a self-attention cache (grows) and a static cross-attention cache
        (filled once)."""
        device, dtype = _device_and_dtype(self, device, dtype)
        head_dim = self.token_embedding.embedding_dim // self.num_heads
        return make_caches(
            len(self.blocks),
            batch_size,
            self.num_heads,
            self.max_len,
            head_dim,
            memory_len=memory_len,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        tokens,
        memory,
        key_padding_mask=None,
        caches=None,
        *,
        check_ids: bool = True,
    ):
        start = caches[0][0].length if caches else 0
        check_token_ids(
            tokens,
            self.vocab_size,
            self.max_len,
            start=start,
            check_range=check_ids,
            name="tokens",
        )
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
        embedded = (
            self.token_embedding(tokens) * self.embedding_scale
            if self.embedding_scale != 1.0
            else self.token_embedding(tokens)
        )
        x = self.dropout(self.positions(embedded, start))  # (B, T, d)
        layer_caches = [(None, None)] * len(self.blocks) if caches is None else caches
        for block, (self_cache, cross_cache) in zip(
            self.blocks, layer_caches, strict=True
        ):
            x = block(
                x,
                memory,
                key_padding_mask=key_padding_mask,
                self_cache=self_cache,
                cross_cache=cross_cache,
                is_causal=True,
            )  # (B, T, d)
        x = self.norm(x)
        if self.lm_head is None:
            # (B, T, vocab): the output projection is the embedding
            return x @ self.token_embedding.weight.T
        return self.lm_head(x)  # (B, T, vocab)


class EncoderDecoderModel(nn.Module):
    """Encoder–decoder (T5/BART-like) transformer with sinusoidal positions.

    ``forward(source (B, S), target (B, T), key_padding_mask=None) -> logits (B, T,
    target_vocab_size)``, where ``key_padding_mask (B, S)`` is True at the source's
    padding: the keys that both the encoder's self-attention and the decoder's
    cross-attention must not read;
    :meth:`encode` gives the memory ``(B, S, d)`` once, :meth:`decode` runs the
    :class:`TransformerDecoder` on it (with per-layer self-attention and cross-attention
    caches from :meth:`make_caches`).
    """

    def __init__(
        self,
        source_vocab_size,
        target_vocab_size,
        d_model,
        num_heads,
        num_encoder_layers,
        num_decoder_layers,
        max_len,
        *,
        hidden=None,
        dropout=0.0,
        norm="pre",
        activation="gelu",
    ):
        super().__init__()
        _check_sizes(
            source_vocab_size=source_vocab_size,
            target_vocab_size=target_vocab_size,
            d_model=d_model,
            num_heads=num_heads,
            num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers,
            max_len=max_len,
        )
        self.source_vocab_size, self.target_vocab_size = (
            source_vocab_size,
            target_vocab_size,
        )
        self.max_len, self.num_heads = max_len, num_heads
        # embeddings scaled by sqrt(d) before adding positions, as in the original
        self.scale = d_model**0.5
        self.source_embedding = nn.Embedding(source_vocab_size, d_model)
        self.positions = SinusoidalPositions(d_model, max_len)
        self.dropout = dropout_layer(dropout)
        self.encoder_blocks = stack_blocks(
            num_encoder_layers,
            d_model,
            num_heads,
            hidden,
            dropout,
            activation=activation,
            norm=norm,
        )
        self.encoder_norm = _final_norm(norm, d_model)
        self.decoder = TransformerDecoder(
            target_vocab_size,
            d_model,
            num_heads,
            num_decoder_layers,
            max_len,
            hidden=hidden,
            dropout=dropout,
            norm=norm,
            activation=activation,
            positions="sinusoidal",
            embedding_scale=self.scale,
        )
        # std d^-1/2: after the sqrt(d)
        for embedding in (self.source_embedding, self.decoder.token_embedding):
            # scale tokens and positions are both of size ~1
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

    def decode(
        self,
        target,
        memory,
        key_padding_mask=None,
        caches=None,
        *,
        check_ids: bool = True,
    ):
        """Decoder logits ``(B, T, target_vocab)`` for ``target (B, T)`` (only the new
        tokens with ``caches``)."""
        return self.decoder(
            target, memory, key_padding_mask, caches, check_ids=check_ids
        )

    def forward(self, source, target, key_padding_mask=None):
        return self.decode(
            target, self.encode(source, key_padding_mask), key_padding_mask
        )

    def make_caches(self, batch_size: int, memory_len: int, device=None, dtype=None):
        """Per decoder layer: a self-attention cache (grows) and a static
        cross-attention cache (filled once)."""
        return self.decoder.make_caches(batch_size, memory_len, device, dtype)

    # the decoding interface (see the module docstring)
    def decoding_context(self, batch_size: int, source=None, key_padding_mask=None):
        """``(memory (B, S, d), key_padding_mask (B, S) or None)`` for ``source (B,
        S)`` token ids."""
        if source is None:
            raise ValueError(
                "an EncoderDecoderModel needs source=(B, S) token ids to generate from"
            )
        device = next(self.parameters()).device
        source = torch.as_tensor(source)
        source = (source[None] if source.dim() == 1 else source).to(
            device=device, dtype=torch.long
        )
        if source.shape[0] != batch_size:
            raise ValueError(
                f"source has batch size {source.shape[0]} but the prompt has "
                f"{batch_size}"
            )
        if key_padding_mask is not None:
            key_padding_mask = torch.as_tensor(key_padding_mask)
            key_padding_mask = (
                key_padding_mask[None]
                if key_padding_mask.dim() == 1
                else key_padding_mask
            )
            if key_padding_mask.shape != source.shape:
                raise ValueError(
                    f"key_padding_mask {tuple(key_padding_mask.shape)} must have "
                    "the source's "
                    f"shape {tuple(source.shape)}"
                )
            key_padding_mask = key_padding_mask.to(
                device=device, dtype=torch.bool
            )
        return self.encode(source, key_padding_mask), key_padding_mask

    def decoding_caches(self, batch_size: int, context):
        return self.make_caches(batch_size, context[0].shape[1])

    def decode_step(self, tokens, context, caches):
        memory, key_padding_mask = context
        return self.decode(tokens, memory, key_padding_mask, caches, check_ids=False)


__all__ = [
    "EncoderDecoderModel",
    "EncoderOnlyModel",
    "GPT",
    "TransformerDecoder",
    "mean_pool",
]
