"""KV caches: the keys and values of earlier tokens, one cache per attention layer.

Every cache stands on :class:`Cache`, so that the models and the decoding loops never
look inside one, and the rules live once:

- ``append(...)`` stores the new tokens' keys and values ``(B, h, t, head_dim)`` (a
  latent cache: latents and RoPE keys) and returns the ones the new queries attend to;
  ``key_len(t)`` says how many that will be (``length + t``, fewer for a rolling
  cache), so that a model can build its mask before the first layer runs;
- what arrives is checked once (:meth:`Cache._accept`), and the first arrivals decide
  the dtype and device (autocast's, say);
- ``length`` counts the tokens seen (the position of the next one); ``held`` the
  entries filled in the preallocated tensors; ``nbytes()`` the bytes of memory the
  cache holds;
- the surgery decoding needs: ``truncate(length)`` (speculative decoding rolls
  rejected drafts back; ``can_truncate`` says whether a cache can), ``repeat(n)`` (beam
  search widens a batch-1 cache to ``n`` beams) and ``reorder(rows)`` (each beam takes
  over the entries of the prefix it extends).

:class:`KVCache` keeps every token up to ``max_len`` (a ``static`` one holds an
encoder's keys and values, filled once); :class:`RollingKVCache` keeps the last
``window`` (sliding-window attention; with attention sinks, the first tokens too);
:class:`LatentKVCache` keeps multi-head latent attention's latents and RoPE keys
(chapter 18); :class:`QuantizedKVCache` stores keys and values in 2, 4 or 8 bits
(:mod:`attnbook.quantize`). :func:`make_caches` builds a model's caches, one per layer.
The paged caches of chapter 18 (one pool of blocks shared by many sequences) are in
:mod:`attnbook.paging`.
"""

from __future__ import annotations

import torch

from .masks import check_sink_tokens
from .positions import Rotary
from .quantize import (
    QUANTIZED_AXES,
    QUANTIZED_BITS,
    QuantizedTensor,
    concatenate_quantized,
    dequantize_kv,
    quantize_kv,
)
from .utils import check_positive_int

__all__ = [
    "Cache",
    "KVCache",
    "LatentKVCache",
    "QuantizedKVCache",
    "RollingKVCache",
    "check_arrivals",
    "make_caches",
    "must_follow",
]


def _sizes(**sizes) -> list[int]:
    """The ``sizes`` checked as positive ints (a ``ValueError`` names the first that is
    not), in order."""
    return [check_positive_int(name, value) for name, value in sizes.items()]


def _kv_shapes(batch_size, num_heads, size_name: str, size, head_dim):
    """The shapes of preallocated keys and values ``(B, h, size, head_dim)``, each size
    checked."""
    shape = _sizes(batch_size=batch_size, num_heads=num_heads, **{size_name: size},
                   head_dim=head_dim)  # fmt: skip
    return shape, shape


def check_arrivals(owner: str, names, expected, arrivals, token_dim: int) -> int:
    """Check the tensors arriving at a cache, one per name in ``names``: each shaped as
    in ``expected`` (a ``(label, size)`` pair per axis; any size on ``token_dim``), all
    with the same number ``t`` of tokens, one dtype and one device. Returns ``t``; a
    mismatch raises a ``ValueError`` naming ``owner`` and the shapes."""

    def fits(x, shape):
        return x.dim() == len(shape) and all(
            i == token_dim or x.shape[i] == size for i, (_, size) in enumerate(shape)
        )

    t = arrivals[0].shape[token_dim] if arrivals[0].dim() > token_dim else None
    if t is None or not all(
        fits(x, shape) and x.shape[token_dim] == t
        for x, shape in zip(arrivals, expected, strict=True)
    ):
        wanted = [
            f"{name} ("
            + ", ".join(
                "t" if i == token_dim else f"{label}={size}" if label else str(size)
                for i, (label, size) in enumerate(shape)
            )
            + ")"
            for name, shape in zip(names, expected, strict=True)
        ]
        raise ValueError(
            f"{owner} expects {' and '.join(wanted)}, got "
            f"{' and '.join(str(tuple(x.shape)) for x in arrivals)}"
        )
    first = arrivals[0]
    if any((x.dtype, x.device) != (first.dtype, first.device) for x in arrivals):
        raise ValueError(
            f"{' and '.join(names)} must share dtype and device, got "
            + " and ".join(f"{x.dtype} on {x.device}" for x in arrivals)
        )
    return t


def must_follow(owner: str, held: torch.Tensor, arrival: torch.Tensor, seen: bool):
    """True when ``arrival`` (a cache's first tensor arriving) comes in another dtype
    or on another device than the ``held`` tensors, which an empty cache then follows
    (reallocated: autocast's dtype, say); once the cache has ``seen`` tokens, a
    ``ValueError``: never a silent cast."""
    if (arrival.dtype, arrival.device) == (held.dtype, held.device):
        return False
    if seen:
        raise ValueError(
            f"{owner} holds {held.dtype} on {held.device}, got {arrival.dtype} on "
            f"{arrival.device}: one generation must keep one dtype"
        )
    return True


class Cache:
    """What every cache shares: preallocated per-token tensors (those named in
    ``names``, batch first, tokens on axis ``token_dim``) of which the first ``held``
    entries are filled, ``length`` tokens seen, one validator for what arrives, the
    length arithmetic, ``nbytes``, and the surgery of decoding (``truncate``,
    ``repeat``, ``reorder``)."""

    static = False  # filled once and then read as it is (an encoder's keys)
    can_truncate = True
    dropped_or_quantized = False  # True: it holds fewer entries than it has seen
    names = ("keys", "values")
    labels = ("B", "h", None, "head_dim")  # the axes' names, for error messages
    token_dim = 2

    def __init__(self, shapes, device, dtype):
        self._allocate(shapes, device, dtype)
        self.length = 0  # tokens seen
        self._held = 0  # entries filled, when that is not every token seen

    def _allocate(self, shapes, device, dtype) -> None:
        for name, shape in zip(self.names, shapes, strict=True):
            setattr(self, name, torch.zeros(shape, device=device, dtype=dtype))

    def tensors(self) -> list[torch.Tensor]:
        """The preallocated tensors, in the order of ``names``."""
        return [getattr(self, name) for name in self.names]

    @property
    def held(self) -> int:
        """Entries filled in the preallocated tensors (every token seen, unless the
        cache drops or quantises some)."""
        return self._held if self.dropped_or_quantized else self.length

    @property
    def max_len(self) -> int | None:
        """The most tokens it can hold (``None``: no limit)."""
        return self.tensors()[0].shape[self.token_dim]

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return self.length + new_tokens

    def _accept(self, *arrivals: torch.Tensor) -> int:
        """Check the new tokens' tensors (one per name, each shaped as the tensor it
        joins with ``t`` tokens) and that ``t`` more fit; return ``t``. The first
        arrivals decide dtype and device (:func:`must_follow`)."""
        held, owner = self.tensors(), type(self).__name__
        expected = [
            tuple(zip(self.labels, x.shape, strict=True)) for x in held
        ]  # (label, size) per axis
        t = check_arrivals(owner, self.names, expected, arrivals, self.token_dim)
        if must_follow(owner, held[0], arrivals[0], seen=self.length > 0):
            sizes = dict(device=arrivals[0].device, dtype=arrivals[0].dtype)
            self._allocate([x.shape for x in held], **sizes)
        if self.max_len is not None and self.length + t > self.max_len:
            raise ValueError(
                f"{owner} holds {self.max_len} tokens; cannot add {t} to the "
                f"{self.length} stored"
            )
        return t

    def _first(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.narrow(self.token_dim, 0, n)

    def filled(self) -> list[torch.Tensor]:
        """The filled entries of each tensor (``(B, h, held, head_dim)`` each for keys
        and values)."""
        return [self._first(x, self.held) for x in self.tensors()]

    def nbytes(self) -> int:
        """Bytes of memory the cache holds (its preallocated tensors)."""
        return sum(x.numel() * x.element_size() for x in self.tensors())

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

    def repeat(self, n: int) -> None:
        """Widen a batch-1 cache to ``n`` rows (one per beam): copies, each beam to
        extend its own prefix; a static cache as views (the source is the same for
        every beam)."""
        n = check_positive_int("n", n)
        batch = self.tensors()[0].shape[0]
        if batch != 1:
            raise ValueError(f"repeat widens a cache of batch 1, this one has {batch}")
        for name, x in zip(self.names, self.tensors(), strict=True):
            widened = x.expand(n, *x.shape[1:])  # (n, ...) views
            setattr(self, name, widened if self.static else widened.contiguous())

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` takes over the entries of row ``rows[i]`` (beam search: each
        surviving beam keeps the keys and values of the prefix it extends). A static
        cache is the same for every row and stays as it is."""
        if self.static:
            return
        for x in self.tensors():  # the filled entries of rows, copied first
            self._first(x, self.held).copy_(self._first(x, self.held)[rows])


class KVCache(Cache):
    """Keys and values of earlier tokens for one attention layer, in preallocated
    tensors.

    ``keys`` and ``values`` are ``(B, h, max_len, head_dim)``; ``length`` tokens are
    filled. :meth:`append` writes new keys and values in place (no concatenation, no
    reallocation) and returns every filled one. A ``static`` cache (cross-attention) is
    filled once and then reused as it is.
    """

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
        shapes = _kv_shapes(batch_size, num_heads, "max_len", max_len, head_dim)
        super().__init__(shapes, device, dtype)
        self.static = static

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (B, h, t, head_dim)`` after the filled part; return all filled
        keys and values, ``(B, h, length, head_dim)``."""
        t = self._accept(k, v)
        self.keys[:, :, self.length : self.length + t] = k
        self.values[:, :, self.length : self.length + t] = v
        self.length += t
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class RollingKVCache(Cache):
    """The KV cache of sliding-window attention: the keys and values of the last
    ``window`` tokens only.

    A query sees itself and the ``window - 1`` tokens before it, so older entries are
    never read again: the cache keeps at most ``window`` of them in preallocated ``(B,
    h, window, head_dim)`` tensors, and its memory stays ``2 * B * window * d * bytes``
    per layer however long the sequence grows. ``length`` counts every token seen (the
    position of the next one, as for :class:`KVCache`); ``held`` is how many entries
    the tensors hold, ``min(length, window)``. :meth:`append` returns the held entries
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

    can_truncate, dropped_or_quantized = False, True
    max_len = None  # it streams

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
        shapes = _kv_shapes(batch_size, num_heads, "window", window, head_dim)
        super().__init__(shapes, device, dtype)
        self.window = shapes[0][2]  # the most entries it holds
        self.sink_tokens = check_sink_tokens(sink_tokens, self.window)

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        total, sinks = self.held + new_tokens, self.sink_tokens
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
        t = self._accept(k, v)
        # (B, h, held + t, d/h)
        keys = torch.cat([self.keys[:, :, : self.held], k], dim=2)
        values = torch.cat([self.values[:, :, : self.held], v], dim=2)
        rolling = self.window - self.sink_tokens
        # (B, h, keep, d/h): the last window tokens (or the sinks and the last
        # window - sinks), oldest first
        kept = self._sinks_and_last(keys, rolling)
        keep = kept.shape[2]
        self.keys[:, :, :keep] = kept
        self.values[:, :, :keep] = self._sinks_and_last(values, rolling)
        self._held, self.length = keep, self.length + t
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


class LatentKVCache(Cache):
    """The cache of multi-head latent attention (DeepSeek-V2/V3,
    :class:`~attnbook.latent.MultiHeadLatentAttention`) for one layer: per token one
    latent of ``kv_lora_rank`` numbers, from which every head's keys and values are
    computed, and one RoPE key of ``qk_rope_head_dim`` numbers shared by every head.

    ``latents (B, max_len, kv_lora_rank)`` and ``rope_keys (B, max_len,
    qk_rope_head_dim)``, preallocated: ``(kv_lora_rank + qk_rope_head_dim) * bytes``
    per token, against ``2 h head_dim * bytes`` for a :class:`KVCache`.
    :meth:`append` takes ``latent (B, t, kv_lora_rank)`` and ``rope_key (B, t,
    qk_rope_head_dim)`` and returns every filled one; the rest as for :class:`KVCache`.
    """

    names = ("latents", "rope_keys")
    labels = ("B", None, None)
    token_dim = 1

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
        B, T, r, rope = _sizes(
            batch_size=batch_size, max_len=max_len, kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )  # fmt: skip
        super().__init__(((B, T, r), (B, T, rope)), device, dtype)

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor):
        """Store ``latent (B, t, kv_lora_rank)`` and ``rope_key (B, t,
        qk_rope_head_dim)`` after the filled part; return all filled ones, ``(B,
        length, ...)``."""
        t = self._accept(latent, rope_key)
        self.latents[:, self.length : self.length + t] = latent
        self.rope_keys[:, self.length : self.length + t] = rope_key
        self.length += t
        return self.latents[:, : self.length], self.rope_keys[:, : self.length]


class QuantizedKVCache(Cache):
    """A KV cache that stores keys and values quantised, KIVI's way (Liu et al. 2024): a
    drop-in for :class:`KVCache` that holds up to ``max_len`` tokens and returns
    dequantised keys and values to attention.

    Keys have ``key_bits`` and values ``value_bits`` (2, 4 or 8), each quantised along
    its own axis: ``"channel"`` (one scale and offset per channel for each group of
    ``group_size`` tokens: KIVI's choice for keys, whose outliers sit in a few
    channels) or ``"token"`` (one per token, over its ``head_dim`` channels: KIVI's
    choice for values). As KIVI, the most recent tokens stay in full precision: the
    residual ``keys`` and ``values`` ``(B, h, group_size, head_dim)`` hold the last
    ``held < group_size`` tokens, and each time ``group_size`` of them have gathered
    they are quantised together (keys and values alike) and appended to
    ``quantized_keys`` and ``quantized_values`` (a
    :class:`~attnbook.quantize.QuantizedTensor` each, grown by concatenation).
    :meth:`append` returns the dequantised tokens, then the residual, then the new
    tokens at full precision (the step that computed them has them).

    With ``pre_rope`` (the attention's :class:`~attnbook.positions.Rotary`), keys are
    quantised as they were before RoPE, as KVQuant (Hooper et al. 2024) does: each
    group is turned back with :meth:`~attnbook.positions.Rotary.inverse` before it is
    quantised, and the dequantised keys are rotated again (the cache's first token is
    position 0).

    :meth:`packed_nbytes` counts what a packed implementation holds for the ``length``
    tokens stored: per quantised token and head, ``head_dim * bits / 8`` bytes of codes;
    a scale and an offset in the cache's dtype per group (``head_dim`` of them per
    ``group_size`` tokens for ``"channel"``, one per token for ``"token"``); and ``2 *
    head_dim`` numbers in the cache's dtype per residual token. It cannot
    :meth:`truncate`.
    """

    can_truncate, dropped_or_quantized = False, True

    def __init__(self, batch_size, num_heads, max_len, head_dim, *, key_bits=8,
                 value_bits=8, key_axis="channel", value_axis="token", group_size=32,
                 pre_rope=None, device=None, dtype=torch.float32):  # fmt: skip
        shapes = _kv_shapes(batch_size, num_heads, "group_size", group_size, head_dim)
        super().__init__(shapes, device, dtype)
        self._max_len = check_positive_int("max_len", max_len)
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
        if pre_rope is not None and not isinstance(pre_rope, Rotary):
            raise TypeError(
                "pre_rope must be the attention's Rotary (or None), got "
                f"{type(pre_rope).__name__}"
            )
        self.pre_rope = pre_rope
        self.key_bits, self.value_bits = key_bits, value_bits
        self.key_axis, self.value_axis = key_axis, value_axis
        # QuantizedTensor once a group is full
        self.quantized_keys = self.quantized_values = None
        self.group_size = shapes[0][2]  # held: the residual tokens, fewer than this

    @property
    def max_len(self) -> int:
        return self._max_len

    def _all(self, quantized, residual, new, rotate=False):
        """``(B, h, length + t, head_dim)``: the dequantised tokens (rotated by
        ``pre_rope`` from position 0 if ``rotate``), the residual ones, the new ones."""
        parts = [residual[:, :, : self.held], new]
        if quantized is not None:
            old = dequantize_kv(quantized)
            parts.insert(0, self.pre_rope(old) if rotate else old)
        return torch.cat(parts, dim=2)

    def _quantize(self, x, bits, axis) -> QuantizedTensor:
        """``x (B, h, n * group_size, head_dim)`` quantised along ``axis``."""
        group_size = self.group_size if axis == "channel" else None
        return quantize_kv(x, bits, QUANTIZED_AXES[axis], group_size)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (B, h, t, head_dim)``; return every token's keys and values,
        ``(B, h, length, head_dim)``: the quantised ones dequantised, the residual and
        new ones as they are."""
        t = self._accept(k, v)
        rotate = self.pre_rope is not None
        keys = self._all(self.quantized_keys, self.keys, k, rotate)  # (B, h, n, d/h)
        values = self._all(self.quantized_values, self.values, v)
        first = self.length - self.held  # the first token not yet quantised
        last = first + (self.held + t) // self.group_size * self.group_size
        if last > first:  # whole groups: quantised
            new_keys = keys[:, :, first:last]  # (B, h, groups * group_size, d/h)
            if rotate:  # back to before RoPE: positions first ..
                new_keys = self.pre_rope.inverse(new_keys, first)
            new_values = values[:, :, first:last]
            self.quantized_keys = concatenate_quantized(
                self.quantized_keys,
                self._quantize(new_keys, self.key_bits, self.key_axis),
            )
            self.quantized_values = concatenate_quantized(
                self.quantized_values,
                self._quantize(new_values, self.value_bits, self.value_axis),
            )
        self._held, self.length = keys.shape[2] - last, self.length + t
        self.keys[:, :, : self.held] = keys[:, :, last:]  # the rest: the residual
        self.values[:, :, : self.held] = values[:, :, last:]
        return keys, values

    def _quantized(self) -> list[QuantizedTensor]:
        quantized = (self.quantized_keys, self.quantized_values)
        return [q for q in quantized if q is not None]

    def nbytes(self) -> int:
        """Bytes of memory the cache holds: the residual buffers and the quantised
        tokens' codes (a byte each here), scales and offsets."""
        codes = sum(
            sum(x.numel() * x.element_size() for x in (q.codes, q.scale, q.offset))
            for q in self._quantized()
        )
        return super().nbytes() + codes

    def packed_nbytes(self) -> int:
        """Bytes a packed implementation holds for the tokens stored (see the class)."""
        residual = self.keys[:, :, : self.held]
        return 2 * residual.numel() * residual.element_size() + sum(
            q.nbytes() for q in self._quantized()
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
    latent: tuple[int, int] | None = None,
    kv_bits: int | tuple[int, int] | None = None,
    group_size: int = 32,
):
    """A model's caches, one per layer, with the arguments in :class:`KVCache`'s
    order: a :class:`KVCache` of ``max_len`` tokens; with ``window``, a
    :class:`RollingKVCache` of ``window`` entries (``sink_tokens`` of them attention
    sinks); with ``latent=(kv_lora_rank, qk_rope_head_dim)``, a :class:`LatentKVCache`
    (``num_heads`` and ``head_dim`` unused); with ``kv_bits`` (``bits``, or
    ``(key_bits, value_bits)``), a :class:`QuantizedKVCache` (keys per channel, values
    per token, groups of ``group_size`` tokens); with ``memory_len`` (an
    encoder–decoder), a pair per layer: the growing self-attention cache and a static
    cross-attention cache of ``memory_len`` keys, filled once from the encoder's
    output."""
    num_layers = check_positive_int("num_layers", num_layers)
    sizes = dict(device=device, dtype=dtype)
    if kv_bits is not None and (window is not None or latent is not None):
        raise ValueError(
            "kv_bits quantises a full cache of keys and values: build it without a "
            "window and without latents (mla's)"
        )
    key_bits, value_bits = kv_bits if isinstance(kv_bits, tuple) else (kv_bits, kv_bits)

    def self_attention_cache():
        if latent is not None:
            return LatentKVCache(batch_size, max_len, *latent, **sizes)
        if kv_bits is not None:
            return QuantizedKVCache(
                batch_size, num_heads, max_len, head_dim, key_bits=key_bits,
                value_bits=value_bits, group_size=group_size, **sizes,
            )  # fmt: skip
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
