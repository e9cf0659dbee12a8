"""Today's decoder (chapter 17): the pieces that turn chapter 6's GPT-2-style decoder
into a Llama-style one.

- :class:`RMSNorm`: LayerNorm without the mean and the bias, ``(..., d) -> (..., d)``.
- :class:`SwiGLU`: the gated feed-forward network, ``(..., d) -> (..., hidden) -> (...,
  d)``.
- :class:`GroupedQueryAttention`: chapter 3's multi-head attention with fewer key and
  value heads than query heads (:func:`repeat_kv`), QK-norm and RoPE;
  ``GPT(..., positions="rope", norm="rms", activation="swiglu", bias=False,
  num_kv_heads=...)`` is a Llama.
- :func:`rope_halves_to_pairs`: transformers rotates the pairs ``(x[i], x[i + d/2])``
  of a head, :func:`~attnbook.positions.apply_rope` the pairs ``(x[2i], x[2i+1])``;
  reordering the rows of ``W_q`` and ``W_k`` maps one onto the other.
- :func:`decoder_parameters`: the parameter count of such a decoder.

Reading transformers' Llama, Qwen3 and Mistral into a GPT is :mod:`attnbook.convert`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .multihead import MultiHeadAttention, check_attention_sizes, split_heads
from .positions import Rotary
from .utils import check_eps, check_positive_int


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang and Sennrich 2019): ``x / sqrt(mean(x^2) + eps) *
    weight`` over the last dimension, ``(..., d) -> (..., d)``.

    LayerNorm without subtracting the mean and without a bias: ``d`` parameters
    (``weight``, ones at first). Equal to ``torch.nn.RMSNorm(d, eps=eps)``; computed in
    float32 whatever the input's dtype, as Llama does.
    """

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        d = check_positive_int("d", d)
        self.normalized_shape, self.eps = (d,), check_eps(eps)
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(
                f"x must be (..., d={self.normalized_shape[0]}), got shape "
                f"{tuple(x.shape)}"
            )
        x32 = x.float()
        # (..., d): each vector divided by its root mean square
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class SwiGLU(nn.Module):
    """Llama's feed-forward network, a SiLU-gated linear unit (Shazeer 2020):
    ``down(silu(gate(x)) * up(x))``, ``(..., d) -> (..., hidden) -> (..., d)``.

    Three ``nn.Linear`` layers ``gate_proj``, ``up_proj`` (``d -> hidden``) and
    ``down_proj`` (``hidden -> d``), without biases unless ``bias=True``: ``3 d
    hidden`` parameters, as many as a two-layer MLP of width ``1.5 hidden``. With
    ``dropout`` the gated hidden units are dropped in training.
    """

    def __init__(
        self, d_model: int, hidden: int, *, bias: bool = False, dropout: float = 0.0
    ):
        super().__init__()
        d_model = check_positive_int("d_model", d_model)
        hidden = check_positive_int("hidden", hidden)
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (..., hidden)
        return self.down_proj(self.dropout(gated))  # (..., d)


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``(B, h_kv, T, d/h)`` -> ``(B, h_kv * repeats, T, d/h)``: each key or value head
    repeated for the ``repeats`` query heads it serves (head ``g`` for query heads ``g
    repeats .. g repeats + repeats - 1``), as transformers' ``repeat_kv``."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=1)


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention (Ainslie et al. 2023) with QK-norm and RoPE: today's
    decoders' attention, :class:`~attnbook.multihead.MultiHeadAttention`'s forward with
    three of its steps changed.

    ``k_proj`` and ``v_proj`` give only ``num_kv_heads`` heads (a divisor of
    ``num_heads``; 1 is multi-query attention; ``None``, as many as the queries), a
    cache stores only those, and each serves ``num_heads / num_kv_heads`` query heads
    (:func:`repeat_kv`). With ``qk_norm`` an :class:`RMSNorm` over ``d / h``
    (``q_norm``, ``k_norm``, eps ``qk_norm_eps``) normalises each head's queries and
    keys before any rotation (Qwen3); with ``rope_base`` they are rotated by RoPE
    (``rotary``), as in :class:`~attnbook.multihead.RotaryMultiHeadAttention`.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias=True,
        dropout=0.0,
        *,
        num_kv_heads: int | None = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        rope_base: float | None = None,
    ):
        nn.Module.__init__(self)  # MultiHeadAttention's modules, two of them narrower
        d_model, num_heads, self.dropout = check_attention_sizes(
            d_model, num_heads, dropout
        )
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kv_heads = check_positive_int("num_kv_heads", kv_heads)
        if num_heads % kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={kv_heads}"
            )
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, kv_heads
        self.head_dim = d_model // num_heads
        kv_width = kv_heads * self.head_dim  # d_model unless grouped
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, qk_norm_eps) if qk_norm else None
        self.rotary = None if rope_base is None else Rotary(rope_base)

    @property
    def rope_base(self) -> float | None:
        return None if self.rotary is None else self.rotary.base

    def keys_values(self, key, value):
        """Per-head keys and values ``(B, h_kv, Tk, d/h)``: ``h_kv`` heads."""
        k = split_heads(self.k_proj(key), self.num_kv_heads)
        return k, split_heads(self.v_proj(value), self.num_kv_heads)

    def encode_positions(self, q, k, start):
        """QK-norm, then RoPE."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        return q, k

    def attend(self, q, k, v, mask, need_weights, is_causal):
        """Each key and value head repeated for the query heads it serves ``(B, h,
        Tk, d/h)``, then :meth:`MultiHeadAttention.attend`."""
        groups = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return super().attend(q, k, v, mask, need_weights, is_causal)


def rope_halves_to_pairs(
    weight: torch.Tensor, num_heads: int, head_dim: int
) -> torch.Tensor:
    """The rows of a query or key projection ``(num_heads * head_dim, d)`` (or its bias
    ``(num_heads * head_dim,)``; a per-head norm weight ``(head_dim,)`` with
    ``num_heads=1``) reordered within each head: row ``2i`` of a head is its row ``i``,
    row ``2i + 1`` its row ``i + head_dim / 2``.

    transformers' RoPE rotates each head's pairs ``(x[i], x[i + head_dim/2])`` by ``p
    theta_i``, :func:`~attnbook.positions.apply_rope` the pairs ``(x[2i], x[2i+1])``
    by the same angle: with the rows reordered, our rotated queries and keys are theirs
    reordered, and the scores ``q . k`` are the same.
    """
    num_heads = check_positive_int("num_heads", num_heads)
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim % 2 or weight.dim() == 0 or weight.shape[0] != num_heads * head_dim:
        raise ValueError(
            f"weight must have num_heads * head_dim = {num_heads} * {head_dim} rows "
            f"(head_dim even), got shape {tuple(weight.shape)}"
        )
    # 0, d/2, 1, d/2 + 1, ...: row 2i takes row i, row 2i + 1 takes row i + d/2
    order = torch.arange(head_dim, device=weight.device).view(2, -1).T.flatten()
    heads = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return heads[:, order].reshape(weight.shape)


def decoder_parameters(
    vocab: int,
    d_model: int,
    layers: int,
    heads: int,
    kv_heads: int,
    hidden: int,
    *,
    head_dim: int | None = None,
    tie_embeddings: bool = False,
    qk_norm: bool = False,
    bias: bool = False,
) -> int:
    """The parameters of a Llama-style decoder (RoPE, RMSNorm, SwiGLU): token embedding
    ``vocab d``; per layer the attention (``W_q``, ``W_o``: ``d heads head_dim`` each;
    ``W_k``, ``W_v``: ``d kv_heads head_dim`` each; with ``qk_norm`` two norms of
    ``head_dim``), the SwiGLU (``3 d hidden``) and two RMSNorms (``2 d``); a final
    RMSNorm (``d``) and the output head (``vocab d``, none when tied to the embedding).

    ``head_dim`` defaults to ``d_model / heads`` (Qwen3 sets it apart). With ``bias``
    every linear layer of the attention and the feed-forward network has a bias.
    """
    sizes = dict(vocab=vocab, d_model=d_model, layers=layers, heads=heads)
    sizes.update(kv_heads=kv_heads, hidden=hidden)
    for name, value in sizes.items():
        check_positive_int(name, value)
    if head_dim is None:
        head_dim = d_model // heads
    head_dim = check_positive_int("head_dim", head_dim)
    q, kv = heads * head_dim, kv_heads * head_dim  # widths of W_q and of W_k, W_v
    attention = 2 * d_model * q + 2 * d_model * kv + (2 * head_dim if qk_norm else 0)
    feed_forward = 3 * d_model * hidden
    if bias:
        attention += q + 2 * kv + d_model
        feed_forward += 2 * hidden + d_model
    layer = attention + feed_forward + 2 * d_model
    head = 0 if tie_embeddings else vocab * d_model
    return vocab * d_model + layers * layer + d_model + head


__all__ = [
    "GroupedQueryAttention",
    "RMSNorm",
    "SwiGLU",
    "decoder_parameters",
    "repeat_kv",
    "rope_halves_to_pairs",
]
