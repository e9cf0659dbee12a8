"""The transformer block: position-wise feed-forward network, add & norm, encoder and
decoder blocks.

Every block maps ``(B, T, d)`` to ``(B, T, d)``: each token keeps its own vector (no
pooling). ``norm="post"`` is the original ``LayerNorm(x + Sublayer(x))``; ``norm="pre"``
is ``x + Sublayer(LayerNorm(x))`` (ViT, GPT-2 and most later models). The decoder-only
block also builds today's decoders (chapter 17): ``norm="rms"`` (pre-norm with RMSNorm),
``activation="swiglu"``, no biases, grouped-query attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .experts import moe_feed_forward
from .modern import RMSNorm, SwiGLU
from .multihead import MultiHeadAttention
from .utils import check_positive_int

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


def _check_choices(norm: str, activation: str) -> None:
    if norm not in ("post", "pre"):
        raise ValueError(f"norm must be 'post' or 'pre', got {norm!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )


def dropout_layer(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity()`` when ``p == 0``: a layer that drops
    nothing should cost nothing (a decoding step would call a dozen of them). A ``p``
    outside ``[0, 1]`` raises, as ``nn.Dropout`` does."""
    return nn.Identity() if p == 0 else nn.Dropout(p)


def _check_width(name: str, x, d_model: int) -> None:
    """Raise unless ``x`` is a tensor ending in ``d_model`` features (checked before any
    LayerNorm runs)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(
            f"{name} must be (B, T, d_model={d_model}), got shape {tuple(x.shape)}"
        )


class FeedForward(nn.Module):
    """The same two-layer MLP on every token: ``d -> hidden -> d`` (``hidden`` defaults
    to ``4 d``).

    ``8 d^2 + 5 d`` parameters at the default width.
    """

    def __init__(
        self,
        d: int,
        hidden: int | None = None,
        activation: str = "relu",
        dropout: float = 0.0,
    ):
        super().__init__()
        d = check_positive_int("d", d)
        hidden = 4 * d if hidden is None else check_positive_int("hidden", hidden)
        _check_choices("post", activation)
        self.fc1 = nn.Linear(d, hidden)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = dropout_layer(dropout)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, d) -> (B, T, hidden) -> (B, T, d)
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class EncoderBlock(nn.Module):
    """Self-attention then a feed-forward network, each inside a residual connection
    with LayerNorm.

    ``forward(x (B, T, d), mask=None, key_padding_mask=None, cache=None,
    is_causal=False) -> (B, T, d)``. With ``is_causal=True`` (or a causal ``mask``), and
    a :class:`~attnbook.caches.KVCache`, it is also the block of a decoder-only
    model. Arguments after ``dropout`` are keyword-only. Set ``record_weights = True``
    to keep the last per-head attention weights in ``self.weights``.
    """

    def __init__(
        self,
        d_model,
        num_heads,
        hidden=None,
        dropout=0.0,
        *,
        activation="relu",
        norm="post",
        layer_norm_eps=1e-5,
        attention_class=MultiHeadAttention,
    ):
        super().__init__()
        _check_choices(norm, activation)
        self.norm_position, self.activation_name = norm, activation
        self.self_attention = attention_class(d_model, num_heads, dropout=dropout)
        self.feed_forward = FeedForward(d_model, hidden, activation, dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = dropout_layer(dropout)
        self.dropout2 = dropout_layer(dropout)
        self.record_weights = False
        self.weights = None

    def _attend(self, x, mask, key_padding_mask, cache, is_causal):
        out, weights = self.self_attention(
            x,
            x,
            x,
            mask,
            key_padding_mask=key_padding_mask,
            need_weights=self.record_weights,
            cache=cache,
            is_causal=is_causal,
        )
        if self.record_weights:  # kept for the reader; None until recorded
            self.weights = weights
        return self.dropout1(out)

    def forward(
        self, x, mask=None, *, key_padding_mask=None, cache=None, is_causal=False
    ):
        _check_width("x", x, self.norm1.normalized_shape[0])
        if self.norm_position == "post":
            # add & norm
            x = self.norm1(
                x + self._attend(x, mask, key_padding_mask, cache, is_causal)
            )
            return self.norm2(x + self.dropout2(self.feed_forward(x)))
        x = x + self._attend(self.norm1(x), mask, key_padding_mask, cache, is_causal)
        return x + self.dropout2(self.feed_forward(self.norm2(x)))

    @torch.no_grad()
    def load_from_torch(self, reference: nn.TransformerEncoderLayer) -> EncoderBlock:
        """Copy the weights of an ``nn.TransformerEncoderLayer`` of the same sizes, norm
        position, activation and LayerNorm eps (a different one raises: the outputs
        would differ)."""
        _check_same_layout(self, reference)
        self.self_attention.load_from_torch(reference.self_attn)
        _copy_feed_forward(self.feed_forward, reference)
        self.norm1.load_state_dict(reference.norm1.state_dict())
        self.norm2.load_state_dict(reference.norm2.state_dict())
        return self


class DecoderOnlyBlock(EncoderBlock):
    """The block of a decoder-only model (GPT): causal self-attention, then the
    feed-forward network.

    An :class:`EncoderBlock` whose attention is causal unless told otherwise, aligned to
    the bottom right: with a :class:`~attnbook.caches.KVCache` the new tokens are the
    last ones and see every earlier token. ``forward(x (B, T, d), *, cache=None) -> (B,
    T, d)``.

    Its further keywords build today's decoders (chapter 17): ``norm="rms"`` (pre-norm
    with :class:`~attnbook.modern.RMSNorm`, eps ``layer_norm_eps``),
    ``activation="swiglu"`` (:class:`~attnbook.modern.SwiGLU` of width ``hidden``,
    ``8 d / 3`` by default), ``bias=False`` (no bias in the attention's and the
    feed-forward network's linear layers) and ``attention_options`` for
    ``attention_class`` (``num_kv_heads``, ``qk_norm``, ``rope_base``, ...).
    ``experts=dict(num_experts=..., top_k=2, capacity_factor=None)`` (chapter 19, with
    ``activation="swiglu"``) makes the feed-forward network a
    :class:`~attnbook.experts.MoEFeedForward` of width ``hidden``. The
    defaults build :class:`EncoderBlock`'s modules, in its order.
    """

    def __init__(
        self,
        d_model,
        num_heads,
        hidden=None,
        dropout=0.0,
        *,
        activation="relu",
        norm="post",
        layer_norm_eps=1e-5,
        attention_class=MultiHeadAttention,
        bias=True,
        experts=None,
        **attention_options,
    ):
        nn.Module.__init__(self)  # EncoderBlock's modules, built here
        if norm not in ("post", "pre", "rms"):
            raise ValueError(f"norm must be 'post', 'pre' or 'rms', got {norm!r}")
        if activation not in (*ACTIVATIONS, "swiglu"):
            raise ValueError(
                f"activation must be one of {sorted([*ACTIVATIONS, 'swiglu'])}, got "
                f"{activation!r}"
            )
        self.norm_position, self.activation_name = norm, activation
        self.self_attention = attention_class(
            d_model, num_heads, bias=bias, dropout=dropout, **attention_options
        )
        self.feed_forward = (
            _feed_forward(d_model, hidden, activation, dropout, bias)
            if experts is None  # else a mixture of SwiGLU experts (chapter 19)
            else moe_feed_forward(d_model, hidden, experts, activation, bias, dropout)
        )
        self.norm1 = _norm(norm, d_model, layer_norm_eps)
        self.norm2 = _norm(norm, d_model, layer_norm_eps)
        self.dropout1 = dropout_layer(dropout)
        self.dropout2 = dropout_layer(dropout)
        self.record_weights = False
        self.weights = None

    @torch.no_grad()
    def load_from_torch(self, reference: nn.TransformerEncoderLayer):
        """As :meth:`EncoderBlock.load_from_torch`, for a block of the defaults' kind
        (LayerNorm, a two-layer MLP, biases)."""
        if self.norm_position == "rms" or not isinstance(
            self.feed_forward, FeedForward
        ):
            raise ValueError(
                "PyTorch's layers have LayerNorm and a two-layer MLP; this block has "
                f"norm={self.norm_position!r}, activation={self.activation_name!r}"
            )
        return super().load_from_torch(reference)

    def forward(
        self, x, mask=None, *, key_padding_mask=None, cache=None, is_causal=True
    ):
        return super().forward(
            x, mask, key_padding_mask=key_padding_mask, cache=cache, is_causal=is_causal
        )


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention to the encoder's outputs, then a
    feed-forward network.

    ``forward(x (B, T, d), memory (B, S, d), mask=None, memory_mask=None,
    key_padding_mask=None, self_cache=None, cross_cache=None, is_causal=False) ->
    (B, T, d)``. ``mask`` is the self-attention mask (``is_causal=True`` makes it causal
    without a mask tensor); the cross-attention queries come from ``x``, its keys and
    values from ``memory``, and ``key_padding_mask (B, S)`` is True at the padded memory
    positions (the one padding a decoder needs: its own padded tokens come after the
    real ones, which causal attention keeps from reading them; the library names every
    padding mask ``key_padding_mask``, after the keys it hides). Arguments after
    ``dropout`` are keyword-only; set
    ``record_weights = True`` to keep the last weights in ``self_weights`` and
    ``cross_weights``.
    """

    def __init__(
        self,
        d_model,
        num_heads,
        hidden=None,
        dropout=0.0,
        *,
        activation="relu",
        norm="post",
        layer_norm_eps=1e-5,
    ):
        super().__init__()
        _check_choices(norm, activation)
        self.norm_position, self.activation_name = norm, activation
        self.self_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout)
        self.cross_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout)
        self.feed_forward = FeedForward(d_model, hidden, activation, dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1, self.dropout2, self.dropout3 = (
            dropout_layer(dropout) for _ in range(3)
        )
        self.record_weights = False
        self.self_weights = self.cross_weights = None

    def _self(self, x, mask, cache, is_causal):
        out, weights = self.self_attention(
            x,
            x,
            x,
            mask,
            need_weights=self.record_weights,
            cache=cache,
            is_causal=is_causal,
        )
        if self.record_weights:
            self.self_weights = weights
        return self.dropout1(out)

    def _cross(self, x, memory, memory_mask, key_padding_mask, cache):
        out, weights = self.cross_attention(
            x,
            memory,
            memory,
            memory_mask,
            key_padding_mask=key_padding_mask,
            need_weights=self.record_weights,
            cache=cache,
        )
        if self.record_weights:
            self.cross_weights = weights
        return self.dropout2(out)

    def forward(
        self,
        x,
        memory,
        mask=None,
        memory_mask=None,
        *,
        key_padding_mask=None,
        self_cache=None,
        cross_cache=None,
        is_causal=False,
    ):
        _check_width("x", x, self.norm1.normalized_shape[0])
        if x.shape[0] != memory.shape[0] or x.shape[-1] != memory.shape[-1]:
            raise ValueError(
                f"x {tuple(x.shape)} and memory {tuple(memory.shape)} must share batch "
                "size and d_model"
            )
        if self.norm_position == "post":
            x = self.norm1(x + self._self(x, mask, self_cache, is_causal))
            x = self.norm2(
                x
                + self._cross(
                    x, memory, memory_mask, key_padding_mask, cross_cache
                )
            )
            return self.norm3(x + self.dropout3(self.feed_forward(x)))
        x = x + self._self(self.norm1(x), mask, self_cache, is_causal)
        x = x + self._cross(
            self.norm2(x), memory, memory_mask, key_padding_mask, cross_cache
        )
        return x + self.dropout3(self.feed_forward(self.norm3(x)))

    @torch.no_grad()
    def load_from_torch(self, reference: nn.TransformerDecoderLayer) -> DecoderBlock:
        """Copy the weights of an ``nn.TransformerDecoderLayer`` of the same sizes, norm
        position, activation and LayerNorm eps (a different one raises: the outputs
        would differ)."""
        _check_same_layout(self, reference)
        self.self_attention.load_from_torch(reference.self_attn)
        self.cross_attention.load_from_torch(reference.multihead_attn)
        _copy_feed_forward(self.feed_forward, reference)
        for i in (1, 2, 3):
            getattr(self, f"norm{i}").load_state_dict(
                getattr(reference, f"norm{i}").state_dict()
            )
        return self


def _norm(norm: str, d_model: int, eps: float) -> nn.Module:
    return RMSNorm(d_model, eps) if norm == "rms" else nn.LayerNorm(d_model, eps=eps)


def _feed_forward(d_model, hidden, activation, dropout, bias) -> nn.Module:
    """:class:`FeedForward`, or :class:`~attnbook.modern.SwiGLU` (``hidden`` ``8 d /
    3`` by default: the parameters of a ``4 d`` two-layer MLP); without biases unless
    ``bias``."""
    if activation == "swiglu":
        hidden = 8 * d_model // 3 if hidden is None else hidden
        return SwiGLU(d_model, hidden, bias=bias, dropout=dropout)
    feed_forward = FeedForward(d_model, hidden, activation, dropout)
    if not bias:  # the same MLP without its two bias vectors
        feed_forward.fc1.bias = feed_forward.fc2.bias = None
    return feed_forward


def _torch_activation(reference: nn.Module) -> str | None:
    """The name of a PyTorch layer's activation ("relu", "gelu"), or None for anything
    else."""
    activation = reference.activation
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu or (
        isinstance(activation, nn.GELU) and activation.approximate == "none"
    ):
        return "gelu"
    return None


def _check_same_layout(ours: nn.Module, reference: nn.Module) -> None:
    """Raise unless the PyTorch layer has our sizes, norm position, activation and
    LayerNorm eps."""
    sizes = {  # name: (theirs, ours)
        "d_model": (reference.self_attn.embed_dim, ours.self_attention.d_model),
        "num_heads": (reference.self_attn.num_heads, ours.self_attention.num_heads),
        "hidden": (reference.linear1.out_features, ours.feed_forward.fc1.out_features),
    }
    wrong = {name: pair for name, pair in sizes.items() if pair[0] != pair[1]}
    if wrong:
        raise ValueError(
            "reference has "
            + ", ".join(f"{name}={theirs}" for name, (theirs, _) in wrong.items())
            + "; this block has "
            + ", ".join(f"{name}={mine}" for name, (_, mine) in wrong.items())
        )
    theirs = "pre" if reference.norm_first else "post"
    if theirs != ours.norm_position:
        raise ValueError(
            f"reference has norm_first={reference.norm_first} ({theirs}-norm); "
            f"this block has norm={ours.norm_position!r}"
        )
    activation = _torch_activation(reference)
    if activation != ours.activation_name:
        raise ValueError(
            f"reference has activation {reference.activation!r}; this block has "
            f"activation={ours.activation_name!r}"
        )
    if reference.norm1.eps != ours.norm1.eps:
        raise ValueError(
            f"reference has layer_norm_eps={reference.norm1.eps}; this block has "
            f"{ours.norm1.eps}"
        )


def _copy_feed_forward(ours: FeedForward, reference: nn.Module) -> None:
    ours.fc1.load_state_dict(reference.linear1.state_dict())
    ours.fc2.load_state_dict(reference.linear2.state_dict())


def stack_blocks(
    num_layers,
    d_model,
    num_heads,
    hidden=None,
    dropout=0.0,
    *,
    block=EncoderBlock,
    **options,
) -> nn.ModuleList:
    """``num_layers`` blocks of one kind (:class:`EncoderBlock` unless ``block`` names
    another), each ``block(d_model, num_heads, hidden, dropout, **options)``: the one
    builder of every stack of blocks in the library (the three families, BERT, the ViT,
    Whisper's and chapter 10's speech encoders). ``options`` are the blocks' keywords
    (``activation``, ``norm``, ``layer_norm_eps``, ``attention_class``)."""
    num_layers = check_positive_int("num_layers", num_layers)
    return nn.ModuleList(
        block(d_model, num_heads, hidden, dropout, **options) for _ in range(num_layers)
    )


__all__ = [
    "DecoderBlock",
    "DecoderOnlyBlock",
    "EncoderBlock",
    "FeedForward",
    "dropout_layer",
    "stack_blocks",
]
