"""Position information: the sinusoidal encoding, a learned table, 2D interpolation of a
grid, RoPE (and its scalings for longer inputs: linear interpolation, NTK-aware, YaRN)
and ALiBi's distance bias.

Attention alone is permutation-equivariant (a bag of tokens); these give each token its
position. Shapes: token embeddings ``(B, T, d)``; position tables ``(T, d)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .masks import key_minus_query, sliding_window_mask
from .utils import check_positive_int


def _check_size(name: str, value, *, even: bool = False) -> int:
    value = check_positive_int(name, value)
    if even and value % 2:
        raise ValueError(f"{name} must be even (sin/cos pairs), got {value}")
    return value


def sinusoidal_encoding(n: int, d: int, base: float = 10000.0) -> torch.Tensor:
    """``(n, d)`` table with ``PE[p, 2i] = sin(p / base^(2i/d))`` and ``PE[p, 2i+1] =
    cos(p / base^(2i/d))``."""
    _check_size("n", n)
    _check_size("d", d, even=True)
    position = torch.arange(n, dtype=torch.float64)[:, None]  # (n, 1)
    # (d/2,) = 1 / base^(2i/d)
    frequency = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.empty(n, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table.float()


def _add_rows(table, x: torch.Tensor, start, has: str, remedy: str) -> torch.Tensor:
    """``x (B, T, d)`` plus ``table``'s rows for positions ``start .. start + T - 1``
    (``start`` a ``(B, T)`` tensor: each token's own position); a position past the
    table raises, saying what the table ``has`` and the ``remedy`` (``{end}``: the
    length asked for)."""
    _check_positions_input(x, start, table.shape[1])
    if isinstance(start, torch.Tensor):
        return x + table[start].to(x.dtype)  # (B, T, d)
    end = start + x.shape[1]
    if end > table.shape[0]:
        raise ValueError(
            f"positions up to {end - 1} requested but {has} 0..{table.shape[0] - 1}; "
            + remedy.format(end=end)
        )
    return x + table[start:end].to(x.dtype)  # (B, T, d)


def _check_positions_input(x: torch.Tensor, start, d_model: int) -> None:
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(
            f"x must be (B, T, d_model={d_model}), got shape {tuple(x.shape)}"
        )
    if isinstance(start, torch.Tensor):  # each token's own position
        if start.shape != x.shape[:2] or start.is_floating_point():
            raise ValueError(
                f"positions must be a (B, T) = {tuple(x.shape[:2])} integer tensor, "
                f"got {start.dtype} {tuple(start.shape)}"
            )
    elif start < 0:
        raise ValueError(f"start must be a non-negative position, got {start!r}")


class SinusoidalPositions(nn.Module):
    """Adds the sinusoidal encoding to ``x (B, T, d)``; no parameters.

    The table is computed once for positions ``0 .. max_len - 1``; a longer input raises
    (the formula covers any position: build the module with a larger ``max_len``)."""

    def __init__(self, d_model: int, max_len: int = 1024):
        super().__init__()
        self.d_model = _check_size("d_model", d_model, even=True)
        self.register_buffer(
            "table",
            sinusoidal_encoding(_check_size("max_len", max_len), d_model),
            persistent=False,
        )

    @property
    def max_len(self) -> int:
        return self.table.shape[0]

    def forward(self, x: torch.Tensor, start=0) -> torch.Tensor:
        """``x (B, T, d)`` plus the encoding of positions ``start .. start + T - 1``
        (``start`` may be a ``(B, T)`` tensor: each token's position)."""
        remedy = "build SinusoidalPositions(d_model, max_len={end}) or more"
        return _add_rows(self.table, x, start, "this table was computed for", remedy)


class LearnedPositions(nn.Module):
    """A learned table with one row per position ``0 .. max_len - 1``, added to ``x (B,
    T, d)``.

    It has no row for a position beyond ``max_len``: use :meth:`extend` (new rows, to be
    trained) or :func:`interpolate_grid` (for a 2D grid of patches) to serve longer
    inputs.
    """

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        _check_size("max_len", max_len)
        _check_size("d_model", d_model)
        self.table = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    @property
    def max_len(self) -> int:
        return self.table.shape[0]

    def forward(self, x: torch.Tensor, start=0) -> torch.Tensor:
        """``x (B, T, d)`` plus the rows of positions ``start .. start + T - 1``
        (``start`` may be a ``(B, T)`` tensor: each token's position)."""
        remedy = (
            "extend the table (LearnedPositions.extend) or interpolate it "
            "(interpolate_grid)"
        )
        has = "the learned table has rows only for"
        return _add_rows(self.table, x, start, has, remedy)

    @torch.no_grad()
    def extend(self, new_max_len: int) -> None:
        """Add rows up to ``new_max_len`` (initialised like the table; they must be
        trained)."""
        if new_max_len <= self.max_len:
            raise ValueError(
                f"new_max_len={new_max_len} must exceed the current {self.max_len}"
            )
        extra = (
            torch.randn(
                new_max_len - self.max_len,
                self.table.shape[1],
                device=self.table.device,
            )
            * 0.02
        )
        self.table = nn.Parameter(
            torch.cat([self.table.data, extra.to(self.table.dtype)])
        )


GRID_MODES = ("nearest", "bilinear", "bicubic")


def interpolate_grid(
    table: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    mode: str = "bicubic",
) -> torch.Tensor:
    """Resize a learned position table of a 2D patch grid, ``(h*w, d)`` -> ``(H*W, d)``,
    bicubically (or ``mode="nearest"``, ``"bilinear"``).

    Row ``r * w + c`` holds the position of the patch in row ``r``, column ``c`` (as ViT
    lays patches out). Used to fine-tune a ViT at a higher resolution. Pixel centres are
    aligned as ``F.interpolate(..., align_corners=False)`` aligns them.
    """
    h, w = old_grid
    H, W = new_grid
    if table.dim() != 2 or table.shape[0] != h * w:
        raise ValueError(
            f"table must be (h*w, d) = ({h * w}, d) for grid {old_grid}, got "
            f"{tuple(table.shape)}"
        )
    if H < 1 or W < 1:
        raise ValueError(f"new_grid must be positive, got {new_grid}")
    if mode not in GRID_MODES:
        raise ValueError(f"mode must be one of {GRID_MODES}, got {mode!r}")
    d = table.shape[1]
    grid = table.T.reshape(1, d, h, w)  # (1, d, h, w): the features as image channels
    corners = None if mode == "nearest" else False  # nearest takes no align_corners
    # (1, d, H, W)
    resized = F.interpolate(grid, size=(H, W), mode=mode, align_corners=corners)
    return resized.reshape(d, H * W).T  # (H*W, d)


ROPE_SCALINGS = ("linear", "ntk", "yarn")


def _check_rope_scaling(scale, method, original_length):
    """Validate RoPE's scaling arguments; return ``(scale, original_length)``."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not 1.0 <= scale < float("inf")
    ):
        raise ValueError(
            "scale must be a finite number >= 1 (1 = no scaling; 4 = a context four "
            "times the "
            f"trained one), got {scale!r}"
        )
    if method not in ROPE_SCALINGS:
        raise ValueError(f"method must be one of {ROPE_SCALINGS}, got {method!r}")
    if original_length is not None:
        original_length = check_positive_int("original_length", original_length)
    if method == "yarn" and scale != 1.0 and original_length is None:
        raise ValueError(
            "method='yarn' needs original_length, the context length the model was "
            "trained at"
        )
    return float(scale), original_length


def yarn_ramp(
    ratio: torch.Tensor, alpha: float = 1.0, beta: float = 32.0
) -> torch.Tensor:
    """YaRN's ramp ``gamma(r)``: 0 for ``r < alpha``, 1 for ``r > beta``, linear in
    between.

    ``r = original_length / wavelength`` is how many turns a pair makes within the
    trained context: ``gamma = 1`` keeps its frequency, ``gamma = 0`` interpolates it
    fully (divides it by the scale)."""
    return ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)


def yarn_attention_factor(scale: float) -> float:
    """YaRN's attention temperature as a factor on queries and keys: ``0.1 ln(scale) +
    1`` (each of ``q`` and ``k`` is multiplied by it, so the scores are multiplied by
    its square)."""
    scale, _ = _check_rope_scaling(scale, "linear", None)
    return 0.1 * math.log(scale) + 1.0


def rope_angles(
    positions: torch.Tensor,
    dim: int,
    base: float = 10000.0,
    *,
    scale: float = 1.0,
    method: str = "linear",
    original_length: int | None = None,
) -> torch.Tensor:
    """Rotation angles ``positions[:, None] * theta_i`` with ``theta_i =
    base^(-2i/dim)``: ``(T, dim/2)``.

    ``scale > 1`` stretches RoPE for inputs ``scale`` times longer than the trained
    ``original_length``:

    - ``"linear"`` (position interpolation, Chen et al. 2023): the angles at position
      ``p`` are the unscaled ones at ``p / scale``;
    - ``"ntk"`` (NTK-aware, bloc97 2023): the base becomes ``base * scale^(dim / (dim -
      2))``, so the fastest pair is unchanged and the slowest is interpolated by
      ``scale``;
    - ``"yarn"`` (Peng et al. 2023): per pair, ``theta_i' = (1 - g) theta_i / scale + g
      theta_i`` with ``g = yarn_ramp(original_length / wavelength_i)``: pairs that turn
      more than 32 times within the trained length keep their frequency, those that turn
      less than once are interpolated. (Its attention temperature is applied by
      :func:`apply_rope`.)

    ``scale=1.0`` is plain RoPE for every method.
    """
    _check_size("dim", dim, even=True)
    scale, original_length = _check_rope_scaling(scale, method, original_length)
    theta = base ** (
        -torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
    )
    if scale == 1.0:
        return positions.float()[:, None] * theta  # (T, dim/2)
    if method == "linear":
        # (T, dim/2): position p -> p / scale
        return (positions.float() / scale)[:, None] * theta
    if method == "ntk":
        if dim == 2:  # the one pair turns at frequency 1 whatever the base
            return positions.float()[:, None] * theta
        ntk_base = base * scale ** (dim / (dim - 2))
        theta = ntk_base ** (
            -torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
        )
        return positions.float()[:, None] * theta  # (T, dim/2)
    # (dim/2,) = original_length / wavelength
    turns = original_length * theta / (2 * math.pi)
    keep = yarn_ramp(turns)  # (dim/2,): 1 = keep the frequency, 0 = interpolate it
    theta = (1 - keep) * theta / scale + keep * theta
    return positions.float()[:, None] * theta  # (T, dim/2)


def apply_rope(
    x: torch.Tensor,
    start: int = 0,
    base: float = 10000.0,
    *,
    scale: float = 1.0,
    method: str = "linear",
    original_length: int | None = None,
) -> torch.Tensor:
    """Rotary position embedding: rotate each pair ``(x[2i], x[2i+1])`` of ``x (..., T,
    dim)`` by ``p * theta_i`` for the token at position ``p = start + t``.

    Applied to queries and keys, it makes ``q_p . k_r`` depend on ``p - r`` only.
    ``scale``, ``method`` and ``original_length`` stretch the angles as in
    :func:`rope_angles`; with ``method="yarn"`` and ``scale > 1`` the result is also
    multiplied by
    :func:`yarn_attention_factor` (applied to queries and keys, it sharpens the
    softmax).
    """
    T, dim = x.shape[-2], x.shape[-1]
    angles = rope_angles(
        torch.arange(start, start + T, device=x.device),
        dim,
        base,
        scale=scale,
        method=method,
        original_length=original_length,
    )  # (T, dim/2)
    cos, sin = angles.cos(), angles.sin()
    if method == "yarn" and scale != 1.0:
        factor = yarn_attention_factor(scale)
        cos, sin = cos * factor, sin * factor
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]  # (..., T, dim/2) each
    # (..., T, dim/2, 2)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2)  # (..., T, dim)


class Rotary(nn.Module):
    """RoPE as a module: :func:`apply_rope` with its ``base`` and its scaling for
    inputs longer than the trained length, held in one place. No parameters.

    ``forward(x (..., T, dim), start=0)`` rotates ``x``'s tokens as positions ``start
    ..``. :meth:`set_scaling` (``scale``, ``method``, ``original_length`` as in
    :func:`rope_angles`) stretches every later rotation; ``scale=1.0`` (the default)
    is plain RoPE."""

    def __init__(self, base: float = 10000.0):
        super().__init__()
        if (
            isinstance(base, bool)
            or not isinstance(base, (int, float))
            or not 1 < base < float("inf")
        ):
            raise ValueError(f"rope_base must be a number > 1, got {base!r}")
        self.base = float(base)
        self.scale, self.method, self.original_length = 1.0, "linear", None

    def set_scaling(
        self,
        scale: float = 1.0,
        method: str = "linear",
        original_length: int | None = None,
    ) -> Rotary:
        """Rotate with RoPE scaled by ``scale`` with ``method`` from now on."""
        self.scale, self.original_length = _check_rope_scaling(
            scale, method, original_length
        )
        self.method = method
        return self

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        scaling = dict(
            scale=self.scale, method=self.method, original_length=self.original_length
        )
        return apply_rope(x, start, self.base, **scaling)  # (..., T, dim)

    def inverse(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Undo :meth:`forward`: ``x (..., T, dim)``, rotated as positions ``start ..``,
        turned back to what it was before RoPE. Mirroring each pair, ``(a, b) -> (a,
        -b)``, rotating it and mirroring it again turns it by minus its angle; YaRN's
        factor, applied twice that way, is divided out."""
        mirror = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        mirror[1::2] = -1
        back = self(x * mirror, start) * mirror  # (..., T, dim)
        if self.method == "yarn" and self.scale != 1.0:
            back = back / yarn_attention_factor(self.scale) ** 2
        return back

    def extra_repr(self) -> str:
        scaled = "" if self.scale == 1.0 else f", scale={self.scale}, {self.method}"
        return f"base={self.base}{scaled}"


def scale_rope(
    model: nn.Module,
    scale: float = 1.0,
    method: str = "linear",
    original_length: int | None = None,
) -> nn.Module:
    """Stretch the RoPE of every :class:`Rotary` in ``model`` (see
    :meth:`Rotary.set_scaling`; ``scale=1.0`` undoes it); returns ``model``. A model
    without RoPE raises."""
    rotaries = [module for module in model.modules() if isinstance(module, Rotary)]
    if not rotaries:
        raise ValueError(
            f"set_rope_scaling needs a model with RoPE (positions='rope'), "
            f"{type(model).__name__} has none"
        )
    for rotary in rotaries:
        rotary.set_scaling(scale, method, original_length)
    return model


def rope_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    max_distance: int | None = None,
    base: float = 10000.0,
) -> torch.Tensor:
    """RoPE's scores ``q_i . k_j`` (not divided by sqrt(dim)): ``(..., T, T)`` for the
    queries and keys ``(..., T, dim)`` of one sequence, from position 0.

    With ``max_distance``, every distance ``i - j`` beyond it is scored as if it were
    ``max_distance`` (the idea of Su's ReRoPE, 2023): no query meets a distance larger
    than one it was trained on, yet every key stays in the softmax. ``None`` is plain
    RoPE. Entries above the diagonal (future keys) are plain RoPE's; a causal mask
    hides them.
    """
    _check_qk_pair(q, k)
    near = apply_rope(q, base=base) @ apply_rope(k, base=base).transpose(-1, -2)
    if max_distance is None:
        return near
    max_distance = check_positive_int("max_distance", max_distance)
    # every query rotated to position max_distance, every key left at position 0
    at_cap = apply_rope(q.unsqueeze(-2), max_distance, base).squeeze(-2)
    far = at_cap @ k.transpose(-1, -2)  # (..., T, T): distance max_distance
    T = q.shape[-2]
    positions = torch.arange(T, device=q.device)
    beyond = positions[:, None] - positions[None, :] > max_distance  # (T, T): i - j
    return torch.where(beyond, far, near)


def _check_qk_pair(q, k) -> None:
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] % 2:
            raise ValueError(
                f"{name} must be a tensor (..., T, dim) with an even dim, got "
                f"{getattr(x, 'shape', type(x).__name__)}"
            )
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape (one sequence), got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )


def log_length_scale(length: int, trained_length: int) -> torch.Tensor:
    """Log-length scaling of the queries (Chiang and Cholak 2022; Qwen's "logn"
    attention): ``(length,)`` factors ``max(1, log(p + 1) / log(trained_length))`` for
    the positions ``p = 0 .. length - 1``.

    A causal query at position ``p`` sees ``p + 1`` keys; multiplying its scores by
    the factor keeps a softmax over more keys about as peaked as over
    ``trained_length`` (1 within the trained length)."""
    length = check_positive_int("length", length)
    trained_length = check_positive_int("trained_length", trained_length)
    if trained_length < 2:
        raise ValueError(f"trained_length must be at least 2, got {trained_length}")
    keys_seen = torch.arange(1, length + 1, dtype=torch.float64)
    factors = (keys_seen.log() / math.log(trained_length)).clamp(min=1.0)
    return factors.float()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes ``(num_heads,)`` (Press et al. 2022): for ``h`` a power
    of two the geometric sequence ``2^(-8/h), 2^(-16/h), ..., 2^(-8)`` (1/2, 1/4, ...,
    1/256 for 8 heads); otherwise the slopes of the power of two ``n`` just below ``h``,
    then every other slope of ``2n`` for the rest."""
    num_heads = check_positive_int("num_heads", num_heads)

    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(
    num_heads: int, query_len: int, key_len: int, *, device=None
) -> torch.Tensor:
    """ALiBi's additive bias ``-m_h (i - j)``: ``(num_heads, query_len, key_len)``
    float32, for query ``i`` and key ``j`` with :func:`alibi_slopes` ``m_h``.

    The queries are the last ``query_len`` of the ``key_len`` tokens (aligned to the
    bottom right, as ``is_causal`` and a KV cache): query row ``t`` is token ``key_len -
    query_len + t``. The bias is 0 on the diagonal and falls linearly with the distance
    into the past; it is meant for causal attention (above the diagonal it is positive
    and must be blocked by the causal mask). Added to the scores (as a float mask
    ``bias[None]`` of shape ``(1, h, Tq, Tk)``), it replaces any position embedding.
    """
    slopes = alibi_slopes(num_heads).to(device)  # (h,)
    query_len, key_len = (
        check_positive_int("query_len", query_len),
        check_positive_int("key_len", key_len),
    )
    offset = key_minus_query(query_len, key_len, device=device)  # (Tq, Tk): j - i
    # (h, Tq, Tk) = -m_h (i - j), 0 (not -0) on the diagonal
    return slopes[:, None, None] * offset.float()


def decoder_attention_mask(
    query_len: int,
    key_len: int,
    *,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_heads: int | None = None,
    device=None,
):
    """The mask a decoder's layers add to causal attention for ``query_len`` new
    queries over ``key_len`` keys (aligned to the bottom right): ``None`` (causal
    attention alone), with ``window`` the bool :func:`~attnbook.masks.
    sliding_window_mask` (``sink_tokens`` of its keys attention sinks), with
    ``alibi_heads`` ALiBi's bias ``(1, h, Tq, Tk)``, or the bias at ``-inf`` outside
    the window."""
    if window is None and alibi_heads is None:
        return None
    mask = None
    if window is not None:  # (Tq, Tk) bool
        mask = sliding_window_mask(
            query_len, key_len, window, sink_tokens=sink_tokens, device=device
        )
    if alibi_heads is None:
        return mask
    bias = alibi_bias(alibi_heads, query_len, key_len, device=device)[None]
    return bias if mask is None else bias.masked_fill(mask, float("-inf"))


def sinusoidal_shift_matrix(k: int, d: int, base: float = 10000.0) -> torch.Tensor:
    """The fixed ``(d, d)`` block-rotation ``M_k`` with ``PE[p + k] = PE[p] @ M_k.T``
    for every ``p``."""
    _check_size("d", d, even=True)
    M = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        angle = k * base ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        M[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(
            [[c, s], [-s, c]], dtype=torch.float64
        )
    return M.float()


__all__ = [
    "LearnedPositions",
    "Rotary",
    "SinusoidalPositions",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "decoder_attention_mask",
    "interpolate_grid",
    "log_length_scale",
    "rope_angles",
    "rope_scores",
    "scale_rope",
    "sinusoidal_encoding",
    "sinusoidal_shift_matrix",
    "yarn_attention_factor",
    "yarn_ramp",
]
