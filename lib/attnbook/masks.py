"""Attention masks.

Convention everywhere in ``attnbook``: a boolean mask is ``True`` where attention is **blocked**
(as ``nn.MultiheadAttention``'s ``attn_mask``). ``F.scaled_dot_product_attention`` uses the
opposite meaning (``True`` = keep); chapter 2 shows the difference.
"""

from __future__ import annotations

import torch


def causal_mask(n: int, device=None) -> torch.Tensor:
    """``(n, n)`` bool mask, ``True`` above the diagonal: token ``i`` may not see tokens ``j > i``.

    It leaves ``n (n + 1) / 2`` entries allowed.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"causal_mask needs a positive int n, got {n!r}")
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(diagonal=1)


def padding_mask(lengths, max_len: int | None = None) -> torch.Tensor:
    """``(B, max_len)`` bool mask, ``True`` at padding positions (position ``>= lengths[b]``).

    ``lengths`` is a sequence or 1-D tensor of ``B`` ints; ``max_len`` defaults to ``max(lengths)``.
    To mask keys in scores of shape ``(B, Tq, Tk)`` use ``mask[:, None, :]``;
    for per-head scores ``(B, h, Tq, Tk)`` use ``mask[:, None, None, :]``.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise ValueError(f"lengths must be a non-empty 1-D sequence of ints, got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max())
    if max_len is None:
        max_len = longest
    if max_len < longest:
        raise ValueError(f"max_len={max_len} is shorter than the longest sequence ({longest})")
    positions = torch.arange(max_len, device=lengths.device)
    return positions[None, :] >= lengths[:, None]


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Block a position if any of the bool ``masks`` blocks it (logical OR, broadcast).

    ``None`` entries are skipped; returns ``None`` when every mask is ``None``.
    """
    result = None
    for mask in masks:
        if mask is None:
            continue
        if mask.dtype != torch.bool:
            raise TypeError(f"combine_masks takes bool masks (True = blocked), got dtype {mask.dtype}")
        result = mask if result is None else result | mask
    return result
