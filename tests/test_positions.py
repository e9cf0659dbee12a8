"""Positions: the sinusoidal formula and its shift matrix, the learned table, 2D grid interpolation, RoPE."""

import math

import attnbook
import pytest
import torch
import torch.nn.functional as F
from attnbook import (
    LearnedPositions,
    SinusoidalPositions,
    apply_rope,
    interpolate_grid,
    sinusoidal_encoding,
)
from attnbook.positions import rope_angles, sinusoidal_shift_matrix

# ---------------------------------------------------------------------------------------------
# sinusoidal encoding


def by_hand(n, d, base=10000.0):
    """The formula of the paper, one entry at a time, in float64."""
    table = torch.empty(n, d, dtype=torch.float64)
    for p in range(n):
        for i in range(d // 2):
            angle = p / base ** (2 * i / d)
            table[p, 2 * i] = math.sin(angle)
            table[p, 2 * i + 1] = math.cos(angle)
    return table


@pytest.mark.parametrize("n, d", [(1, 2), (3, 2), (5, 4), (10, 8), (17, 6), (50, 16)])
def test_sinusoidal_matches_the_formula(n, d):
    table = sinusoidal_encoding(n, d)
    assert table.shape == (n, d) and table.dtype == torch.float32
    torch.testing.assert_close(table.double(), by_hand(n, d), atol=1e-6, rtol=0)


def test_sinusoidal_known_values():
    table = sinusoidal_encoding(3, 4)
    # position 0: sin 0 = 0, cos 0 = 1 in every pair
    assert torch.equal(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    # position 1, i = 0: angle 1; i = 1: angle 1 / 10000^(2/4) = 0.01
    expected = torch.tensor([math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)])
    torch.testing.assert_close(table[1], expected)
    # a different base
    torch.testing.assert_close(sinusoidal_encoding(4, 6, base=100.0).double(), by_hand(4, 6, base=100.0),
                               atol=1e-6, rtol=0)


def test_sinusoidal_values_in_range_and_pairs_on_the_unit_circle():
    table = sinusoidal_encoding(2000, 64)
    assert table.min() >= -1.0 and table.max() <= 1.0
    # each (sin, cos) pair has norm 1, so every row has norm sqrt(d/2)
    torch.testing.assert_close(table[:, 0::2] ** 2 + table[:, 1::2] ** 2, torch.ones(2000, 32))
    torch.testing.assert_close(table.norm(dim=1), torch.full((2000,), math.sqrt(32)))


def test_sinusoidal_is_a_prefix_of_a_longer_table():
    torch.testing.assert_close(sinusoidal_encoding(100, 32)[:40], sinusoidal_encoding(40, 32))


@pytest.mark.parametrize("k", [0, 1, 3, 17, 100])
@pytest.mark.parametrize("d", [2, 8, 32])
def test_shift_is_a_fixed_linear_map(k, d):
    """PE[p + k] = PE[p] @ M_k.T for every p, with one matrix M_k that does not depend on p."""
    n = 60
    table = sinusoidal_encoding(n + k, d)
    M = sinusoidal_shift_matrix(k, d)
    assert M.shape == (d, d)
    torch.testing.assert_close(table[:n] @ M.T, table[k : k + n], atol=2e-5, rtol=0)
    # in float64 by hand, far out too
    far = by_hand(300 + k, d)
    torch.testing.assert_close(far[:300] @ M.double().T, far[k:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 5, 42])
def test_shift_matrix_is_a_rotation(k):
    d = 16
    M = sinusoidal_shift_matrix(k, d).double()
    torch.testing.assert_close(M @ M.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.linalg.det(M).item() == pytest.approx(1.0, abs=1e-5)  # a rotation, not a reflection
    # block diagonal: each 2x2 block acts on one (sin, cos) pair only
    mask = torch.block_diag(*[torch.ones(2, 2)] * (d // 2)).bool()
    assert bool((M[~mask] == 0).all())
    # shifting by j then by k is shifting by j + k; by 0 is the identity
    torch.testing.assert_close(sinusoidal_shift_matrix(3, d) @ sinusoidal_shift_matrix(k, d),
                               sinusoidal_shift_matrix(3 + k, d), atol=1e-6, rtol=0)
    torch.testing.assert_close(sinusoidal_shift_matrix(0, d), torch.eye(d))


def test_shift_matrix_bad_size_raises():
    with pytest.raises(ValueError, match="d must be even.*got 5"):
        sinusoidal_shift_matrix(1, 5)


@pytest.mark.parametrize("n, d, match", [
    (4, 3, "d must be even.*got 3"),
    (4, 7, "d must be even.*got 7"),
    (0, 4, "n must be a positive int, got 0"),
    (-2, 4, "n must be a positive int, got -2"),
    (4, 0, "d must be a positive int, got 0"),
    (4.0, 4, "n must be a positive int, got 4.0"),
    (True, 4, "n must be a positive int, got True"),
])
def test_sinusoidal_bad_sizes_raise(n, d, match):
    with pytest.raises(ValueError, match=match):
        sinusoidal_encoding(n, d)


# ---------------------------------------------------------------------------------------------
# SinusoidalPositions


def test_sinusoidal_positions_adds_the_table():
    layer = SinusoidalPositions(16)
    assert sum(p.numel() for p in layer.parameters()) == 0
    x = torch.randn(2, 7, 16)
    torch.testing.assert_close(layer(x), x + sinusoidal_encoding(7, 16))
    assert torch.equal(layer(torch.zeros(1, 7, 16))[0], sinusoidal_encoding(7, 16))


@pytest.mark.parametrize("start, T", [(0, 1), (3, 4), (10, 1), (999, 5), (5000, 3)])
def test_sinusoidal_positions_with_start_offset(start, T):
    layer = SinusoidalPositions(8, max_len=6000)
    x = torch.randn(2, T, 8)
    torch.testing.assert_close(layer(x, start=start), x + sinusoidal_encoding(start + T, 8)[start:])


def test_sinusoidal_positions_are_precomputed_and_raise_past_max_len():
    """The table is computed once in __init__; forward never grows a buffer (it used to, inside forward)."""
    layer = SinusoidalPositions(8, max_len=3000)
    table = layer.table
    long = layer(torch.zeros(1, 3000, 8))
    assert layer.table is table and table.shape == (3000, 8)
    torch.testing.assert_close(long[0], sinusoidal_encoding(3000, 8))
    with pytest.raises(ValueError, match=r"positions up to 3000 requested.*0\.\.2999.*max_len=3001"):
        layer(torch.zeros(1, 1, 8), start=3000)
    assert SinusoidalPositions(8).max_len == 1024
    # decoding one token at a time equals the whole sequence at once
    steps = torch.cat([layer(torch.zeros(1, 1, 8), start=p) for p in range(20)], dim=1)
    torch.testing.assert_close(steps, layer(torch.zeros(1, 20, 8)))
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        SinusoidalPositions(8, max_len=0)


def test_sinusoidal_positions_keeps_dtype_and_is_not_saved():
    layer = SinusoidalPositions(8)
    assert layer(torch.zeros(1, 3, 8, dtype=torch.float64)).dtype == torch.float64
    assert layer.state_dict() == {}


@pytest.mark.parametrize("d_model", [7, 0, -2])
def test_sinusoidal_positions_bad_width_raises(d_model):
    with pytest.raises(ValueError, match=f"d_model must be.*got {d_model}"):
        SinusoidalPositions(d_model)


# ---------------------------------------------------------------------------------------------
# LearnedPositions


def test_learned_positions_adds_its_rows():
    torch.manual_seed(0)
    layer = LearnedPositions(10, 6)
    assert layer.max_len == 10 and layer.table.shape == (10, 6)
    assert sum(p.numel() for p in layer.parameters()) == 60
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(layer(x), x + layer.table[:4])
    torch.testing.assert_close(layer(x, start=6), x + layer.table[6:10])
    layer(x).sum().backward()
    assert torch.equal(layer.table.grad[:4], torch.full((4, 6), 3.0))  # each row added to 3 sequences
    assert torch.equal(layer.table.grad[4:], torch.zeros(6, 6))


@pytest.mark.parametrize("start, T, last", [(0, 11, 10), (8, 3, 10), (10, 1, 10), (0, 40, 39)])
def test_learned_positions_beyond_the_table_raise(start, T, last):
    layer = LearnedPositions(10, 6)
    with pytest.raises(ValueError, match=rf"positions up to {last}.*0\.\.9.*extend.*interpolate"):
        layer(torch.randn(2, T, 6), start=start)


def test_learned_positions_extend_keeps_old_rows():
    torch.manual_seed(0)
    layer = LearnedPositions(5, 4)
    old = layer.table.detach().clone()
    layer.extend(12)
    assert layer.max_len == 12 and layer.table.shape == (12, 4)
    assert isinstance(layer.table, torch.nn.Parameter) and layer.table.requires_grad
    assert torch.equal(layer.table[:5], old)
    assert not torch.equal(layer.table[5:], torch.zeros(7, 4))  # new rows, initialised like the table
    assert layer.table[5:].abs().max() < 0.2
    x = torch.zeros(1, 12, 4)
    torch.testing.assert_close(layer(x)[0], layer.table.detach())
    assert "table" in dict(layer.named_parameters())


@pytest.mark.parametrize("new_max_len", [5, 3])
def test_learned_positions_extend_must_grow(new_max_len):
    layer = LearnedPositions(5, 4)
    with pytest.raises(ValueError, match=f"new_max_len={new_max_len}.*current 5"):
        layer.extend(new_max_len)


@pytest.mark.parametrize("max_len, d_model, match", [(0, 4, "max_len"), (4, 0, "d_model"), (2.5, 4, "max_len")])
def test_learned_positions_bad_sizes_raise(max_len, d_model, match):
    with pytest.raises(ValueError, match=match):
        LearnedPositions(max_len, d_model)


# ---------------------------------------------------------------------------------------------
# interpolate_grid


@pytest.mark.parametrize("grid", [(1, 1), (2, 3), (4, 4), (7, 5)])
def test_interpolate_grid_is_identity_when_unchanged(grid):
    table = torch.randn(grid[0] * grid[1], 6)
    torch.testing.assert_close(interpolate_grid(table, grid, grid), table, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("old, new", [((2, 2), (4, 4)), ((3, 4), (6, 5)), ((4, 4), (2, 2)), ((14, 14), (24, 24))])
def test_interpolate_grid_output_shape(old, new):
    out = interpolate_grid(torch.randn(old[0] * old[1], 8), old, new)
    assert out.shape == (new[0] * new[1], 8)


def test_interpolate_grid_preserves_constant_tables():
    table = torch.full((9, 3), 0.7)
    torch.testing.assert_close(interpolate_grid(table, (3, 3), (7, 5)), torch.full((35, 3), 0.7))


def test_interpolate_grid_of_a_linear_function():
    """A table linear in (row, col) is resized to approximately the same linear function on the new grid.

    With ``align_corners=False`` a new cell (R, C) sits at old coordinates
    ``r = (R + 0.5) h / H - 0.5``, ``c = (C + 0.5) w / W - 0.5``. PyTorch's bicubic kernel
    (Keys, a = -0.75) reproduces constants exactly and linear functions up to a small ripple; cells
    near the border also see the clamped edge.
    """
    h, w, H, W = 6, 8, 12, 16

    def f(r, c):  # two features, each a + b row + c col
        return torch.stack([0.3 + 0.5 * r - 0.2 * c, -1.0 + 0.1 * r + 0.4 * c], dim=-1)

    rows, cols = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    table = f(rows, cols).reshape(h * w, 2)  # row r * w + c holds patch (r, c)
    out = interpolate_grid(table, (h, w), (H, W)).reshape(H, W, 2)
    R, C = torch.meshgrid(torch.arange(H).float(), torch.arange(W).float(), indexing="ij")
    expected = f((R + 0.5) * h / H - 0.5, (C + 0.5) * w / W - 0.5)
    spread = expected.amax((0, 1)) - expected.amin((0, 1))  # range of each feature over the grid: ~4
    error = (out - expected).abs()
    assert bool((error[2:-2, 2:-2].amax((0, 1)) < 0.02 * spread).all())  # interior: within 2 % of the range
    assert bool((error.amax((0, 1)) < 0.05 * spread).all())  # border too, within 5 %
    # the same function sampled at the new positions, far closer than the old table placed naively
    naive = f(R, C)  # pretending the new grid's cells are the old ones
    assert (out - naive).abs().mean() > 10 * error.mean()


def test_interpolate_grid_keeps_features_separate():
    """Each feature is interpolated on its own (features are the image channels)."""
    table = torch.randn(16, 5)
    out = interpolate_grid(table, (4, 4), (6, 6))
    for j in range(5):
        torch.testing.assert_close(interpolate_grid(table[:, j : j + 1], (4, 4), (6, 6))[:, 0], out[:, j])


def test_interpolate_grid_layout_is_row_major():
    """Row r * w + c of the table is patch (r, c): a table that varies only along rows stays so."""
    h, w = 3, 5
    table = torch.arange(h).float().repeat_interleave(w)[:, None]  # value = row index
    out = interpolate_grid(table, (h, w), (6, 4)).reshape(6, 4)
    torch.testing.assert_close(out, out[:, :1].expand(6, 4))  # constant along each new row
    assert bool((out[1:, 0] >= out[:-1, 0]).all())  # increasing down the rows


@pytest.mark.parametrize("table_shape, old, match", [
    ((15, 4), (4, 4), r"\(16, d\).*\(4, 4\).*\(15, 4\)"),
    ((16,), (4, 4), r"\(16,\)"),
    ((1, 16, 4), (4, 4), r"\(1, 16, 4\)"),
    ((12, 4), (4, 4), r"\(12, 4\)"),
])
def test_interpolate_grid_bad_table_shapes_raise(table_shape, old, match):
    with pytest.raises(ValueError, match=match):
        interpolate_grid(torch.randn(table_shape), old, (6, 6))


@pytest.mark.parametrize("new", [(0, 4), (4, -1)])
def test_interpolate_grid_bad_new_grid_raises(new):
    with pytest.raises(ValueError, match="new_grid must be positive"):
        interpolate_grid(torch.randn(16, 4), (4, 4), new)


# ---------------------------------------------------------------------------------------------
# RoPE


def rotate_by_hand(x, p, base=10000.0):
    """Rotate each pair (x[2i], x[2i+1]) by p * base^(-2i/dim), in float64."""
    out = x.double().clone()
    dim = x.shape[-1]
    for i in range(dim // 2):
        angle = p * base ** (-2 * i / dim)
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[..., 2 * i].double(), x[..., 2 * i + 1].double()
        out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("start", [0, 1, 7])
def test_apply_rope_matches_hand_rotation(start):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)  # (B, h, T, dim)
    rotated = apply_rope(x, start)
    assert rotated.shape == x.shape and rotated.dtype == x.dtype
    for t in range(5):
        torch.testing.assert_close(rotated[..., t, :].double(), rotate_by_hand(x[..., t, :], start + t),
                                   atol=1e-5, rtol=1e-5)


def test_apply_rope_is_identity_at_position_zero():
    x = torch.randn(4, 1, 16)
    assert torch.equal(apply_rope(x, 0), x)


@pytest.mark.parametrize("start", [0, 3, 1000])
def test_apply_rope_preserves_norms(start):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 10, 32)
    torch.testing.assert_close(apply_rope(x, start).norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [2, 8, 64])
@pytest.mark.parametrize("p, r", [(0, 0), (3, 1), (1, 3), (10, 4), (7, 7)])
@pytest.mark.parametrize("shift", [1, 5, 100])
def test_rope_score_depends_on_relative_position_only(dim, p, r, shift):
    """dot(RoPE(q at p), RoPE(k at r)) is the same for (p, r) and (p + s, r + s)."""
    g = torch.Generator().manual_seed(dim * 1000 + p * 10 + r)
    q, k = torch.randn(1, dim, generator=g), torch.randn(1, dim, generator=g)
    score = (apply_rope(q, p) * apply_rope(k, r)).sum()
    shifted = (apply_rope(q, p + shift) * apply_rope(k, r + shift)).sum()
    assert shifted.item() == pytest.approx(score.item(), abs=1e-4 * math.sqrt(dim))
    # and it does depend on p - r (else RoPE would carry no position at all)
    if dim > 2 and p != r:
        other = (apply_rope(q, p + 1) * apply_rope(k, r)).sum()
        assert abs(other.item() - score.item()) > 1e-4


def test_rope_scores_form_a_toeplitz_matrix():
    """For a constant query and key at every position, the score matrix q_p . k_r is constant along diagonals."""
    torch.manual_seed(0)
    T, dim = 12, 16
    q, k = torch.randn(dim).expand(T, dim), torch.randn(dim).expand(T, dim)
    scores = apply_rope(q) @ apply_rope(k).T  # (T, T)
    for offset in range(-T + 1, T):
        diagonal = scores.diagonal(offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-4, rtol=1e-4)


def test_apply_rope_with_start_equals_slice_of_full():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 8)
    full = apply_rope(x)
    torch.testing.assert_close(apply_rope(x[:, 4:], start=4), full[:, 4:])
    steps = torch.cat([apply_rope(x[:, t : t + 1], start=t) for t in range(10)], dim=1)
    torch.testing.assert_close(steps, full)


def test_rope_angles():
    angles = rope_angles(torch.arange(3), 4)
    expected = torch.tensor([[0.0, 0.0], [1.0, 0.01], [2.0, 0.02]])
    torch.testing.assert_close(angles, expected)


@pytest.mark.parametrize("dim", [3, 5])
def test_apply_rope_odd_dim_raises(dim):
    with pytest.raises(ValueError, match=f"dim must be even.*got {dim}"):
        apply_rope(torch.randn(2, 4, dim))


@pytest.mark.parametrize("layer", [SinusoidalPositions(8), LearnedPositions(10, 8)], ids=["sinusoidal", "learned"])
def test_positions_bad_inputs_raise(layer):
    with pytest.raises(ValueError, match=r"d_model=8.*\(2, 3, 6\)"):
        layer(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"\(3, 8\)"):  # missing the batch dimension
        layer(torch.randn(3, 8))
    with pytest.raises(ValueError, match="start must be a non-negative position, got -1"):
        layer(torch.randn(2, 3, 8), start=-1)


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_interpolate_grid_modes_are_torch_s_resize_of_the_grid(mode):
    table = torch.randn(12, 5)  # a 3 x 4 grid of 5 features
    corners = None if mode == "nearest" else False
    image = table.T.reshape(1, 5, 3, 4)
    expected = F.interpolate(image, size=(6, 8), mode=mode, align_corners=corners)
    torch.testing.assert_close(
        interpolate_grid(table, (3, 4), (6, 8), mode), expected.reshape(5, 48).T
    )


def test_interpolate_grid_nearest_at_twice_the_side_copies_each_parent_row():
    table = torch.randn(16, 3)
    out = interpolate_grid(table, (4, 4), (8, 8), "nearest")
    rows, cols = torch.arange(64) // 8, torch.arange(64) % 8
    torch.testing.assert_close(out, table[(rows // 2) * 4 + cols // 2], rtol=0, atol=0)


def test_interpolate_grid_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        interpolate_grid(torch.randn(4, 2), (2, 2), (4, 4), "area")


# ---- rope_scores (distances capped, as ReRoPE) and log-length scaling


def test_rope_scores_without_cap_is_plain_rope():
    q, k = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    plain = apply_rope(q) @ apply_rope(k).transpose(-1, -2)
    torch.testing.assert_close(attnbook.rope_scores(q, k), plain)
    # a cap at the longest distance (T - 1) or beyond changes nothing
    torch.testing.assert_close(attnbook.rope_scores(q, k, max_distance=6), plain)


@pytest.mark.parametrize("cap", [1, 3])
def test_rope_scores_treats_far_distances_as_the_cap(cap):
    T, dim = 9, 8
    q, k = torch.randn(T, dim), torch.randn(T, dim)
    scores = attnbook.rope_scores(q, k, max_distance=cap)
    plain = attnbook.rope_scores(q, k)
    for i in range(T):
        for j in range(T):
            if i - j > cap:  # as if query i stood cap positions after key j
                q_moved = apply_rope(q[i : i + 1], j + cap)
                expected = (q_moved * apply_rope(k[j : j + 1], j)).sum()
                torch.testing.assert_close(scores[i, j], expected, atol=1e-5, rtol=1e-5)
                assert not torch.isclose(scores[i, j], plain[i, j], atol=1e-3)
            else:  # near keys and future keys: plain RoPE
                assert scores[i, j] == plain[i, j]


def test_rope_scores_rejects_bad_inputs():
    q = torch.randn(4, 8)
    with pytest.raises(ValueError, match="same shape"):
        attnbook.rope_scores(q, torch.randn(5, 8))
    with pytest.raises(ValueError, match="even dim"):
        attnbook.rope_scores(torch.randn(4, 7), torch.randn(4, 7))
    with pytest.raises(ValueError, match="max_distance"):
        attnbook.rope_scores(q, q, max_distance=0)


def test_log_length_scale_by_hand_and_as_qwen_writes_it():
    factors = attnbook.log_length_scale(6, 4)
    expected = [1, 1, 1, 1, math.log(5) / math.log(4), math.log(6) / math.log(4)]
    torch.testing.assert_close(factors, torch.tensor(expected, dtype=torch.float32))
    # Qwen's list, indexed by the 1-based position
    qwen = [math.log(i, 32) if i > 32 else 1 for i in range(1, 300)]
    torch.testing.assert_close(
        attnbook.log_length_scale(299, 32), torch.tensor(qwen, dtype=torch.float32)
    )


@pytest.mark.parametrize(
    "length, trained, match",
    [(0, 4, "length"), (4, 1, "trained_length"), (4.5, 4, "length")],
)
def test_log_length_scale_rejects_bad_sizes(length, trained, match):
    with pytest.raises((ValueError, TypeError), match=match):
        attnbook.log_length_scale(length, trained)
