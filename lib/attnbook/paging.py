"""vLLM's paged KV memory (Kwon et al. 2023; chapter 18): many sequences' caches in one
pool of fixed-size blocks.

- :class:`BlockPool`: the blocks (every layer's keys and values of ``block_size``
  tokens each) and the allocator: a free list;
- :class:`PagedKVCache`: one sequence's table of blocks, with one cache per layer
  that stands on :class:`~attnbook.caches.Cache`;
- :func:`paged_memory_waste`: what contiguous and paged caches reserve but leave
  unused.

:func:`~attnbook.generation.generate_paged` decodes with them.
"""

from __future__ import annotations

import torch

from .caches import Cache, check_arrivals, must_follow
from .utils import check_non_negative_int, check_positive_int

__all__ = ["BlockPool", "PagedKVCache", "paged_memory_waste"]


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


class _PagedLayer(Cache):
    """One layer of a :class:`PagedKVCache`, with the caches' protocol (batch 1): its
    tokens live in the pool's blocks that the sequence's table lists."""

    can_truncate, names, max_len = False, (), None

    def __init__(self, sequence: PagedKVCache, layer: int):
        self.sequence, self.layer, self.length = sequence, layer, 0

    def _accept(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Check ``k, v (1, h, t, head_dim)`` against the pool; an empty pool follows
        their dtype and device (:func:`~attnbook.caches.must_follow`)."""
        pool = self.sequence.pool
        _, _, h, _, head_dim = pool.keys.shape
        expected = [(("B", 1), ("h", h), ("t", None), ("head_dim", head_dim))] * 2
        t = check_arrivals("a paged cache", ("keys", "values"), expected, (k, v), 2)
        in_use = len(pool.free_blocks) < pool.num_blocks
        if must_follow("the block pool", pool.keys, k, seen=in_use):
            pool.keys = torch.zeros(pool.keys.shape, device=k.device, dtype=k.dtype)
            pool.values = torch.zeros(pool.keys.shape, device=k.device, dtype=k.dtype)
        return t

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v (1, h, t, head_dim)`` in the sequence's blocks (allocating
        them as needed); return all its keys and values, ``(1, h, length,
        head_dim)``."""
        pool = self.sequence.pool
        table, start = self.sequence.block_table, self.length
        end = start + self._accept(k, v)
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

    def truncate(self, length: int) -> None:
        raise ValueError("a paged cache cannot truncate: free the sequence instead")

    def repeat(self, n: int) -> None:
        raise ValueError("a paged cache holds one sequence: it cannot repeat")

    reorder = repeat


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
