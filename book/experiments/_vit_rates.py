"""Chapter 9's first page, 09_vit: the learning rate of each model, chosen on
validation images by the mean of several seeds. The MNIST sample and its splits, the
ViT, the CNN of about its size, the ViT without positions, one training of 200
steps."""

import functools

import attnbook
import torch
from attnbook import data, train

KINDS = ("ViT", "CNN", "no positions")
STEPS, BATCH = 200, 96  # the page's training


@functools.lru_cache(maxsize=1)
def splits():
    """``{"fit", "val", "test"}`` -> ``(images (N, 1, 28, 28), labels (N,))``: of the
    5,000-image sample, 1,000 test images; of the other 4,000, 500 validation images (50
    of each digit) and 3,500 to train on."""
    images, labels = data.load_mnist_5k()
    test_index, train_index = data.stratified_split(labels, 0.2, seed=0)
    train_x, train_y = images[train_index], labels[train_index]
    val_index, fit_index = data.stratified_split(train_y, 0.125, seed=0)
    return {
        "fit": (train_x[fit_index], train_y[fit_index]),
        "val": (train_x[val_index], train_y[val_index]),
        "test": (images[test_index], labels[test_index]),
    }


def make_model(kind):
    """The page's models: a ViT (7 x 7 patches, d = 32, 4 heads, 3 blocks, <cls>),
    the same ViT without a position table, and a small ResNet-style CNN of about its
    size."""
    if kind in ("ViT", "no positions"):
        positions = "learned" if kind == "ViT" else "none"
        return attnbook.ViT(
            28, 7, 10, 32, 4, 3, hidden=64, position_embedding=positions
        )
    if kind == "CNN":
        cnn = attnbook.SmallResNet(10, widths=(12, 24, 32), stem_stride=2)
        return cnn.to(memory_format=torch.channels_last)  # faster convolutions on a CPU
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def fit(kind, lr, seed, device=None, eval_every=None):
    """A fresh ``kind`` trained on the 3,500 images for 200 steps of 96 at rate ``lr``;
    returns the model (in eval mode) and its History (validation accuracy every
    ``eval_every`` steps, if given)."""
    x, y = splits()["fit"]
    val_x, val_y = splits()["val"]
    attnbook.seed_everything(seed)
    model = make_model(kind).to(device or attnbook.device())
    history = train.train_classifier(
        model,
        x,
        y,
        steps=STEPS,
        batch_size=BATCH,
        lr=lr,
        seed=seed,
        eval_fn=None
        if eval_every is None
        else (lambda m: train.accuracy(m, val_x, val_y)),
        eval_every=eval_every,
    )
    return model.eval(), history


def run(point, seed, device=None):
    """Train ``point["model"]`` at ``point["lr"]``; its accuracy on the validation and
    test images and on its 3,500 training images."""
    model, _ = fit(point["model"], point["lr"], seed, device)
    return {
        name: train.accuracy(model, *splits()[part])
        for name, part in (("val", "val"), ("test", "test"), ("train", "fit"))
    }
