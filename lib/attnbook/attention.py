"""Attention itself: scaled dot-product attention, additive attention, memory-efficient attention.

Shapes: queries ``q (..., Tq, d)``, keys ``k (..., Tk, d)``, values ``v (..., Tk, dv)``;
outputs ``(..., Tq, dv)``, weights ``(..., Tq, Tk)``.

Masks: a bool mask is ``True`` where attention is blocked; a float mask is added to the scores.
Either must broadcast to ``(..., Tq, Tk)``. A query whose keys are all blocked gets weights 0 and
output 0, never NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _broadcast(*shapes) -> tuple[int, ...] | None:
    """The broadcast of ``shapes`` (NumPy rules), or ``None`` if they do not broadcast.

    A plain-Python version of ``torch.broadcast_shapes``, which is slow enough to show in the
    per-token cost of cached generation."""
    result: list[int] = []
    length = max(len(s) for s in shapes)
    padded = [(1,) * (length - len(s)) + tuple(s) for s in shapes]
    for dims in zip(*padded, strict=True):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            return None
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., T, d), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature size d, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of tokens Tk, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if _broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2]) is None:
        raise ValueError(f"batch dims of q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not broadcast")


def check_mask(mask: torch.Tensor, scores_shape: tuple[int, ...]) -> None:
    """Raise a clear error unless ``mask`` is bool or float and broadcasts to ``scores_shape``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = blocked) or float (added to the scores), got dtype {mask.dtype}"
        )
    scores_shape = tuple(scores_shape)
    if _broadcast(mask.shape, scores_shape) != scores_shape:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {scores_shape} (..., Tq, Tk)"
        )


def _scores_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    return (*_broadcast(q.shape[:-2], k.shape[:-2]), q.shape[-2], k.shape[-2])


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim with ``mask`` applied before it (``-inf`` where blocked).

    Rows whose entries are all blocked give weights 0 instead of NaN.
    """
    if mask is not None:
        check_mask(mask, scores.shape)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    blocked_row = torch.isneginf(scores).all(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(blocked_row, 0.0), dim=-1)
    return weights.masked_fill(blocked_row, 0.0)


def scaled_dot_product_attention(q, k, v, mask=None, *, need_weights: bool = True):
    """Scaled dot-product attention ``softmax(q k^T / sqrt(d) + mask) v``.

    q ``(..., Tq, d)``, k ``(..., Tk, d)``, v ``(..., Tk, dv)``; mask bool (``True`` = blocked) or
    float (added), broadcasting to ``(..., Tq, Tk)``.
    Returns ``(out (..., Tq, dv), weights (..., Tq, Tk))``. With ``need_weights=False`` the
    fused ``F.scaled_dot_product_attention`` computes ``out`` and ``weights`` is ``None``.

    In fp16/bf16 the scores and the softmax are computed in fp32, so large scores stay finite.
    """
    _check_qkv(q, k, v)
    scores_shape = _scores_shape(q, k)
    if mask is not None:
        check_mask(mask, scores_shape)
    if not need_weights:
        return _fused_attention(q, k, v, mask), None
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.dtype in _LOW_PRECISION:
        scores = (q.float() * scale) @ k.float().transpose(-2, -1)  # (..., Tq, Tk) in fp32
    else:
        scores = (q * scale) @ k.transpose(-2, -1)  # (..., Tq, Tk)
    weights = masked_softmax(scores, mask).to(v.dtype)  # (..., Tq, Tk)
    return weights @ v, weights  # (..., Tq, dv)


def _fused_attention(q, k, v, mask):
    """The fast path: PyTorch's fused kernel, with our mask meaning and zero for blocked rows."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    if mask.dtype == torch.bool:
        blocked_row = mask.all(dim=-1, keepdim=True)  # broadcasts to (..., Tq, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)  # torch: True = keep
    else:
        blocked_row = torch.isneginf(mask).all(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
    return out.masked_fill(blocked_row, 0.0)  # some kernels give NaN for a fully blocked row


class AdditiveAttention(nn.Module):
    """Additive (Bahdanau) attention: score ``w_v^T tanh(W_q q + W_k k)``.

    Queries ``(..., Tq, query_size)`` and keys ``(..., Tk, key_size)`` may have different sizes;
    values ``(..., Tk, dv)``. ``forward`` returns ``(out (..., Tq, dv), weights (..., Tq, Tk))``.
    """

    def __init__(self, query_size: int, key_size: int, hidden_size: int):
        super().__init__()
        for name, size in (("query_size", query_size), ("key_size", key_size), ("hidden_size", hidden_size)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        self.W_q = nn.Linear(query_size, hidden_size, bias=False)
        self.W_k = nn.Linear(key_size, hidden_size, bias=False)
        self.w_v = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, query, key, value, mask=None):
        if query.shape[-1] != self.W_q.in_features:
            raise ValueError(f"query must end in {self.W_q.in_features} features, got shape {tuple(query.shape)}")
        if key.shape[-1] != self.W_k.in_features:
            raise ValueError(f"key must end in {self.W_k.in_features} features, got shape {tuple(key.shape)}")
        if key.shape[-2] != value.shape[-2]:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in Tk")
        features = self.W_q(query).unsqueeze(-2) + self.W_k(key).unsqueeze(-3)  # (..., Tq, Tk, hidden)
        scores = self.w_v(torch.tanh(features)).squeeze(-1)  # (..., Tq, Tk)
        weights = masked_softmax(scores, mask)
        return weights @ value, weights


def memory_efficient_attention(q, k, v, mask=None, *, block_size: int = 1024):
    """Attention that never stores the ``Tq x Tk`` score matrix: keys in blocks, online softmax.

    Queries are processed ``block_size`` at a time; for each query block the keys are visited
    ``block_size`` at a time, keeping a running max ``m``, a running denominator ``l`` and a
    running numerator ``acc`` per query (the online softmax of Milakov & Gimelshein, 2018, as in
    FlashAttention). Peak extra memory is ``O(block_size^2)`` per batch element instead of
    ``O(Tq Tk)``. Same arguments and mask rules as :func:`scaled_dot_product_attention`; returns
    only the output ``(..., Tq, dv)``.
    """
    _check_qkv(q, k, v)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    scores_shape = _scores_shape(q, k)
    if mask is not None:
        check_mask(mask, scores_shape)
        mask = mask.expand(scores_shape)  # a view: no memory
    batch = scores_shape[:-2]
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:])
    compute_dtype = torch.float32 if q.dtype in _LOW_PRECISION else q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[-2], k.shape[-2]
    outputs = []
    for q_start in range(0, n_q, block_size):
        q_block = q[..., q_start : q_start + block_size, :].to(compute_dtype) * scale  # (..., bq, d)
        rows = q_block.shape[-2]
        m = q_block.new_full((*batch, rows, 1), float("-inf"))  # running max of the scores
        l = q_block.new_zeros((*batch, rows, 1))  # running sum of exp(score - m)  # noqa: E741
        acc = q_block.new_zeros((*batch, rows, v.shape[-1]))  # running sum of exp(score - m) v
        for k_start in range(0, n_k, block_size):
            k_block = k[..., k_start : k_start + block_size, :].to(compute_dtype)  # (..., bk, d)
            v_block = v[..., k_start : k_start + block_size, :].to(compute_dtype)  # (..., bk, dv)
            scores = q_block @ k_block.transpose(-2, -1)  # (..., bq, bk)
            if mask is not None:
                block_mask = mask[..., q_start : q_start + rows, k_start : k_start + block_size]
                if block_mask.dtype == torch.bool:
                    scores = scores.masked_fill(block_mask, float("-inf"))
                else:
                    scores = scores + block_mask.to(compute_dtype)
            m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # rows blocked so far: no NaN
            p = torch.exp(scores - m_safe)  # (..., bq, bk)
            correction = torch.exp(m - m_safe)  # rescales what was summed under the old max
            l = l * correction + p.sum(dim=-1, keepdim=True)  # noqa: E741
            acc = acc * correction + p @ v_block
            m = m_new
        outputs.append(acc / l.clamp_min(torch.finfo(compute_dtype).tiny))  # blocked rows: 0 / tiny = 0
    return torch.cat(outputs, dim=-2).to(v.dtype)
