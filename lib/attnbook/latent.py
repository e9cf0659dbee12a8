"""Multi-head latent attention (MLA, DeepSeek-V2 and V3; chapter 18): the keys and
values of every head come from one small latent per token, and the cache holds only
that.

Per token, ``x (d_model,)`` is compressed to a latent ``c = RMSNorm(W_DKV x)`` of
``kv_lora_rank`` numbers and a RoPE key ``k_R = RoPE(W_KR x)`` of
``qk_rope_head_dim`` numbers, shared by all heads. Head ``i``'s key is ``[W_UK_i c,
k_R]`` (a no-RoPE part of ``qk_nope_head_dim``, then the rotated part) and its value
``W_UV_i c`` (``v_head_dim``). The queries are ``[q_nope_i, RoPE(q_rope_i)]`` from a
plain projection or, with ``q_lora_rank``, through a low-rank bottleneck ``W_UQ
RMSNorm(W_DQ x)``.

A cache (:class:`~attnbook.caches.LatentKVCache`) keeps ``c`` and ``k_R``:
``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, against ``2 h
head_dim`` for multi-head attention. Two ways to compute the same output (``mode``):

- ``"expanded"``: up-project the cached latents to per-head keys and values, then
  ordinary attention;
- ``"absorbed"``: fold ``W_UK_i`` into the query (``q_nope_i . W_UK_i c = (W_UK_i^T
  q_nope_i) . c``), attend over the latents themselves, and apply ``W_UV_i`` to the
  latent-weighted sum (``sum_j a_j W_UV_i c_j = W_UV_i sum_j a_j c_j``).

RoPE is applied to neighbouring pairs (:func:`~attnbook.positions.apply_rope`), as
DeepSeek's ``rope_interleave=True``: its scores equal transformers' at the same weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import _attention, _check_dropout, check_mask
from .caches import LatentKVCache
from .cost import LATENT_MODES
from .masks import attention_mask_for_heads
from .modern import RMSNorm
from .multihead import merge_heads
from .positions import Rotary
from .utils import check_positive_int

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention, equal to transformers'
    ``DeepseekV3Attention`` (default RoPE) with the same weights.

    Modules: ``q_proj`` (``d -> h (nope + rope)``) or, with ``q_lora_rank``, ``q_down``
    (``d -> q_lora_rank``), ``q_norm`` (RMSNorm), ``q_up`` (``q_lora_rank -> h (nope +
    rope)``); ``kv_down`` (``d -> kv_lora_rank``), ``kv_norm`` (RMSNorm on the latent),
    ``k_rope`` (``d -> rope``, one RoPE key for all heads), ``kv_up`` (``kv_lora_rank ->
    h (nope + v)``: per head ``W_UK`` then ``W_UV``), ``out_proj`` (``h v -> d``).
    With ``bias=True`` ``q_down``, ``kv_down``, ``k_rope`` and ``out_proj`` have
    biases (where DeepSeek's ``attention_bias`` puts them). The RMSNorms use
    ``norm_eps`` (1e-6, as DeepSeek's whatever its ``rms_norm_eps``).

    ``forward(x, x, x, mask=None, *, key_padding_mask=None, need_weights=True,
    cache=None, is_causal=False)``: self-attention only, ``x (B, T, d_model)`` -> ``(out
    (B, T, d_model), weights (B, h, T, Tk) or None)``, the interface of
    :class:`~attnbook.multihead.MultiHeadAttention`. The softmax scale is
    ``softmax_scale = (nope + rope)^-1/2`` in both modes (DeepSeek-V3's YaRN would
    multiply it by ``mscale^2``). ``mode`` (``"expanded"`` or ``"absorbed"``) may be
    changed at any time; ``rotary`` (a :class:`~attnbook.positions.Rotary`) rotates the
    RoPE parts, scaled by its ``set_scaling``.
    """

    def __init__(self, d_model: int, num_heads: int, bias: bool = False,
                 dropout: float = 0.0, *, kv_lora_rank: int, qk_rope_head_dim: int,
                 qk_nope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
                 rope_base: float = 10000.0, norm_eps: float = 1e-6,
                 mode: str = "expanded"):  # fmt: skip
        super().__init__()
        d_model = check_positive_int("d_model", d_model)
        h = self.num_heads = check_positive_int("num_heads", num_heads)
        r = check_positive_int("kv_lora_rank", kv_lora_rank)
        rope = check_positive_int("qk_rope_head_dim", qk_rope_head_dim)
        nope = check_positive_int("qk_nope_head_dim", qk_nope_head_dim)
        v = check_positive_int("v_head_dim", v_head_dim)
        if q_lora_rank is not None:
            q_lora_rank = check_positive_int("q_lora_rank", q_lora_rank)
        for name, rank in (("kv_lora_rank", r), ("q_lora_rank", q_lora_rank)):
            if rank is not None and rank > d_model:
                raise ValueError(
                    f"{name}={rank} exceeds d_model={d_model}: a latent larger than "
                    "the token it compresses saves nothing"
                )
        if rope % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (RoPE rotates pairs), got {rope}"
            )
        self.d_model, self.dropout = d_model, _check_dropout(dropout, "dropout")
        self.rotary = Rotary(rope_base)
        self.kv_lora_rank, self.q_lora_rank = r, q_lora_rank
        self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim = rope, nope, v
        self.softmax_scale = (nope + rope) ** -0.5
        self.mode = mode
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, h * (nope + rope), bias=False)
            self.q_down = self.q_norm = self.q_up = None
        else:
            self.q_proj = None
            self.q_down = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.q_up = nn.Linear(q_lora_rank, h * (nope + rope), bias=False)
        self.kv_down = nn.Linear(d_model, r, bias=bias)
        self.k_rope = nn.Linear(d_model, rope, bias=bias)
        self.kv_norm = RMSNorm(r, norm_eps)
        self.kv_up = nn.Linear(r, h * (nope + v), bias=False)
        self.out_proj = nn.Linear(h * v, d_model, bias=bias)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in LATENT_MODES:
            raise ValueError(f"mode must be one of {LATENT_MODES}, got {mode!r}")
        self._mode = mode

    def make_cache(
        self, batch_size: int, max_len: int, *, device=None, dtype=torch.float32
    ) -> LatentKVCache:
        """A :class:`~attnbook.caches.LatentKVCache` of ``max_len`` tokens for this
        layer: ``kv_lora_rank + qk_rope_head_dim`` numbers per token."""
        return LatentKVCache(
            batch_size,
            max_len,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            device=device,
            dtype=dtype,
        )

    def _check_inputs(self, query, key, value) -> None:
        def same(x):  # the query tensor, or a view of the same memory
            return x is query or (
                isinstance(x, torch.Tensor)
                and isinstance(query, torch.Tensor)
                and (x.shape, x.stride(), x.data_ptr())
                == (query.shape, query.stride(), query.data_ptr())
            )

        if not (same(key) and same(value)):
            raise ValueError(
                "MultiHeadLatentAttention is self-attention: pass one tensor as query, "
                "key and value"
            )
        if not isinstance(query, torch.Tensor):
            raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
        if query.dim() != 3 or query.shape[-1] != self.d_model:
            raise ValueError(
                f"query must be (B, T, d_model={self.d_model}), got shape "
                f"{tuple(query.shape)}"
            )

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, T, d)`` -> ``(B, h, T, nope + rope)``, not yet rotated."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:  # the low-rank bottleneck
            q = self.q_up(self.q_norm(self.q_down(x)))
        B, T, _ = x.shape
        # (B, h, T, nope + rope)
        return q.view(B, T, self.num_heads, -1).transpose(1, 2)

    def latents(self, x: torch.Tensor, start: int = 0):
        """What a cache stores for ``x (B, T, d)`` at positions ``start ..``: the
        latents ``(B, T, kv_lora_rank)`` and the rotated RoPE keys ``(B, T, rope)``."""
        k_rope = self.rotary(self.k_rope(x), start)  # (B, T, rope)
        # (B, T, r): one dtype with k_rope under autocast
        latent = self.kv_norm(self.kv_down(x)).to(k_rope.dtype)
        return latent, k_rope

    def _attend(self, q, k, v, mask, need_weights, is_causal):
        """Attention with the softmax scale ``softmax_scale`` whatever the width of
        ``q``: ``_attention`` divides by ``sqrt(width)``, so ``q`` is rescaled first."""
        factor = self.softmax_scale * math.sqrt(q.shape[-1])
        if abs(factor - 1.0) > 1e-12:
            q = q * factor
        dropout_p = self.dropout if self.training else 0.0
        return _attention(q, k, v, mask, need_weights, is_causal, dropout_p)

    def _expanded(self, q_nope, q_rope, latent, k_rope, *attention_options):
        """Up-project the latents ``(B, Tk, r)`` to every head's keys and values, then
        ordinary attention: ``(B, h, T, v)`` and the weights."""
        B, Tk, _ = latent.shape
        h, nope, v = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        # (B, h, Tk, nope + v): every head's keys and values from the latents
        kv = self.kv_up(latent).view(B, Tk, h, nope + v).transpose(1, 2)
        k_nope, values = kv.split([nope, v], dim=-1)
        k_shared = k_rope[:, None].expand(B, h, Tk, -1)  # one RoPE key per token
        keys = torch.cat([k_nope, k_shared], dim=-1)  # (B, h, Tk, nope + rope)
        queries = torch.cat([q_nope, q_rope], dim=-1)  # (B, h, T, nope + rope)
        return self._attend(queries, keys, values, *attention_options)

    def _absorbed(self, q_nope, q_rope, latent, k_rope, *attention_options):
        """Attend over the latents themselves: ``W_UK`` folded into the queries,
        ``W_UV`` applied to the latent-weighted sum: ``(B, h, T, v)`` and the
        weights."""
        B, Tk, r = latent.shape
        h, nope, v = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        w_uk, w_uv = self.kv_up.weight.view(h, nope + v, r).split([nope, v], dim=1)
        # (B, h, T, nope) @ (h, nope, r) -> (B, h, T, r): W_UK folded into q
        queries = torch.cat([q_nope @ w_uk, q_rope], dim=-1)  # (B, h, T, r + rope)
        # (B, h, Tk, r + rope): the same keys for every head
        keys = torch.cat([latent, k_rope], dim=-1)[:, None].expand(B, h, Tk, -1)
        values = latent[:, None].expand(B, h, Tk, r)  # (B, h, Tk, r)
        # (B, h, T, r): the latent-weighted sum
        mixed, weights = self._attend(queries, keys, values, *attention_options)
        return mixed @ w_uv.transpose(1, 2), weights  # (h, r, v): (B, h, T, v)

    def forward(self, query, key, value, mask=None, *, key_padding_mask=None,
                need_weights=True, cache=None, is_causal=False):  # fmt: skip
        self._check_inputs(query, key, value)
        x, h = query, self.num_heads
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        B, T, _ = x.shape
        start = 0 if cache is None else cache.length
        q_nope, q_rope = self._queries(x).split([nope, rope], dim=-1)
        q_rope = self.rotary(q_rope, start)  # (B, h, T, rope)
        latent, k_rope = self.latents(x, start)  # (B, T, r), (B, T, rope)
        if cache is not None:  # every token so far: (B, Tk, r), (B, Tk, rope)
            latent, k_rope = cache.append(latent, k_rope)
        Tk = latent.shape[1]
        mask = attention_mask_for_heads(mask, key_padding_mask, B, T, Tk)
        if mask is not None:
            check_mask(mask, (B, h, T, Tk), x.device)
        compute = self._expanded if self.mode == "expanded" else self._absorbed
        # (B, h, T, v), (B, h, T, Tk) or None
        out, weights = compute(
            q_nope, q_rope, latent, k_rope, mask, need_weights, is_causal
        )
        # (B, T, d), (B, h, T, Tk) or None
        return self.out_proj(merge_heads(out)), weights
