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
from .modern import RMSNorm
from .positions import _check_rope_scaling, apply_rope
from .utils import check_positive_int

__all__ = [
    "MultiHeadAttention",
    "RotaryMultiHeadAttention",
    "WideMultiHeadAttention",
    "merge_heads",
    "repeat_kv",
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


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``(B, h_kv, T, d/h)`` -> ``(B, h_kv * repeats, T, d/h)``: each key or value head
    repeated for the ``repeats`` query heads it serves (head ``g`` for query heads ``g
    repeats .. g repeats + repeats - 1``), as transformers' ``repeat_kv``."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=1)


class MultiHeadAttention(nn.Module):
    """``h`` heads of scaled dot-product attention on ``d_model / h`` slices,
    concatenated and mixed by ``W_o``.

    Four ``nn.Linear`` layers ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``: ``4 (d^2
    + d)`` parameters (with bias) whatever ``num_heads`` is.

    Grouped-query attention (chapter 17): with ``num_kv_heads`` (a divisor of
    ``num_heads``; 1 is multi-query attention) ``k_proj`` and ``v_proj`` give only
    ``num_kv_heads`` heads, a cache stores only those, and each serves ``num_heads /
    num_kv_heads`` query heads (:func:`repeat_kv`). With ``qk_norm`` an
    :class:`~attnbook.modern.RMSNorm` over ``d / h`` (``q_norm``, ``k_norm``)
    normalises each head's queries and keys before any rotation (Qwen3).

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
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        num_kv_heads: int | None = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
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
        num_kv_heads = (
            num_heads
            if num_kv_heads is None
            else check_positive_int("num_kv_heads", num_kv_heads)
        )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}"
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
        self.num_kv_heads = num_kv_heads
        self.dropout = float(dropout)
        kv_width = num_kv_heads * self.head_dim  # d_model unless grouped
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        # QK-norm: None without it
        self.q_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm else None

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

    def _heads(self, x: torch.Tensor, num_heads: int, norm: nn.Module | None):
        """``(B, T, num_heads * d/h)`` -> ``(B, num_heads, T, d/h)``, each head's
        vectors RMS-normalised with QK-norm."""
        heads = split_heads(x, num_heads)
        return heads if norm is None else norm(heads)

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
        # (B, h, Tq, d/h)
        q = self._heads(self.q_proj(query), self.num_heads, self.q_norm)
        if cache is not None and cache.static and cache.length > 0:
            # computed once
            k, v = cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]
        else:
            # (B, h_kv, Tk, d/h): h_kv = h unless grouped
            k = self._heads(self.k_proj(key), self.num_kv_heads, self.k_norm)
            v = split_heads(self.v_proj(value), self.num_kv_heads)
            q, k = self.project_queries_keys(q, k, start)
            if cache is not None:
                # all keys/values so far: (B, h_kv, start + Tk, d/h)
                k, v = cache.append(k, v)
        # (B, h, Tk, d/h): each key/value head serves h / h_kv query heads
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
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
        if self.num_kv_heads != self.num_heads or self.q_norm is not None:
            raise ValueError(
                "nn.MultiheadAttention has neither grouped keys and values nor "
                "QK-norm: build this module with num_kv_heads=None, qk_norm=False"
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

    ``rope_base`` is the base of the angles ``theta_i = base^(-2i/d)`` (10000, Llama 3's
    500000). :meth:`set_rope_scaling` stretches the rotations for inputs longer than the
    trained length (``scale``, ``method``, ``original_length`` as in
    :func:`~attnbook.positions.rope_angles`); the default, ``scale=1.0``, is plain
    RoPE."""

    rope_scale, rope_method, rope_original_length = 1.0, "linear", None

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        rope_base: float = 10000.0,
        **options,
    ):
        # options: MultiHeadAttention's num_kv_heads, qk_norm, qk_norm_eps
        super().__init__(d_model, num_heads, bias, dropout, **options)
        if (
            isinstance(rope_base, bool)
            or not isinstance(rope_base, (int, float))
            or not 1 < rope_base < float("inf")
        ):
            raise ValueError(f"rope_base must be a number > 1, got {rope_base!r}")
        self.rope_base = float(rope_base)

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
        scaling = {}  # plain RoPE
        if self.rope_scale != 1.0:
            scaling = dict(
                scale=self.rope_scale,
                method=self.rope_method,
                original_length=self.rope_original_length,
            )
        q = apply_rope(q, start, self.rope_base, **scaling)
        k = apply_rope(k, start, self.rope_base, **scaling)
        return q, k
