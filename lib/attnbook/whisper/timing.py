"""Word timing from the cross-attention, as Whisper's ``timing.py``: the alignment
heads (:func:`decode_alignment_heads`), :func:`median_filter`, :func:`dtw` and the
grouping of BPE pieces into words (:func:`group_words`)."""

from __future__ import annotations

import base64
import gzip
import string

import numpy as np
import torch
import torch.nn.functional as F

from ..utils import check_positive_int


def decode_alignment_heads(
    encoded: bytes, num_layers: int, num_heads: int
) -> list[tuple[int, int]]:
    """Whisper's alignment heads, as published in ``openai/whisper``'s ``__init__.py``:
    the base85 text of a gzip-compressed ``(num_layers, num_heads)`` boolean array ->
    the ``(layer, head)`` pairs marked ``True``."""
    num_layers = check_positive_int("num_layers", num_layers)
    num_heads = check_positive_int("num_heads", num_heads)
    try:
        mask = np.frombuffer(gzip.decompress(base64.b85decode(encoded)), dtype=bool)
    except (ValueError, OSError) as error:
        raise ValueError(
            f"not a base85 gzip-compressed boolean array: {encoded!r}"
        ) from error
    if mask.size != num_layers * num_heads:
        raise ValueError(
            f"the alignment-head mask holds {mask.size} values, expected {num_layers} "
            f"x {num_heads}"
        )
    return [
        (int(layer), int(head))
        for layer, head in np.argwhere(mask.reshape(num_layers, num_heads))
    ]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """The running median of width ``width`` (odd) along the last axis of ``x``, with
    reflected edges (Whisper's ``median_filter``; an axis no longer than ``width // 2``
    is returned as it is)."""
    width = check_positive_int("width", width)
    if width % 2 == 0:
        raise ValueError(f"width must be odd, got {width}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise TypeError(
            "x must be a float tensor with at least one axis, got "
            f"{getattr(x, 'dtype', type(x))}"
        )
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    # (rows, 1, n + 2 pad)
    rows = F.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect")
    windows = rows.unfold(-1, width, 1)  # (rows, 1, n, width)
    return windows.sort(dim=-1).values[..., pad].reshape(x.shape)


def dtw(cost: torch.Tensor) -> torch.Tensor:
    """Dynamic time warping: the cheapest monotonic path through ``cost (N, M)`` from
    ``(0, 0)`` to ``(N - 1, M - 1)``, each step moving one row down, one column right,
    or both.

    Returns the path as ``(L, 2)`` long ``(row, column)`` pairs, ``max(N, M) <= L <= N +
    M - 1``. ``total[i, j] = cost[i, j] + min(total[i-1, j-1], total[i-1, j], total[i,
    j-1])``, filled column by column, then followed back from the corner. Ties go as in
    Whisper's ``dtw_cpu``: the diagonal only if strictly cheapest, then the step down if
    strictly cheapest, else the step right.
    """
    if not isinstance(cost, torch.Tensor) or not cost.is_floating_point():
        raise TypeError(
            "cost must be a float tensor (N, M), got "
            f"{getattr(cost, 'dtype', type(cost))}"
        )
    if cost.dim() != 2 or cost.numel() == 0:
        raise ValueError(
            f"cost must be a non-empty (N, M) matrix, got shape {tuple(cost.shape)}"
        )
    if not torch.isfinite(cost).all():
        raise ValueError("cost must be finite (no inf or NaN)")
    # Python floats: the loop is sequential anyway
    values = cost.detach().double().cpu().tolist()
    N, M = cost.shape
    inf = float("inf")
    # total[i][j]: the cheapest path to cell (i-1, j-1)
    total = [[inf] * (M + 1) for _ in range(N + 1)]
    # 0 diagonal, 1 down (from the row above), 2 right
    move = [[0] * (M + 1) for _ in range(N + 1)]
    total[0][0] = 0.0
    for j in range(1, M + 1):
        for i in range(1, N + 1):
            diagonal, up, left = total[i - 1][j - 1], total[i - 1][j], total[i][j - 1]
            if diagonal < up and diagonal < left:
                best, move[i][j] = diagonal, 0
            elif up < diagonal and up < left:
                best, move[i][j] = up, 1
            else:
                best, move[i][j] = left, 2
            total[i][j] = values[i - 1][j - 1] + best
    path, i, j = [], N, M
    # back from the corner; the border of inf keeps the path inside
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        step = move[i][j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return torch.tensor(path[::-1], dtype=torch.long).reshape(-1, 2)  # (L, 2)


# Punctuation that joins the following word when it stands alone after a space (an
# opening quote, say); any other lone punctuation joins the word before it (Whisper's
# merge_punctuations).
PREPENDED_PUNCTUATION = "\"'“¿([{-"


def is_punctuation(piece: str) -> bool:
    """Whether a token's text is punctuation alone (spaces aside): ``","``, ``" ."``,
    ``' "'``."""
    return piece.strip() != "" and all(
        c in string.punctuation + "“”¿。，！？：、" for c in piece.strip()
    )


def group_words(pieces: list[str]) -> list[list[int]]:
    """Group tokens into words, given each token's text: ``[" The", " qu", "ick", ","]``
    -> ``[[0], [1, 2, 3]]``.

    A token whose text starts with a space begins a new word (byte-level BPE marks word
    starts that way); any other token continues the word before it (a sub-word, or
    trailing punctuation such as ``","``). A token that is nothing but punctuation after
    a space joins the following word if it opens (a quote, a bracket:
    :data:`PREPENDED_PUNCTUATION`), otherwise the word before it.
    """
    if isinstance(pieces, str) or not all(isinstance(piece, str) for piece in pieces):
        raise TypeError("pieces must be a list of the tokens' texts (str)")

    def lone_punctuation(piece):
        return piece.startswith(" ") and is_punctuation(piece)

    words, pending = [], []  # pending: opening punctuation waiting for its word
    for index, piece in enumerate(pieces):
        if lone_punctuation(piece) and piece.strip()[0] in PREPENDED_PUNCTUATION:
            pending.append(index)
        elif lone_punctuation(piece) and words and not pending:
            words[-1].append(index)
        elif piece.startswith(" ") or not words or pending:
            words.append(pending + [index])
            pending = []
        else:
            words[-1].append(index)
    if pending:  # opening punctuation at the very end: it has no word to open
        if words:
            words[-1].extend(pending)
        else:
            words.append(pending)
    return words


__all__ = [
    "decode_alignment_heads",
    "dtw",
    "group_words",
    "is_punctuation",
    "median_filter",
]
