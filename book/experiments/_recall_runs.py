"""Chapter 20's recall at the budgets its pages cannot run: ``attnbook.MixerModel`` with
softmax attention, linear attention or Mamba, trained on multi-query associative recall
for ``point["steps"]`` steps, with ``point["heads"]`` heads (attention) or
``point["state"]`` numbers of state per channel (Mamba). The task, the held-out
sequences and the figures are ``_recall``'s (recall_budget), so the records compare."""

import attnbook
from attnbook.mixers import train_recall
from experiments._recall import LENGTH, MAX_PAIRS, VOCAB, recall, validation_loss

EVALS = 10  # recall on the validation sequences ten times a training


class _Stop(Exception):
    """Raised by :func:`prefix`'s evaluation to end a training early."""


def build(point, device=None):
    """A fresh ``MixerModel`` (``d = 32``, two layers) for ``point``: ``"mixer"``
    (``"softmax"``, ``"linear"`` or ``"mamba"``), with ``"heads"`` heads (default 2) or
    ``"state"`` numbers of state per channel."""
    if point["mixer"] == "mamba":
        sizes = {"state_size": point["state"]}
    else:
        sizes = {"num_heads": point.get("heads", 2)}
    model = attnbook.MixerModel(VOCAB, LENGTH, point["mixer"], **sizes)
    return model.to(device or attnbook.device())


def fit(point, seed, device=None, eval_fn=None):
    """``build(point)`` trained by ``attnbook.mixers.train_recall`` for
    ``point["steps"]`` steps at rate ``point["lr"]``; ``(model, history)``,
    ``eval_fn(model)`` ``EVALS`` times, evenly spaced, in ``history.evals``."""
    attnbook.seed_everything(seed)
    model = build(point, device)
    history = train_recall(
        model, steps=point["steps"], lr=point["lr"], max_pairs=MAX_PAIRS,
        generator=attnbook.generator(seed),  # the same sequences for every model
        eval_fn=eval_fn, eval_every=point["steps"] // EVALS if eval_fn else None,
    )  # fmt: skip
    return model.eval(), history


def _mean_val_recall(model):
    return sum(recall(model, "val")) / MAX_PAIRS


def prefix(point, seed, device=None) -> float:
    """The mean validation recall after the first tenth of :func:`fit`'s steps, the
    rate schedule that of the whole run: the record's first ``"val_<step>"``, again,
    in a tenth of the time."""

    def evaluate_then_stop(model):
        raise _Stop(_mean_val_recall(model))

    try:
        fit(point, seed, device, eval_fn=evaluate_then_stop)
    except _Stop as stop:
        return stop.args[0]
    raise AssertionError("the training ended before its first evaluation")


def run(point, seed, device=None):
    """:func:`fit`; the mean validation recall every tenth of the steps (``"val_600"``
    ... at 6,000 steps) and at the end (``"val"``), the test recall at each number of
    pairs (``"test_1"`` .. ``"test_8"``), the loss on validation sequences at the end
    (``"val_loss"``) and the training loss of the last 100 steps (``"loss"``)."""
    model, history = fit(point, seed, device, eval_fn=_mean_val_recall)
    figures = {
        f"val_{s}": v for s, v in zip(history.eval_steps, history.evals, strict=True)
    }
    figures["val"] = figures.pop(f"val_{point['steps']}")
    for pairs, share in enumerate(recall(model, "test"), start=1):
        figures[f"test_{pairs}"] = share
    figures["val_loss"] = validation_loss(model)
    last = history.loss[-100:]
    figures["loss"] = sum(last) / len(last)
    return figures
