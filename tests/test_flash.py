"""Chapter 15's library: FlashAttention's forward and backward (attnbook.flash).

Outputs and gradients are compared with PyTorch's fused kernel and with the library's naive
attention (float64 gradcheck on small shapes; float32 to 1e-5), the tile loops with
flash_tile_count, and what is saved for the backward with the naive attention's.
"""

import math

import attnbook
import pytest
import torch
import torch.nn.functional as F
from attnbook import causal_mask, flash_attention
from attnbook.attention import online_softmax_attention
from attnbook.flash import (
    TileTraffic,
    flash_tile_count,
    flash_tiles,
    slow_memory_traffic,
    tile_rows,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ATOL = RTOL = 1e-5  # float32, against PyTorch's kernels and the naive attention


@pytest.fixture(autouse=True)
def one_thread():
    """The tiles are small operations: on a shared machine a thread pool waiting for a busy
    second core makes each of them far slower than one thread."""
    with attnbook.measure.num_threads(1):
        yield


# (B, h, Tq, Tk, d, dv, block_size): batch and heads, T not a multiple of the block,
# Tq != Tk both ways, a block larger than T, a block of 1
SHAPES = [
    (2, 3, 64, 64, 16, 16, 16),
    (2, 2, 37, 37, 8, 8, 16),
    (1, 2, 20, 50, 8, 4, 16),
    (1, 2, 50, 20, 8, 4, 16),
    (2, 1, 13, 13, 4, 4, 64),
    (1, 1, 7, 5, 3, 2, 1),
]


def make_qkv(B, h, Tq, Tk, d, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d, generator=g, dtype=dtype)
    k = torch.randn(B, h, Tk, d, generator=g, dtype=dtype)
    v = torch.randn(B, h, Tk, dv, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def output_and_grads(fn, q, k, v, grad_out=None):
    out = fn(q, k, v)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
        grad_out = grad_out.to(out.dtype)
    return out, torch.autograd.grad(out, (q, k, v), grad_out), grad_out


def naive(is_causal):
    def fn(q, k, v):
        return attnbook.scaled_dot_product_attention(q, k, v, is_causal=is_causal)[0]

    return fn


def torch_reference(is_causal, Tq, Tk):
    """F.scaled_dot_product_attention with the library's bottom-right causal mask (the
    kernel's own is_causal aligns to the top left when Tq != Tk)."""
    if not is_causal:
        return F.scaled_dot_product_attention
    keep = ~causal_mask(Tq, key_len=Tk)  # torch: True = keep

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    return fn


def flash(is_causal, block_size):
    def fn(q, k, v):
        return flash_attention(q, k, v, is_causal=is_causal, block_size=block_size)

    return fn


# --- outputs and gradients ----------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_naive_attention_float32(shape, is_causal):
    *sizes, block = shape
    q, k, v = make_qkv(*sizes)
    out, grads, grad_out = output_and_grads(flash(is_causal, block), q, k, v)
    ref, ref_grads, _ = output_and_grads(naive(is_causal), q, k, v, grad_out)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] <= s[3]])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_fused_kernel_float32(shape, is_causal):
    # Tq <= Tk: every query sees a key, so PyTorch's kernel gives no NaN rows
    *sizes, block = shape
    Tq, Tk = sizes[2], sizes[3]
    q, k, v = make_qkv(*sizes, seed=1)
    out, grads, grad_out = output_and_grads(flash(is_causal, block), q, k, v)
    ref, ref_grads, _ = output_and_grads(
        torch_reference(is_causal, Tq, Tk), q, k, v, grad_out
    )
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=RTOL)


def test_square_causal_matches_torch_is_causal():
    q, k, v = make_qkv(2, 2, 45, 45, 8, 8)
    out, grads, grad_out = output_and_grads(flash(True, 16), q, k, v)
    ref, ref_grads, _ = output_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        q,
        k,
        v,
        grad_out,
    )
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "sizes,block,is_causal",
    [
        ((1, 2, 5, 5, 4, 3), 2, False),
        ((1, 2, 5, 5, 4, 3), 2, True),
        ((2, 1, 3, 7, 4, 2), 3, True),
        ((1, 1, 7, 3, 2, 2), 2, True),  # 4 queries see no key
        ((1, 1, 6, 4, 3, 3), 10, False),  # one tile larger than T
    ],
)
def test_gradcheck_float64(sizes, block, is_causal):
    q, k, v = make_qkv(*sizes, dtype=torch.float64)
    assert torch.autograd.gradcheck(flash(is_causal, block), (q, k, v))


def test_query_without_visible_key_gives_zero_not_nan():
    q, k, v = make_qkv(1, 2, 9, 4, 4, 4)  # causal, Tq > Tk: queries 0..4 see nothing
    out, grads, _ = output_and_grads(flash(True, 4), q, k, v)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert (out[:, :, :5] == 0).all() and (out[:, :, 5:] != 0).any()
    assert (grads[0][:, :, :5] == 0).all()
    ref, _ = attnbook.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block", [1, 3, 8, 100])
def test_result_does_not_depend_on_block_size(block):
    q, k, v = make_qkv(1, 2, 23, 23, 8, 8, dtype=torch.float64)
    out, grads, grad_out = output_and_grads(flash(True, block), q, k, v)
    ref, ref_grads, _ = output_and_grads(flash(True, 23), q, k, v, grad_out)
    torch.testing.assert_close(out, ref)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_computed_in_float32(dtype):
    q, k, v = make_qkv(1, 2, 40, 40, 16, 16, dtype=dtype)
    out, grads, grad_out = output_and_grads(flash(True, 16), q, k, v)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_grads, _ = output_and_grads(naive(True), q32, k32, v32, grad_out.float())
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.float(), ref_grad, atol=tol, rtol=tol)


def test_large_scores_stay_finite():
    q, k, v = make_qkv(1, 1, 20, 20, 8, 8)
    with torch.no_grad():
        q.mul_(300.0)  # scores of several thousand
    out, grads, grad_out = output_and_grads(flash(False, 8), q, k, v)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    ref, ref_grads, _ = output_and_grads(naive(False), q, k, v, grad_out)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_autocast_is_switched_off_inside():
    q, k, v = make_qkv(1, 2, 24, 24, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attention(q, k, v, block_size=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive(False)(q, k, v), atol=ATOL, rtol=RTOL)


def test_no_grad_and_exported():
    assert attnbook.flash_attention is flash_attention
    q, k, v = make_qkv(1, 1, 8, 8, 4, 4)
    with torch.no_grad():
        out = flash_attention(q, k, v, block_size=4)
    assert not out.requires_grad


# --- tiles: what the loops compute ----------------------------------------------------


class CountMatmuls(TorchDispatchMode):
    """Counts the batched matrix products that run (a 4-D ``@`` is one ``bmm``; ``baddbmm`` too)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("bmm", "mm", "matmul", "baddbmm", "addmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "Tq,Tk,block",
    [(64, 64, 16), (70, 70, 16), (20, 50, 16), (50, 20, 16), (9, 9, 20), (33, 100, 7)],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_loops_compute_exactly_the_counted_tiles(Tq, Tk, block, is_causal):
    q, k, v = make_qkv(1, 2, Tq, Tk, 8, 8)
    tiles = flash_tile_count(Tq, Tk, block, is_causal)
    with CountMatmuls() as forward:
        out = flash_attention(q, k, v, is_causal=is_causal, block_size=block)
    with CountMatmuls() as backward:
        out.sum().backward()
    assert forward.count == 2 * tiles  # S = Q K^T and P V per tile
    assert backward.count == 5 * tiles  # S again, P^T dO, dO V^T, dS K, dS^T Q


@pytest.mark.parametrize("T,block", [(64, 16), (256, 64), (1000, 100)])
def test_tile_counts_without_and_with_the_causal_skip(T, block):
    blocks = math.ceil(T / block)
    assert flash_tile_count(T, T, block) == blocks * blocks
    assert flash_tile_count(T, T, block, True) == blocks * (blocks + 1) // 2
    assert flash_tile_count(T, 3 * T, block) == blocks * math.ceil(3 * T / block)
    assert flash_tile_count(T, T, 10 * T) == flash_tile_count(T, T, 10 * T, True) == 1


@pytest.mark.parametrize(
    "Tq,Tk,block", [(16, 16, 4), (10, 23, 4), (23, 10, 4), (7, 7, 3)]
)
def test_tiles_cover_every_visible_pair_and_skip_only_blocked_ones(Tq, Tk, block):
    blocked = causal_mask(Tq, key_len=Tk)  # (Tq, Tk)
    covered = torch.zeros(Tq, Tk, dtype=torch.int64)
    for q_start, q_stop, k_start, k_stop in flash_tiles(Tq, Tk, block, True):
        covered[q_start:q_stop, k_start:k_stop] += 1
    assert covered.max() == 1  # no pair twice
    assert (covered[~blocked] == 1).all()  # every visible pair computed
    all_tiles = flash_tiles(Tq, Tk, block)
    assert len(all_tiles) == math.ceil(Tq / block) * math.ceil(Tk / block)
    skipped = set(all_tiles) - set(flash_tiles(Tq, Tk, block, True))
    for (
        q_start,
        q_stop,
        k_start,
        k_stop,
    ) in skipped:  # a skipped tile: all in the future
        assert blocked[q_start:q_stop, k_start:k_stop].all()


def test_counted_flops_match_the_tiles():
    Tq, Tk, d, dv, block = 50, 70, 8, 4, 16
    q, k, v = make_qkv(2, 3, Tq, Tk, d, dv)
    for is_causal in (False, True):
        area = sum(
            (qe - qs) * (ke - ks)
            for qs, qe, ks, ke in flash_tiles(Tq, Tk, block, is_causal)
        )
        with FlopCounterMode(display=False) as forward:
            out = flash_attention(q, k, v, is_causal=is_causal, block_size=block)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
        assert forward.get_total_flops() == 6 * 2 * area * (d + dv)  # B h = 6
        assert backward.get_total_flops() == 6 * 2 * area * (3 * d + 2 * dv)
    assert area < Tq * Tk


# --- memory saved for the backward ------------------------------------------------------


def saved_bytes(fn, *inputs):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def test_saved_for_backward_is_linear_in_T():
    B, h, T, d = 1, 2, 512, 8
    ours, theirs = [], []
    for n in (T, 2 * T):
        q, k, v = make_qkv(B, h, n, n, d, d)
        ours.append(saved_bytes(flash(False, 128), q, k, v))
        theirs.append(saved_bytes(naive(False), q, k, v))
        # q, k, v, out (B, h, n, d) and one log-sum-exp per row, in float32
        assert ours[-1] == 4 * (4 * B * h * n * d + B * h * n)
    assert ours[1] == 2 * ours[0]
    assert theirs[1] > 3.5 * theirs[0]  # the n x n weights


def test_backward_peak_above_the_gradients_is_tiles_not_a_copy_of_q():
    # forward + backward peak minus what must exist anyway (the gradients of q, k, v and
    # the saved out and log-sum-exp): a few block x block tiles, whatever T is; a
    # scaled copy of all of q would add B h T d floats, growing with T
    from attnbook.measure import peak_memory

    B, h, d, block = 1, 2, 64, 64
    extra = []
    for n in (256, 1024):
        q, k, v = make_qkv(B, h, n, n, d, d)
        grad_out = torch.randn(B, h, n, d)

        def run(q=q, k=k, v=v, grad_out=grad_out):
            out = flash_attention(q, k, v, block_size=block)
            torch.autograd.grad(out, (q, k, v), grad_out)

        extra.append(peak_memory(run) - 4 * (4 * B * h * n * d + B * h * n))
    tile = 4 * B * h * block * block
    assert 0 < extra[0] < 12 * tile
    assert abs(extra[1] - extra[0]) < tile  # a q copy would add 4 B h (1024-256) d


# --- bad inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("block", [0, -1, 2.5, True, "64", None])
def test_bad_block_size_raises(block):
    q, k, v = make_qkv(1, 1, 4, 4, 2, 2)
    with pytest.raises(
        ValueError, match=f"block_size must be a positive int, got {block!r}"
    ):
        flash_attention(q, k, v, block_size=block)
    with pytest.raises(ValueError, match="block_size"):
        flash_tile_count(4, 4, block)


def test_bad_is_causal_raises():
    q, k, v = make_qkv(1, 1, 4, 4, 2, 2)
    with pytest.raises(TypeError, match="is_causal must be True or False, got 'yes'"):
        flash_attention(q, k, v, is_causal="yes")
    with pytest.raises(TypeError, match="is_causal"):
        flash_tiles(4, 4, 2, 1)


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((1, 1, 4, 8), (1, 1, 4, 6), (1, 1, 4, 8)), "same feature size d"),
        (((1, 1, 4, 8), (1, 1, 5, 8), (1, 1, 6, 8)), "same number of tokens Tk"),
        (
            ((1, 1, 0, 8), (1, 1, 4, 8), (1, 1, 4, 8)),
            r"needs Tq >= 1, got q \(1, 1, 0, 8\)",
        ),
        (((1, 1, 4, 8), (1, 1, 0, 8), (1, 1, 0, 8)), "needs Tk >= 1"),
        (((1, 1, 4, 0), (1, 1, 4, 0), (1, 1, 4, 3)), "needs d >= 1"),
        (
            ((1, 4, 8), (1, 4, 8), (1, 4, 8)),
            r"q must have 4 dims \(B, h, T, d\), got shape \(1, 4, 8\)",
        ),
        (((2, 1, 1, 4, 8),) * 3, "4 dims"),
        (((1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)), r"must share \(B, h\)"),
        (((2, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)), r"must share \(B, h\)"),
        (((8,), (8,), (8,)), "at least 2 dims"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    q, k, v = (torch.randn(shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v)


def test_bad_types_raise():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="same dtype|share one dtype"):
        flash_attention(q, q.double(), q)
    with pytest.raises(TypeError, match="floating-point"):
        flash_attention(q.long(), q.long(), q.long())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        flash_attention(q.tolist(), q, q)


@pytest.mark.parametrize(
    "args,match",
    [((0, 4, 2), "query_len"), ((4, -1, 2), "key_len"), ((4, 4, 0), "block_size")],
)
def test_bad_tile_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        flash_tiles(*args)


def test_second_derivative_is_refused_not_silently_wrong():
    q, k, v = make_qkv(1, 1, 4, 4, 2, 2)
    out = flash_attention(q, k, v, block_size=2)
    with pytest.raises(RuntimeError, match="first derivatives only: create_graph=True"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    (grad_q,) = torch.autograd.grad(flash_attention(q, k, v, block_size=2).sum(), q)
    assert not grad_q.requires_grad


def test_slow_memory_traffic_counts_tile_loads_as_the_closed_forms():
    T, d, M = 1000, 64, 4 * 64 * 100 * 4  # fast memory: 100 rows of 4 d float32 numbers
    assert slow_memory_traffic(T, d) == 4 * (4 * T * d + 4 * T * T)  # standard attention
    outer = 100  # ceil(M / 4 / (4 d)) rows in the outer loop's tile
    tiles = math.ceil(T / outer)
    kv_outer = 2 * T * d + (3 * T * d + 4 * T) * tiles
    q_outer = 2 * T * d + T + 2 * T * d * tiles
    assert slow_memory_traffic(T, d, M, "kv_outer") == 4 * kv_outer
    assert slow_memory_traffic(T, d, M, "q_outer") == 4 * q_outer
    # in half precision the same fast memory holds twice the rows: half the tiles
    half = slow_memory_traffic(T, d, M, bytes_per_element=2)
    assert half == 2 * (2 * T * d + T + 2 * T * d * math.ceil(T / 200))
    # Theorem 2: Theta(T^2 d^2 / M): twice the memory, half the rereads; twice T, 4x
    for order in ("q_outer", "kv_outer"):
        big = 8192
        ratio = slow_memory_traffic(big, d, M, order) / slow_memory_traffic(big, d, 2 * M, order)
        assert 1.9 < ratio < 2.0
        growth = slow_memory_traffic(2 * big, d, M, order) / slow_memory_traffic(big, d, M, order)
        assert 3.9 < growth < 4.0
    # a fast memory holding all of K and V (or Q): every matrix moves once
    assert slow_memory_traffic(64, 16, 4 * 64 * 16 * 4, "q_outer") == 4 * (4 * 64 * 16 + 64)
    with pytest.raises(ValueError, match="order"):
        slow_memory_traffic(T, d, M, "inner")
    with pytest.raises(ValueError, match="at least 4 d"):
        slow_memory_traffic(T, d, 4 * d * 4 - 4)
    with pytest.raises(ValueError, match="seq_len"):
        slow_memory_traffic(0, d)


def test_tile_rows_are_algorithm_1s():
    # M = 100 KiB of float32: 25,600 numbers; 4 d = 256 per row: 100 rows outside
    assert tile_rows(64, 100 * 1024) == (100, 64)
    assert tile_rows(64, 100 * 1024, bytes_per_element=2) == (200, 64)
    assert tile_rows(64, 16 * 64 * 4) == (4, 4)  # fewer rows than d: the inner tile too
    assert tile_rows(16, 4 * 16 * 4 + 4) == (2, 2)  # ceil: a part row is a row
    with pytest.raises(ValueError, match="at least 4 d"):
        tile_rows(64, 4 * 64 * 4 - 1)
    with pytest.raises(ValueError, match="head_dim"):
        tile_rows(0, 1024)
    with pytest.raises(ValueError, match="bytes_per_element"):
        tile_rows(64, 1024, bytes_per_element=0)


@pytest.mark.parametrize("T", [50, 100, 257])
@pytest.mark.parametrize("d", [4, 16])
def test_traffic_counted_in_the_librarys_loop_is_the_closed_form(T, d):
    """The bytes the library's own loop slices (Q_i once, every K_j and V_j per query
    tile, O_i and L_i written once) are slow_memory_traffic's FlashAttention-2 count, for
    every fast memory whose tiles are smaller than T; a batch of h heads moves h times
    one head's bytes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, T, d, generator=g) for _ in range(3))
    counted = 0
    # tiles of 8 rows, of 25 (a fast memory that is no whole number of rows), larger
    for fast_memory in (8 * 4 * d * 4, 24 * 4 * d * 4 + 4, 16 * 1024, 64 * 1024):
        outer, inner = tile_rows(d, fast_memory)
        if outer >= T:  # one tile holds the whole tensor: no slice runs
            continue
        with TileTraffic([q, k, v]) as traffic:
            out, lse = online_softmax_attention(
                q, k, v, block_size=inner, query_block_size=outer
            )
        assert traffic.written == 3 * 4 * (T * d + T)  # O and L, each row once
        assert traffic.read + traffic.written == 3 * slow_memory_traffic(
            T, d, fast_memory, "q_outer"
        )
        counted += 1
    assert counted >= 2


def test_traffic_of_flash_attention_forward_with_square_tiles():
    # square tiles of b <= d rows are Algorithm 1's for M = 4 d b numbers
    T, d, b = 200, 32, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 1, T, d, generator=g) for _ in range(3))
    with TileTraffic([q, k, v]) as traffic:
        flash_attention(q, k, v, block_size=b)
    assert tile_rows(d, 4 * d * b * 4) == (b, b)
    assert traffic.read + traffic.written == 2 * slow_memory_traffic(T, d, 4 * d * b * 4)


def test_tile_traffic_needs_tensors():
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        TileTraffic([])
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        TileTraffic([torch.zeros(2), "k"])
