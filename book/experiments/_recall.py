"""Chapter 20's recall: ``attnbook.MixerModel`` with softmax attention, linear attention
or Mamba trained on multi-query associative recall, its recall measured along the
way."""

import attnbook
import torch
from attnbook.data import associative_recall
from attnbook.mixers import recall_by_pairs, recall_loss, train_recall

VOCAB, LENGTH, MAX_PAIRS = 64, 32, 8  # as on the pages
STEPS = 6000
EVAL_EVERY = 1000  # recall on the validation sequences every 1,000 steps
HELD_OUT_SEEDS = {"val": 998, "test": 999}  # the sequences of each, the same every run
VAL_LOSS_SEED = 997  # the validation sequences the loss is measured on


def build(mixer, state, device=None):
    """A fresh ``MixerModel`` (``d = 32``, two layers): ``mixer`` ``"softmax"``,
    ``"linear"`` or ``"mamba"``, the last with ``state`` numbers of state per
    channel."""
    sizes = {"state_size": state} if mixer == "mamba" else {}
    model = attnbook.MixerModel(VOCAB, LENGTH, mixer, **sizes)
    return model.to(device or attnbook.device())


def recall(model, part):
    """``(MAX_PAIRS,)`` list: the share of queries answered right with 1 .. 8 pairs, on
    256 sequences each of the ``"val"`` or ``"test"`` sequences (no seed offset: the
    same sequences for every run)."""
    draws = torch.Generator().manual_seed(HELD_OUT_SEEDS[part])
    return recall_by_pairs(model, MAX_PAIRS, generator=draws)


@torch.no_grad()
def validation_loss(model):
    """The loss at the queries (``recall_loss``) on 256 validation sequences for each
    number of pairs, 1 .. 8, averaged: it tells apart rates whose recall ties."""
    draws = torch.Generator().manual_seed(VAL_LOSS_SEED)
    device = next(model.parameters()).device
    losses = []
    for pairs in range(1, MAX_PAIRS + 1):
        batch = associative_recall(256, pairs, pairs, VOCAB, LENGTH, generator=draws)
        losses.append(recall_loss(model.eval(), [t.to(device) for t in batch]).item())
    return sum(losses) / MAX_PAIRS


def fit(point, seed, device=None, eval_fn=None):
    """``point["mixer"]`` (with ``point["state"]``) trained by
    ``attnbook.mixers.train_recall`` for ``STEPS`` steps at rate ``point["lr"]``;
    ``(model, history)``, ``eval_fn(model)`` every ``EVAL_EVERY`` steps in
    ``history.evals``."""
    attnbook.seed_everything(seed)
    model = build(point["mixer"], point["state"], device)
    history = train_recall(
        model, steps=STEPS, lr=point["lr"], max_pairs=MAX_PAIRS,
        generator=attnbook.generator(seed),  # the same sequences for every model
        eval_fn=eval_fn, eval_every=EVAL_EVERY if eval_fn else None,
    )  # fmt: skip
    return model.eval(), history


def run(point, seed, device=None):
    """:func:`fit`; the mean validation recall every ``EVAL_EVERY`` steps
    (``"val_1000"`` ...) and at the end (``"val"``), the test recall at each number of
    pairs (``"test_1"`` .. ``"test_8"``), the loss on validation sequences at the end
    (``"val_loss"``, :func:`validation_loss`) and the training loss of the last 100
    steps (``"loss"``)."""
    model, history = fit(
        point, seed, device, eval_fn=lambda m: sum(recall(m, "val")) / MAX_PAIRS
    )
    figures = {
        f"val_{s}": v for s, v in zip(history.eval_steps, history.evals, strict=True)
    }
    figures["val"] = figures.pop(f"val_{STEPS}")
    for pairs, share in enumerate(recall(model, "test"), start=1):
        figures[f"test_{pairs}"] = share
    figures["val_loss"] = validation_loss(model)
    last = history.loss[-100:]
    figures["loss"] = sum(last) / len(last)
    return figures
