"""Attention masks: every mask helper of the library lives here.

Convention everywhere in ``attnbook``: a boolean mask is ``True`` where attention is
**blocked** (as ``nn.MultiheadAttention``'s ``attn_mask``).
``F.scaled_dot_product_attention`` uses the opposite meaning (``True`` = keep); chapter
2 shows the difference.
"""

from __future__ import annotations

import torch

from .utils import check_non_negative_int, check_positive_int


def key_minus_query(
    query_len: int,
    key_len: int,
    *,
    query_start: int = 0,
    rows: int | None = None,
    key_start: int = 0,
    cols: int | None = None,
    device=None,
) -> torch.Tensor:
    """The one home of attention's position arithmetic: ``(rows, cols)``, for query row
    ``query_start + i`` and key ``key_start + j``, the key's position minus the
    query's. The queries are aligned to the bottom right, as with a KV cache: query row
    ``t`` is token ``key_len - query_len + t``. Positive: the key lies in the query's
    future; 0: the query itself; ``-k``: ``k`` tokens back. ``rows`` and ``cols``
    default to the rest of the queries and keys (a tile of them otherwise)."""
    rows = query_len - query_start if rows is None else rows
    cols = key_len - key_start if cols is None else cols
    first = key_len - query_len + query_start  # the token of query row query_start
    query_pos = torch.arange(first, first + rows, device=device)  # (rows,)
    key_pos = torch.arange(key_start, key_start + cols, device=device)  # (cols,)
    return key_pos[None, :] - query_pos[:, None]  # (rows, cols)


def causal_key_stop(query_stop: int, query_len: int, key_len: int) -> int:
    """Under a causal mask, the queries before row ``query_stop`` see keys ``0 ..
    stop - 1`` and no later ones (aligned to the bottom right, as
    :func:`key_minus_query`)."""
    return max(0, min(key_len, query_stop + key_len - query_len))


def causal_first_query(key_start: int, query_len: int, key_len: int) -> int:
    """Under a causal mask, the first query row that sees key ``key_start``."""
    return max(0, key_start - (key_len - query_len))


def mask_future_(
    scores: torch.Tensor, query_start: int, key_start: int, query_len: int, key_len: int
) -> torch.Tensor:
    """Set to ``-inf``, in place, the entries of a tile of scores ``(..., rows, cols)``
    (query rows from ``query_start``, keys from ``key_start``, of ``query_len`` and
    ``key_len`` in all) whose key lies in its query's future: the causal mask of one
    tile, built on the fly by the tiled attentions. A tile that its first query sees
    whole is left as it is."""
    rows, cols = scores.shape[-2:]
    if key_start + cols <= causal_key_stop(query_start + 1, query_len, key_len):
        return scores
    offset = key_minus_query(
        query_len,
        key_len,
        query_start=query_start,
        rows=rows,
        key_start=key_start,
        cols=cols,
        device=scores.device,
    )  # (rows, cols)
    return scores.masked_fill_(offset > 0, float("-inf"))


def causal_mask(n: int, device=None, *, key_len: int | None = None) -> torch.Tensor:
    """``(n, n)`` bool mask, ``True`` above the diagonal: token ``i`` may not see tokens
    ``j > i``.

    It leaves ``n (n + 1) / 2`` entries allowed. With ``key_len`` it is ``(n, key_len)``
    and aligned to the bottom right, as with a KV cache: the ``n`` queries are the last
    ``n`` tokens of a sequence whose last ``key_len`` tokens are the keys, so query
    ``i`` sees keys ``0 .. key_len - n + i`` (none at all for the first ``n - key_len``
    queries when ``key_len < n``). This is what ``is_causal=True`` means everywhere in
    the library (``F.scaled_dot_product_attention`` aligns it to the top left).
    """
    n = check_positive_int("n", n)
    key_len = n if key_len is None else check_positive_int("key_len", key_len)
    return key_minus_query(n, key_len, device=device) > 0  # the key is in the future


def check_sink_tokens(sink_tokens, window: int) -> int:
    """``sink_tokens`` as an int in ``[0, window)`` (a window that counts its attention
    sinks keeps room for the query itself); otherwise a ``ValueError`` naming both."""
    sink_tokens = check_non_negative_int("sink_tokens", sink_tokens)
    if sink_tokens >= window:
        raise ValueError(
            f"sink_tokens={sink_tokens} must be smaller than window={window}: the "
            "window counts the sinks and keeps room for the query itself"
        )
    return sink_tokens


def sliding_window_mask(
    query_len: int,
    key_len: int | None = None,
    window: int | None = None,
    *,
    sink_tokens: int = 0,
    device=None,
) -> torch.Tensor:
    """``(query_len, key_len)`` bool mask for local (sliding-window) causal attention,
    ``True`` = blocked: each query sees itself and the ``window - 1`` keys before it,
    nothing earlier and nothing later.

    Aligned to the bottom right as :func:`causal_mask` (query ``t`` is token ``key_len -
    query_len + t``), so it also serves queries arriving after a cache; ``key_len``
    defaults to ``query_len``. With ``window >= key_len`` it equals
    ``causal_mask(query_len, key_len=key_len)``.

    With ``sink_tokens = S > 0`` (StreamingLLM's attention sinks) the first ``S`` keys
    stay visible to every later query, and the window counts them: a query sees the
    ``S`` sinks, itself and the ``window - S - 1`` keys before it (``S < window``). A
    rolling cache with sinks returns its sinks first, so the same rule serves it.
    """
    query_len = check_positive_int("query_len", query_len)
    key_len = query_len if key_len is None else check_positive_int("key_len", key_len)
    if window is None:
        raise ValueError(
            "sliding_window_mask needs window, the number of keys each query sees (>= "
            "1)"
        )
    window = check_positive_int("window", window)
    sink_tokens = check_sink_tokens(sink_tokens, window)
    offset = key_minus_query(query_len, key_len, device=device)  # (Tq, Tk)
    too_far = offset <= -(window - sink_tokens)  # (Tq, Tk): out of the rolling part
    if sink_tokens:  # ... unless a sink
        too_far &= torch.arange(key_len, device=device) >= sink_tokens
    return (offset > 0) | too_far  # future, or too far back


def padding_mask(lengths, max_len: int | None = None) -> torch.Tensor:
    """``(B, max_len)`` bool mask, ``True`` at padding positions (position ``>=
    lengths[b]``).

    ``lengths`` is a sequence or 1-D tensor of ``B`` ints; ``max_len`` defaults to
    ``max(lengths)``. To mask keys in scores of shape ``(B, Tq, Tk)`` use ``mask[:,
    None, :]``; for per-head scores ``(B, h, Tq, Tk)`` use ``mask[:, None, None, :]``.
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise ValueError(
            "lengths must be a non-empty 1-D sequence of ints, got shape "
            f"{tuple(lengths.shape)}"
        )
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    if max_len is not None:
        max_len = check_non_negative_int("max_len", max_len)
    longest = int(lengths.max())
    if max_len is None:
        max_len = longest
    if max_len < longest:
        raise ValueError(
            f"max_len={max_len} is shorter than the longest sequence ({longest})"
        )
    positions = torch.arange(max_len, device=lengths.device)
    return positions[None, :] >= lengths[:, None]


def padded_positions(
    key_padding_mask: torch.Tensor, start: int, query_len: int, key_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a batch of left-padded sequences, ``key_padding_mask (B, start +
    query_len)`` (``True`` at padding) over every token so far, the last ``query_len``
    of them new: each new token's position ``(B, query_len)``, counted from its row's
    first real token (a padding token gets 0), and the padding of the last ``key_len``
    tokens ``(B, key_len)``, the keys the new queries see."""
    if (
        not isinstance(key_padding_mask, torch.Tensor)
        or key_padding_mask.dtype != torch.bool
        or key_padding_mask.dim() != 2
        or key_padding_mask.shape[1] != start + query_len
    ):
        raise ValueError(
            f"key_padding_mask must be a bool (B, {start + query_len}) tensor over "
            "every token so far, True at padding; got "
            f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)} "
            f"{tuple(getattr(key_padding_mask, 'shape', ()))}"
        )
    real = (~key_padding_mask).long().cumsum(-1)  # (B, N): real tokens up to each
    positions = (real[:, start:] - 1).clamp_min(0)  # (B, Tq)
    return positions, key_padding_mask[:, -key_len:]


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Block a position if any of the bool ``masks`` blocks it (logical OR, broadcast).

    ``None`` entries are skipped; returns ``None`` when every mask is ``None``.
    """
    result = None
    for mask in masks:
        if mask is None:
            continue
        if mask.dtype != torch.bool:
            raise TypeError(
                "combine_masks takes bool masks (True = blocked), got dtype "
                f"{mask.dtype}"
            )
        result = mask if result is None else result | mask
    return result


def attention_mask_for_heads(
    mask, key_padding_mask, batch_size: int, query_len: int, key_len: int
):
    """Turn a ``(Tq, Tk)``, ``(B, Tq, Tk)`` or ``(B, h, Tq, Tk)`` mask plus a ``(B,
    Tk)`` key padding mask into one mask that broadcasts to per-head scores ``(B, h, Tq,
    Tk)`` (``None`` if both are ``None``).

    Padding travels only as ``key_padding_mask``: a 2-D ``mask`` is ``(Tq, Tk)`` (either
    may be 1 to broadcast), so a ``(B, Tk)`` padding mask passed as ``mask`` raises
    unless ``B`` happens to equal ``Tq`` (then no shape can tell the two apart). A float
    ``mask`` gets ``-inf`` at the padded keys; a bool one is OR-ed with them
    (:func:`combine_masks`).
    """
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"mask must be a torch.Tensor or None, got {type(mask).__name__}"
        )
    if (
        mask is not None
        and mask.dim() == 2
        and (mask.shape[0] not in (1, query_len) or mask.shape[1] not in (1, key_len))
    ):
        raise ValueError(
            f"a 2-D mask is (Tq, Tk) = ({query_len}, {key_len}), got "
            f"{tuple(mask.shape)}; "
            "a (B, Tk) padding mask goes in key_padding_mask"
        )
    if mask is not None and mask.dim() == 3:
        if mask.shape[0] not in (1, batch_size):
            raise ValueError(
                f"a 3-D mask must be (B, Tq, Tk) with B={batch_size}, got "
                f"{tuple(mask.shape)}"
            )
        mask = mask.unsqueeze(1)  # (B, 1, Tq, Tk): the same for every head
    if key_padding_mask is None:
        return mask
    if not isinstance(key_padding_mask, torch.Tensor):
        raise TypeError(
            "key_padding_mask must be a torch.Tensor or None, got "
            f"{type(key_padding_mask).__name__}"
        )
    if (
        key_padding_mask.dtype != torch.bool
        or key_padding_mask.dim() != 2
        or key_padding_mask.shape[0] != batch_size
    ):
        raise ValueError(
            f"key_padding_mask must be a bool (B={batch_size}, Tk) tensor, True at "
            "padding; "
            f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
    if (
        mask is not None
        and mask.dim() >= 1
        and mask.shape[-1] not in (1, key_padding_mask.shape[1])
    ):
        raise ValueError(
            f"mask {tuple(mask.shape)} has Tk={mask.shape[-1]} keys but "
            "key_padding_mask "
            f"{tuple(key_padding_mask.shape)} has "
            f"Tk={key_padding_mask.shape[1]}"
        )
    if mask is not None and mask.dim() >= 4 and mask.shape[-4] not in (1, batch_size):
        raise ValueError(
            f"mask {tuple(mask.shape)} has batch size {mask.shape[-4]} but "
            "key_padding_mask "
            f"{tuple(key_padding_mask.shape)} has B={batch_size} (the "
            f"mask's must be {batch_size} or 1)"
        )
    padding = key_padding_mask[:, None, None, :]  # (B, 1, 1, Tk)
    if mask is None or mask.dtype == torch.bool:
        return combine_masks(mask, padding)
    return mask.masked_fill(padding, float("-inf"))


__all__ = [
    "attention_mask_for_heads",
    "causal_first_query",
    "causal_key_stop",
    "causal_mask",
    "check_sink_tokens",
    "combine_masks",
    "key_minus_query",
    "mask_future_",
    "padded_positions",
    "padding_mask",
    "sliding_window_mask",
]
