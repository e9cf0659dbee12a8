"""KV caches: the keys and values of earlier tokens, one cache per attention layer.

Every cache follows one protocol, so that the models and the decoding loops never look
inside one:

- ``append(k, v)`` stores the new tokens' keys and values ``(B, h, t, head_dim)`` and
  returns the keys and values the new queries attend to; ``key_len(t)`` says how many
  that will be, so that a model can build its mask before the first layer runs;
- ``length`` counts the tokens seen (the position of the next one); ``nbytes()`` is the
  memory the cache holds;
- the surgery decoding needs, as methods: ``truncate(length)`` (speculative decoding
  rolls rejected drafts back; ``can_truncate`` says whether a cache can), ``repeat(n)``
  (beam search widens a batch-1 cache to ``n`` beams) and ``reorder(rows)`` (each beam
  takes over the entries of the prefix it extends).

:class:`KVCache` keeps every token up to ``max_len`` (a ``static`` one holds an
encoder's keys and values, filled once); :class:`RollingKVCache` keeps the last
``window`` (sliding-window attention; with attention sinks, the first tokens too);
:class:`LatentKVCache` keeps multi-head latent attention's latents and RoPE keys
(chapter 18). Chapter 18's economics: :class:`QuantizedKVCache` stores keys and values
in 4 or 8 bits (:func:`quantize_kv`); :class:`BlockPool` and :class:`PagedKVCache` page
many sequences' caches into one pool of fixed-size blocks (:func:`paged_memory_waste`).
:func:`make_caches` is the one factory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .masks import check_sink_tokens
from .utils import check_non_negative_int, check_positive_int

__all__ = [
    "BlockPool",
    "KVCache",
    "LatentKVCache",
    "PagedKVCache",
    "QuantizedKVCache",
    "QuantizedTensor",
    "RollingKVCache",
    "dequantize_kv",
    "make_caches",
    "paged_memory_waste",
    "quantize_kv",
]


class _Cache:
    """What every cache shares: preallocated ``keys`` and ``values`` ``(B, h, size,
    head_dim)``, of which the first ``stored`` entries are filled, one validator for the
    keys and values that arrive, and the beam surgery."""

    static = False
    stored = 0

    def __init__(self, batch_size, num_heads, size_name, size, head_dim, device, dtype):
        shape = tuple(
            check_positive_int(name, value)
            for name, value in (
                ("batch_size", batch_size),
                ("num_heads", num_heads),
                (size_name, size),
                ("head_dim", head_dim),
            )
        )
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # tokens seen

    def _accept(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Check ``k, v (B, h, t, head_dim)``. The first keys decide the dtype and
        device: an empty cache whose keys arrive in another dtype (under autocast, say)
        or on another device is reallocated to match them once; after that a mismatch
        is an error, never a silent cast."""
        B, h, _, head_dim = self.keys.shape
        if (
            k.dim() != 4
            or (k.shape[0], k.shape[1], k.shape[3]) != (B, h, head_dim)
            or v.shape != k.shape
        ):
            raise ValueError(
                f"KV cache expects keys and values (B={B}, h={h}, t, "
                f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if v.dtype != k.dtype or v.device != k.device:
            raise ValueError(
                f"keys and values must share dtype and device, got {k.dtype} on "
                f"{k.device} and {v.dtype} on {v.device}"
            )
        if (k.dtype, k.device) == (self.keys.dtype, self.keys.device):
            return
        if self.stored:
            raise ValueError(
                f"KV cache holds {self.keys.dtype} on {self.keys.device}, got keys "
                f"{k.dtype} on {k.device}: one generation must keep one dtype"
            )
        # empty: follow the activations
        self.keys = torch.zeros(self.keys.shape, device=k.device, dtype=k.dtype)
        self.values = torch.zeros(self.values.shape, device=k.device, dtype=k.dtype)

    def nbytes(self) -> int:
        """Bytes held by the preallocated keys and values."""
        return self.keys.numel() * self.keys.element_size() * 2

    def repeat(self, n: int) -> None:
        """Widen a batch-1 cache to ``n`` rows (one per beam): copies, each beam to
        extend its own prefix; a static cache as a view (the source is the same for
        every beam)."""
        n = check_positive_int("n", n)
        if self.keys.shape[0] != 1:
            raise ValueError(
                f"repeat widens a cache of batch 1, this one has {self.keys.shape[0]}"
            )
        if self.static:  # (n, h, S, head_dim) views
            self.keys = self.keys.expand(n, -1, -1, -1)
            self.values = self.values.expand(n, -1, -1, -1)
        else:  # (n, h, max_len, head_dim) copies
            self.keys = self.keys.repeat(n, 1, 1, 1)
            self.values = self.values.repeat(n, 1, 1, 1)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` takes over the entries of row ``rows[i]`` (beam search: each
        surviving beam keeps the keys and values of the prefix it extends). A static
        cache is the same for every row and stays as it is."""
        if self.static:
            return
        n = self.stored
        self.keys[:, :, :n] = self.keys[rows, :, :n]
        self.values[:, :, :n] = self.values[rows, :, :n]


class KVCache(_Cache):
    """Keys and values of earlier tokens for one attention layer, in preallocated
    tensors.

    ``keys`` and ``values`` are ``(B, h, max_len, head_dim)``; ``length`` tokens are
    filled. :meth:`append` writes new keys and values in place (no concatenation, no
    reallocation) and returns every filled one. A ``static`` cache (cross-attention) is
    filled once and then reused as it is.
    """

    can_truncate = True

    def __init__(
        self,
        batch_size,
        num_heads,
        max_len,
        head_dim,
        *,
        device=None,
        dtype=torch.float32,
        static=False,
    ):
        super().__init__(
            batch_size, num_heads, "max_len", max_len, head_dim, device, dtype
        )
        self.static = static

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    @property
    def stored(self) -> int:
        return self.length

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return self.length + new_tokens

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (B, h, t, head_dim)`` after the filled part; return all filled
        keys and values, ``(B, h, length, head_dim)``."""
        self._accept(k, v)
        t = k.shape[2]
        if self.length + t > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} tokens; cannot add {t} to the "
                f"{self.length} stored"
            )
        self.keys[:, :, self.length : self.length + t] = k
        self.values[:, :, self.length : self.length + t] = v
        self.length += t
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length``: the next :meth:`append`
        overwrites them (speculative decoding rolls rejected draft tokens back this
        way). Nothing is copied."""
        if (
            isinstance(length, bool)
            or not isinstance(length, int)
            or not 0 <= length <= self.length
        ):
            raise ValueError(
                f"truncate needs a length in [0, {self.length}] (the tokens stored), "
                f"got {length!r}"
            )
        self.length = length


class RollingKVCache(_Cache):
    """The KV cache of sliding-window attention: the keys and values of the last
    ``window`` tokens only.

    A query sees itself and the ``window - 1`` tokens before it, so older entries are
    never read again: the cache keeps at most ``window`` of them in preallocated ``(B,
    h, window, head_dim)`` tensors, and its memory stays ``2 * B * window * d * bytes``
    per layer however long the sequence grows. ``length`` counts every token seen (the
    position of the next one, as for :class:`KVCache`); ``stored`` is how many entries
    the tensors hold, ``min(length, window)``. :meth:`append` returns the stored entries
    followed by the new ones, oldest first, trimmed to the ``window - 1 + t`` keys that
    ``t`` new queries can see; the caller masks them with
    :func:`~attnbook.masks.sliding_window_mask`. It cannot :meth:`truncate`: the
    entries it dropped are gone.

    With ``sink_tokens = S`` (StreamingLLM's attention sinks) the first ``S`` tokens
    never leave: the ``window`` entries are the ``S`` sinks followed by the last
    ``window - S`` tokens, and :meth:`append` returns the sinks first, then the last
    ``window - S - 1 + t`` tokens (``sliding_window_mask(..., sink_tokens=S)`` masks
    them). Keys keep the positions they were computed at (RoPE's rotation included);
    StreamingLLM instead renumbers positions within the cache.
    """

    can_truncate = False

    def __init__(
        self,
        batch_size,
        num_heads,
        window,
        head_dim,
        *,
        device=None,
        dtype=torch.float32,
        sink_tokens=0,
    ):
        super().__init__(
            batch_size, num_heads, "window", window, head_dim, device, dtype
        )
        self.sink_tokens = check_sink_tokens(sink_tokens, self.window)
        self.stored = 0  # entries held, at most window

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        total, sinks = self.stored + new_tokens, self.sink_tokens
        rolling = self.window - sinks - 1 + new_tokens  # the most the queries see
        return min(sinks, total) + min(max(total - sinks, 0), rolling)

    def _sinks_and_last(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``x (B, h, T, d/h)``'s first ``sink_tokens`` entries, then the last ``n`` of
        the rest."""
        start = max(self.sink_tokens, x.shape[2] - n)
        if not self.sink_tokens:
            return x[:, :, start:]
        return torch.cat([x[:, :, : self.sink_tokens], x[:, :, start:]], dim=2)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add ``k, v (B, h, t, head_dim)``; return the keys and values the new queries
        can see, ``(B, h, key_len(t), head_dim)``, oldest first (sinks first); keep the
        last ``window`` of them (the sinks and the last ``window - sink_tokens``)."""
        self._accept(k, v)
        t = k.shape[2]
        # (B, h, stored + t, d/h)
        keys = torch.cat([self.keys[:, :, : self.stored], k], dim=2)
        values = torch.cat([self.values[:, :, : self.stored], v], dim=2)
        rolling = self.window - self.sink_tokens
        # (B, h, keep, d/h): the last window tokens (or the sinks and the last
        # window - sinks), oldest first
        kept = self._sinks_and_last(keys, rolling)
        keep = kept.shape[2]
        self.keys[:, :, :keep] = kept
        self.values[:, :, :keep] = self._sinks_and_last(values, rolling)
        self.stored, self.length = keep, self.length + t
        # the first new query sees window - sinks - 1 tokens before it (and the sinks)
        visible = rolling - 1 + t
        return (
            self._sinks_and_last(keys, visible),
            self._sinks_and_last(values, visible),
        )

    def truncate(self, length: int) -> None:
        raise ValueError(
            "a RollingKVCache cannot truncate: it keeps only the last "
            f"{self.window} entries, and the ones it dropped are gone"
        )


class LatentKVCache:
    """The cache of multi-head latent attention (DeepSeek-V2/V3,
    :class:`~attnbook.latent.MultiHeadLatentAttention`) for one layer: per token one
    latent of ``kv_lora_rank`` numbers, from which every head's keys and values are
    computed, and one RoPE key of ``qk_rope_head_dim`` numbers shared by every head.

    ``latents (B, max_len, kv_lora_rank)`` and ``rope_keys (B, max_len,
    qk_rope_head_dim)``, preallocated: ``(kv_lora_rank + qk_rope_head_dim) * bytes``
    per token, against ``2 h head_dim * bytes`` for a :class:`KVCache`.
    :meth:`append` takes ``latent (B, t, kv_lora_rank)`` and ``rope_key (B, t,
    qk_rope_head_dim)`` and returns every filled one; ``length``, ``key_len``,
    ``truncate``, ``repeat`` and ``reorder`` as for :class:`KVCache`.
    """

    static = False
    can_truncate = True

    def __init__(
        self,
        batch_size,
        max_len,
        kv_lora_rank,
        qk_rope_head_dim,
        *,
        device=None,
        dtype=torch.float32,
    ):
        B, T, r, rope = (
            check_positive_int(name, value)
            for name, value in (
                ("batch_size", batch_size),
                ("max_len", max_len),
                ("kv_lora_rank", kv_lora_rank),
                ("qk_rope_head_dim", qk_rope_head_dim),
            )
        )
        self.latents = torch.zeros(B, T, r, device=device, dtype=dtype)
        self.rope_keys = torch.zeros(B, T, rope, device=device, dtype=dtype)
        self.length = 0  # tokens seen

    @property
    def max_len(self) -> int:
        return self.latents.shape[1]

    @property
    def stored(self) -> int:
        return self.length

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return self.length + new_tokens

    def nbytes(self) -> int:
        """Bytes held by the preallocated latents and RoPE keys."""
        return sum(t.numel() * t.element_size() for t in (self.latents, self.rope_keys))

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor):
        """Store ``latent (B, t, kv_lora_rank)`` and ``rope_key (B, t,
        qk_rope_head_dim)`` after the filled part; return all filled ones, ``(B,
        length, ...)``. The first arrivals decide dtype and device, as for
        :class:`KVCache`."""
        B, _, r = self.latents.shape
        rope = self.rope_keys.shape[2]
        if (
            latent.dim() != 3
            or (latent.shape[0], latent.shape[2]) != (B, r)
            or rope_key.shape != (*latent.shape[:2], rope)
        ):
            raise ValueError(
                f"latent KV cache expects latents (B={B}, t, {r}) and RoPE keys (B, t, "
                f"{rope}), got {tuple(latent.shape)} and {tuple(rope_key.shape)}"
            )
        if (rope_key.dtype, rope_key.device) != (latent.dtype, latent.device):
            raise ValueError(
                f"latents and RoPE keys must share dtype and device, got "
                f"{latent.dtype} on {latent.device} and {rope_key.dtype} on "
                f"{rope_key.device}"
            )
        if (latent.dtype, latent.device) != (self.latents.dtype, self.latents.device):
            if self.length:
                raise ValueError(
                    f"latent KV cache holds {self.latents.dtype} on "
                    f"{self.latents.device}, got {latent.dtype} on {latent.device}: "
                    "one generation must keep one dtype"
                )
            sizes = dict(device=latent.device, dtype=latent.dtype)  # empty: follow
            self.latents = torch.zeros(self.latents.shape, **sizes)
            self.rope_keys = torch.zeros(self.rope_keys.shape, **sizes)
        t = latent.shape[1]
        if self.length + t > self.max_len:
            raise ValueError(
                f"latent KV cache holds {self.max_len} tokens; cannot add {t} to the "
                f"{self.length} stored"
            )
        self.latents[:, self.length : self.length + t] = latent
        self.rope_keys[:, self.length : self.length + t] = rope_key
        self.length += t
        return self.latents[:, : self.length], self.rope_keys[:, : self.length]

    truncate = KVCache.truncate

    def repeat(self, n: int) -> None:
        """Widen a batch-1 cache to ``n`` rows (one per beam), as copies."""
        n = check_positive_int("n", n)
        if self.latents.shape[0] != 1:
            raise ValueError(
                "repeat widens a cache of batch 1, this one has "
                f"{self.latents.shape[0]}"
            )
        self.latents = self.latents.repeat(n, 1, 1)
        self.rope_keys = self.rope_keys.repeat(n, 1, 1)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` takes over the entries of row ``rows[i]`` (beam search)."""
        n = self.length
        self.latents[:, :n] = self.latents[rows, :n]
        self.rope_keys[:, :n] = self.rope_keys[rows, :n]


QUANTIZED_BITS = (4, 8)
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
    codes (4 or 8), with one scale and offset per group of ``group_size`` consecutive
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


def _concatenate(first: QuantizedTensor | None, second: QuantizedTensor):
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


class QuantizedKVCache(_Cache):
    """A KV cache that stores keys and values quantised, KIVI's way (Liu et al. 2024): a
    drop-in for :class:`KVCache` that holds up to ``max_len`` tokens and returns
    dequantised keys and values to attention.

    Keys have ``key_bits`` and values ``value_bits`` (4 or 8), each quantised along its
    own axis: ``"channel"`` (one scale and offset per channel for each group of
    ``group_size`` tokens: KIVI's choice for keys, whose outliers sit in a few
    channels) or ``"token"`` (one per token, over its ``head_dim`` channels: KIVI's
    choice for values). As KIVI, the most recent tokens stay in full precision: the
    residual ``keys`` and ``values`` ``(B, h, group_size, head_dim)`` hold the last
    ``stored < group_size`` tokens, and each time ``group_size`` of them have gathered
    they are quantised together (keys and values alike) and appended to
    ``quantized_keys`` and ``quantized_values`` (:class:`QuantizedTensor`, grown by
    concatenation). :meth:`append` returns the dequantised tokens, then the residual,
    then the new tokens at full precision (the step that computed them has them).

    :meth:`nbytes` counts what a packed implementation holds for the ``length`` tokens
    stored (not a preallocated capacity, as :meth:`KVCache.nbytes`): per quantised
    token and head, ``head_dim * bits / 8`` bytes of codes; a scale and an offset in the
    cache's dtype per group (``head_dim`` of them per ``group_size`` tokens for
    ``"channel"``, one per token for ``"token"``); and ``2 * head_dim`` numbers in the
    cache's dtype per residual token. It cannot :meth:`truncate`.
    """

    can_truncate = False

    def __init__(
        self,
        batch_size,
        num_heads,
        max_len,
        head_dim,
        *,
        key_bits=8,
        value_bits=8,
        key_axis="channel",
        value_axis="token",
        group_size=32,
        device=None,
        dtype=torch.float32,
    ):
        super().__init__(
            batch_size, num_heads, "group_size", group_size, head_dim, device, dtype
        )
        self.max_len = check_positive_int("max_len", max_len)
        for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
            if isinstance(bits, bool) or bits not in QUANTIZED_BITS:
                raise ValueError(
                    f"{name} must be one of {QUANTIZED_BITS}, got {bits!r}"
                )
        for name, axis in (("key_axis", key_axis), ("value_axis", value_axis)):
            if axis not in QUANTIZED_AXES:
                raise ValueError(
                    f"{name} must be one of {sorted(QUANTIZED_AXES)}, got {axis!r}"
                )
        self.key_bits, self.value_bits = key_bits, value_bits
        self.key_axis, self.value_axis = key_axis, value_axis
        # QuantizedTensor once a group is full
        self.quantized_keys = self.quantized_values = None
        self.stored = 0  # residual tokens, fewer than group_size

    @property
    def group_size(self) -> int:
        return self.keys.shape[2]

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return self.length + new_tokens

    def _accept(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.length and (k.dtype, k.device) != (self.keys.dtype, self.keys.device):
            raise ValueError(
                f"QuantizedKVCache holds {self.keys.dtype} on {self.keys.device}, got "
                f"keys {k.dtype} on {k.device}: one generation must keep one dtype"
            )
        super()._accept(k, v)

    def _all(self, quantized, residual, new):
        """``(B, h, length + t, head_dim)``: the dequantised tokens, the residual ones,
        the new ones."""
        parts = [residual[:, :, : self.stored], new]
        if quantized is not None:
            parts.insert(0, dequantize_kv(quantized))
        return torch.cat(parts, dim=2)

    def _quantize(self, x, bits, axis) -> QuantizedTensor:
        """``x (B, h, n * group_size, head_dim)`` quantised along ``axis``."""
        group_size = self.group_size if axis == "channel" else None
        return quantize_kv(x, bits, QUANTIZED_AXES[axis], group_size)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (B, h, t, head_dim)``; return every token's keys and values,
        ``(B, h, length, head_dim)``: the quantised ones dequantised, the residual and
        new ones as they are."""
        self._accept(k, v)
        t = k.shape[2]
        if self.length + t > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} tokens; cannot add {t} to the "
                f"{self.length} stored"
            )
        keys = self._all(self.quantized_keys, self.keys, k)  # (B, h, length + t, d/h)
        values = self._all(self.quantized_values, self.values, v)
        first = self.length - self.stored  # the first token not yet quantised
        last = first + (self.stored + t) // self.group_size * self.group_size
        if last > first:  # whole groups: quantised
            new_keys = keys[:, :, first:last]  # (B, h, groups * group_size, d/h)
            new_values = values[:, :, first:last]
            self.quantized_keys = _concatenate(
                self.quantized_keys,
                self._quantize(new_keys, self.key_bits, self.key_axis),
            )
            self.quantized_values = _concatenate(
                self.quantized_values,
                self._quantize(new_values, self.value_bits, self.value_axis),
            )
        self.stored, self.length = keys.shape[2] - last, self.length + t
        self.keys[:, :, : self.stored] = keys[:, :, last:]  # the rest: the residual
        self.values[:, :, : self.stored] = values[:, :, last:]
        return keys, values

    def nbytes(self) -> int:
        """Bytes a packed implementation holds for the tokens stored (see the class)."""
        residual = self.keys[:, :, : self.stored]
        return 2 * residual.numel() * residual.element_size() + sum(
            q.nbytes()
            for q in (self.quantized_keys, self.quantized_values)
            if q is not None
        )

    def _change_quantized(self, change) -> None:
        """Apply ``change`` to the quantised keys' and values' tensors."""
        self.quantized_keys, self.quantized_values = (
            None
            if q is None
            else q._replace(
                codes=change(q.codes), scale=change(q.scale), offset=change(q.offset)
            )
            for q in (self.quantized_keys, self.quantized_values)
        )

    def repeat(self, n: int) -> None:
        super().repeat(n)  # the residual
        self._change_quantized(lambda x: x.repeat(n, 1, 1, 1))

    def reorder(self, rows: torch.Tensor) -> None:
        super().reorder(rows)  # the residual
        self._change_quantized(lambda x: x[rows])

    def truncate(self, length: int) -> None:
        raise ValueError(
            "a QuantizedKVCache cannot truncate: its tokens are quantised in groups"
        )


class BlockPool:
    """vLLM's paged KV memory (Kwon et al. 2023): ``num_blocks`` fixed-size blocks,
    each holding the keys and values of ``block_size`` tokens in every layer, and a
    free list.

    ``keys`` and ``values`` are ``(num_layers, num_blocks, num_kv_heads, block_size,
    head_dim)``. :meth:`allocate` takes a free block (the most recently freed first)
    and raises when none is left; :meth:`free` gives blocks back. Each sequence keeps
    the table of its blocks in a :class:`PagedKVCache`.
    """

    def __init__(
        self,
        num_blocks,
        block_size,
        num_layers,
        num_kv_heads,
        head_dim,
        *,
        device=None,
        dtype=torch.float32,
    ):
        shape = tuple(
            check_positive_int(name, value)
            for name, value in (
                ("num_layers", num_layers),
                ("num_blocks", num_blocks),
                ("num_kv_heads", num_kv_heads),
                ("block_size", block_size),
                ("head_dim", head_dim),
            )
        )
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.free_blocks = list(range(self.num_blocks))[::-1]  # a stack: 0 on top

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    @property
    def block_size(self) -> int:
        return self.keys.shape[3]

    def block_nbytes(self) -> int:
        """Bytes of one block: keys and values of ``block_size`` tokens, every layer."""
        return 2 * self.keys[:, 0].numel() * self.keys.element_size()

    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_blocks * self.block_nbytes()

    def allocate(self) -> int:
        """Take a free block; its id."""
        if not self.free_blocks:
            raise RuntimeError(
                f"the block pool is exhausted: all {self.num_blocks} blocks of "
                f"{self.block_size} tokens are in use"
            )
        return self.free_blocks.pop()

    def free(self, blocks) -> None:
        """Give ``blocks`` (ids in use) back; they are reused first, in their order."""
        for block in reversed(list(blocks)):
            if not 0 <= block < self.num_blocks or block in self.free_blocks:
                raise ValueError(
                    f"block {block!r} is not a block in use (the pool has "
                    f"{self.num_blocks}): freed twice?"
                )
            self.free_blocks.append(block)


class PagedKVCache:
    """One sequence's KV cache in a shared :class:`BlockPool`: its ``block_table``
    lists the pool's blocks it holds, in order, and token ``p`` lives in block
    ``block_table[p // block_size]`` at slot ``p % block_size``, in every layer.

    ``layers`` holds one cache per layer with :class:`KVCache`'s protocol (batch 1):
    pass it as a model's ``caches``. An append allocates blocks as the tokens need
    them, so only the last block has unused slots (fewer than ``block_size``).
    Attention reads the blocks gathered into contiguous ``(1, h, length, head_dim)``
    keys and values (vLLM's kernel reads them in place). :meth:`free` returns the
    blocks to the pool and clears the table: a table left as it was would still point
    at blocks that another sequence may now hold, and read or overwrite its tokens.
    """

    def __init__(self, pool: BlockPool):
        if not isinstance(pool, BlockPool):
            raise TypeError(
                f"PagedKVCache needs a BlockPool, got {type(pool).__name__}"
            )
        self.pool, self.block_table = pool, []
        self.layers = [_PagedLayer(self, layer) for layer in range(pool.num_layers)]

    @property
    def length(self) -> int:
        """Tokens stored in every layer."""
        return min(layer.length for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes of the blocks it holds."""
        return len(self.block_table) * self.pool.block_nbytes()

    def free(self) -> None:
        """Return every block to the pool; the table and the length go back to 0."""
        self.pool.free(self.block_table)
        self.block_table = []
        for layer in self.layers:
            layer.length = 0


class _PagedLayer:
    """One layer of a :class:`PagedKVCache`, with the caches' protocol."""

    static, can_truncate = False, False

    def __init__(self, sequence: PagedKVCache, layer: int):
        self.sequence, self.layer, self.length = sequence, layer, 0

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return self.length + new_tokens

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (1, h, t, head_dim)`` in the sequence's blocks (allocating
        them as needed); return all its keys and values, ``(1, h, length,
        head_dim)``."""
        pool = self.sequence.pool
        h, head_dim = pool.keys.shape[2], pool.keys.shape[4]
        if (
            k.dim() != 4
            or (k.shape[0], k.shape[1], k.shape[3]) != (1, h, head_dim)
            or v.shape != k.shape
        ):
            raise ValueError(
                f"a paged cache expects keys and values (1, h={h}, t, "
                f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if v.dtype != k.dtype or v.device != k.device:
            raise ValueError(
                f"keys and values must share dtype and device, got {k.dtype} on "
                f"{k.device} and {v.dtype} on {v.device}"
            )
        if (k.dtype, k.device) != (pool.keys.dtype, pool.keys.device):
            if len(pool.free_blocks) < pool.num_blocks:
                raise ValueError(
                    f"the block pool holds {pool.keys.dtype} on {pool.keys.device}, "
                    f"got keys {k.dtype} on {k.device}: one generation must keep one "
                    "dtype"
                )
            # empty: follow the activations (autocast)
            pool.keys = torch.zeros(pool.keys.shape, device=k.device, dtype=k.dtype)
            pool.values = torch.zeros(pool.keys.shape, device=k.device, dtype=k.dtype)
        table, start = self.sequence.block_table, self.length
        end = start + k.shape[2]
        while len(table) * pool.block_size < end:
            table.append(pool.allocate())
        positions = torch.arange(end, device=k.device)  # (end,)
        # (end,) each token's block and slot
        blocks = torch.tensor(table, device=k.device)[positions // pool.block_size]
        slots = positions % pool.block_size
        # (num_blocks, h, block_size, d/h), views of the pool
        keys, values = pool.keys[self.layer], pool.values[self.layer]
        keys[blocks[start:], :, slots[start:]] = k[0].transpose(0, 1)  # (t, h, d/h)
        values[blocks[start:], :, slots[start:]] = v[0].transpose(0, 1)
        self.length = end
        # (1, h, end, d/h): the blocks gathered in order
        return (
            keys[blocks, :, slots].transpose(0, 1)[None],
            values[blocks, :, slots].transpose(0, 1)[None],
        )


def paged_memory_waste(
    lengths, block_size: int, *, max_len: int | None = None, bytes_per_token: int = 1
) -> tuple[int, int]:
    """The KV memory a batch of sequences of ``lengths`` tokens (prompt + generated)
    reserves but leaves unused: ``(contiguous, paged)``, in bytes (token slots with
    ``bytes_per_token=1``; a token takes ``2 * layers * kv_heads * head_dim * bytes per
    number``).

    A contiguous cache reserves ``max_len`` slots a sequence (by default the batch's
    longest: the least a padded batch needs) and wastes ``sum(max_len - L)``; a paged
    one fills every block but the last and wastes ``sum(ceil(L / block_size) *
    block_size - L)``, fewer than ``block_size`` slots a sequence.
    """
    lengths = [check_non_negative_int("each length", length) for length in lengths]
    if not lengths:
        raise ValueError("lengths must hold at least one sequence length")
    block_size = check_positive_int("block_size", block_size)
    bytes_per_token = check_positive_int("bytes_per_token", bytes_per_token)
    longest = max(lengths)
    max_len = longest if max_len is None else check_positive_int("max_len", max_len)
    if max_len < longest:
        raise ValueError(
            f"max_len={max_len} is shorter than the longest length, {longest}"
        )
    contiguous = sum(max_len - length for length in lengths)
    paged = sum(-length % block_size for length in lengths)
    return contiguous * bytes_per_token, paged * bytes_per_token


def make_caches(
    num_layers: int,
    batch_size: int,
    num_heads: int,
    max_len: int,
    head_dim: int,
    *,
    window: int | None = None,
    memory_len: int | None = None,
    device=None,
    dtype=torch.float32,
    sink_tokens: int = 0,
    kv_bits: int | tuple[int, int] | None = None,
    group_size: int = 32,
):
    """The library's one cache factory, with the arguments in :class:`KVCache`'s order:
    one :class:`KVCache` of ``max_len`` tokens per layer; with ``window``, one
    :class:`RollingKVCache` of ``window`` entries per layer (``sink_tokens`` of them
    attention sinks); with ``kv_bits`` (``bits``, or ``(key_bits, value_bits)``), one
    :class:`QuantizedKVCache` per layer (keys per channel, values per token, groups of
    ``group_size`` tokens); with ``memory_len`` (an encoder–decoder), a pair per layer:
    the growing self-attention cache and a static cross-attention cache of
    ``memory_len`` keys, filled once from the encoder's output."""
    num_layers = check_positive_int("num_layers", num_layers)
    sizes = dict(device=device, dtype=dtype)
    if kv_bits is not None and window is not None:
        raise ValueError("kv_bits quantises a full cache: build it without a window")
    key_bits, value_bits = kv_bits if isinstance(kv_bits, tuple) else (kv_bits, kv_bits)

    def self_attention_cache():
        if kv_bits is not None:
            return QuantizedKVCache(
                batch_size,
                num_heads,
                max_len,
                head_dim,
                key_bits=key_bits,
                value_bits=value_bits,
                group_size=group_size,
                **sizes,
            )
        if window is None:
            return KVCache(batch_size, num_heads, max_len, head_dim, **sizes)
        return RollingKVCache(
            batch_size, num_heads, window, head_dim, sink_tokens=sink_tokens, **sizes
        )

    if memory_len is None:
        return [self_attention_cache() for _ in range(num_layers)]
    return [
        (
            self_attention_cache(),
            KVCache(batch_size, num_heads, memory_len, head_dim, static=True, **sizes),
        )
        for _ in range(num_layers)
    ]
