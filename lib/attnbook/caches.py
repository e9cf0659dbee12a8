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
``window`` (sliding-window attention). :func:`make_caches` is the one factory.
"""

from __future__ import annotations

import torch

from .utils import check_positive_int

__all__ = ["KVCache", "RollingKVCache", "make_caches"]


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
    ):
        super().__init__(
            batch_size, num_heads, "window", window, head_dim, device, dtype
        )
        self.stored = 0  # entries held, at most window

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    def key_len(self, new_tokens: int) -> int:
        """How many keys :meth:`append` returns for ``new_tokens`` new tokens."""
        return min(self.stored + new_tokens, self.window - 1 + new_tokens)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add ``k, v (B, h, t, head_dim)``; return the keys and values the new queries
        can see, ``(B, h, key_len(t), head_dim)``, oldest first; keep the last
        ``window`` of them."""
        self._accept(k, v)
        t = k.shape[2]
        # (B, h, stored + t, d/h)
        keys = torch.cat([self.keys[:, :, : self.stored], k], dim=2)
        values = torch.cat([self.values[:, :, : self.stored], v], dim=2)
        keep = min(self.window, keys.shape[2])
        # the last window tokens, oldest first
        self.keys[:, :, :keep] = keys[:, :, -keep:]
        self.values[:, :, :keep] = values[:, :, -keep:]
        self.stored, self.length = keep, self.length + t
        # the first new query sees window - 1 tokens before it
        visible = self.window - 1 + t
        return keys[:, :, -visible:], values[:, :, -visible:]

    def truncate(self, length: int) -> None:
        raise ValueError(
            "a RollingKVCache cannot truncate: it keeps only the last "
            f"{self.window} entries, and the ones it dropped are gone"
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
):
    """The library's one cache factory, with the arguments in :class:`KVCache`'s order:
    one :class:`KVCache` of ``max_len`` tokens per layer; with ``window``, one
    :class:`RollingKVCache` of ``window`` entries per layer; with ``memory_len`` (an
    encoder–decoder), a pair per layer: the growing self-attention cache and a static
    cross-attention cache of ``memory_len`` keys, filled once from the encoder's
    output."""
    num_layers = check_positive_int("num_layers", num_layers)
    sizes = dict(device=device, dtype=dtype)

    def self_attention_cache():
        if window is None:
            return KVCache(batch_size, num_heads, max_len, head_dim, **sizes)
        return RollingKVCache(batch_size, num_heads, window, head_dim, **sizes)

    if memory_len is None:
        return [self_attention_cache() for _ in range(num_layers)]
    return [
        (
            self_attention_cache(),
            KVCache(batch_size, num_heads, memory_len, head_dim, static=True, **sizes),
        )
        for _ in range(num_layers)
    ]
