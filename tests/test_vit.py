"""The Vision Transformer: patches, the patch embedding, the ViT against PyTorch's layers, moving it to
a larger grid (its table interpolated, or its patch embedding resized as FlexiViT does), the fixed 2-D
sin-cos table, attention rollout, the CNN baseline, and a ViT trained on a tiny task (the MNIST sample and its split are
tested in test_data.py, the classifier loop in test_train.py)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import ViT, interpolate_grid
from attnbook.train import accuracy, count_parameters, train_classifier
from attnbook.vit import (
    PatchEmbedding,
    SmallResNet,
    attention_rollout,
    mean_attention_distance,
    patch_grid,
    patchify,
    resize_patch_kernel,
    resize_position_table,
    sincos_table_2d,
)
from torch import nn

# ---------------------------------------------------------------------------------------------
# patches and the patch embedding


@pytest.mark.parametrize("size, p, tokens", [(28, 7, 16), (56, 7, 64), (28, 4, 49), (224, 16, 196), ((32, 48), 8, 24)])
def test_token_count_is_hw_over_p_squared(size, p, tokens):
    h, w = (size, size) if isinstance(size, int) else size
    assert patch_grid(size, p) == (h // p, w // p)
    embed = PatchEmbedding(p, d_model=6, in_channels=3)
    out = embed(torch.rand(2, 3, h, w))
    assert out.shape == (2, tokens, 6) and tokens == h * w // p**2


@pytest.mark.parametrize("size", [30, (28, 30), 27])
def test_image_side_not_divisible_by_p_is_rejected(size):
    h, w = (size, size) if isinstance(size, int) else size
    with pytest.raises(ValueError, match=rf"{h}x{w}.*patch_size=7"):
        patch_grid(size, 7)
    with pytest.raises(ValueError, match=rf"{h}x{w}.*patch_size=7"):
        PatchEmbedding(7, 8)(torch.rand(1, 1, h, w))
    with pytest.raises(ValueError, match="patch_size=7"):
        ViT(size, 7, 10, 8, 2, 1)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="patch_size"):
        patch_grid(28, 0)
    with pytest.raises(ValueError, match="image_size"):
        patch_grid(-28, 7)
    with pytest.raises(ValueError, match="float .B, C, H, W."):
        PatchEmbedding(7, 8)(torch.rand(1, 28, 28))
    with pytest.raises(ValueError, match="1 channel"):
        PatchEmbedding(7, 8)(torch.rand(1, 3, 28, 28))
    with pytest.raises(ValueError, match="float"):
        patchify(torch.zeros(1, 1, 28, 28, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="patch_size must be a positive int, got True"):
        PatchEmbedding(True, 8)


def test_numpy_integer_sizes_are_accepted():
    """Sizes computed with NumPy (np.int64) are valid sizes; the model stores plain ints."""
    model = ViT(np.int64(28), np.int64(7), np.int64(10), np.int64(16), np.int64(2), np.int64(1))
    assert model.grid == (4, 4) and model.image_size == (28, 28)
    assert all(type(side) is int for side in model.image_size)
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    assert SmallResNet(np.int64(10), widths=np.array([8, 16]))(torch.rand(1, 1, 28, 28)).shape == (1, 10)
    with pytest.raises(ValueError, match=r"widths\[1\] must be a positive int, got 0"):
        SmallResNet(10, widths=(8, 0))


def test_patchify_cuts_patches_row_by_row():
    images = torch.rand(2, 3, 12, 8)
    patches = patchify(images, 4)  # grid 3 x 2
    assert patches.shape == (2, 6, 3 * 16)
    for r in range(3):
        for c in range(2):
            expected = images[:, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4].reshape(2, -1)  # (C, p, p) flattened
            torch.testing.assert_close(patches[:, r * 2 + c], expected, rtol=0, atol=0)


def test_convolution_equals_patches_then_one_linear_layer():
    torch.manual_seed(0)
    embed = PatchEmbedding(7, d_model=16, in_channels=2)
    images = torch.rand(3, 2, 28, 21)
    linear = nn.Linear(2 * 7 * 7, 16)
    with torch.no_grad():
        linear.weight.copy_(embed.proj.weight.reshape(16, -1))  # (d, C p p)
        linear.bias.copy_(embed.proj.bias)
    torch.testing.assert_close(embed(images), linear(patchify(images, 7)), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the ViT


def reference_vit(model: ViT) -> nn.Module:
    """The same ViT from PyTorch's own layers (nn.TransformerEncoderLayer, norm_first=True), weights copied."""
    d = model.head.in_features
    layers = []
    for block in model.blocks:
        layer = nn.TransformerEncoderLayer(d, block.self_attention.num_heads, block.feed_forward.fc1.out_features,
                                           dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        with torch.no_grad():
            for ours, theirs in ((block.self_attention.q_proj, 0), (block.self_attention.k_proj, 1),
                                 (block.self_attention.v_proj, 2)):
                layer.self_attn.in_proj_weight[theirs * d : (theirs + 1) * d].copy_(ours.weight)
                layer.self_attn.in_proj_bias[theirs * d : (theirs + 1) * d].copy_(ours.bias)
        layer.self_attn.out_proj.load_state_dict(block.self_attention.out_proj.state_dict())
        layer.linear1.load_state_dict(block.feed_forward.fc1.state_dict())
        layer.linear2.load_state_dict(block.feed_forward.fc2.state_dict())
        layer.norm1.load_state_dict(block.norm1.state_dict())
        layer.norm2.load_state_dict(block.norm2.state_dict())
        layers.append(layer)
    encoder = nn.Sequential(*layers).eval()

    def forward(images):
        x = model.patch_embed.proj(images).flatten(2).transpose(1, 2)  # (B, N, d)
        if model.pool == "cls":
            x = torch.cat([model.cls_token.expand(len(x), -1, -1), x], dim=1)
        x = model.norm(encoder(x + model.positions.table))
        return model.head(x[:, 0] if model.pool == "cls" else x.mean(1))

    return forward


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_forward_matches_pytorch_layers(pool):
    torch.manual_seed(1)
    model = ViT(28, 7, num_classes=10, d_model=32, num_heads=4, num_layers=2, pool=pool).eval()
    with torch.no_grad():
        model.positions.table.normal_()  # make the positions matter
        images = torch.rand(5, 1, 28, 28)
        logits = model(images)
        assert logits.shape == (5, 10)
        torch.testing.assert_close(logits, reference_vit(model)(images), rtol=1e-5, atol=1e-5)
    assert model.num_tokens == 16 + (pool == "cls")
    assert model.positions.table.shape == (model.num_tokens, 32)
    assert (model.cls_token is None) == (pool == "mean")


def test_vit_parameter_count():
    d, p, layers, classes, hidden = 32, 7, 3, 10, 64
    model = ViT(28, p, classes, d, 4, layers, hidden=hidden)
    block = 4 * (d * d + d) + (2 * d * hidden + hidden + d) + 2 * 2 * d
    expected = (p * p * d + d) + d + 17 * d + layers * block + 2 * d + (d * classes + classes)
    assert count_parameters(model) == expected
    mean = ViT(28, p, classes, d, 4, layers, hidden=hidden, pool="mean")
    assert count_parameters(model) - count_parameters(mean) == 2 * d  # the <cls> token and its position row


def test_vit_without_positions_is_a_bag_of_patches():
    torch.manual_seed(2)
    model = ViT(28, 7, 10, 16, 2, 2).eval()
    with torch.no_grad():
        images = torch.rand(2, 1, 28, 28)
        tiles = images.reshape(2, 1, 4, 7, 4, 7)
        shuffled = tiles[:, :, torch.tensor([3, 1, 0, 2])][:, :, :, :, torch.tensor([2, 0, 3, 1])].reshape(2, 1, 28, 28)
        assert not torch.allclose(model(images), model(shuffled), atol=1e-4)  # positions tell the patches apart
        model.positions.table.zero_()
        torch.testing.assert_close(model(images), model(shuffled), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_built_without_positions_ignores_the_order_of_its_patches(pool):
    torch.manual_seed(3)
    model = ViT(28, 7, 10, 16, 2, 2, pool=pool, position_embedding="none").eval()
    learned = ViT(28, 7, 10, 16, 2, 2, pool=pool)
    assert model.positions is None
    assert count_parameters(learned) - count_parameters(model) == (16 + (pool == "cls")) * 16
    images = torch.rand(3, 1, 28, 28)
    tiles = images.reshape(3, 1, 4, 7, 4, 7).permute(0, 1, 2, 4, 3, 5).reshape(3, 1, 16, 7, 7)
    order = torch.randperm(16)  # any permutation of the 16 patches, not only rows and columns
    shuffled = tiles[:, :, order].reshape(3, 1, 4, 4, 7, 7).permute(0, 1, 2, 4, 3, 5).reshape(3, 1, 28, 28)
    with torch.no_grad():
        assert not torch.equal(images, shuffled)
        torch.testing.assert_close(model(images), model(shuffled), rtol=1e-4, atol=1e-5)
        tokens, shuffled_tokens = model.tokens(images), model.tokens(shuffled)
        first = model.num_prefix  # the patch outputs are permuted with the patches
        torch.testing.assert_close(shuffled_tokens[:, first:], tokens[:, first:][:, order], rtol=1e-4, atol=1e-5)
    model.resize(56)  # no table to interpolate: only the grid changes
    assert model(torch.rand(1, 1, 56, 56)).shape == (1, 10)
    with pytest.raises(ValueError, match="position_embedding must be one of.*'sinusoidal'"):
        ViT(28, 7, 10, 16, 2, 1, position_embedding="sinusoidal")


def test_mean_attention_distance_by_hand():
    n = 4  # a 2 x 2 grid of 7-pixel patches, one <cls> in front
    own = torch.eye(1 + n).expand(2, 3, -1, -1)  # every token attends to itself
    torch.testing.assert_close(mean_attention_distance(own, 2, 7, 1), torch.zeros(3))
    uniform = torch.full((1, 1, 1 + n, 1 + n), 1 / (1 + n))  # <cls> weight is dropped
    pairs = torch.tensor([0, 7, 7, 7 * 2**0.5])  # from one patch to the 4 of the grid
    expected = pairs.mean()
    torch.testing.assert_close(mean_attention_distance(uniform, (2, 2), 7, 1), expected[None])
    neighbour = torch.zeros(1, 2, n, n)  # head 0: to the patch on the right (or left)
    neighbour[0, 0] = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0.0]])
    neighbour[0, 1] = torch.tensor([[0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0.0]])
    torch.testing.assert_close(mean_attention_distance(neighbour, 2, 1), torch.tensor([1.0, 2**0.5]))
    with pytest.raises(ValueError, match=r"T = 1 \+ 2\*2 = 5, got \(1, 2, 4, 4\)"):
        mean_attention_distance(neighbour, 2, 1, num_prefix=1)
    with pytest.raises(ValueError, match="patch_size"):
        mean_attention_distance(neighbour, 2, 0)


def test_vit_rejects_bad_input():
    model = ViT(28, 7, 10, 16, 2, 1)
    with pytest.raises(ValueError, match="28x28 images.*got 56x56.*resize"):
        model(torch.rand(1, 1, 56, 56))
    with pytest.raises(ValueError, match="pool must be one of"):
        ViT(28, 7, 10, 16, 2, 1, pool="max")
    with pytest.raises(ValueError, match="num_layers"):
        ViT(28, 7, 10, 16, 2, 0)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        ViT(28, 7, 10, 16, 3, 1)
    with pytest.raises(ValueError, match="positions must be"):
        model.resize(56, positions="nearest")
    with pytest.raises(ValueError, match="patch_size=7"):
        model.resize(50)


def test_attention_weights_rows_sum_to_one():
    model = ViT(28, 7, 10, 16, 2, 3).eval()
    images = torch.rand(4, 1, 28, 28)
    weights = model.attention_weights(images)
    assert len(weights) == 3 and all(w.shape == (4, 2, 17, 17) for w in weights)
    torch.testing.assert_close(weights[-1].sum(-1), torch.ones(4, 2, 17))
    assert all(not block.record_weights and block.weights is None for block in model.blocks)


def test_attention_weights_of_a_model_in_training_mode_have_no_dropout():
    """Bug: attention_weights ran with dropout on when the model was training, so two calls differed."""
    torch.manual_seed(6)
    model = ViT(28, 7, 10, 16, 2, 3, dropout=0.5).train()
    images = torch.rand(4, 1, 28, 28)
    first = model.attention_weights(images)
    second = model.attention_weights(images)
    assert model.training and all(module.training for module in model.modules())  # the caller's mode is back
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not any(w.requires_grad for w in first)
    reference = model.eval().attention_weights(images)
    for a, b in zip(first, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    model.train()
    with pytest.raises(ValueError, match="28x28 images"):
        model.attention_weights(torch.rand(1, 1, 56, 56))
    assert model.training  # restored after an error too
    assert all(not block.record_weights and block.weights is None for block in model.blocks)


# ---------------------------------------------------------------------------------------------
# moving to a larger grid


def test_resize_position_table_keeps_cls_and_interpolates_the_patches():
    torch.manual_seed(3)
    table = torch.randn(1 + 16, 8)
    resized = resize_position_table(table, (4, 4), (8, 8))
    assert resized.shape == (1 + 64, 8)
    torch.testing.assert_close(resized[0], table[0], rtol=0, atol=0)  # <cls> kept as is
    torch.testing.assert_close(resized[1:], interpolate_grid(table[1:], (4, 4), (8, 8)))
    by_torch = F.interpolate(table[1:].T.reshape(1, 8, 4, 4), size=(8, 8), mode="bicubic", align_corners=False)
    torch.testing.assert_close(resized[1:], by_torch.reshape(8, 64).T)
    torch.testing.assert_close(resize_position_table(table, (4, 4), (4, 4)), table)  # same grid: unchanged
    torch.testing.assert_close(resize_position_table(table[1:], 4, 4, num_prefix=0), table[1:])
    for mode in ("nearest", "bilinear"):  # another mode reaches the grid's interpolation
        other = resize_position_table(table, (4, 4), (8, 8), mode=mode)
        torch.testing.assert_close(other[0], table[0], rtol=0, atol=0)
        torch.testing.assert_close(other[1:], interpolate_grid(table[1:], (4, 4), (8, 8), mode))


def test_resize_position_table_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\(17, d\)"):
        resize_position_table(torch.randn(16, 8), (4, 4), (8, 8))
    with pytest.raises(ValueError, match="num_prefix"):
        resize_position_table(torch.randn(17, 8), (4, 4), (8, 8), num_prefix=-1)
    with pytest.raises(ValueError, match="new_grid"):
        resize_position_table(torch.randn(17, 8), (4, 4), (0, 8))


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_resize_interpolates_or_starts_fresh(pool):
    torch.manual_seed(4)
    model = ViT(28, 7, 10, 16, 2, 2, pool=pool).eval()
    images = torch.rand(2, 1, 28, 28)
    before = model(images)
    old = model.positions.table.detach().clone()
    model.resize(28)  # the same grid: nothing changes
    torch.testing.assert_close(model(images), before)
    model.resize(56)
    prefix = model.num_prefix
    assert model.grid == (8, 8) and model.image_size == (56, 56) and model.num_tokens == prefix + 64
    table = model.positions.table
    assert isinstance(table, nn.Parameter) and table.shape == (prefix + 64, 16)
    torch.testing.assert_close(table.detach(), resize_position_table(old, (4, 4), (8, 8), prefix))
    assert model(torch.rand(3, 1, 56, 56)).shape == (3, 10)
    fresh = ViT(28, 7, 10, 16, 2, 2, pool=pool)
    old = fresh.positions.table.detach().clone()
    fresh.resize((56, 28), positions="fresh")
    assert fresh.positions.table.shape == (prefix + 32, 16)
    torch.testing.assert_close(fresh.positions.table[:prefix].detach(), old[:prefix])  # <cls> row kept
    assert fresh(torch.rand(1, 1, 56, 28)).shape == (1, 10)
    nearest = ViT(28, 7, 10, 16, 2, 2, pool=pool)
    old = nearest.positions.table.detach().clone()
    nearest.resize(56, mode="nearest")
    torch.testing.assert_close(
        nearest.positions.table.detach(), resize_position_table(old, 4, 8, prefix, "nearest")
    )
    with pytest.raises(ValueError, match="mode must be one of"):
        nearest.resize(28, mode="area")


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_resize_controls_shuffle_or_redraw_the_interpolated_rows(pool):
    torch.manual_seed(5)
    model = ViT(28, 7, 10, 16, 2, 2, pool=pool)
    prefix, old = model.num_prefix, model.positions.table.detach().clone()
    interpolated = resize_position_table(old, (4, 4), (8, 8), prefix)[prefix:]  # (64, 16)
    tables = {}
    for positions in ("fresh", "shuffled", "random"):
        first = copy.deepcopy(model).resize(56, positions, generator=torch.Generator().manual_seed(1))
        again = copy.deepcopy(model).resize(56, positions, generator=torch.Generator().manual_seed(1))
        other = copy.deepcopy(model).resize(56, positions, generator=torch.Generator().manual_seed(2))
        table = first.positions.table.detach()
        assert table.shape == (prefix + 64, 16)
        torch.testing.assert_close(table[:prefix], old[:prefix], rtol=0, atol=0)  # <cls> kept
        torch.testing.assert_close(again.positions.table.detach(), table, rtol=0, atol=0)
        assert not torch.equal(other.positions.table.detach(), table)  # the generator draws
        assert first(torch.rand(2, 1, 56, 56)).shape == (2, 10)
        tables[positions] = table[prefix:]
    # shuffled: the same 64 vectors, most in other places
    order = torch.cdist(tables["shuffled"], interpolated).argmin(dim=1)  # (64,)
    assert sorted(order.tolist()) == list(range(64)) and (order != torch.arange(64)).sum() > 50
    torch.testing.assert_close(tables["shuffled"], interpolated[order])
    # random: every row as long as the interpolated rows on average, directions unrelated
    lengths = tables["random"].norm(dim=-1)
    torch.testing.assert_close(lengths, interpolated.norm(dim=-1).mean().expand(64))
    cosine = F.cosine_similarity(tables["random"], interpolated, dim=-1)
    assert cosine.abs().mean() < 0.5
    # fresh: small rows, as a new model's (std 0.02)
    assert 0.01 < tables["fresh"].std() < 0.03


# ---------------------------------------------------------------------------------------------
# the CNN baseline


def test_small_resnet_shapes_and_errors():
    model = SmallResNet(10, widths=(8, 16), stem_stride=2)
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)
    assert model(torch.rand(1, 1, 56, 56)).shape == (1, 10)  # any size: global average pooling
    stem = 9 * 8 + 2 * 8
    block1 = 2 * (9 * 8 * 8 + 2 * 8)
    block2 = 9 * 8 * 16 + 9 * 16 * 16 + 2 * 2 * 16 + (8 * 16 + 2 * 16)
    assert count_parameters(model) == stem + block1 + block2 + 16 * 10 + 10
    with pytest.raises(ValueError, match="widths"):
        SmallResNet(10, widths=())
    with pytest.raises(ValueError, match="channel"):
        model(torch.rand(1, 3, 28, 28))


# ---------------------------------------------------------------------------------------------
# training


def test_train_classifier_and_accuracy_learn_a_tiny_task():
    torch.manual_seed(5)
    images = torch.zeros(64, 1, 14, 14)
    labels = torch.arange(64) % 2
    images[labels == 1, :, :7] = 1.0  # class 1: the top half lit
    model = ViT(14, 7, 2, 16, 2, 1)
    history = train_classifier(model, images, labels, steps=40, batch_size=16, lr=1e-2)
    assert len(history.loss) == 40 and model.training
    assert accuracy(model, images, labels, batch_size=7) == 1.0 and model.training


# ---------------------------------------------------------------------------------------------
# a fixed 2-D sin-cos table (Beyer et al. 2022)


def test_sincos_table_2d_by_hand():
    table = sincos_table_2d((2, 3), 8)  # d / 4 = 2 frequencies: 1 and 1/10000
    assert table.shape == (6, 8)
    w = torch.tensor([1.0, 1e-4], dtype=torch.float64)
    for r in range(2):
        for c in range(3):
            x, y = c * w, r * w  # big_vision's posemb_sincos_2d: x the column, y the row
            expected = torch.cat([x.sin(), x.cos(), y.sin(), y.cos()]).float()
            torch.testing.assert_close(table[r * 3 + c], expected)
    torch.testing.assert_close(table[5], torch.tensor(  # row 1, column 2, written out
        [np.sin(2), np.sin(2e-4), np.cos(2), np.cos(2e-4), np.sin(1), np.sin(1e-4), np.cos(1), np.cos(1e-4)],
        dtype=torch.float32))
    assert sincos_table_2d(4, 32).shape == (16, 32)
    for d in (6, 4):
        with pytest.raises(ValueError, match="multiple of 4 and at least 8"):
            sincos_table_2d(4, d)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_with_a_fixed_sincos_table(pool):
    torch.manual_seed(6)
    model = ViT(28, 7, 10, 16, 2, 1, pool=pool, position_embedding="sincos")
    learned = ViT(28, 7, 10, 16, 2, 1, pool=pool)
    prefix = model.num_prefix
    table = model.positions.table
    assert not isinstance(table, nn.Parameter) and "positions.table" in model.state_dict()
    assert count_parameters(learned) - count_parameters(model) == (prefix + 16) * 16  # no table to learn
    torch.testing.assert_close(table[prefix:], sincos_table_2d(4, 16), rtol=0, atol=0)
    assert (table[:prefix] == 0).all()  # <cls> gets no position
    before = table.clone()
    train_classifier(model, torch.rand(32, 1, 28, 28), torch.arange(32) % 10, steps=3, batch_size=8)
    torch.testing.assert_close(model.positions.table, before, rtol=0, atol=0)  # never trained
    images = torch.rand(2, 1, 28, 28)
    with torch.no_grad():  # the table is added to the tokens
        tokens = model.patch_embed(images)
        if pool == "cls":
            tokens = torch.cat([model.cls_token.expand(2, -1, -1), tokens], dim=1)
        x = tokens + before
        for block in model.blocks:
            x = block(x)
        x = model.norm(x)
        expected = model.head(x[:, 0] if pool == "cls" else x.mean(1))
    torch.testing.assert_close(model.eval()(images), expected)
    moved = copy.deepcopy(model).resize(56, mode="nearest")
    assert not isinstance(moved.positions.table, nn.Parameter)  # still fixed
    torch.testing.assert_close(moved.positions.table, resize_position_table(before, 4, 8, prefix, "nearest"))
    recomputed = copy.deepcopy(model).resize(56, positions="recompute")
    torch.testing.assert_close(recomputed.positions.table[prefix:], sincos_table_2d(8, 16), rtol=0, atol=0)
    assert recomputed(torch.rand(1, 1, 56, 56)).shape == (1, 10)
    with pytest.raises(ValueError, match="recompute.*sin-cos.*'learned'"):
        learned.resize(56, positions="recompute")
    with pytest.raises(ValueError, match="position_embedding must be one of"):
        ViT(28, 7, 10, 16, 2, 1, position_embedding="sin")


# ---------------------------------------------------------------------------------------------
# FlexiViT: resizing the patch embedding instead of the table


def test_resize_patch_kernel_by_hand():
    w = torch.tensor([3.0, -1.0]).reshape(2, 1, 1, 1)  # d = 2, one channel, p = 1
    # 1 -> 2: a pixel becomes a 2 x 2 block of itself, so each new weight is a quarter
    torch.testing.assert_close(resize_patch_kernel(w, 2), w.expand(2, 1, 2, 2) / 4)
    # 2 -> 1: bilinear shrinks a 2 x 2 patch to its mean; the least-squares kernel is the sum
    w2 = torch.arange(8.0).reshape(2, 1, 2, 2)
    torch.testing.assert_close(resize_patch_kernel(w2, 1), torch.tensor([6.0, 22.0]).reshape(2, 1, 1, 1))
    # naive: the kernel resized like an image
    torch.testing.assert_close(resize_patch_kernel(w, 2, "bilinear"), w.expand(2, 1, 2, 2))
    torch.testing.assert_close(resize_patch_kernel(w2, 2), w2)  # same size: a copy
    assert resize_patch_kernel(w2, 2) is not w2


@pytest.mark.parametrize("old, new", [(3, 5), (7, 14), (4, 6)])
def test_pi_resize_keeps_every_token_of_an_upsampled_patch(old, new):
    torch.manual_seed(7)
    w = torch.randn(5, 2, old, old)
    x = torch.rand(9, 2, old, old)  # nine patches
    big = F.interpolate(x, size=(new, new), mode="bilinear", align_corners=False)
    tokens = torch.einsum("bcij,dcij->bd", x, w)
    pi = resize_patch_kernel(w, new)
    torch.testing.assert_close(torch.einsum("bcij,dcij->bd", big, pi), tokens, rtol=1e-4, atol=1e-4)
    naive = torch.einsum("bcij,dcij->bd", big, resize_patch_kernel(w, new, "bilinear"))
    assert (naive - tokens).abs().max() > 0.1  # the naive resize does not


def test_resize_patch_kernel_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(d, C, p, p\)"):
        resize_patch_kernel(torch.randn(2, 1, 3, 4), 6)
    with pytest.raises(ValueError, match=r"\(d, C, p, p\)"):
        resize_patch_kernel(torch.randn(2, 3, 3), 6)
    with pytest.raises(ValueError, match="method must be one of"):
        resize_patch_kernel(torch.randn(2, 1, 3, 3), 6, "bicubic")
    with pytest.raises(ValueError, match="new_patch_size"):
        resize_patch_kernel(torch.randn(2, 1, 3, 3), 0)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_resize_patch_size_keeps_the_grid_and_the_tokens(pool):
    torch.manual_seed(8)
    model = ViT(28, 7, 10, 16, 2, 2, pool=pool).eval()
    table = model.positions.table.detach().clone()
    images = torch.rand(3, 1, 28, 28)
    before = model(images)
    moved = copy.deepcopy(model).resize(56, patch_size=14)
    assert moved.grid == (4, 4) and moved.image_size == (56, 56) and moved.patch_embed.patch_size == 14
    torch.testing.assert_close(moved.positions.table.detach(), table, rtol=0, atol=0)  # untouched
    # each 7 x 7 patch upsampled to 14 x 14 on its own: the same tokens, the same logits
    patches = patchify(images, 7).reshape(3 * 16, 1, 7, 7)
    big = F.interpolate(patches, size=(14, 14), mode="bilinear", align_corners=False)
    big = big.reshape(3, 4, 4, 1, 14, 14).permute(0, 3, 1, 4, 2, 5).reshape(3, 1, 56, 56)
    torch.testing.assert_close(moved(big), before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(moved.patch_embed.proj.bias, model.patch_embed.proj.bias)
    with pytest.raises(ValueError, match="patch_size=15"):  # checked before anything changes
        moved.resize(56, patch_size=15)
    assert moved.patch_embed.patch_size == 14
    both = copy.deepcopy(model).resize(112, patch_size=14)  # a larger grid and patch at once
    assert both.grid == (8, 8) and both.positions.table.shape[0] == model.num_prefix + 64


# ---------------------------------------------------------------------------------------------
# attention rollout (Abnar and Zuidema 2020)


def test_attention_rollout_by_hand():
    w = torch.tensor([[1.0, 0.0], [0.5, 0.5]]).reshape(1, 1, 2, 2)  # one image, one head
    # 0.5 A + 0.5 I, rows renormalised (they already sum to 1)
    one = torch.tensor([[1.0, 0.0], [0.25, 0.75]])
    torch.testing.assert_close(attention_rollout([w])[0], one)
    torch.testing.assert_close(attention_rollout([w, w])[0], torch.tensor([[1.0, 0.0], [0.4375, 0.5625]]))
    torch.testing.assert_close(attention_rollout([w, w], residual=False)[0], torch.tensor([[1.0, 0.0], [0.75, 0.25]]))
    # the heads are averaged first
    two_heads = torch.stack([torch.eye(2), torch.tensor([[0.0, 1.0], [1.0, 0.0]])]).reshape(1, 2, 2, 2)
    torch.testing.assert_close(attention_rollout(two_heads, residual=False)[0], torch.full((2, 2), 0.5))
    # a trained-free model: every row a distribution
    model = ViT(28, 7, 10, 16, 2, 3).eval()
    rollout = attention_rollout(model.attention_weights(torch.rand(4, 1, 28, 28)))
    assert rollout.shape == (4, 17, 17)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(4, 17))
    with pytest.raises(ValueError, match="non-empty list"):
        attention_rollout([])
    with pytest.raises(ValueError, match="one B and T"):
        attention_rollout([torch.rand(1, 1, 2, 2), torch.rand(1, 1, 3, 3)])
