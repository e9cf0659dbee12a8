"""The transformer block (chapter 5): position-wise feed-forward network, add & norm,
encoder and decoder blocks.

Every block maps ``(B, T, d)`` to ``(B, T, d)``: each token keeps its own vector (no
pooling). ``norm="post"`` is the original ``LayerNorm(x + Sublayer(x))``; ``norm="pre"``
is ``x + Sublayer(LayerNorm(x))`` (ViT, GPT-2 and most later models).

:class:`Block` is composed from the modules it is given (an attention, a feed-forward
network, two norms): :class:`EncoderBlock` builds the original transformer's for it,
and the decoders of later chapters plug in theirs (grouped-query or latent attention,
SwiGLU or a mixture of experts, RMSNorm: :func:`attnbook.models.decoder_block`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .multihead import MultiHeadAttention, load_torch_attention
from .utils import check_positive_int

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}
NORM_POSITIONS = ("post", "pre")


def _check_choices(norm: str, activation: str) -> None:
    if norm not in NORM_POSITIONS:
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
    norm runs)."""
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
        self.activation_name = activation
        self.fc1 = nn.Linear(d, hidden)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = dropout_layer(dropout)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, d) -> (B, T, hidden) -> (B, T, d)
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class Block(nn.Module):
    """Self-attention then a feed-forward network, each inside a residual connection
    with a norm, composed from the modules it is given: ``attention`` (with
    :class:`~attnbook.multihead.MultiHeadAttention`'s call), ``feed_forward`` and
    ``norm1``, ``norm2`` (``(B, T, d) -> (B, T, d)`` each).

    ``forward(x (B, T, d), mask=None, *, key_padding_mask=None, cache=None,
    is_causal=False) -> (B, T, d)``; ``norm_position`` is ``"post"`` or ``"pre"``;
    ``dropout`` drops each sublayer's output in training. Set ``record_weights = True``
    to keep the last per-head attention weights in ``self.weights``.
    """

    def __init__(
        self, attention, feed_forward, norm1, norm2, *, norm_position="pre", dropout=0.0
    ):
        super().__init__()
        if norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm must be 'post' or 'pre', got {norm_position!r}")
        self.norm_position = norm_position
        self.self_attention, self.feed_forward = attention, feed_forward
        self.norm1, self.norm2 = norm1, norm2
        self.dropout1, self.dropout2 = dropout_layer(dropout), dropout_layer(dropout)
        self.record_weights, self.weights = False, None

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

    def load_from_torch(self, reference: nn.TransformerEncoderLayer):
        """Copy the weights of an ``nn.TransformerEncoderLayer`` of the same sizes, norm
        position, activation and LayerNorm eps (:func:`load_torch_layer`)."""
        return load_torch_layer(self, reference)


class EncoderBlock(Block):
    """The original transformer's encoder block: a :class:`Block` of
    :class:`~attnbook.multihead.MultiHeadAttention` (or ``attention_class``), a
    :class:`FeedForward` of width ``hidden`` and two LayerNorms.

    With ``is_causal=True`` (or a causal ``mask``) and a
    :class:`~attnbook.caches.KVCache`, it is also the block of a decoder-only model.
    Arguments after ``dropout`` are keyword-only.
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
        _check_choices(norm, activation)
        super().__init__(
            attention_class(d_model, num_heads, dropout=dropout),
            FeedForward(d_model, hidden, activation, dropout),
            nn.LayerNorm(d_model, eps=layer_norm_eps),
            nn.LayerNorm(d_model, eps=layer_norm_eps),
            norm_position=norm,
            dropout=dropout,
        )


class DecoderOnlyBlock(Block):
    """The block of a decoder-only model (GPT): a :class:`Block` whose attention is
    causal unless told otherwise, aligned to the bottom right (with a KV cache the new
    tokens are the last ones and see every earlier token). ``forward(x (B, T, d), *,
    cache=None) -> (B, T, d)``; :func:`attnbook.models.decoder_block` builds a GPT's.
    """

    def forward(
        self, x, mask=None, *, key_padding_mask=None, cache=None, is_causal=True
    ):
        return super().forward(
            x, mask, key_padding_mask=key_padding_mask, cache=cache, is_causal=is_causal
        )


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention to the encoder's outputs, then a
    feed-forward network, each inside a residual connection with a LayerNorm.

    ``forward(x (B, T, d), memory (B, S, d), mask=None, memory_mask=None, *,
    key_padding_mask=None, self_cache=None, cross_cache=None, is_causal=False) -> (B,
    T, d)``. ``mask`` is the self-attention's (``is_causal=True`` makes it causal
    without a mask tensor); the cross-attention's queries come from ``x``, its keys and
    values from ``memory``, whose padding ``key_padding_mask (B, S)`` hides (a decoder's
    own padded tokens come after the real ones, which causal attention keeps from
    reading them). Set ``record_weights = True`` to keep the last weights in
    ``self_weights`` and ``cross_weights``.
    """

    def __init__(self, d_model, num_heads, hidden=None, dropout=0.0, *,
                 activation="relu", norm="post", layer_norm_eps=1e-5):  # fmt: skip
        super().__init__()
        _check_choices(norm, activation)
        self.norm_position = norm
        self.self_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout)
        self.cross_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout)
        self.feed_forward = FeedForward(d_model, hidden, activation, dropout)
        self.norm1, self.norm2, self.norm3 = (
            nn.LayerNorm(d_model, eps=layer_norm_eps) for _ in range(3)
        )
        self.dropout1, self.dropout2, self.dropout3 = (
            dropout_layer(dropout) for _ in range(3)
        )
        self.record_weights = False
        self.self_weights = self.cross_weights = None

    def _self(self, x, mask, cache, is_causal):
        out, weights = self.self_attention(
            x, x, x, mask, need_weights=self.record_weights, cache=cache,
            is_causal=is_causal,
        )  # fmt: skip
        if self.record_weights:
            self.self_weights = weights
        return self.dropout1(out)

    def _cross(self, x, memory, memory_mask, key_padding_mask, cache):
        out, weights = self.cross_attention(
            x, memory, memory, memory_mask, key_padding_mask=key_padding_mask,
            need_weights=self.record_weights, cache=cache,
        )  # fmt: skip
        if self.record_weights:
            self.cross_weights = weights
        return self.dropout2(out)

    def forward(self, x, memory, mask=None, memory_mask=None, *, key_padding_mask=None,
                self_cache=None, cross_cache=None, is_causal=False):  # fmt: skip
        _check_width("x", x, self.norm1.normalized_shape[0])
        if x.shape[0] != memory.shape[0] or x.shape[-1] != memory.shape[-1]:
            raise ValueError(
                f"x {tuple(x.shape)} and memory {tuple(memory.shape)} must share batch "
                "size and d_model"
            )
        cross = (memory, memory_mask, key_padding_mask, cross_cache)
        if self.norm_position == "post":
            x = self.norm1(x + self._self(x, mask, self_cache, is_causal))
            x = self.norm2(x + self._cross(x, *cross))
            return self.norm3(x + self.dropout3(self.feed_forward(x)))
        x = x + self._self(self.norm1(x), mask, self_cache, is_causal)
        x = x + self._cross(self.norm2(x), *cross)
        return x + self.dropout3(self.feed_forward(self.norm3(x)))

    def load_from_torch(self, reference: nn.TransformerDecoderLayer) -> DecoderBlock:
        """Copy the weights of an ``nn.TransformerDecoderLayer`` of the same sizes, norm
        position, activation and LayerNorm eps (:func:`load_torch_layer`)."""
        return load_torch_layer(self, reference)


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
    """Raise unless the PyTorch layer has our modules, sizes, norm position, activation
    and LayerNorm eps."""
    feed_forward = ours.feed_forward
    if not isinstance(feed_forward, FeedForward) or not isinstance(
        ours.norm1, nn.LayerNorm
    ):
        raise ValueError(
            "PyTorch's layers have LayerNorm and a two-layer MLP; this block has "
            f"{type(ours.norm1).__name__} and {type(feed_forward).__name__}"
        )
    sizes = {  # name: (theirs, ours)
        "d_model": (reference.self_attn.embed_dim, ours.self_attention.d_model),
        "num_heads": (reference.self_attn.num_heads, ours.self_attention.num_heads),
        "hidden": (reference.linear1.out_features, feed_forward.fc1.out_features),
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
    if _torch_activation(reference) != feed_forward.activation_name:
        raise ValueError(
            f"reference has activation {reference.activation!r}; this block has "
            f"activation={feed_forward.activation_name!r}"
        )
    if reference.norm1.eps != ours.norm1.eps:
        raise ValueError(
            f"reference has layer_norm_eps={reference.norm1.eps}; this block has "
            f"{ours.norm1.eps}"
        )


@torch.no_grad()
def load_torch_layer(ours: nn.Module, reference: nn.Module) -> nn.Module:
    """Copy an ``nn.TransformerEncoderLayer``'s weights into a :class:`Block` (or an
    ``nn.TransformerDecoderLayer``'s into a :class:`DecoderBlock`) of the same
    modules, sizes, norm position, activation and LayerNorm eps; a difference raises
    (the outputs would differ). Returns ``ours``."""
    _check_same_layout(ours, reference)
    load_torch_attention(ours.self_attention, reference.self_attn)
    if isinstance(reference, nn.TransformerDecoderLayer):
        load_torch_attention(ours.cross_attention, reference.multihead_attn)
    ours.feed_forward.fc1.load_state_dict(reference.linear1.state_dict())
    ours.feed_forward.fc2.load_state_dict(reference.linear2.state_dict())
    for name in ("norm1", "norm2", "norm3"):
        if hasattr(reference, name):
            getattr(ours, name).load_state_dict(getattr(reference, name).state_dict())
    return ours


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
    another), each ``block(d_model, num_heads, hidden, dropout, **options)``: the
    builder of the stacks of the encoder–decoders, BERT, the ViT, Whisper's and chapter
    10's speech encoders. ``options`` are the blocks' keywords (``activation``,
    ``norm``, ``layer_norm_eps``, ``attention_class``)."""
    num_layers = check_positive_int("num_layers", num_layers)
    return nn.ModuleList(
        block(d_model, num_heads, hidden, dropout, **options) for _ in range(num_layers)
    )


__all__ = [
    "Block",
    "DecoderBlock",
    "DecoderOnlyBlock",
    "EncoderBlock",
    "FeedForward",
    "dropout_layer",
    "load_torch_layer",
    "stack_blocks",
]
