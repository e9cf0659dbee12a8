"""Chapter 9's data, steps and compute page, 09_vit_data: the ViT and the CNN of
09_vit trained on a stratified part of the 3,500 training images, for a number of
steps, at a learning rate, with or without random shifts."""

import functools

import attnbook
from attnbook import data, train
from experiments._vit_rates import make_model, splits

BATCH = 96  # images per step, as on every page of the chapter


def subset(images, seed):
    """``(x (images, 1, 28, 28), y (images,))``: ``images`` of the 3,500 training
    images, as many of each digit; ``seed`` picks them (all 3,500 at 3,500)."""
    x, y = splits()["fit"]
    if images == len(y):
        return x, y
    chosen = data.stratified_split(y, images / len(y), seed=seed)[0]
    return x[chosen], y[chosen]


def fit(point, seed, device=None):
    """A fresh ``point["model"]`` ("ViT" or "CNN") trained on ``point["images"]``
    images for ``point["steps"]`` steps of 96 at rate ``point["lr"]``, every batch
    moved by up to ``point["shift"]`` pixels (0: not moved); the model, in eval
    mode."""
    x, y = subset(point["images"], seed)
    augment = None
    if point["shift"]:
        shifts = attnbook.generator(1000 + seed)  # draws the shifts
        augment = functools.partial(
            data.random_shift, max_shift=point["shift"], generator=shifts
        )
    attnbook.seed_everything(seed)
    model = make_model(point["model"]).to(device or attnbook.device())
    train.train_classifier(
        model, x, y, steps=point["steps"], batch_size=BATCH, lr=point["lr"],
        seed=seed, augment=augment,
    )  # fmt: skip
    return model.eval()


def run(point, seed, device=None):
    """:func:`fit`; the model's accuracy on the 500 validation images, the 1,000 test
    images and the (unshifted) images it trained on."""
    model = fit(point, seed, device)
    return {
        "val": train.accuracy(model, *splits()["val"]),
        "test": train.accuracy(model, *splits()["test"]),
        "train": train.accuracy(model, *subset(point["images"], seed)),
    }
