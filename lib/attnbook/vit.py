"""The Vision Transformer (ViT): an image cut into patches, each patch a token.

- :class:`PatchEmbedding`: one ``Conv2d`` with kernel size = stride = ``p``; an ``H x
  W`` image gives ``(H / p)(W / p)`` tokens. :func:`patchify` cuts the same patches out
  by hand, to show that the convolution is "cut into patches, flatten, one linear
  layer".
- :class:`ViT`: patch tokens (+ a learned ``<cls>`` token), a learned position table,
  pre-norm encoder blocks, then the ``<cls>`` output (``pool="cls"``) or the mean of the
  patch outputs (``pool="mean"``) into a linear classifier. :meth:`ViT.resize` moves a
  trained model to another image size: its position table is interpolated in 2D
  (:func:`resize_position_table`, the ``<cls>`` row kept as is) or replaced by a fresh
  one; or, with ``patch_size=``, its patch embedding is resized to another patch size
  instead (FlexiViT's pseudo-inverse resize, :func:`resize_patch_kernel`), which keeps
  the patch grid.
- Positions: a learned table, none, or Beyer et al.'s fixed 2-D sin-cos table
  (:func:`sincos_table_2d`, :class:`SincosPositions2D`).
- :func:`attention_rollout`: how much each output token draws on each input token
  through every block (Abnar and Zuidema's rollout, the ViT paper's Figure 6).
- :class:`SmallResNet`: a small ResNet-style CNN, the baseline ViT is compared with.

The data (:func:`attnbook.data.load_mnist_5k`, :func:`attnbook.data.stratified_split`)
and the training loop (:func:`attnbook.train.train_classifier`,
:func:`attnbook.train.accuracy`) live in their own modules.

Shapes: images ``(B, C, H, W)``; tokens ``(B, N, d)`` with ``N = (H / p)(W / p)``
patches, plus one ``<cls>`` token in front when ``pool="cls"``; logits ``(B,
num_classes)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import stack_blocks
from .positions import LearnedPositions, interpolate_grid
from .utils import check_non_negative_int, check_positive_int, eval_mode

POOLS = ("cls", "mean")
POSITION_EMBEDDINGS = ("learned", "sincos", "none")


def _pair(name: str, value) -> tuple[int, int]:
    """``28 -> (28, 28)``; ``(28, 56)`` stays; anything else is an error naming
    ``name``."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return check_positive_int(f"{name} height", value[0]), check_positive_int(
            f"{name} width", value[1]
        )
    side = check_positive_int(name, value)
    return side, side


def patch_grid(image_size, patch_size: int) -> tuple[int, int]:
    """The grid of patches, ``(H / p, W / p)``, of an ``H x W`` image (``image_size`` is
    ``H`` or ``(H, W)``).

    Raises ``ValueError`` naming both sizes when a side is not a multiple of ``p``."""
    height, width = _pair("image_size", image_size)
    p = check_positive_int("patch_size", patch_size)
    if height % p or width % p:
        raise ValueError(
            f"image size {height}x{width} is not divisible by patch_size={p}: "
            f"every side must be a multiple of the patch size"
        )
    return height // p, width // p


def _check_images(images, in_channels: int | None = None) -> None:
    if (
        not isinstance(images, torch.Tensor)
        or images.dim() != 4
        or not images.is_floating_point()
    ):
        raise ValueError(
            f"images must be a float (B, C, H, W) tensor, got "
            f"{getattr(images, 'dtype', type(images).__name__)} "
            f"{tuple(getattr(images, 'shape', ()))}"
        )
    if in_channels is not None and images.shape[1] != in_channels:
        raise ValueError(
            f"images must have {in_channels} channel(s), got shape "
            f"{tuple(images.shape)}"
        )


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut ``images (B, C, H, W)`` into ``p x p`` patches, row by row: ``(B, N, C p
    p)``.

    Patch ``r * (W / p) + c`` is the one in patch row ``r``, column ``c``; each is
    flattened in the order ``(C, p, p)``, the layout of a ``Conv2d`` kernel."""
    _check_images(images)
    B, C, H, W = images.shape
    rows, cols = patch_grid((H, W), patch_size)
    p = patch_size
    x = images.reshape(B, C, rows, p, cols, p)  # (B, C, rows, p, cols, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, rows, cols, C, p, p)
    return x.reshape(B, rows * cols, C * p * p)  # (B, N, C p p)


class PatchEmbedding(nn.Module):
    """Patches to tokens: one ``Conv2d(in_channels, d_model, kernel_size=p, stride=p)``.

    ``forward(images (B, C, H, W)) -> (B, N, d_model)`` with ``N = (H / p)(W / p)``,
    patches row by row. The kernel never overlaps two patches, so this is the same as
    :func:`patchify` followed by one linear layer ``C p^2 -> d_model`` whose weight is
    the kernel flattened."""

    def __init__(self, patch_size: int, d_model: int, in_channels: int = 1):
        super().__init__()
        self.patch_size = check_positive_int("patch_size", patch_size)
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.d_model = check_positive_int("d_model", d_model)
        self.proj = nn.Conv2d(
            self.in_channels,
            self.d_model,
            kernel_size=self.patch_size,
            stride=self.patch_size,
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images, self.in_channels)
        # a clear error for a size that is not a multiple of p
        patch_grid(images.shape[-2:], self.patch_size)
        x = self.proj(images)  # (B, d, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (B, N, d)

    @torch.no_grad()
    def resize(self, patch_size: int, method: str = "pi") -> PatchEmbedding:
        """Embed patches of ``patch_size`` from now on: the kernel resized by
        :func:`resize_patch_kernel` (``method``), the bias kept. Returns ``self``."""
        weight = resize_patch_kernel(self.proj.weight, patch_size, method)
        p = weight.shape[-1]
        proj = nn.Conv2d(self.in_channels, self.d_model, kernel_size=p, stride=p)
        proj = proj.to(weight.device, weight.dtype)
        proj.weight.copy_(weight)
        proj.bias.copy_(self.proj.bias)
        self.proj, self.patch_size = proj, p
        return self


def _bilinear_resize_matrix(old: int, new: int, dtype=torch.float64) -> torch.Tensor:
    """``B (new^2, old^2)``: the bilinear resize of an ``old x old`` patch to ``new x
    new`` (``F.interpolate``, ``align_corners=False``) as a matrix, both flattened row
    by row: ``resize(x).flatten() == B @ x.flatten()``."""
    basis = torch.eye(old * old, dtype=dtype).reshape(old * old, 1, old, old)
    resized = F.interpolate(
        basis, size=(new, new), mode="bilinear", align_corners=False
    )  # (old^2, 1, new, new)
    return resized.reshape(old * old, new * new).T  # column j: the resized basis j


def resize_patch_kernel(
    weight: torch.Tensor, new_patch_size: int, method: str = "pi"
) -> torch.Tensor:
    """A patch embedding's kernel ``(d, C, p, p)`` for patches of ``new_patch_size``
    ``P``: ``(d, C, P, P)``.

    ``method="pi"`` is FlexiViT's pseudo-inverse resize: with ``B`` the bilinear resize
    of a ``p x p`` patch to ``P x P`` as a matrix, the new kernel is ``pinv(B^T) w``, so
    that a patch resized bilinearly gives the token the old patch gave, ``<B x, w_new>
    = <x, w>`` for every ``x`` when ``P >= p`` (a least-squares fit when ``P < p``).
    ``method="bilinear"`` resizes the kernel like an image, the naive way, which
    multiplies the tokens by about ``(P / p)^2``."""
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 4
        or (weight.shape[-1] != weight.shape[-2])
    ):
        raise ValueError(
            "weight must be a (d, C, p, p) patch kernel, got "
            f"{tuple(getattr(weight, 'shape', ()))}"
        )
    if method not in PATCH_RESIZES:
        raise ValueError(f"method must be one of {PATCH_RESIZES}, got {method!r}")
    new = check_positive_int("new_patch_size", new_patch_size)
    old = weight.shape[-1]
    if new == old:
        return weight.clone()
    if method == "bilinear":
        return F.interpolate(
            weight, size=(new, new), mode="bilinear", align_corners=False
        )
    resize = _bilinear_resize_matrix(old, new)  # (P^2, p^2)
    flat = weight.reshape(-1, old * old).T.to(torch.float64)  # (p^2, d C)
    resized = torch.linalg.pinv(resize.T) @ flat  # (P^2, d C)
    return resized.T.reshape(*weight.shape[:2], new, new).to(weight.dtype)


def sincos_table_2d(grid, d_model: int, temperature: float = 10_000.0) -> torch.Tensor:
    """The fixed 2-D sin-cos position table of Beyer et al. (2022), ``(h w, d)``,
    patches row by row.

    With ``d / 4`` frequencies ``w_k = temperature^(-k / (d / 4 - 1))``, the patch in
    row ``r``, column ``c`` gets ``[sin(c w), cos(c w), sin(r w), cos(r w)]``: a quarter
    of the features for each, as ``posemb_sincos_2d`` in big_vision lays them out.
    ``d`` must be a multiple of 4, at least 8."""
    rows, cols = _pair("grid", grid)
    d_model = check_positive_int("d_model", d_model)
    if d_model % 4 or d_model < 8:
        raise ValueError(
            f"d_model must be a multiple of 4 and at least 8 for a 2-D sin-cos table, "
            f"got {d_model}"
        )
    quarter = d_model // 4
    omega = temperature ** -(torch.arange(quarter, dtype=torch.float64) / (quarter - 1))
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)  # (h w,)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    x, y = c[:, None] * omega, r[:, None] * omega  # (h w, d / 4)
    table = torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)
    return table.to(torch.get_default_dtype())


class SincosPositions2D(nn.Module):
    """A fixed (not trained) position table: :func:`sincos_table_2d` for the patches,
    after ``num_prefix`` rows of zeros (``<cls>`` gets no position, as in big_vision),
    added to ``x (B, num_prefix + h w, d)``. The table is a buffer, ``table``: it moves
    with the model and is saved with it, and no optimiser sees it."""

    def __init__(self, grid, d_model: int, num_prefix: int = 0):
        super().__init__()
        num_prefix = check_non_negative_int("num_prefix", num_prefix)
        patches = sincos_table_2d(grid, d_model)
        prefix = torch.zeros(num_prefix, patches.shape[1])
        self.register_buffer("table", torch.cat([prefix, patches]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or tuple(x.shape[1:]) != tuple(self.table.shape):
            raise ValueError(
                f"x must be (B, {self.table.shape[0]}, {self.table.shape[1]}), got "
                f"{tuple(x.shape)}"
            )
        return x + self.table.to(x.dtype)


def resize_position_table(
    table: torch.Tensor, old_grid, new_grid, num_prefix: int = 1, mode: str = "bicubic"
) -> torch.Tensor:
    """A ViT position table for another patch grid: ``(num_prefix + h w, d) ->
    (num_prefix + H W, d)``.

    The first ``num_prefix`` rows (the ``<cls>`` token's) belong to no patch and are
    kept as they are; the patch rows are interpolated in 2D by
    :func:`~attnbook.positions.interpolate_grid`, bicubically (or ``mode="nearest"``,
    ``"bilinear"``)."""
    (h, w), (H, W) = _pair("old_grid", old_grid), _pair("new_grid", new_grid)
    num_prefix = check_non_negative_int("num_prefix", num_prefix)
    if table.dim() != 2 or table.shape[0] != num_prefix + h * w:
        raise ValueError(
            f"table must be (num_prefix + h*w, d) = ({num_prefix + h * w}, d) for grid "
            f"{(h, w)} "
            f"and num_prefix={num_prefix}, got {tuple(table.shape)}"
        )
    # (num_prefix, d), (h*w, d)
    prefix, patches = table[:num_prefix], table[num_prefix:]
    # (num_prefix + H*W, d)
    return torch.cat([prefix, interpolate_grid(patches, (h, w), (H, W), mode)])


def mean_attention_distance(
    weights: torch.Tensor, grid, patch_size: int, num_prefix: int = 0
) -> torch.Tensor:
    """How far each head looks, in pixels (the ViT paper's Figure 7): for weights
    ``(B, h, T, T)`` over ``num_prefix`` special tokens then a ``grid`` of patches,
    the distance between query and key patch centres weighted by the attention among
    the patches (renormalised to sum to 1 per query), averaged over queries and images:
    ``(h,)``. Attention to itself gives 0; uniform attention gives the grid's mean
    pairwise distance."""
    rows, cols = _pair("grid", grid)
    patch_size = check_positive_int("patch_size", patch_size)
    num_prefix = check_non_negative_int("num_prefix", num_prefix)
    tokens = num_prefix + rows * cols
    if weights.dim() != 4 or weights.shape[-2:] != (tokens, tokens):
        raise ValueError(
            f"weights must be (B, h, T, T) with T = {num_prefix} + {rows}*{cols} = "
            f"{tokens}, got {tuple(weights.shape)}"
        )
    among = weights[..., num_prefix:, num_prefix:]  # (B, h, N, N)
    among = among / among.sum(-1, keepdim=True)
    r = torch.arange(rows * cols, device=weights.device) // cols
    c = torch.arange(rows * cols, device=weights.device) % cols
    dr, dc = r[:, None] - r[None], c[:, None] - c[None]  # (N, N)
    distance = torch.sqrt((dr**2 + dc**2).to(among.dtype)) * patch_size  # (N, N)
    return (among * distance).sum(-1).mean(dim=(0, 2))  # (h,)


def attention_rollout(weights, residual: bool = True) -> torch.Tensor:
    """Attention rollout (Abnar and Zuidema, 2020), as the ViT paper's Figure 6 uses it:
    for every block's weights ``(B, h, T, T)``, first block first, average the heads,
    add the identity for the residual connection (``0.5 A + 0.5 I``, rows renormalised;
    ``residual=False`` leaves it out) and multiply the blocks' matrices: ``(B, T, T)``,
    row ``i`` how much output token ``i`` draws on each input token. Every row sums to
    1."""
    if isinstance(weights, torch.Tensor):
        weights = [weights]
    weights = list(weights)
    if not weights or any(
        not isinstance(w, torch.Tensor)
        or w.dim() != 4
        or w.shape[-1] != w.shape[-2]
        or w.shape[0] != weights[0].shape[0]
        or w.shape[-1] != weights[0].shape[-1]
        for w in weights
    ):
        raise ValueError(
            "weights must be a non-empty list of (B, h, T, T) tensors of one B and T, "
            f"got {[tuple(getattr(w, 'shape', ())) for w in weights]}"
        )
    tokens = weights[0].shape[-1]
    eye = torch.eye(tokens, dtype=weights[0].dtype, device=weights[0].device)
    rollout = eye.expand(weights[0].shape[0], tokens, tokens)
    for w in weights:
        a = w.mean(dim=1)  # (B, T, T): the heads averaged
        if residual:
            a = 0.5 * a + 0.5 * eye
            a = a / a.sum(dim=-1, keepdim=True)
        rollout = a @ rollout  # this block after the ones below it
    return rollout


class ViT(nn.Module):
    """Vision Transformer: patch embedding, ``<cls>`` token, learned positions, pre-norm
    encoder blocks.

    ``forward(images (B, in_channels, H, W)) -> logits (B, num_classes)`` for images of
    the size it was built (or last resized) for. ``pool="cls"`` puts a learned ``<cls>``
    token in front of the patches and classifies its output; ``pool="mean"`` has no
    ``<cls>`` token and classifies the mean of the patch outputs. The position table
    ``positions.table`` has one row per token: row 0 for ``<cls>`` (when there is one),
    then the patches row by row. ``position_embedding="none"`` leaves the table out:
    the model then sees a set of patches, and permuting them changes nothing (with mean
    pooling, not even the logits).
    """

    def __init__(
        self,
        image_size,
        patch_size: int,
        num_classes: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        in_channels: int = 1,
        pool: str = "cls",
        hidden: int | None = None,
        dropout: float = 0.0,
        position_embedding: str = "learned",
    ):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding must be one of {POSITION_EMBEDDINGS}, "
                f"got {position_embedding!r}"
            )
        patch_size, d_model = (
            check_positive_int("patch_size", patch_size),
            check_positive_int("d_model", d_model),
        )
        self.grid = patch_grid(image_size, patch_size)  # (H/p, W/p)
        self.image_size = (self.grid[0] * patch_size, self.grid[1] * patch_size)
        self.pool = pool
        self.num_prefix = 1 if pool == "cls" else 0
        self.patch_embed = PatchEmbedding(patch_size, d_model, in_channels)
        self.cls_token = (
            nn.Parameter(torch.randn(1, 1, d_model) * 0.02) if pool == "cls" else None
        )
        self.position_embedding = position_embedding
        self.positions = None  # "none": a bag of patches
        if position_embedding == "learned":
            tokens = self.num_prefix + self.grid[0] * self.grid[1]
            self.positions = LearnedPositions(tokens, d_model)
        elif position_embedding == "sincos":  # fixed, not trained
            self.positions = SincosPositions2D(self.grid, d_model, self.num_prefix)
        self.blocks = stack_blocks(
            num_layers,
            d_model,
            num_heads,
            hidden,
            dropout,
            activation="gelu",
            norm="pre",
        )
        # pre-norm: the residual stream is normalised once, at the end
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, check_positive_int("num_classes", num_classes))

    @property
    def num_tokens(self) -> int:
        """Tokens the blocks see: the patches, plus ``<cls>`` when ``pool="cls"``."""
        return self.num_prefix + self.grid[0] * self.grid[1]

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The encoder's output for every token, ``(B, num_tokens, d)`` (``<cls>``
        first, if any)."""
        _check_images(images)
        if tuple(images.shape[-2:]) != self.image_size:
            raise ValueError(
                f"this ViT takes {self.image_size[0]}x{self.image_size[1]} images (a "
                f"{self.grid[0]}x{self.grid[1]} "
                f"patch grid), got {images.shape[-2]}x{images.shape[-1]}; call "
                "resize() to move it to another size"
            )
        x = self.patch_embed(images)  # (B, N, d)
        if self.cls_token is not None:
            # (B, 1 + N, d)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.positions is not None:
            x = self.positions(x)  # (B, T, d): one learned row per token
        for block in self.blocks:
            x = block(x)  # (B, T, d)
        return self.norm(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.tokens(images)  # (B, T, d)
        pooled = x[:, 0] if self.pool == "cls" else x.mean(dim=1)  # (B, d)
        return self.head(pooled)  # (B, num_classes)

    def attention_weights(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Every block's attention weights for ``images``: a list of ``(B, h, T, T)``,
        first block first.

        Computed in eval mode (no dropout) without gradients; the caller's training mode
        is restored."""
        for block in self.blocks:
            block.record_weights = True
        try:
            with eval_mode(self):
                self.tokens(images)
            return [block.weights for block in self.blocks]
        finally:
            for block in self.blocks:
                block.record_weights, block.weights = False, None

    @torch.no_grad()
    def resize(
        self,
        image_size,
        positions: str = "interpolate",
        mode: str = "bicubic",
        generator: torch.Generator | None = None,
        patch_size: int | None = None,
        patch_method: str = "pi",
    ) -> ViT:
        """Move the model to images of ``image_size``. Returns ``self``.

        With the same patch size, the patch grid changes, and so must the position
        table. ``positions="interpolate"``: its patch rows are interpolated in 2D to the
        new grid (:func:`resize_position_table`, bicubically or by ``mode``).
        ``"fresh"``: new patch rows, initialised like a new model's (they must be
        trained). Two controls, for experiments on what the interpolated table carries:
        ``"shuffled"``, the interpolated rows in a random order (the same vectors in the
        wrong places), and ``"random"``, random directions scaled to the interpolated
        rows' mean length (the right size, no placement). ``"recompute"`` (a fixed
        sin-cos table only): the table of the new grid. The ``<cls>`` row is always
        kept, a fixed table stays fixed, and the random draws use ``generator``
        (default: torch's global one).

        ``patch_size``: the patch embedding is resized instead (FlexiViT,
        :meth:`PatchEmbedding.resize` by ``patch_method``), so that twice the side with
        twice the patch size keeps the grid and the table as they are. Every other
        weight is unchanged (a ViT without positions only changes its grid).
        """
        if positions not in _RESIZED_POSITIONS:
            raise ValueError(
                f"positions must be one of {', '.join(map(repr, _RESIZED_POSITIONS))}, "
                f"got {positions!r}"
            )
        if positions == "recompute" and self.position_embedding != "sincos":
            raise ValueError(
                'positions="recompute" needs a fixed sin-cos table (position_embedding='
                f'"sincos"), this ViT has {self.position_embedding!r}'
            )
        patch = self.patch_embed.patch_size if patch_size is None else patch_size
        new_grid = patch_grid(image_size, patch)  # checked before anything changes
        if patch_size is not None:
            self.patch_embed.resize(patch_size, patch_method)
        same_grid = new_grid == self.grid and positions == "interpolate"
        if self.positions is not None and not same_grid:
            self._resize_table(new_grid, positions, mode, generator)
        self.grid = new_grid
        self.image_size = (new_grid[0] * patch, new_grid[1] * patch)
        return self

    def _resize_table(self, new_grid, positions: str, mode: str, generator) -> None:
        """Replace the position table's patch rows for ``new_grid`` (see resize)."""
        table = self.positions.table.detach()  # (num_prefix + h*w, d)
        prefix = self.num_prefix
        # (H*W, d)
        rows = resize_position_table(table, self.grid, new_grid, prefix, mode)[prefix:]
        if positions == "fresh":
            draw = torch.randn(rows.shape, generator=generator)
            rows = draw.to(rows.device, rows.dtype) * 0.02
        elif positions == "shuffled":
            order = torch.randperm(len(rows), generator=generator)
            rows = rows[order.to(rows.device)]
        elif positions == "random":
            draw = torch.randn(rows.shape, generator=generator)
            draw = draw.to(rows.device, rows.dtype)
            length = rows.norm(dim=-1).mean()
            rows = draw / draw.norm(dim=-1, keepdim=True) * length
        elif positions == "recompute":
            rows = sincos_table_2d(new_grid, table.shape[1]).to(rows.device, rows.dtype)
        new_table = torch.cat([table[:prefix], rows]).contiguous()  # (prefix + H*W, d)
        if isinstance(self.positions, SincosPositions2D):
            self.positions.table = new_table  # the buffer: still fixed
        else:
            self.positions.table = nn.Parameter(new_table)


_RESIZED_POSITIONS = ("interpolate", "fresh", "shuffled", "random", "recompute")
PATCH_RESIZES = ("pi", "bilinear")


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (a projected shortcut
    when the width or the stride changes): ``(B, C_in, H, W) -> (B, C_out, H / stride, W
    / stride)``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_channels, out_channels, 3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # (B, C_out, H', W')
        out = self.bn2(self.conv2(out))  # (B, C_out, H', W')
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A small ResNet-style CNN: a 3x3 stem, one :class:`ResidualBlock` per width (each
    after the first halves the resolution), global average pooling and a linear
    classifier.

    ``forward(images (B, in_channels, H, W)) -> logits (B, num_classes)``; any image
    size works (the pooling removes the spatial dims). Its locality and translation
    equivariance are built in: what a ViT has to learn from the data.
    """

    def __init__(
        self,
        num_classes: int,
        widths=(16, 32, 64),
        in_channels: int = 1,
        stem_stride: int = 1,
    ):
        super().__init__()
        widths = tuple(
            check_positive_int(f"widths[{i}]", width) for i, width in enumerate(widths)
        )
        if not widths:
            raise ValueError(
                "widths must be a non-empty sequence of positive ints, got ()"
            )
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.stem = nn.Sequential(
            nn.Conv2d(
                self.in_channels,
                widths[0],
                3,
                stride=check_positive_int("stem_stride", stem_stride),
                padding=1,
                bias=False,
            ),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        self.stages = nn.Sequential(
            *(
                ResidualBlock(widths[max(i - 1, 0)], width, stride=1 if i == 0 else 2)
                for i, width in enumerate(widths)
            )
        )
        self.head = nn.Linear(
            widths[-1], check_positive_int("num_classes", num_classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images, self.in_channels)
        x = self.stages(self.stem(images))  # (B, C_last, H', W')
        return self.head(x.mean(dim=(2, 3)))  # (B, num_classes)


__all__ = [
    "PatchEmbedding",
    "ResidualBlock",
    "SincosPositions2D",
    "SmallResNet",
    "ViT",
    "attention_rollout",
    "mean_attention_distance",
    "patch_grid",
    "patchify",
    "resize_patch_kernel",
    "resize_position_table",
    "sincos_table_2d",
]
