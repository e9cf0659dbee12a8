"""Attention itself: scaled dot-product attention, additive attention, memory-efficient
attention.

Shapes: queries ``q (..., Tq, d)``, keys ``k (..., Tk, d)``, values ``v (..., Tk, dv)``;
outputs ``(..., Tq, dv)``, weights ``(..., Tq, Tk)``.

Masks: a bool mask is ``True`` where attention is blocked; a float mask is added to the
scores. Either must broadcast to ``(..., Tq, Tk)``. A query whose keys are all blocked
gets weights 0 and output 0, never NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .masks import causal_key_stop, causal_mask, mask_future_
from .utils import check_positive_int

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _with_causal(
    mask: torch.Tensor | None, n_q: int, n_k: int, device
) -> torch.Tensor | None:
    """``mask`` with the causal mask added (None when a single query may see every
    key)."""
    if n_q == 1 and n_k >= 1 and mask is None:
        return None
    # (Tq, Tk), aligned to the bottom right
    causal = causal_mask(n_q, device, key_len=n_k)
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask | causal
    return mask.masked_fill(causal, float("-inf"))


def masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax over the last dim with ``mask`` applied before it (``-inf`` where
    blocked).

    Rows whose entries are all blocked give weights 0 instead of NaN (one
    ``masked_fill`` after the softmax); their gradients are 0, not NaN. Without a mask
    it is a plain softmax, with no copy. A float mask is cast to the scores' dtype
    first; an entry that becomes ``-inf`` then is blocked.
    """
    if mask is None:
        return torch.softmax(scores, dim=-1)
    check_mask(mask, scores.shape, scores.device)
    if mask.dtype == torch.bool:
        blocked = mask
        scores = scores.masked_fill(mask, float("-inf"))  # (..., Tq, Tk)
    else:
        mask = mask.to(scores.dtype)
        blocked = torch.isneginf(mask)
        # the masked_fill_ stops the gradient at blocked entries (a fully blocked row's
        # softmax is NaN)
        scores = (scores + mask).masked_fill_(blocked, float("-inf"))  # (..., Tq, Tk)
    # (..., Tq, 1) on the mask's own shape
    blocked_row = blocked.all(dim=-1, keepdim=True)
    weights = torch.softmax(scores, dim=-1)  # NaN in fully blocked rows
    if torch.is_grad_enabled() and weights.requires_grad:
        return weights.masked_fill(blocked_row, 0.0)
    return weights.masked_fill_(blocked_row, 0.0)


def scaled_dot_product_attention(
    q,
    k,
    v,
    mask=None,
    *,
    need_weights: bool = True,
    is_causal: bool = False,
    dropout_p: float = 0.0,
):
    """Scaled dot-product attention ``softmax(q k^T / sqrt(d) + mask) v``.

    q ``(..., Tq, d)``, k ``(..., Tk, d)``, v ``(..., Tk, dv)``, all of one dtype and
    device; mask bool (``True`` = blocked) or float (added, after a cast to q's dtype),
    broadcasting to ``(..., Tq, Tk)``. ``is_causal=True`` also blocks the future: query
    ``i`` is token ``Tk - Tq + i`` and sees keys up to it (aligned to the bottom right,
    as with a KV cache; ``F.scaled_dot_product_attention`` aligns it to the top left
    when ``Tq < Tk``). ``dropout_p`` drops attention weights (pass it only in training).
    Returns ``(out (..., Tq, dv), weights (..., Tq, Tk))``, the weights after dropout.
    With ``need_weights=False`` the fused ``F.scaled_dot_product_attention`` computes
    ``out`` and ``weights`` is ``None``.

    In fp16/bf16 the scores and the softmax are computed in fp32, so large scores stay
    finite.
    """
    _check_qkv(q, k, v)
    dropout_p = _check_dropout(dropout_p)
    if mask is not None:
        check_mask(mask, _scores_shape(q, k), q.device)
    return _attention(q, k, v, mask, need_weights, is_causal, dropout_p)


def _attention(q, k, v, mask, need_weights, is_causal, dropout_p):
    """:func:`scaled_dot_product_attention` on inputs already checked (multi-head
    attention checks its own once, and calls this once a layer and token)."""
    if mask is not None and mask.dtype != torch.bool:
        # fully blocked rows are decided in q's dtype, on every path
        mask = mask.to(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if not need_weights:
        if is_causal and mask is None and n_q == n_k:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True
            ), None
        if is_causal:
            mask = _with_causal(mask, n_q, n_k, q.device)
        return _fused_attention(q, k, v, mask, dropout_p), None
    if is_causal:
        mask = _with_causal(mask, n_q, n_k, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.dtype in _LOW_PRECISION:
        # (..., Tq, Tk) in fp32
        scores = (q.float() * scale) @ k.float().transpose(-2, -1)
    else:
        scores = (q * scale) @ k.transpose(-2, -1)  # (..., Tq, Tk)
    weights = masked_softmax(scores, mask).to(v.dtype)  # (..., Tq, Tk)
    if dropout_p > 0:
        # (..., Tq, Tk), what the values are averaged with
        weights = F.dropout(weights, dropout_p)
    return weights @ v, weights  # (..., Tq, dv)


def _fused_attention(q, k, v, mask, dropout_p=0.0):
    """The fast path: PyTorch's fused kernel, with our mask meaning and zero for blocked
    rows.

    A fully blocked row is unblocked for the kernel (which may give NaN or a NaN
    gradient for it) and its output set to 0 afterwards, so its gradients are 0. A float
    mask is already in q's dtype."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    # () or (Tk,) broadcast, but the fused kernel of a 4-D q wants (..., Tq, Tk)
    if mask.dim() < 2:
        # (1, 1) or (1, Tk): a view
        mask = mask.view((1,) * (2 - mask.dim()) + tuple(mask.shape))
    if mask.dtype == torch.bool:
        blocked_row = mask.all(dim=-1, keepdim=True)  # (..., Tq, 1)
        keep = ~mask | blocked_row  # torch: True = keep
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=dropout_p
        )
    else:
        # (..., Tq, 1), in q's dtype
        blocked_row = torch.isneginf(mask).all(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.masked_fill(blocked_row, 0.0), dropout_p=dropout_p
        )
    return out.masked_fill(blocked_row, 0.0)  # (..., Tq, dv)


class AdditiveAttention(nn.Module):
    """Additive (Bahdanau) attention: score ``w_v^T tanh(W_q q + W_k k)``.

    Queries ``(..., Tq, query_size)`` and keys ``(..., Tk, key_size)`` may have
    different sizes; values ``(..., Tk, dv)``. ``forward`` returns ``(out (..., Tq, dv),
    weights (..., Tq, Tk))``.
    """

    def __init__(self, query_size: int, key_size: int, hidden_size: int):
        super().__init__()
        for name, size in (
            ("query_size", query_size),
            ("key_size", key_size),
            ("hidden_size", hidden_size),
        ):
            check_positive_int(name, size)
        self.W_q = nn.Linear(query_size, hidden_size, bias=False)
        self.W_k = nn.Linear(key_size, hidden_size, bias=False)
        self.w_v = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, query, key, value, mask=None):
        if query.shape[-1] != self.W_q.in_features:
            raise ValueError(
                f"query must end in {self.W_q.in_features} features, got shape "
                f"{tuple(query.shape)}"
            )
        if key.shape[-1] != self.W_k.in_features:
            raise ValueError(
                f"key must end in {self.W_k.in_features} features, got shape "
                f"{tuple(key.shape)}"
            )
        if key.shape[-2] != value.shape[-2]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in Tk"
            )
        # (..., Tq, Tk, hidden)
        features = self.W_q(query).unsqueeze(-2) + self.W_k(key).unsqueeze(-3)
        scores = self.w_v(torch.tanh(features)).squeeze(-1)  # (..., Tq, Tk)
        weights = masked_softmax(scores, mask)
        return weights @ value, weights


def memory_efficient_attention(
    q,
    k,
    v,
    mask=None,
    *,
    block_size: int = 1024,
    query_block_size: int | None = None,
    is_causal: bool = False,
):
    """Attention that never stores the ``Tq x Tk`` score matrix: keys in blocks, online
    softmax (:func:`online_softmax_attention`, which also returns each row's
    log-sum-exp). Peak extra memory is one block of scores, ``batch x query_block_size
    x block_size``, plus the output, instead of ``O(Tq Tk)``; the products, and so the
    FLOPs, are those of the naive version.

    Same arguments and mask rules as :func:`scaled_dot_product_attention`. With
    ``is_causal=True`` a block's causal mask is built on the fly, and key blocks
    entirely in the future are skipped. Returns only the output ``(..., Tq, dv)``.
    """
    out, _ = online_softmax_attention(
        q,
        k,
        v,
        mask,
        block_size=block_size,
        query_block_size=query_block_size,
        is_causal=is_causal,
    )
    return out.to(q.dtype)


def online_softmax_attention(q, k, v, mask=None, *, block_size: int = 1024,
                             query_block_size: int | None = None,
                             is_causal: bool = False):  # fmt: skip
    """The library's one online softmax: ``(out (..., Tq, dv), lse (..., Tq, 1))``,
    the attention output and the log-sum-exp ``L = log sum_j exp(s_j)`` of every
    query's scores (``+inf`` for a query that sees no key), both in float32 for fp16 /
    bf16 inputs. :func:`memory_efficient_attention` keeps the output; FlashAttention's
    forward (:mod:`attnbook.flash`) keeps both, for its backward.

    Queries are processed ``query_block_size`` (default ``block_size``) at a time, all
    batch and head dims in one batched product; for each query block the keys are
    visited ``block_size`` at a time, keeping a running max ``m``, a running denominator
    ``l`` and a running numerator ``acc`` per query (Milakov & Gimelshein, 2018, as in
    FlashAttention), updated in place; the output is ``acc / l`` and ``L = m + log l``.
    """
    _check_qkv(q, k, v)
    block_size = check_positive_int("block_size", block_size)
    query_block_size = (
        block_size
        if query_block_size is None
        else check_positive_int("query_block_size", query_block_size)
    )
    scores_shape = _scores_shape(q, k)
    n_q, n_k, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    # v's batch dims broadcast too, as in torch
    batch = _broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if mask is not None:
        check_mask(mask, scores_shape, q.device)
        mask = mask.expand(*batch, n_q, n_k)  # a view: no memory
    in_dtype = q.dtype
    compute_dtype = torch.float32 if in_dtype in _LOW_PRECISION else in_dtype
    scale = 1.0 / math.sqrt(d)
    # (N, Tq, d), N = product of batch
    q = q.expand(*batch, n_q, d).reshape(-1, n_q, d).to(compute_dtype)
    # (N, d, Tk)
    k_t = k.expand(*batch, n_k, d).reshape(-1, n_k, d).to(compute_dtype).transpose(1, 2)
    v = v.expand(*batch, n_k, dv).reshape(-1, n_k, dv).to(compute_dtype)
    out = q.new_empty(q.shape[0], n_q, dv)  # (N, Tq, dv)
    lse = q.new_empty(q.shape[0], n_q, 1)  # (N, Tq, 1)
    for q_start in range(0, n_q, query_block_size):
        rows = min(query_block_size, n_q - q_start)
        q_block = q[:, q_start : q_start + rows]  # (N, bq, d)
        # later keys: future (causal masks align to the bottom right)
        last_key = causal_key_stop(q_start + rows, n_q, n_k) if is_causal else n_k
        m = l = acc = None  # noqa: E741
        for k_start in range(0, last_key, block_size):
            cols = min(block_size, n_k - k_start)
            k_block = k_t[:, :, k_start : k_start + cols]  # (N, d, bk)
            scores = torch.baddbmm(
                q_block.new_empty(()), q_block, k_block, beta=0.0, alpha=scale
            )  # (N, bq, bk)
            if mask is not None:
                block_mask = mask[
                    ..., q_start : q_start + rows, k_start : k_start + cols
                ].reshape(-1, rows, cols)
                if block_mask.dtype == torch.bool:
                    scores.masked_fill_(block_mask, float("-inf"))
                else:
                    # -inf decided in q's dtype
                    scores.add_(block_mask.to(in_dtype).to(compute_dtype))
            if is_causal:  # the block's causal mask, built on the fly
                mask_future_(scores, q_start, k_start, n_q, n_k)
            block_max = scores.amax(dim=-1, keepdim=True)  # (N, bq, 1)
            m_new = block_max if m is None else torch.maximum(m, block_max)
            # rows blocked so far: exp(-inf - 0) = 0, no NaN
            m_safe = m_new.nan_to_num(neginf=0.0)
            p = scores.sub_(m_safe).exp_()  # (N, bq, bk), in place
            v_block = v[:, k_start : k_start + cols]  # (N, bk, dv)
            if acc is None:
                l = p.sum(dim=-1, keepdim=True)  # (N, bq, 1)  # noqa: E741
                acc = torch.bmm(p, v_block)  # (N, bq, dv)
            else:  # rescale what was summed under the old max, then add this block
                correction = (m - m_safe).exp_()  # (N, bq, 1)
                l = l.mul_(correction).add_(p.sum(dim=-1, keepdim=True))  # noqa: E741
                acc = torch.baddbmm(acc.mul_(correction), p, v_block)
            m = m_new
            # free this block before the next one is allocated: one block at a time
            del scores, p
        if acc is None:  # no key visible to this whole block
            out[:, q_start : q_start + rows] = 0.0
            lse[:, q_start : q_start + rows] = math.inf
            continue
        # L = m + log l; +inf for a query with no visible key (l = 0)
        lse[:, q_start : q_start + rows] = (m + l.log()).masked_fill_(l == 0, math.inf)
        tiny = torch.finfo(compute_dtype).tiny  # 0 / tiny for a query that sees none
        torch.div(acc, l.clamp_min_(tiny), out=out[:, q_start : q_start + rows])
    # (..., Tq, dv), (..., Tq, 1)
    return out.reshape(*batch, n_q, dv), lse.reshape(*batch, n_q, 1)


# --- validation: every public function above checks its inputs with these
# ---------------------------


def _broadcast(*shapes) -> tuple[int, ...] | None:
    """The broadcast of ``shapes`` (NumPy rules), or ``None`` if they do not broadcast.

    A plain-Python version of ``torch.broadcast_shapes``, which is slow enough to show
    in the per-token cost of cached generation."""
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
            raise ValueError(
                f"{name} must have at least 2 dims (..., T, d), got shape "
                f"{tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got dtype {t.dtype}"
            )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(
                "q, k and v must share one dtype: "
                f"q is {q.dtype} but {name} is {t.dtype}"
            )
        if t.device != q.device:
            raise ValueError(
                f"q, k and v must be on one device: q is on {q.device} but {name} is "
                f"on {t.device}"
            )
    batch = _broadcast(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    broken = {  # each rule, and whether it is broken
        "q and k must have the same feature size d": q.shape[-1] != k.shape[-1],
        "k and v must have the same number of tokens Tk": k.shape[-2] != v.shape[-2],
        "the batch dims of q, k and v must broadcast (these do not broadcast)": (
            batch is None
        ),
    }
    for rule in (rule for rule, wrong in broken.items() if wrong):
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(f"{rule}, got {shapes}")


def check_mask(
    mask: torch.Tensor,
    scores_shape: tuple[int, ...],
    device: torch.device | None = None,
) -> None:
    """Raise a clear error unless ``mask`` is bool or float, broadcasts to
    ``scores_shape`` and (when ``device`` is given) lies on ``device``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"mask must be a torch.Tensor or None, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            "mask must be bool (True = blocked) or float (added to the scores), got "
            f"dtype {mask.dtype}"
        )
    if device is not None and mask.device != device:
        raise ValueError(
            f"mask is on {mask.device} but q is on {device}: move the mask to the same "
            "device"
        )
    scores_shape = tuple(scores_shape)
    if _broadcast(mask.shape, scores_shape) != scores_shape:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' "
            f"shape {scores_shape} (..., Tq, Tk)"
        )


def _scores_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    return (*_broadcast(q.shape[:-2], k.shape[:-2]), q.shape[-2], k.shape[-2])


def _check_dropout(dropout_p, name: str = "dropout_p") -> float:
    """``dropout_p`` as a float in ``[0, 1)``; otherwise a ``ValueError`` naming
    ``name``."""
    if (
        isinstance(dropout_p, bool)
        or not isinstance(dropout_p, (int, float))
        or not 0 <= dropout_p < 1
    ):
        raise ValueError(f"{name} must be a number in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


__all__ = [
    "AdditiveAttention",
    "check_mask",
    "masked_softmax",
    "memory_efficient_attention",
    "online_softmax_attention",
    "scaled_dot_product_attention",
]
