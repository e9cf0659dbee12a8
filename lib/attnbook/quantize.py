"""Quantisation of keys and values (chapter 18): asymmetric min/max codes of 2, 4 or 8
bits with one scale and offset per group, as KIVI stores a KV cache
(:class:`~attnbook.caches.QuantizedKVCache`).

- :func:`quantize_kv` ``x -> QuantizedTensor`` (codes, scale, offset) and
  :func:`dequantize_kv` back: within half a step of ``x``;
- :class:`QuantizedTensor` ``.nbytes()``: the bytes a packed implementation stores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .utils import check_positive_int

__all__ = [
    "QUANTIZED_AXES",
    "QUANTIZED_BITS",
    "QuantizedTensor",
    "concatenate_quantized",
    "dequantize_kv",
    "quantize_kv",
]

QUANTIZED_BITS = (2, 4, 8)
# the axis of (B, h, T, head_dim) that a group's statistics run over
QUANTIZED_AXES = {"channel": 2, "token": 3}


class QuantizedTensor(NamedTuple):
    """A tensor quantised by :func:`quantize_kv`: ``codes`` (uint8, the tensor's shape),
    ``scale`` and ``offset`` (the tensor's dtype; its shape with ``axis`` cut to one
    entry per group of ``group_size``), and how: ``x ~ codes * scale + offset``."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    axis: int
    group_size: int

    def nbytes(self) -> int:
        """The bytes a real implementation stores: the codes packed at ``bits / 8``
        bytes a number (two 4-bit codes a byte; here each code has a byte of its own),
        and a scale and an offset per group in the tensor's dtype."""
        codes = (self.codes.numel() * self.bits + 7) // 8
        return codes + 2 * self.scale.numel() * self.scale.element_size()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32, or float64


def quantize_kv(
    x: torch.Tensor, bits: int, axis: int, group_size: int | None = None
) -> QuantizedTensor:
    """Asymmetric min/max quantisation of ``x`` (floating, any shape) to ``bits``-bit
    codes (2, 4 or 8), with one scale and offset per group of ``group_size`` consecutive
    entries along ``axis`` (the whole axis by default; it must divide it).

    In each group ``offset = min``, ``scale = (max - min) / (2**bits - 1)`` and ``codes
    = round((x - offset) / scale)``, so :func:`dequantize_kv` lands within ``scale / 2``
    of ``x`` (up to rounding in ``x``'s dtype); a constant group gets ``scale = 0``,
    codes 0, and comes back exact. KIVI quantises keys per channel (``axis`` the token
    axis: each channel's statistics over a group of tokens) and values per token
    (``axis`` the channel axis). ``scale`` and ``offset`` have ``x``'s shape with
    ``axis`` cut to ``x.shape[axis] // group_size`` entries.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_kv needs a floating-point tensor, got {got}")
    if isinstance(bits, bool) or bits not in QUANTIZED_BITS:
        raise ValueError(f"bits must be one of {QUANTIZED_BITS}, got {bits!r}")
    rank = x.dim()
    if not isinstance(axis, int) or isinstance(axis, bool) or not -rank <= axis < rank:
        raise ValueError(
            f"axis must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
            f"{tuple(x.shape)}, got {axis!r}"
        )
    axis %= x.dim()
    n = x.shape[axis]
    if group_size is not None:
        group_size = check_positive_int("group_size", group_size)
    group_size = n if group_size is None else group_size
    if n == 0 or n % group_size:
        raise ValueError(
            f"group_size={group_size} must divide x.shape[{axis}]={n} (> 0)"
        )
    levels = 2**bits - 1
    # (..., groups, group_size, ...): each group along axis + 1
    groups = x.to(_compute_dtype(x.dtype)).unflatten(axis, (-1, group_size))
    low = groups.amin(axis + 1, keepdim=True)  # (..., groups, 1, ...)
    scale = ((groups.amax(axis + 1, keepdim=True) - low) / levels).to(x.dtype)
    offset = low.to(x.dtype)  # exact: an entry of x
    step = scale.to(groups.dtype)
    codes = ((groups - offset.to(groups.dtype)) / step.where(step > 0, 1.0)).round()
    return QuantizedTensor(
        codes.clamp(0, levels).to(torch.uint8).flatten(axis, axis + 1),  # x's shape
        scale.squeeze(axis + 1),
        offset.squeeze(axis + 1),
        bits,
        axis,
        group_size,
    )


def dequantize_kv(quantized: QuantizedTensor) -> torch.Tensor:
    """``codes * scale + offset``, each group's scale and offset spread over its
    entries: a tensor of the codes' shape, in the scale's dtype."""
    if not isinstance(quantized, QuantizedTensor):
        raise TypeError(
            "dequantize_kv takes what quantize_kv returns (a QuantizedTensor), got "
            f"{type(quantized).__name__}"
        )
    codes, scale, offset, _, axis, group_size = quantized
    dtype = _compute_dtype(scale.dtype)
    # (..., groups, group_size, ...)
    codes = codes.to(dtype).unflatten(axis, (-1, group_size))
    scale, offset = (t.to(dtype).unsqueeze(axis + 1) for t in (scale, offset))
    return (codes * scale + offset).flatten(axis, axis + 1).to(quantized.scale.dtype)


def concatenate_quantized(first: QuantizedTensor | None, second: QuantizedTensor):
    """Two quantised tensors of the same layout, the second after the first along dim 2
    (the tokens of ``(B, h, T, head_dim)``)."""
    if first is None:
        return second
    return second._replace(
        **{
            name: torch.cat([getattr(first, name), getattr(second, name)], dim=2)
            for name in ("codes", "scale", "offset")
        }
    )
