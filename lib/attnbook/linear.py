"""Linear attention (Katharopoulos et al., 2020; chapter 20): softmax's ``exp(q . k)``
replaced by a kernel ``phi(q) . phi(k)``, so the sum over keys can be done first.

With ``phi(x) = elu(x) + 1`` (positive, so every weight is positive), query ``i``'s
output is

``out_i = phi(q_i) S_i / (phi(q_i) . z_i)``, ``S_i = sum_{j<=i} phi(k_j) v_j^T``
``(d, dv)``, ``z_i = sum_{j<=i} phi(k_j)`` ``(d,)``

(the non-causal form sums over every ``j``). Two ways to compute the same numbers:

- :func:`linear_attention`, the parallel form: all tokens at once (causal: the
  ``Tq x Tk`` matrix ``phi(Q) phi(K)^T`` with the future zeroed, as attention without
  the softmax; non-causal: ``phi(Q) (phi(K)^T V)``, linear in ``T``);
- :func:`linear_attention_recurrent`, the recurrent form: one token at a time, carrying
  only the state ``(S, z)``, whose size does not grow with the sequence
  (:func:`linear_attention_state_bytes`), and can continue a decode from it.

:class:`LinearAttention` is the multi-head layer, with the projections of
:class:`~attnbook.multihead.MultiHeadAttention`; it can replace that layer in a block.

Shapes: ``q, k (..., T, d)``, ``v (..., T, dv)`` -> ``(..., T, dv)``. In fp16 / bf16
the sums are computed in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import _check_qkv
from .masks import causal_mask
from .multihead import merge_heads, split_heads
from .utils import check_eps, check_positive_int

FEATURE_MAPS = {
    "elu": lambda x: F.elu(x) + 1,  # Katharopoulos et al.: positive, smooth
    "relu": F.relu,  # may give a query no weight at all: its output is then 0
}


class LinearAttentionState(NamedTuple):
    """The recurrent state: ``S (..., d, dv)``, the sum of ``phi(k_j) v_j^T``, and
    ``z (..., d)``, the sum of ``phi(k_j)`` (the normaliser)."""

    S: torch.Tensor
    z: torch.Tensor


def _feature_map(name):
    if name not in FEATURE_MAPS:
        raise ValueError(
            f"feature_map must be one of {sorted(FEATURE_MAPS)}, got {name!r}"
        )
    return FEATURE_MAPS[name]


def _compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def linear_attention(q, k, v, *, causal=True, feature_map="elu", eps=1e-6):
    """Linear attention, parallel form: q ``(..., Tq, d)``, k ``(..., Tk, d)``, v
    ``(..., Tk, dv)`` -> ``(..., Tq, dv)``.

    ``causal=True``: query ``i`` sees keys ``j <= i`` (aligned to the bottom right when
    ``Tq < Tk``, as everywhere in the library); this form builds the ``Tq x Tk`` matrix
    ``phi(Q) phi(K)^T``. ``causal=False``: every key, computed as ``phi(Q) (phi(K)^T
    V)`` in ``O(T d dv)``. ``eps`` is added to the denominator.
    """
    _check_qkv(q, k, v)
    phi, eps = _feature_map(feature_map), check_eps(eps)
    dtype = _compute_dtype(q.dtype)
    phi_q, phi_k, v_ = phi(q.to(dtype)), phi(k.to(dtype)), v.to(dtype)
    if causal:
        scores = phi_q @ phi_k.transpose(-2, -1)  # (..., Tq, Tk)
        n_q, n_k = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(causal_mask(n_q, q.device, key_len=n_k), 0.0)
        out = (scores @ v_) / (scores.sum(-1, keepdim=True) + eps)
    else:
        S = phi_k.transpose(-2, -1) @ v_  # (..., d, dv)
        z = phi_k.sum(-2, keepdim=True)  # (..., 1, d)
        out = (phi_q @ S) / ((phi_q * z).sum(-1, keepdim=True) + eps)
    return out.to(q.dtype)  # (..., Tq, dv)


def linear_attention_recurrent(q, k, v, *, feature_map="elu", state=None, eps=1e-6):
    """Causal linear attention, one token at a time: q, k ``(..., T, d)``, v ``(...,
    T, dv)`` -> ``(out (..., T, dv), state)``.

    For each token ``t``: ``S += phi(k_t) v_t^T``, ``z += phi(k_t)``, ``out_t =
    phi(q_t) S / (phi(q_t) . z + eps)``. ``state`` (a :class:`LinearAttentionState`,
    default zeros) is the state after earlier tokens; the one returned continues the
    sequence. Equal to ``linear_attention(..., causal=True)`` on the whole sequence.
    """
    _check_qkv(q, k, v)
    phi, eps = _feature_map(feature_map), check_eps(eps)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"the recurrent form needs one query per key, got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    dtype = _compute_dtype(q.dtype)
    phi_q, phi_k, v_ = phi(q.to(dtype)), phi(k.to(dtype)), v.to(dtype)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    d, dv = q.shape[-1], v.shape[-1]
    if state is None:
        S, z = phi_q.new_zeros(*batch, d, dv), phi_q.new_zeros(*batch, d)
    else:
        _check_state(state, (*batch, d, dv))
        S, z = state.S.to(dtype), state.z.to(dtype)
    outs = []
    for t in range(q.shape[-2]):
        S = S + phi_k[..., t, :, None] * v_[..., t, None, :]  # (..., d, dv)
        z = z + phi_k[..., t, :]  # (..., d)
        num = (phi_q[..., t, None, :] @ S).squeeze(-2)  # (..., dv)
        den = (phi_q[..., t, :] * z).sum(-1, keepdim=True)  # (..., 1)
        outs.append(num / (den + eps))
    out = torch.stack(outs, dim=-2).to(q.dtype)  # (..., T, dv)
    return out, LinearAttentionState(S, z)


def _check_state(state, S_shape):
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"state must be a LinearAttentionState (S, z), got {state!r}")
    S, z = state
    if tuple(S.shape) != tuple(S_shape) or tuple(z.shape) != tuple(S_shape[:-1]):
        raise ValueError(
            f"state must be S {tuple(S_shape)} and z {tuple(S_shape[:-1])}, got "
            f"{tuple(S.shape)} and {tuple(z.shape)}"
        )


def linear_attention_state_bytes(d, dv, *, batch_size=1, dtype=torch.float32) -> int:
    """Bytes of the recurrent state ``(S, z)``: ``batch_size (d dv + d)`` numbers of
    ``dtype``, whatever the sequence length (pass ``batch_size = B h`` for ``h``
    heads)."""
    d, dv = check_positive_int("d", d), check_positive_int("dv", dv)
    batch_size = check_positive_int("batch_size", batch_size)
    return batch_size * (d * dv + d) * torch.empty((), dtype=dtype).element_size()


class LinearAttention(nn.Module):
    """Multi-head linear attention: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` as
    in :class:`~attnbook.multihead.MultiHeadAttention` (same names and shapes, so its
    weights can be copied in), then :func:`linear_attention` on each head's ``d / h``
    slice.

    ``forward(query (B, Tq, d), key (B, Tk, d), value (B, Tk, d), mask=None, *,
    is_causal=False, ...) -> (out (B, Tq, d), None)``: the signature of
    ``MultiHeadAttention``, so it can be a block's ``attention_class``. No weight matrix
    is returned, and masks and KV caches do not apply (the causal form is
    ``is_causal=True``; a decode carries the state of :meth:`step` instead): passing
    one raises. ``dropout`` drops the heads' outputs before ``out_proj``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        *,
        feature_map: str = "elu",
        eps: float = 1e-6,
    ):
        super().__init__()
        d_model = check_positive_int("d_model", d_model)
        num_heads = check_positive_int("num_heads", num_heads)
        if d_model % num_heads != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}"
            )
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        _feature_map(feature_map)
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.feature_map, self.eps, self.dropout = feature_map, check_eps(eps), dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _check(self, name, x):
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() != 3
            or x.shape[-1] != self.d_model
        ):
            raise ValueError(
                f"{name} must be (B, T, d_model={self.d_model}), got "
                f"{tuple(getattr(x, 'shape', ()))}"
            )

    def _heads(self, query, key, value):
        """Per-head ``q, k (B, h, T, d/h)``, ``v (B, h, Tk, d/h)``."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            self._check(name, x)
        h = self.num_heads
        return (
            split_heads(self.q_proj(query), h),
            split_heads(self.k_proj(key), h),
            split_heads(self.v_proj(value), h),
        )

    def _out(self, heads):
        heads = F.dropout(heads, self.dropout, self.training)
        return self.out_proj(merge_heads(heads))  # (B, T, d)

    def forward(
        self,
        query,
        key,
        value,
        mask=None,
        *,
        key_padding_mask=None,
        need_weights=False,
        cache=None,
        is_causal=False,
    ):
        if mask is not None or key_padding_mask is not None or cache is not None:
            raise ValueError(
                "LinearAttention takes no mask, key_padding_mask or cache: use "
                "is_causal=True for the causal form and step() to decode"
            )
        q, k, v = self._heads(query, key, value)
        out = linear_attention(
            q, k, v, causal=is_causal, feature_map=self.feature_map, eps=self.eps
        )
        return self._out(out), None

    def step(self, x, state=None):
        """Causal self-attention on ``x (B, T, d)`` in the recurrent form, continuing
        from ``state`` (per head: ``S (B, h, d/h, d/h)``, ``z (B, h, d/h)``; default
        zeros). Returns ``(out (B, T, d), state)``; ``T = 1`` decodes one token."""
        q, k, v = self._heads(x, x, x)
        out, state = linear_attention_recurrent(
            q, k, v, feature_map=self.feature_map, state=state, eps=self.eps
        )
        return self._out(out), state

    def state_bytes(self, batch_size: int = 1, dtype=torch.float32) -> int:
        """Bytes of this layer's recurrent state: ``batch_size h (d_h^2 + d_h)``
        numbers (``d_h = d / h``), for any sequence length."""
        return linear_attention_state_bytes(
            self.head_dim,
            self.head_dim,
            batch_size=check_positive_int("batch_size", batch_size) * self.num_heads,
            dtype=dtype,
        )


__all__ = [
    "FEATURE_MAPS",
    "LinearAttention",
    "LinearAttentionState",
    "linear_attention",
    "linear_attention_recurrent",
    "linear_attention_state_bytes",
]
