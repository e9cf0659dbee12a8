"""Multi-head attention and the head split and merge (the KV caches it appends to are in
:mod:`attnbook.caches`).

Shapes: inputs batch-first ``(B, T, d_model)``; per-head tensors ``(B, h, T, d_model /
h)``; per-head weights ``(B, h, Tq, Tk)``.

Masks (``True`` = blocked, float = added) may be ``(Tq, Tk)``, ``(B, Tq, Tk)`` (the same
for every head) or ``(B, h, Tq, Tk)``; ``key_padding_mask`` is ``(B, Tk)``, ``True`` at
padding.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import _attention, check_mask, scaled_dot_product_attention
from .masks import attention_mask_for_heads
from .positions import _check_rope_scaling, apply_rope
from .utils import check_positive_int

__all__ = [
    "MultiHeadAttention",
    "RotaryMultiHeadAttention",
    "WideMultiHeadAttention",
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
    kernel runs and ``weights`` is ``None``. ``is_causal=True`` blocks the future
    without a mask tensor (queries are the last ``Tq`` of the ``Tk`` tokens, as with a
    cache). In training mode with ``dropout > 0`` the weights are dropped (the fused
    kernel's ``dropout_p`` when no weights are needed) and, as in
    ``nn.MultiheadAttention``, the weights returned are those after dropout. With a
    cache (:mod:`attnbook.caches`), only the new tokens' keys and values are computed
    and appended (or, for a filled static cache, none at all).
    """

    def __init__(
        self, d_model: int, num_heads: int, bias: bool = True, dropout: float = 0.0
    ):
        super().__init__()
        d_model, num_heads = (
            check_positive_int("d_model", d_model),
            check_positive_int("num_heads", num_heads),
        )
        if d_model % num_heads != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}"
            )
        if (
            isinstance(dropout, bool)
            or not isinstance(dropout, (int, float))
            or not 0 <= dropout < 1
        ):
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.d_model, self.num_heads, self.head_dim = (
            d_model,
            num_heads,
            d_model // num_heads,
        )
        self.dropout = float(dropout)
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _check_inputs(self, query, key, value):
        # self-attention passes one tensor three times: check it once
        inputs = (
            (("query", query),)
            if key is query and value is query
            else (("query", query), ("key", key), ("value", value))
        )
        for name, x in inputs:
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"{name} must be a torch.Tensor, got {type(x).__name__}"
                )
            if x.dim() != 3 or x.shape[-1] != self.d_model:
                raise ValueError(
                    f"{name} must be (B, T, d_model={self.d_model}), got shape "
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

    def project_queries_keys(self, q: torch.Tensor, k: torch.Tensor, start: int):
        """Hook for position schemes that act on per-head queries and keys (RoPE);
        identity here."""
        return q, k

    def forward(
        self,
        query,
        key,
        value,
        mask=None,
        *,
        key_padding_mask=None,
        need_weights=True,
        cache=None,
        is_causal=False,
    ):
        self._check_inputs(query, key, value)
        B = query.shape[0]
        start = cache.length if cache is not None and not cache.static else 0
        q = split_heads(self.q_proj(query), self.num_heads)  # (B, h, Tq, d/h)
        if cache is not None and cache.static and cache.length > 0:
            # computed once
            k, v = cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]
        else:
            k = split_heads(self.k_proj(key), self.num_heads)  # (B, h, Tk, d/h)
            v = split_heads(self.v_proj(value), self.num_heads)  # (B, h, Tk, d/h)
            q, k = self.project_queries_keys(q, k, start)
            if cache is not None:
                # all keys/values so far: (B, h, start + Tk, d/h)
                k, v = cache.append(k, v)
        mask = attention_mask_for_heads(
            mask, key_padding_mask, B, q.shape[2], k.shape[2]
        )
        if mask is not None:  # q, k and v are ours: only a caller's mask is checked
            check_mask(mask, (B, self.num_heads, q.shape[2], k.shape[2]), q.device)
        # one computation, the fused kernel's without weights
        dropout_p = self.dropout if self.training else 0.0
        # (B, h, Tq, d/h), and the weights after dropout or None
        out, weights = _attention(q, k, v, mask, need_weights, is_causal, dropout_p)
        # (B, Tq, d), (B, h, Tq, Tk) or None
        return self.out_proj(merge_heads(out)), weights

    @torch.no_grad()
    def load_from_torch(self, reference: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy the weights of an ``nn.MultiheadAttention`` of the same size into this
        module."""
        if reference.embed_dim != self.d_model or reference.num_heads != self.num_heads:
            raise ValueError(
                f"reference has embed_dim={reference.embed_dim}, "
                f"num_heads={reference.num_heads}; "
                f"this module has d_model={self.d_model}, num_heads={self.num_heads}"
            )
        if not reference._qkv_same_embed_dim:
            raise ValueError("reference must have kdim == vdim == embed_dim")
        if reference.bias_k is not None or reference.add_zero_attn:
            raise ValueError(
                "reference has add_bias_kv=True or add_zero_attn=True (an extra key "
                "and value this "
                "module does not have): build it with both False"
            )
        if (reference.in_proj_bias is None) != (self.q_proj.bias is None):
            has_bias = reference.in_proj_bias is not None
            raise ValueError(
                f"reference has bias={has_bias}; this module has bias={not has_bias}"
            )
        for proj, w in zip(
            (self.q_proj, self.k_proj, self.v_proj),
            reference.in_proj_weight.chunk(3),
            strict=True,
        ):
            proj.weight.copy_(w)
        if reference.in_proj_bias is not None and self.q_proj.bias is not None:
            for proj, b in zip(
                (self.q_proj, self.k_proj, self.v_proj),
                reference.in_proj_bias.chunk(3),
                strict=True,
            ):
                proj.bias.copy_(b)
        self.out_proj.load_state_dict(reference.out_proj.state_dict())
        return self


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

    _check_inputs = MultiHeadAttention._check_inputs

    def forward(
        self,
        query,
        key,
        value,
        mask=None,
        *,
        key_padding_mask=None,
        need_weights=True,
        is_causal=False,
    ):
        self._check_inputs(query, key, value)
        h = self.num_heads
        q = split_heads(self.q_proj(query), h)  # (B, h, Tq, d)
        k = split_heads(self.k_proj(key), h)  # (B, h, Tk, d)
        v = split_heads(self.v_proj(value), h)  # (B, h, Tk, d)
        mask = attention_mask_for_heads(
            mask, key_padding_mask, query.shape[0], query.shape[1], key.shape[1]
        )
        out, weights = scaled_dot_product_attention(
            q, k, v, mask, need_weights=need_weights, is_causal=is_causal
        )
        return self.out_proj(merge_heads(out)), weights


class RotaryMultiHeadAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` with rotary position embedding (RoPE) applied to each
    head's queries and keys, so the scores depend on relative position only. Same
    arguments and shapes.

    :meth:`set_rope_scaling` stretches the rotations for inputs longer than the trained
    length (``scale``, ``method``, ``original_length`` as in
    :func:`~attnbook.positions.rope_angles`); the default, ``scale=1.0``, is plain
    RoPE."""

    rope_scale, rope_method, rope_original_length = 1.0, "linear", None

    def set_rope_scaling(
        self,
        scale: float = 1.0,
        method: str = "linear",
        original_length: int | None = None,
    ):
        """Use RoPE scaled by ``scale`` with ``method`` from now on (``scale=1.0`` turns
        it off)."""
        scale, original_length = _check_rope_scaling(scale, method, original_length)
        self.rope_scale, self.rope_method, self.rope_original_length = (
            scale,
            method,
            original_length,
        )
        return self

    def project_queries_keys(self, q, k, start):
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                "RotaryMultiHeadAttention is for self-attention (queries and keys from "
                "one sequence)"
            )
        if self.rope_scale == 1.0:
            return apply_rope(q, start), apply_rope(k, start)
        scaling = dict(
            scale=self.rope_scale,
            method=self.rope_method,
            original_length=self.rope_original_length,
        )
        return apply_rope(q, start, **scaling), apply_rope(k, start, **scaling)
