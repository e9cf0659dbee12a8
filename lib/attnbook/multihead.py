"""Multi-head attention (chapter 3), the head split and merge, and RoPE's rotation of
the heads' queries and keys (chapter 4).

Shapes: inputs batch-first ``(B, T, d_model)``; per-head tensors ``(B, h, T, d_model /
h)``; per-head weights ``(B, h, Tq, Tk)``.

Masks (``True`` = blocked, float = added) may be ``(Tq, Tk)``, ``(B, Tq, Tk)`` (the same
for every head) or ``(B, h, Tq, Tk)``; ``key_padding_mask`` is ``(B, Tk)``, ``True`` at
padding. Later chapters build on :class:`MultiHeadAttention` by overriding its small
steps: :class:`RotaryMultiHeadAttention` (chapter 4) rotates queries and keys,
:class:`~attnbook.modern.GroupedQueryAttention` (chapter 17) shares key and value heads.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import (
    _attention,
    _check_dropout,
    check_mask,
    scaled_dot_product_attention,
)
from .masks import attention_mask_for_heads
from .positions import Rotary
from .utils import check_positive_int

__all__ = [
    "MultiHeadAttention",
    "RotaryMultiHeadAttention",
    "WideMultiHeadAttention",
    "attention_mask_for_heads",
    "check_attention_inputs",
    "check_attention_sizes",
    "load_torch_attention",
    "merge_heads",
    "split_heads",
]


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, T, d)`` -> ``(B, h, T, d/h)``: each token's vector is cut into ``h``
    slices."""
    if x.dim() != 3 or x.shape[-1] % num_heads != 0:
        raise ValueError(
            f"split_heads needs (B, T, d) with d divisible by num_heads={num_heads}, "
            f"got {tuple(x.shape)}"
        )
    B, T, d = x.shape
    return x.view(B, T, num_heads, d // num_heads).transpose(1, 2)  # (B, h, T, d/h)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, h, T, d/h)`` -> ``(B, T, d)``: the inverse of :func:`split_heads`
    (concatenate the heads)."""
    B, h, T, head_dim = x.shape
    return x.transpose(1, 2).reshape(B, T, h * head_dim)  # (B, T, d)


class MultiHeadAttention(nn.Module):
    """``h`` heads of scaled dot-product attention on ``d_model / h`` slices,
    concatenated and mixed by ``W_o``.

    Four ``nn.Linear`` layers ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``: ``4 (d^2
    + d)`` parameters (with bias) whatever ``num_heads`` is.

    ``forward(query (B, Tq, d), key (B, Tk, d), value (B, Tk, d), mask=None)`` returns
    ``(out (B, Tq, d), weights (B, h, Tq, Tk))``. With ``need_weights=False`` the fused
    kernel runs and ``weights`` is ``None``; ``is_causal=True`` blocks the future
    without a mask tensor (the queries are the last ``Tq`` of the ``Tk`` tokens). In
    training with ``dropout > 0`` the weights are dropped, and returned after dropout
    (as ``nn.MultiheadAttention`` does). With a ``cache`` (chapter 8) only the new
    tokens' keys and values are computed and appended to it; a filled ``static`` cache
    (an encoder's keys and values) is read as it is.
    """

    def __init__(self, d_model: int, num_heads: int, bias=True, dropout=0.0):
        super().__init__()
        d_model, num_heads, self.dropout = check_attention_sizes(
            d_model, num_heads, dropout
        )
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def queries(self, query: torch.Tensor) -> torch.Tensor:
        """``(B, Tq, d)`` -> per-head queries ``(B, h, Tq, d/h)``."""
        return split_heads(self.q_proj(query), self.num_heads)

    def keys_values(self, key: torch.Tensor, value: torch.Tensor):
        """``(B, Tk, d)`` each -> per-head keys and values ``(B, h, Tk, d/h)``."""
        k = split_heads(self.k_proj(key), self.num_heads)
        return k, split_heads(self.v_proj(value), self.num_heads)

    def encode_positions(self, q: torch.Tensor, k: torch.Tensor, start: int):
        """Where a position scheme acts on the heads' queries and keys (RoPE rotates
        them, tokens from position ``start``); nothing here."""
        return q, k

    def attend(self, q, k, v, mask, need_weights: bool, is_causal: bool):
        """Each head's attention: ``(B, h, Tq, d/h)`` and the weights (or ``None``)."""
        dropout_p = self.dropout if self.training else 0.0
        return _attention(q, k, v, mask, need_weights, is_causal, dropout_p)

    def forward(self, query, key, value, mask=None, *, key_padding_mask=None,
                need_weights=True, cache=None, is_causal=False):  # fmt: skip
        check_attention_inputs(self.d_model, query, key, value)
        q = self.queries(query)  # (B, h, Tq, d/h)
        if cache is not None and cache.static and cache.length:
            k, v = cache.filled()  # an encoder's keys and values, computed once
        else:
            k, v = self.keys_values(key, value)  # (B, h, Tk, d/h)
            start = 0 if cache is None else cache.length  # the new tokens' position
            q, k = self.encode_positions(q, k, start)
            if cache is not None:  # every key and value so far: (B, h, start + Tk, d/h)
                k, v = cache.append(k, v)
        B, _, Tq, _ = q.shape
        mask = attention_mask_for_heads(mask, key_padding_mask, B, Tq, k.shape[2])
        if mask is not None:  # q, k and v are ours: only a caller's mask is checked
            check_mask(mask, (B, self.num_heads, Tq, k.shape[2]), q.device)
        # (B, h, Tq, d/h), and the weights after dropout (or None)
        out, weights = self.attend(q, k, v, mask, need_weights, is_causal)
        return self.out_proj(merge_heads(out)), weights  # (B, Tq, d), weights

    def load_from_torch(self, reference: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy the weights of an ``nn.MultiheadAttention`` of the same size into this
        module (:func:`load_torch_attention`)."""
        return load_torch_attention(self, reference)


def check_attention_sizes(d_model, num_heads, dropout) -> tuple[int, int, float]:
    """``d_model`` and ``num_heads`` positive ints, ``num_heads`` dividing ``d_model``,
    ``dropout`` in ``[0, 1)``; otherwise a ``ValueError`` naming the value."""
    d_model = check_positive_int("d_model", d_model)
    num_heads = check_positive_int("num_heads", num_heads)
    if d_model % num_heads != 0:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    return d_model, num_heads, _check_dropout(dropout, "dropout")


def check_attention_inputs(d_model: int, query, key, value) -> None:
    """Raise unless ``query (B, Tq, d_model)``, ``key`` and ``value (B, Tk, d_model)``
    are tensors of one batch size (self-attention passes one tensor thrice: checked
    once)."""
    inputs = (
        (("query", query),)
        if key is query and value is query
        else (("query", query), ("key", key), ("value", value))
    )
    for name, x in inputs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != d_model:
            raise ValueError(
                f"{name} must be (B, T, d_model={d_model}), got shape "
                f"{tuple(x.shape)}"
            )
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError(
            f"query, key, value must share the batch size, got {query.shape[0]}, "
            f"{key.shape[0]}, {value.shape[0]}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(
            f"key and value must have the same length, got {key.shape[1]} and "
            f"{value.shape[1]}"
        )


@torch.no_grad()
def load_torch_attention(ours: nn.Module, reference: nn.MultiheadAttention):
    """Copy an ``nn.MultiheadAttention``'s weights into a plain
    :class:`MultiHeadAttention` of the same size (its packed ``in_proj_weight`` cut into
    ``q_proj``, ``k_proj``, ``v_proj``); returns ``ours``. A layout the reference does
    not have (other sizes, grouped heads, an extra key, a bias on one side) raises."""
    if reference.embed_dim != ours.d_model or reference.num_heads != ours.num_heads:
        raise ValueError(
            f"reference has embed_dim={reference.embed_dim}, "
            f"num_heads={reference.num_heads}; "
            f"this module has d_model={ours.d_model}, num_heads={ours.num_heads}"
        )
    if ours.k_proj.out_features != ours.d_model or hasattr(ours, "q_norm"):
        raise ValueError(
            "nn.MultiheadAttention has neither grouped keys and values nor "
            "QK-norm: load it into a plain MultiHeadAttention"
        )
    if not reference._qkv_same_embed_dim:
        raise ValueError("reference must have kdim == vdim == embed_dim")
    if reference.bias_k is not None or reference.add_zero_attn:
        raise ValueError(
            "reference has add_bias_kv=True or add_zero_attn=True (an extra key "
            "and value this module does not have): build it with both False"
        )
    if (reference.in_proj_bias is None) != (ours.q_proj.bias is None):
        has_bias = reference.in_proj_bias is not None
        raise ValueError(
            f"reference has bias={has_bias}; this module has bias={not has_bias}"
        )
    projections = (ours.q_proj, ours.k_proj, ours.v_proj)
    for proj, w in zip(projections, reference.in_proj_weight.chunk(3), strict=True):
        proj.weight.copy_(w)
    if reference.in_proj_bias is not None:
        for proj, b in zip(projections, reference.in_proj_bias.chunk(3), strict=True):
            proj.bias.copy_(b)
    ours.out_proj.load_state_dict(reference.out_proj.state_dict())
    return ours


class WideMultiHeadAttention(nn.Module):
    """The "wide" variant: every head gets the full width ``d_model``, so parameters
    grow with ``h``.

    ``q/k/v_proj``: ``d -> h d``, ``out_proj``: ``h d -> d``; ``4 h d^2 + 3 h d + d``
    parameters. Same ``forward`` as :class:`MultiHeadAttention` (without cache).
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool = True):
        super().__init__()
        d_model, num_heads = (
            check_positive_int("d_model", d_model),
            check_positive_int("num_heads", num_heads),
        )
        self.d_model, self.num_heads = d_model, num_heads
        self.q_proj = nn.Linear(d_model, num_heads * d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, num_heads * d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, num_heads * d_model, bias=bias)
        self.out_proj = nn.Linear(num_heads * d_model, d_model, bias=bias)

    def forward(
        self, query, key, value, mask=None, *, key_padding_mask=None, **options
    ):
        """``options``: ``need_weights``, ``is_causal``."""
        check_attention_inputs(self.d_model, query, key, value)
        h = self.num_heads
        q = split_heads(self.q_proj(query), h)  # (B, h, Tq, d)
        k = split_heads(self.k_proj(key), h)  # (B, h, Tk, d)
        v = split_heads(self.v_proj(value), h)  # (B, h, Tk, d)
        mask = attention_mask_for_heads(
            mask, key_padding_mask, query.shape[0], query.shape[1], key.shape[1]
        )
        out, weights = scaled_dot_product_attention(q, k, v, mask, **options)
        return self.out_proj(merge_heads(out)), weights


class RotaryMultiHeadAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` with rotary position embedding (RoPE, chapter 4):
    each head's queries and keys rotated by their positions, so the scores depend on
    relative position only. Same arguments and shapes, plus ``rope_base``, the base of
    the angles ``theta_i = base^(-2i/d)`` (10000; Llama 3's 500000).

    ``rotary`` (a :class:`~attnbook.positions.Rotary`) rotates them;
    ``rotary.set_scaling`` stretches the rotation for inputs longer than the trained
    length (chapter 13)."""

    def __init__(self, d_model, num_heads, bias=True, dropout=0.0, *, rope_base=1e4):
        super().__init__(d_model, num_heads, bias, dropout)
        self.rotary = Rotary(rope_base)

    @property
    def rope_base(self) -> float:
        return self.rotary.base

    def encode_positions(self, q, k, start):
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                "RotaryMultiHeadAttention is for self-attention (queries and keys from "
                "one sequence)"
            )
        return self.rotary(q, start), self.rotary(k, start)
