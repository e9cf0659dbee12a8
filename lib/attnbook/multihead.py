"""Multi-head attention, the head split and merge, and a per-layer KV cache.

Shapes: inputs batch-first ``(B, T, d_model)``; per-head tensors ``(B, h, T, d_model /
h)``; per-head weights ``(B, h, Tq, Tk)``.

Masks (``True`` = blocked, float = added) may be ``(Tq, Tk)``, ``(B, Tq, Tk)`` (the same
for every head) or ``(B, h, Tq, Tk)``; ``key_padding_mask`` is ``(B, Tk)``, ``True`` at
padding.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import scaled_dot_product_attention
from .masks import attention_mask_for_heads
from .positions import _check_rope_scaling, apply_rope
from .utils import check_positive_int

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "RollingKVCache",
    "RotaryMultiHeadAttention",
    "WideMultiHeadAttention",
    "attention_mask_for_heads",
    "make_caches",
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


class KVCache:
    """Keys and values of earlier tokens for one attention layer, in preallocated
    tensors.

    ``keys`` and ``values`` are ``(B, h, max_len, head_dim)``; ``length`` tokens are
    filled.
    :meth:`append` writes new keys/values in place (no concatenation, no reallocation).
    The first append decides the dtype and device: an empty cache whose keys arrive in
    another dtype (under autocast, say) or on another device is reallocated to match
    them once. A ``static`` cache (cross-attention) is filled once and then reused as it
    is.
    """

    def __init__(
        self,
        batch_size,
        num_heads,
        max_len,
        head_dim,
        *,
        device=None,
        dtype=torch.float32,
        static=False,
    ):
        shape = tuple(
            check_positive_int(name, value)
            for name, value in (
                ("batch_size", batch_size),
                ("num_heads", num_heads),
                ("max_len", max_len),
                ("head_dim", head_dim),
            )
        )
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.static = static

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (B, h, t, head_dim)`` after the filled part; return all filled
        keys and values."""
        B, h, _, head_dim = self.keys.shape
        if (
            k.dim() != 4
            or (k.shape[0], k.shape[1], k.shape[3]) != (B, h, head_dim)
            or v.shape != k.shape
        ):
            raise ValueError(
                f"KV cache expects keys and values (B={B}, h={h}, t, "
                f"head_dim={head_dim}), "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if v.dtype != k.dtype or v.device != k.device:
            raise ValueError(
                f"keys and values must share dtype and device, got {k.dtype} on "
                f"{k.device} "
                f"and {v.dtype} on {v.device}"
            )
        if self.length == 0 and (
            k.dtype != self.keys.dtype or k.device != self.keys.device
        ):
            # follow the activations
            self.keys = torch.zeros(self.keys.shape, device=k.device, dtype=k.dtype)
            self.values = torch.zeros(self.values.shape, device=k.device, dtype=k.dtype)
        if k.dtype != self.keys.dtype or k.device != self.keys.device:
            raise ValueError(
                f"KV cache holds {self.keys.dtype} on {self.keys.device}, got keys "
                f"{k.dtype} on "
                f"{k.device}: one generation must keep one dtype"
            )
        t = k.shape[2]
        if self.length + t > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} tokens; cannot add {t} to the "
                f"{self.length} stored"
            )
        self.keys[:, :, self.length : self.length + t] = k
        self.values[:, :, self.length : self.length + t] = v
        self.length += t
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length``: the next :meth:`append`
        overwrites them (speculative decoding rolls rejected draft tokens back this
        way). Nothing is copied."""
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not 0 <= length <= self.length
        ):
            raise ValueError(
                f"truncate needs a length in [0, {self.length}] (the tokens stored), "
                f"got {length!r}"
            )
        self.length = length

    def nbytes(self) -> int:
        """Bytes held by the preallocated keys and values."""
        return self.keys.numel() * self.keys.element_size() * 2


def make_caches(
    num_layers: int,
    batch_size: int,
    num_heads: int,
    head_dim: int,
    max_len: int,
    *,
    memory_len: int | None = None,
    device=None,
    dtype=torch.float32,
):
    """The library's one cache factory: one :class:`KVCache` of ``max_len`` tokens per
    layer, or, with ``memory_len`` (an encoder–decoder), a pair per layer: the growing
    self-attention cache and a static cross-attention cache of ``memory_len`` keys,
    filled once from the encoder's output."""
    sizes = dict(device=device, dtype=dtype)
    if memory_len is None:
        return [
            KVCache(batch_size, num_heads, max_len, head_dim, **sizes)
            for _ in range(num_layers)
        ]
    return [
        (
            KVCache(batch_size, num_heads, max_len, head_dim, **sizes),
            KVCache(batch_size, num_heads, memory_len, head_dim, static=True, **sizes),
        )
        for _ in range(num_layers)
    ]


class RollingKVCache:
    """The KV cache of sliding-window attention: the keys and values of the last
    ``window`` tokens only.

    A query sees itself and the ``window - 1`` tokens before it, so older entries are
    never read again: the cache keeps at most ``window`` of them in preallocated ``(B,
    h, window, head_dim)`` tensors, and its memory stays ``2 * B * window * d * bytes``
    per layer however long the sequence grows. ``length`` counts every token seen (the
    position of the next one, as for :class:`KVCache`); ``stored`` is how many entries
    the tensors hold, ``min(length, window)``.
    :meth:`append` returns the stored entries followed by the new ones, oldest first,
    trimmed to the ``window - 1 + t`` keys that ``t`` new queries can see; the caller
    masks them with
    :func:`~attnbook.masks.sliding_window_mask` (:meth:`key_len` says how many there
    will be).
    """

    static = False

    def __init__(
        self,
        batch_size,
        num_heads,
        window,
        head_dim,
        *,
        device=None,
        dtype=torch.float32,
    ):
        shape = tuple(
            check_positive_int(name, value)
            for name, value in (
                ("batch_size", batch_size),
                ("num_heads", num_heads),
                ("window", window),
                ("head_dim", head_dim),
            )
        )
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # tokens seen
        self.stored = 0  # entries held, at most window

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return min(self.stored + new_tokens, self.window - 1 + new_tokens)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add ``k, v (B, h, t, head_dim)``; return the keys and values the new queries
        can see, ``(B, h, key_len(t), head_dim)``, oldest first; keep the last
        ``window`` of them."""
        B, h, _, head_dim = self.keys.shape
        if (
            k.dim() != 4
            or (k.shape[0], k.shape[1], k.shape[3]) != (B, h, head_dim)
            or v.shape != k.shape
        ):
            raise ValueError(
                f"KV cache expects keys and values (B={B}, h={h}, t, "
                f"head_dim={head_dim}), "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if self.stored == 0 and (
            k.dtype != self.keys.dtype or k.device != self.keys.device
        ):
            # follow the activations
            self.keys = torch.zeros(self.keys.shape, device=k.device, dtype=k.dtype)
            self.values = torch.zeros(self.values.shape, device=k.device, dtype=k.dtype)
        t = k.shape[2]
        # (B, h, stored + t, d/h)
        keys = torch.cat([self.keys[:, :, : self.stored], k.to(self.keys.dtype)], dim=2)
        values = torch.cat(
            [self.values[:, :, : self.stored], v.to(self.values.dtype)], dim=2
        )
        keep = min(self.window, keys.shape[2])
        # the last window tokens, oldest first
        self.keys[:, :, :keep] = keys[:, :, -keep:]
        self.values[:, :, :keep] = values[:, :, -keep:]
        self.stored, self.length = keep, self.length + t
        # the first new query sees window - 1 tokens before it
        visible = self.window - 1 + t
        return keys[:, :, -visible:], values[:, :, -visible:]

    def nbytes(self) -> int:
        """Bytes held by the preallocated keys and values (``2 * B * window * d *
        bytes``)."""
        return self.keys.numel() * self.keys.element_size() * 2


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
    :class:`KVCache`, only the new tokens' keys and values are computed and appended
    (or, for a filled static cache, none at all).
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
        for name, x in (("query", query), ("key", key), ("value", value)):
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
        # one computation, the fused kernel's without weights
        dropout_p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            need_weights=need_weights,
            is_causal=is_causal,
            # (B, h, Tq, d/h), weights after
            # dropout
            dropout_p=dropout_p,
        )
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
