"""Chapter 16: induction heads, found by their attention and proved by ablation.

- :func:`previous_token_score` and :func:`induction_score` read one number per head off
  attention weights ``(..., T, T)``: the weight on the token before the query, and the
  weight on the token after the earlier copy of the query's token.
- :func:`repeated_tokens`: random sequences whose second half repeats the first (to
  measure); :func:`periodic_tokens`: random tokens repeated with a period that changes
  from sequence to sequence (to train).
- :class:`AttentionOnlyTransformer`: token embedding, learned positions, ``L`` layers of
  causal :class:`~attnbook.multihead.MultiHeadAttention` with residual connections (no
  feed-forward network, no LayerNorm) and an unembedding; with ``return_weights=True``
  it also returns every layer's per-head weights.
- :func:`ablate_heads`: a context manager that zeroes (or mean-replaces) chosen heads of
  one attention module during forward passes, without touching its weights.
- :func:`head_circuits`, :func:`composition_score` and :func:`copying_score` read a
  head's circuits off its weights (Elhage et al. 2021): its query-key matrix ``W_QK``
  and output-value matrix ``W_OV``, how much a later head reads what an earlier one
  writes, and whether a matrix copies (mostly positive eigenvalues).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from .multihead import MultiHeadAttention
from .positions import LearnedPositions
from .utils import check_positive_int, check_token_ids

__all__ = [
    "AttentionOnlyTransformer",
    "ablate_heads",
    "composition_score",
    "copying_score",
    "head_circuits",
    "induction_score",
    "periodic_tokens",
    "previous_token_score",
    "repeated_tokens",
]


def _check_weights(weights) -> None:
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be float attention weights, got {weights.dtype}")
    if weights.dim() < 2 or weights.shape[-1] != weights.shape[-2]:
        shape = tuple(weights.shape)
        raise ValueError(f"weights must be shaped (..., T, T), got {shape}")


def previous_token_score(weights: torch.Tensor) -> torch.Tensor:
    """Mean weight from each query ``t >= 1`` to key ``t - 1``.

    ``weights (..., T, T)`` with ``T >= 2`` -> ``(...)``, for example
    ``(B, h, T, T) -> (B, h)``. A head that always attends to the token just before the
    query scores 1.
    """
    _check_weights(weights)
    T = weights.shape[-1]
    if T < 2:
        raise ValueError(f"previous_token_score needs T >= 2 tokens, got T={T}")
    below = weights.diagonal(offset=-1, dim1=-2, dim2=-1)  # (..., T-1): w[t, t-1]
    return below.mean(-1)  # (...)


def induction_score(weights: torch.Tensor, period: int) -> torch.Tensor:
    """Mean weight from each query ``t >= period`` to key ``t - period + 1``.

    On sequences that repeat with period ``period`` (token ``t`` equals token
    ``t - period``), key ``t - period + 1`` holds the token that followed the earlier
    copy of the query's token: the one an induction head attends to, and the one to
    predict.
    ``weights (..., T, T)`` with ``T > period`` -> ``(...)``. A perfect induction head
    scores 1.
    """
    _check_weights(weights)
    period = check_positive_int("period", period)
    T = weights.shape[-1]
    if T <= period:
        raise ValueError(f"induction_score needs T > period; got T={T}, {period=}")
    # w[t, t - period + 1] for t = period - 1 .. T - 1, a diagonal below the main one
    diagonal = weights.diagonal(offset=1 - period, dim1=-2, dim2=-1)  # (..., T-P+1)
    return diagonal[..., 1:].mean(-1)  # (...): queries t >= period only


def repeated_tokens(
    batch_size: int, period: int, vocab_size: int, *, generator=None, device=None
) -> torch.Tensor:
    """``(batch_size, 2 * period)`` random tokens in ``[0, vocab_size)`` whose second
    half repeats the first: ``tokens[:, t] == tokens[:, t - period]`` for
    ``t >= period``. ``generator``: a CPU ``torch.Generator`` (or ``None``)."""
    batch_size = check_positive_int("batch_size", batch_size)
    period = check_positive_int("period", period)
    vocab_size = check_positive_int("vocab_size", vocab_size)
    shape = (batch_size, period)
    first = torch.randint(vocab_size, shape, generator=generator)  # (B, P)
    return first.repeat(1, 2).to(device)  # (B, 2P)


def periodic_tokens(
    batch_size: int,
    length: int,
    min_period: int,
    max_period: int,
    vocab_size: int,
    *,
    generator=None,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training data: ``(tokens (B, length), periods (B,))``.

    Each row draws a period ``p`` in ``[min_period, max_period]`` and ``p`` random
    tokens, then repeats them: ``tokens[b, t] == tokens[b, t - p]`` for ``t >= p``. As
    the period changes from row to row, no position says where the earlier copy is: only
    the tokens do. ``generator``: a CPU ``torch.Generator`` (or ``None``).
    """
    batch_size = check_positive_int("batch_size", batch_size)
    length = check_positive_int("length", length)
    min_period = check_positive_int("min_period", min_period)
    max_period = check_positive_int("max_period", max_period)
    vocab_size = check_positive_int("vocab_size", vocab_size)
    if min_period > max_period:
        raise ValueError(f"min_period={min_period} must be <= max_period={max_period}")
    low, high = min_period, max_period + 1
    periods = torch.randint(low, high, (batch_size,), generator=generator)  # (B,)
    shape = (batch_size, length)
    fresh = torch.randint(vocab_size, shape, generator=generator)  # (B, length)
    source = torch.arange(length)[None] % periods[:, None]  # (B, length): t mod p
    tokens = fresh.gather(1, source)  # (B, length): the first p tokens, over and over
    return tokens.to(device), periods.to(device)


class AttentionOnlyTransformer(nn.Module):
    """A transformer with attention layers only: no feed-forward network, no LayerNorm.

    Token embedding plus a learned position table; ``num_layers`` layers, each
    ``x = x + Attention(x)`` with causal multi-head attention; an unembedding.
    ``forward(tokens (B, T)) -> logits (B, T, vocab_size)``; with
    ``return_weights=True`` -> ``(logits, [weights (B, h, T, T) of each layer])``.
    ``self.blocks[i]`` is layer ``i``'s :class:`~attnbook.multihead.MultiHeadAttention`
    and ``self.lm_head`` the unembedding (the names of the other models).
    """

    def __init__(self, vocab_size, d_model, num_heads, num_layers, max_len):
        super().__init__()
        sizes = dict(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads)
        sizes |= dict(num_layers=num_layers, max_len=max_len)
        for name, value in sizes.items():
            check_positive_int(name, value)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        # std 0.3, not GPT's 0.02: in our trials this model learned the task sooner
        nn.init.normal_(self.token_embedding.weight, std=0.3)
        self.positions = LearnedPositions(max_len, d_model)  # rows of std 0.02
        layers = [MultiHeadAttention(d_model, num_heads) for _ in range(num_layers)]
        self.blocks = nn.ModuleList(layers)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, *, return_weights: bool = False):
        check_token_ids(tokens, self.vocab_size, self.max_len, name="tokens")
        x = self.positions(self.token_embedding(tokens))  # (B, T, d): residual stream
        weights = []
        for attention in self.blocks:
            out, w = attention(x, x, x, need_weights=return_weights, is_causal=True)
            x = x + out  # (B, T, d): each layer adds what its heads read
            weights.append(w)  # (B, h, T, T), or None without return_weights
        logits = self.lm_head(x)  # (B, T, vocab): the unembedding
        return (logits, weights) if return_weights else logits


def _check_heads(attention, heads) -> list[int]:
    if not isinstance(attention, nn.Module) or not hasattr(attention, "num_heads"):
        raise TypeError(
            "attention must be a multi-head attention module with num_heads, got "
            f"{type(attention).__name__}"
        )
    if not isinstance(getattr(attention, "out_proj", None), nn.Linear):
        raise TypeError("attention must have an out_proj nn.Linear")
    if isinstance(heads, (int, np.integer)):
        heads = [heads]
    if not isinstance(heads, Iterable) or isinstance(heads, (str, bytes)):
        raise TypeError(f"heads must be an int or an iterable of ints, got {heads!r}")
    heads, num_heads = list(heads), attention.num_heads
    for head in heads:
        is_int = isinstance(head, (int, np.integer)) and not isinstance(head, bool)
        if not is_int or not 0 <= head < num_heads:
            raise ValueError(
                f"head index {head!r} out of range: this attention has "
                f"num_heads={num_heads} (indices 0..{num_heads - 1})"
            )
    return [int(head) for head in heads]


@contextlib.contextmanager
def ablate_heads(attention: nn.Module, heads, mode: str = "zero") -> Iterator:
    """Inside the block, the chosen ``heads`` of ``attention`` add nothing of their own.

    ``attention`` has ``num_heads`` and an ``out_proj`` linear layer whose input is the
    heads' outputs side by side, ``(B, T, h * head_dim)``, as in
    :class:`~attnbook.multihead.MultiHeadAttention`. A forward pre-hook on ``out_proj``
    replaces each chosen head's slice with zeros (``mode="zero"``) or with that head's
    output averaged over the batch and the positions (``mode="mean"``). The weights are
    not edited, and the hook is removed on leaving the block, also after an error. The
    attention weights the module returns do not change: an ablated head still attends;
    only what it writes is removed. ``heads``: an index or an iterable of indices.
    """
    heads = _check_heads(attention, heads)
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    head_dim = attention.out_proj.in_features // attention.num_heads

    def replace_heads(module, inputs):
        merged = inputs[0].clone()  # (B, T, h * head_dim): the heads side by side
        for head in heads:
            part = slice(head * head_dim, (head + 1) * head_dim)
            if mode == "zero":
                merged[..., part] = 0
            else:  # the head's mean output over every token of the batch
                merged[..., part] = merged[..., part].reshape(-1, head_dim).mean(0)
        return (merged, *inputs[1:])

    handle = attention.out_proj.register_forward_pre_hook(replace_heads)
    try:
        yield attention
    finally:
        handle.remove()


def head_circuits(attention: nn.Module, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's two circuits, read off the weights of ``attention`` (a
    :class:`~attnbook.multihead.MultiHeadAttention`): ``(W_QK, W_OV)``, each
    ``(d_model, d_model)``, for column vectors of the residual stream.

    ``W_QK = W_Q^T W_K`` (the head's rows of the query and key projections): the score
    of query ``x`` on key ``y`` is ``x^T W_QK y / sqrt(head_dim)``. ``W_OV = W_O W_V``
    (its columns of the output projection times its rows of the value projection): what
    the head writes into the stream for a key ``y`` it attends to fully is ``W_OV y``.
    Biases are left out, as in Elhage et al. (2021)."""
    if not isinstance(head, (int, np.integer)) or isinstance(head, bool):
        raise TypeError(f"head must be one int index, got {head!r}")
    (head,) = _check_heads(attention, head)
    for name in ("q_proj", "k_proj", "v_proj"):
        if not isinstance(getattr(attention, name, None), nn.Linear):
            raise TypeError(f"attention must have a {name} nn.Linear")
    head_dim = attention.out_proj.in_features // attention.num_heads
    rows = slice(head * head_dim, (head + 1) * head_dim)
    with torch.no_grad():
        w_q = attention.q_proj.weight[rows]  # (head_dim, d_model)
        w_k = attention.k_proj.weight[rows]
        w_v = attention.v_proj.weight[rows]
        w_o = attention.out_proj.weight[:, rows]  # (d_model, head_dim)
        return w_q.T @ w_k, w_o @ w_v  # (d_model, d_model) each


def composition_score(later: torch.Tensor, earlier_ov: torch.Tensor) -> torch.Tensor:
    """``||later @ earlier_ov||_F / (||later||_F ||earlier_ov||_F)``, in ``[0, 1]``: how
    much of a later head's circuit reads the subspace an earlier head writes to.

    With ``later = W_QK`` of the later head it is K-composition (the earlier head's
    output read by the later head's keys); with ``W_QK^T``, Q-composition; with its
    ``W_OV``, V-composition. Matrices ``(d, d)``. Independent random matrices score
    about ``1 / sqrt(d)`` against each other, whatever their rank: if one of them is
    random in every direction (its distribution unchanged by a rotation, as for
    Gaussian entries or a product of Gaussian ``(d, r)`` and ``(r, d)`` factors), the
    mean of the squared score is exactly ``1 / d``."""
    for name, m in (("later", later), ("earlier_ov", earlier_ov)):
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[0] != m.shape[1]:
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{name} must be a square matrix (d, d), got {shape}")
    if later.shape != earlier_ov.shape:
        raise ValueError(
            f"later {tuple(later.shape)} and earlier_ov {tuple(earlier_ov.shape)} "
            "must have the same shape"
        )
    norms = torch.linalg.matrix_norm(later) * torch.linalg.matrix_norm(earlier_ov)
    if norms == 0:
        raise ValueError("composition_score of a zero matrix is undefined")
    return torch.linalg.matrix_norm(later @ earlier_ov) / norms


def copying_score(circuit: torch.Tensor) -> torch.Tensor:
    """``sum(eigenvalues) / sum(|eigenvalues|)`` of a square matrix, in ``[-1, 1]``.

    For a head's full OV circuit from tokens to logits, ``W_U W_OV W_E`` ``(V, V)``, a
    score near 1 means that attending to a token raises that same token's logit: the
    head copies (Elhage et al. 2021). A random matrix scores near 0."""
    if (
        not isinstance(circuit, torch.Tensor)
        or circuit.dim() != 2
        or circuit.shape[0] != circuit.shape[1]
    ):
        shape = (
            tuple(circuit.shape)
            if isinstance(circuit, torch.Tensor)
            else type(circuit).__name__
        )
        raise ValueError(f"circuit must be a square matrix (V, V), got {shape}")
    eigenvalues = torch.linalg.eigvals(circuit.detach().double())
    total = eigenvalues.abs().sum()
    if total == 0:
        raise ValueError("copying_score of a matrix whose eigenvalues are all 0")
    return (eigenvalues.sum().real / total).to(circuit.dtype)
