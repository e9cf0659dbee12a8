"""Chapter 9's resolution page, 09_vit_resolution: a ViT pretrained on 28 x 28 digits,
moved to 56 x 56 (the digits upsampled) in one of several ways and fine-tuned.

A start is a way to move the model: its position table interpolated (bicubically or
by nearest neighbour), fresh, shuffled or random rows of the right length, not moved at
all (the same fine-tuning at 28 x 28), a fixed 2-D sin-cos table interpolated or
recomputed, or the patch embedding resized to 14 x 14 patches (FlexiViT), which keeps
the grid. One run pretrains (or reuses the pretrained model of its seed), moves it and
fine-tunes it, recording the validation and test accuracy along the way."""

import copy
import functools

import attnbook
import torch
import torch.nn.functional as F
from attnbook import train
from experiments._vit_rates import splits

PRETRAIN_STEPS, PRETRAIN_BATCH = 150, 96
FT_STEPS, FT_BATCH, EVERY = 120, 32, 40
TABLES = ("learned", "sincos")
# each table's pretraining rate, chosen on validation by the mean of the seeds
# (the "pretrain" points of vit_resolution.py; the page checks the choice)
PRETRAIN_RATE = {"learned": 1e-2, "sincos": 1e-2}
STARTS = {  # start -> (the pretrained model's table, ViT.resize's arguments or None)
    "interpolated": ("learned", dict(positions="interpolate", mode="bicubic")),
    "nearest": ("learned", dict(positions="interpolate", mode="nearest")),
    "fresh": ("learned", dict(positions="fresh")),
    "shuffled": ("learned", dict(positions="shuffled")),
    "fresh, learned norm": ("learned", dict(positions="random")),
    "28 x 28, continued": ("learned", None),  # not moved
    "sin-cos, bicubic": ("sincos", dict(positions="interpolate", mode="bicubic")),
    "sin-cos, nearest": ("sincos", dict(positions="interpolate", mode="nearest")),
    "sin-cos, recomputed": ("sincos", dict(positions="recompute")),
    "patches resized": ("learned", dict(patch_size=14)),  # FlexiViT: the same grid
}


def make_vit(table="learned"):
    """The chapter's ViT (7 x 7 patches, d = 32, 4 heads, 3 blocks, <cls>) with a
    learned position table or the fixed 2-D sin-cos one."""
    return attnbook.ViT(28, 7, 10, 32, 4, 3, hidden=64, position_embedding=table)


def upsample(x):
    """Images twice the side, ``(B, 1, 56, 56)``, bilinear."""
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


def pretrain(table, seed, lr=None, device=None):
    """A ViT with ``table`` trained at 28 x 28 on the 3,500 images, 150 steps of 96 at
    ``lr`` (default: the table's chosen rate); in eval mode."""
    attnbook.seed_everything(seed)
    model = make_vit(table).to(device or attnbook.device())
    x, y = splits()["fit"]
    lr = PRETRAIN_RATE[table] if lr is None else lr
    train.train_classifier(
        model, x, y, steps=PRETRAIN_STEPS, batch_size=PRETRAIN_BATCH, lr=lr, seed=seed
    )
    return model.eval()


@functools.cache
def _pretrained(table, seed, device):  # one pretraining per table and seed per process
    return pretrain(table, seed, device=device)


def moved(start, seed, model):
    """A copy of the pretrained ``model`` moved to 56 x 56 as ``start`` says."""
    model = copy.deepcopy(model)
    arguments = STARTS[start][1]
    if arguments is None:
        return model
    # the shuffled table: one fixed permutation for all seeds; random rows: per seed
    draws = attnbook.generator(0 if start == "shuffled" else 1000 + seed)
    return model.resize(56, generator=draws, **arguments)


def fine_tune(model, start, lr, seed):
    """Fine-tune ``model`` (moved as ``start``) for 120 steps of 32 at ``lr``, the same
    batches for every start and rate of a seed; its test accuracy before and every 40
    steps, and its validation accuracy at the end."""
    small = STARTS[start][1] is None  # the unmoved twin trains at 28 x 28

    def images(part):
        x, y = splits()[part]
        return (x if small else upsample(x)), y

    test_x, test_y = images("test")

    def test_accuracy(m):
        return train.accuracy(m, test_x, test_y, batch_size=1000)

    figures = {"test_0": test_accuracy(model)}
    history = train.train_classifier(
        model,
        *images("fit"),
        steps=FT_STEPS,
        batch_size=FT_BATCH,
        lr=lr,
        seed=100 + seed,
        eval_fn=test_accuracy,
        eval_every=EVERY,
    )
    for step, accuracy in zip(history.eval_steps, history.evals, strict=True):
        figures[f"test_{step}"] = accuracy
    figures["val"] = train.accuracy(model.eval(), *images("val"))
    return figures


def run(point, seed, device=None):
    """A "pretrain" point: the table's pretraining at rate ``lr``, its validation and
    test accuracy at 28 x 28. A "finetune" point: the ``start``, fine-tuned at ``lr``
    (:func:`fine_tune`'s figures)."""
    device = device or attnbook.device()
    if point["stage"] == "pretrain":
        model = pretrain(point["table"], seed, point["lr"], device)
        return {
            "val": train.accuracy(model, *splits()["val"]),
            "test": train.accuracy(model, *splits()["test"]),
        }
    table = STARTS[point["start"]][0]
    model = moved(point["start"], seed, _pretrained(table, seed, device))
    return fine_tune(model, point["start"], point["lr"], seed)


def untuned(model, start, seed):  # the moved model's test accuracy, no fine-tuning
    x, y = splits()["test"]
    moved_model = moved(start, seed, model)
    small = STARTS[start][1] is None
    with torch.no_grad():
        return train.accuracy(moved_model, x if small else upsample(x), y)
