"""Chapter 15: FlashAttention's forward and backward, as a ``torch.autograd.Function``.

:func:`flash_attention` computes exact attention tile by tile with the online softmax
(Dao et al., 2022), in the loop order of FlashAttention-2 (Dao, 2023). The forward
visits query tiles in its outer loop and key/value tiles in the inner one, and saves
only the output ``O`` and the log-sum-exp ``L`` of every query row. The backward
recomputes each tile's weights from ``L`` (key/value tiles outer, query tiles inner)
and accumulates ``dQ``, ``dK``, ``dV``. What is kept for the backward grows as ``T``,
not ``T^2``; the price is one extra matrix product per tile.

Shapes: q ``(B, h, Tq, d)``, k ``(B, h, Tk, d)``, v ``(B, h, Tk, dv)``; out
``(B, h, Tq, dv)``. ``is_causal=True`` aligns the causal mask to the bottom right, as
the rest of the library does (query ``i`` is token ``Tk - Tq + i``); a query that sees
no key gets output 0, never NaN. :func:`flash_tiles` lists the tiles the loops compute
(the causal skip included) and :func:`flash_tile_count` counts them.

What the loops move between slow memory and the tiles: :func:`slow_memory_traffic`
counts it in closed form, with the tile sizes of the paper's Algorithm 1
(:func:`tile_rows`), and :class:`TileTraffic` counts it from the operations a loop
runs, so that the two can be checked against each other.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .attention import _check_qkv, online_softmax_attention
from .masks import causal_first_query, causal_key_stop, mask_future_
from .utils import check_positive_int

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _key_stop(q_stop: int, n_q: int, n_k: int, is_causal: bool) -> int:
    """Keys ``0 .. stop - 1`` are visible to the last query of a tile ending at
    ``q_stop`` (every key without a causal mask)."""
    return causal_key_stop(q_stop, n_q, n_k) if is_causal else n_k


def _first_query(k_start: int, n_q: int, n_k: int, block: int, is_causal: bool) -> int:
    """Start of the first query tile that sees key ``k_start`` (0 without a mask)."""
    if not is_causal:
        return 0
    return causal_first_query(k_start, n_q, n_k) // block * block


def flash_tiles(
    query_len: int, key_len: int, block_size: int, is_causal: bool = False
) -> list[tuple[int, int, int, int]]:
    """The tiles ``(q_start, q_stop, k_start, k_stop)`` that :func:`flash_attention`
    computes, in its forward's order (query tiles outer, key tiles inner); the backward
    computes the same set with key tiles outer. With ``is_causal=True`` a tile whose
    keys all lie in the future of all its queries is skipped (bottom-right alignment).
    """
    query_len = check_positive_int("query_len", query_len)
    key_len = check_positive_int("key_len", key_len)
    block_size = check_positive_int("block_size", block_size)
    _check_bool("is_causal", is_causal)
    tiles = []
    for q_start in range(0, query_len, block_size):
        q_stop = min(q_start + block_size, query_len)
        key_stop = _key_stop(q_stop, query_len, key_len, is_causal)
        for k_start in range(0, key_stop, block_size):
            tiles.append((q_start, q_stop, k_start, min(k_start + block_size, key_len)))
    return tiles


def flash_tile_count(
    query_len: int, key_len: int, block_size: int, is_causal: bool = False
) -> int:
    """How many tiles :func:`flash_attention` computes, in the forward and again in the
    backward: ``ceil(Tq / b) * ceil(Tk / b)``, fewer with ``is_causal=True``."""
    return len(flash_tiles(query_len, key_len, block_size, is_causal))


def tile_rows(
    head_dim: int, fast_memory: int, bytes_per_element: int = 4
) -> tuple[int, int]:
    """The rows of the two tiles of FlashAttention's Algorithm 1 (Dao et al. 2022) for a
    fast memory of ``fast_memory`` bytes, ``M`` numbers of ``bytes_per_element`` bytes:
    the outer loop's tile has ``ceil(M / 4d)`` rows and the inner loop's ``min(ceil(M /
    4d), d)``, so that four ``d``-wide tiles, and a tile of scores, fit. A loop over
    fewer rows than a tile simply takes them all."""
    d = check_positive_int("head_dim", head_dim)
    size = check_positive_int("bytes_per_element", bytes_per_element)
    elements = check_positive_int("fast_memory", fast_memory) // size
    if elements < 4 * d:
        raise ValueError(
            f"fast_memory must hold at least 4 d = {4 * d} elements "
            f"({4 * d * size} bytes), got {fast_memory} bytes"
        )
    outer = math.ceil(elements / (4 * d))
    return outer, min(outer, d)


def slow_memory_traffic(
    seq_len: int,
    head_dim: int,
    fast_memory: int | None = None,
    order: str = "q_outer",
    bytes_per_element: int = 4,
) -> int:
    """Bytes that one head's attention forward reads from and writes to slow memory
    (a GPU's HBM), ``T = seq_len`` queries and keys of width ``d = head_dim``.

    ``fast_memory=None``: standard attention, which writes ``S = QK^T``, reads it back
    for the softmax, writes ``P`` and reads it for ``PV``: ``4Td + 4T^2`` elements.
    Otherwise tiled attention whose tiles fit ``fast_memory`` bytes, with the tile
    sizes of :func:`tile_rows` (``M`` in elements): the outer loop's tile stays in fast
    memory during the inner loop, which streams the other matrices past it.
    ``order="kv_outer"`` (FlashAttention-1): every key/value tile is read once, and for
    each of them every query tile with its output rows and two statistics (``m``,
    ``l``) is read and written back: ``2Td + (3Td + 4T) ceil(T / B_c)``.
    ``order="q_outer"`` (FlashAttention-2): every query tile is read once and its output
    and log-sum-exp written once, and for each of them every key/value tile is read:
    ``2Td + T + 2Td ceil(T / B_r)``, what :class:`TileTraffic` counts in the library's
    own loop. Both are ``Theta(T^2 d^2 / M)`` (the paper's Theorem 2)."""
    T = check_positive_int("seq_len", seq_len)
    d = check_positive_int("head_dim", head_dim)
    size = check_positive_int("bytes_per_element", bytes_per_element)
    if order not in ("q_outer", "kv_outer"):
        raise ValueError(f"order must be 'q_outer' or 'kv_outer', got {order!r}")
    if fast_memory is None:
        return size * (4 * T * d + 4 * T * T)
    outer, inner = tile_rows(d, fast_memory, size)  # rows of the outer and inner tiles
    outer, inner = min(outer, T), min(inner, T)
    traffic = 0
    for outer_start in range(0, T, outer):
        rows = min(outer, T - outer_start)
        if order == "kv_outer":
            traffic += 2 * rows * d  # K_j and V_j, once
            for inner_start in range(0, T, inner):
                r = min(inner, T - inner_start)
                traffic += 2 * r * d + 2 * r  # read Q_i, O_i, m_i, l_i
                traffic += r * d + 2 * r  # write O_i, m_i, l_i back
        else:
            traffic += rows * d + rows * d + rows  # Q_i in; O_i and L_i out, once
            traffic += sum(
                2 * min(inner, T - k) * d for k in range(0, T, inner)
            )  # every K_j, V_j
    return size * traffic


class TileTraffic(TorchDispatchMode):
    """Counts the bytes a tiled loop moves between slow memory and its tiles, from the
    slices it takes: a slice of one of ``inputs`` is a tile read from slow memory (its
    bytes go to ``read``), a slice of any other tensor is a tile of an output about to
    be written back (``written``). What the loop computes on whole tiles (scores,
    weights, running statistics) stays in fast memory and is not counted.

    ``with TileTraffic([q, k, v]) as traffic: online_softmax_attention(...)``; then
    ``traffic.read + traffic.written`` equals :func:`slow_memory_traffic` for the same
    tiles. The tiles must be smaller than the tensors: PyTorch does not run a slice that
    takes a whole dimension (``x[:, 0:T]`` is ``x`` itself), so a tile as large as its
    tensor is not seen. The inputs must be the tensors the loop slices (float32 for the
    library's loops, which first copy fp16 / bf16 inputs to float32)."""

    def __init__(self, inputs):
        super().__init__()
        inputs = list(inputs)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError(
                f"inputs must be a non-empty list of tensors, got {inputs!r}"
            )
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.read = self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.slice.Tensor:
            nbytes = result.numel() * result.element_size()
            if args[0].untyped_storage().data_ptr() in self._inputs:
                self.read += nbytes  # a tile of Q, K or V loaded
            else:
                self.written += nbytes  # a tile of an output, to be written
        return result


class FlashAttentionFunction(torch.autograd.Function):
    """The autograd function behind :func:`flash_attention` (call that: it checks).

    ``forward(q, k, v, is_causal, block_size)`` saves ``q, k, v``, the output and the
    log-sum-exp of every row; ``backward`` recomputes the weights tile by tile."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, block_size: int):
        # chapter 7's online softmax, query tiles outer and key tiles inner, keeping
        # the log-sum-exp L of every row as well as the output (in fp32 for fp16/bf16)
        out, lse = online_softmax_attention(
            q, k, v, block_size=block_size, is_causal=is_causal
        )  # (B, h, Tq, dv), (B, h, Tq, 1)
        ctx.save_for_backward(q, k, v, out, lse)  # O(T d) numbers: no T x T tensor
        ctx.is_causal, ctx.block_size = is_causal, block_size
        return out.to(q.dtype)  # (B, h, Tq, dv)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: a graph of this backward
            raise RuntimeError(
                "flash_attention's backward gives first derivatives only: "
                "create_graph=True (a second derivative) is not supported"
            )
        q, k, v, out, lse = ctx.saved_tensors
        is_causal, block_size = ctx.is_causal, ctx.block_size
        n_q, d = q.shape[-2:]
        n_k = k.shape[-2]
        compute = out.dtype
        qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
        do = grad_out.to(compute)  # (B, h, Tq, dv)
        scale = 1.0 / math.sqrt(d)
        D = (do * out).sum(dim=-1, keepdim=True)  # (B, h, Tq, 1): rowsum(dO * O)
        dq = torch.zeros_like(qc)  # (B, h, Tq, d)
        dk = torch.empty_like(kc)  # (B, h, Tk, d)
        dv = torch.empty_like(vc)  # (B, h, Tk, dv)
        for k_start in range(0, n_k, block_size):  # outer loop: key/value tiles
            k_stop = min(k_start + block_size, n_k)
            k_tile = kc[:, :, k_start:k_stop]  # (B, h, bk, d)
            v_tile = vc[:, :, k_start:k_stop]  # (B, h, bk, dv)
            dk_tile = torch.zeros_like(k_tile)
            dv_tile = torch.zeros_like(v_tile)
            first = _first_query(k_start, n_q, n_k, block_size, is_causal)
            for q_start in range(first, n_q, block_size):  # inner loop: query tiles
                q_stop = min(q_start + block_size, n_q)
                # scaled tile by tile: a scaled copy of all of q would be O(T d) more
                q_tile = qc[:, :, q_start:q_stop] * scale  # (B, h, bq, d)
                s = q_tile @ k_tile.transpose(-2, -1)  # (B, h, bq, bk): recomputed
                if is_causal:
                    mask_future_(s, q_start, k_start, n_q, n_k)
                p = torch.exp(s - lse[:, :, q_start:q_stop])  # (B, h, bq, bk): weights
                do_tile = do[:, :, q_start:q_stop]  # (B, h, bq, dv)
                dv_tile += p.transpose(-2, -1) @ do_tile  # dV = P^T dO
                dp = do_tile @ v_tile.transpose(-2, -1)  # (B, h, bq, bk): dO V^T
                ds = p * (dp - D[:, :, q_start:q_stop])  # dS = P * (dP - D)
                dq[:, :, q_start:q_stop] += (ds @ k_tile) * scale  # dS K / sqrt(d)
                dk_tile += ds.transpose(-2, -1) @ q_tile  # dS^T Q / sqrt(d)
            dk[:, :, k_start:k_stop] = dk_tile
            dv[:, :, k_start:k_stop] = dv_tile
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    block_size: int = 64,
) -> torch.Tensor:
    """Exact attention ``softmax(q k^T / sqrt(d)) v``, tiled, with a backward that
    recomputes the weights instead of storing them.

    q ``(B, h, Tq, d)``, k ``(B, h, Tk, d)``, v ``(B, h, Tk, dv)``, of one float dtype
    and device; returns ``(B, h, Tq, dv)``. A tile is ``block_size`` queries by
    ``block_size`` keys (the last ones shorter when ``T`` is not a multiple of it).
    ``is_causal=True`` masks the future, aligned to the bottom right, and skips the
    tiles entirely in it. fp16 / bf16 are computed in fp32 and the results cast back;
    autocast is switched off inside (the tiles run in the inputs' dtype).
    """
    _check_qkv(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (B, h, T, d), got shape {tuple(t.shape)}"
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        raise ValueError(f"q, k and v must share (B, h), got {shapes}")
    sizes = {"Tq": q.shape[2], "Tk": k.shape[2], "d": q.shape[3], "dv": v.shape[3]}
    for name, size in sizes.items():
        if size == 0:
            raise ValueError(f"flash_attention needs {name} >= 1, got {shapes}")
    _check_bool("is_causal", is_causal)
    block_size = check_positive_int("block_size", block_size)
    with torch.autocast(q.device.type, enabled=False):
        return FlashAttentionFunction.apply(q, k, v, is_causal, block_size)


__all__ = [
    "FlashAttentionFunction",
    "TileTraffic",
    "flash_attention",
    "flash_tile_count",
    "flash_tiles",
    "slow_memory_traffic",
    "tile_rows",
]
