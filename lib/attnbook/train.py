"""One small training loop for every chapter: AdamW, warm-up then cosine decay, gradient
clipping.

::

    history = train(model, batches, loss_fn, steps=500, lr=3e-3)

- ``batches``: a callable returning one batch per call (e.g. ``lambda:
  random_batch(...)``), or an iterable/iterator yielding at least ``steps`` batches. A
  batch is anything ``loss_fn`` accepts; tensors in it (also inside tuples, lists and
  dicts) are moved to the model's device.
- ``loss_fn(model, batch) -> loss``: a scalar tensor, e.g. the cross-entropy of
  ``model(x)`` against ``y``.
- ``eval_fn(model) -> value`` (optional): run every ``eval_every`` steps and after the
  last one, in ``eval()`` mode under ``torch.no_grad()``; ``value`` is a number or a
  dict of numbers.

For classifiers (the ViT and the CNN of chapter 9): :func:`train_classifier` draws
random batches of ``(inputs, labels)`` and trains with cross-entropy through
:func:`train`; :func:`accuracy` scores a model and :func:`count_parameters` counts its
trainable parameters.

The learning rate follows :func:`lr_at`: a linear warm-up over ``warmup`` steps to
``lr``, then a half cosine down to ``min_lr_ratio * lr`` at the end. Weight decay
applies to matrices only (weights of linear layers and embeddings), not to biases or
LayerNorm parameters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .utils import (
    check_non_negative_int,
    check_positive_int,
    eval_mode,
    generator,
    progress,
)


def lr_at(
    step: int, *, steps: int, lr: float, warmup: int = 0, min_lr_ratio: float = 0.1
) -> float:
    """The learning rate at ``step`` (0-based) of a run of ``steps`` steps.

    - warm-up, ``step < warmup``: ``lr * (step + 1) / warmup`` (reaches ``lr`` at ``step
      = warmup - 1``);
    - then cosine: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with
      ``p = (step - warmup) / (steps - warmup)``, so ``lr`` at ``step = warmup`` and
      ``min_lr = min_lr_ratio * lr`` at ``step = steps``.
    """
    steps, warmup = (
        check_positive_int("steps", steps),
        check_non_negative_int("warmup", warmup),
    )
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if warmup >= steps:
        raise ValueError(f"warmup must lie in [0, steps={steps}), got {warmup}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(1.0, (step - warmup) / (steps - warmup))
    min_lr = min_lr_ratio * lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * p))


@dataclass
class History:
    """What :func:`train` returns: the loss and learning rate of every step, and the
    evaluations."""

    loss: list[float] = field(default_factory=list)  # training loss at each step
    lr: list[float] = field(default_factory=list)  # learning rate used at each step
    # number of steps done at each evaluation
    eval_steps: list[int] = field(default_factory=list)
    evals: list[Any] = field(default_factory=list)  # what eval_fn returned then
    seconds: float = 0.0  # wall-clock time of the whole run

    def smoothed_loss(self, window: int = 20) -> list[float]:
        """Running mean of the training loss over the last ``window`` steps (for
        plots)."""
        out, total = [], 0.0
        for i, value in enumerate(self.loss):
            total += value
            if i >= window:
                total -= self.loss[i - window]
            out.append(total / min(i + 1, window))
        return out


def to_device(batch, device):
    """Move every tensor in ``batch`` (a tensor, or tuples/lists/dicts of them) to
    ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW with weight decay on the parameters with two or more dimensions only;
    ``fused=True``: one kernel updates every parameter (the book's models are small, so
    a step's per-tensor overhead counts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.99), fused=True
    )


def _batch_source(batches, steps: int) -> Callable[[], Any]:
    """``batches`` as a function that gives the next batch: a callable as it is, an
    iterable's batches in turn (one that runs out before ``steps`` raises, saying
    after how many)."""
    if callable(batches):
        return batches
    try:
        iterator = iter(batches)
    except TypeError:
        raise TypeError(
            f"batches must be a callable or an iterable, got {type(batches).__name__}"
        ) from None
    given = 0

    def next_batch():
        nonlocal given
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError(
                f"batches ran out after {given} of {steps} steps; pass a callable or "
                "an iterable with at least `steps` batches"
            ) from None
        given += 1
        return batch

    return next_batch


def train(
    model: nn.Module,
    batches: Callable[[], Any] | Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    steps: int,
    lr: float,
    warmup: int | None = None,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.01,
    clip: float | None = 1.0,
    eval_fn: Callable[[nn.Module], Any] | None = None,
    eval_every: int | None = None,
    device: torch.device | str | None = None,
    desc: str = "training",
    show_progress: bool = True,
) -> History:
    """Train ``model`` for ``steps`` optimizer steps; return a :class:`History`.

    ``warmup`` defaults to 5 % of ``steps``; ``clip`` is the maximum global gradient
    norm (``None`` to switch clipping off); ``device`` moves the model there first
    (default: where it already is). The progress bar shows the training loss, averaged
    over the last 10 steps.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    steps = check_positive_int("steps", steps)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}")
    warmup = steps // 20 if warmup is None else check_non_negative_int("warmup", warmup)
    if warmup >= steps:
        raise ValueError(f"warmup must be an int in [0, steps={steps}), got {warmup!r}")
    if eval_every is not None:
        eval_every = check_positive_int("eval_every", eval_every)
    next_batch = _batch_source(batches, steps)
    if device is not None:
        model.to(device)
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, lr, weight_decay)
    history = History()

    def evaluate(done: int) -> None:
        model.eval()
        with torch.no_grad():
            history.evals.append(eval_fn(model))
        history.eval_steps.append(done)
        model.train()

    start = time.perf_counter()
    model.train()
    bar = progress(range(steps), desc=desc, disable=not show_progress, mininterval=0.5)
    recent = []  # losses of the last steps, as tensors (read back only every 10 steps)
    for step in bar:
        rate = lr_at(step, steps=steps, lr=lr, warmup=warmup, min_lr_ratio=min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = rate
        loss = loss_fn(model, to_device(next_batch(), device))
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        recent.append(loss.detach())
        history.lr.append(rate)
        if len(recent) == 10 or step == steps - 1:
            values = torch.stack(recent).float().cpu().tolist()
            history.loss.extend(values)
            recent = []
            bar.set_description(
                f"{desc} (loss {sum(values) / len(values):.3f})", refresh=False
            )
        if (
            eval_fn is not None
            and eval_every is not None
            and (step + 1) % eval_every == 0
            and step < steps - 1
        ):
            evaluate(step + 1)
    bar.close()
    if eval_fn is not None:
        evaluate(steps)
    history.seconds = time.perf_counter() - start
    return history


# --------------------------------------------------------------------------------------
# Classifiers: train with cross-entropy, score by accuracy


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _check_dataset(inputs, labels) -> None:
    if (
        not isinstance(inputs, torch.Tensor)
        or inputs.dim() < 1
        or not inputs.is_floating_point()
    ):
        raise ValueError(
            f"images must be a float tensor (N, ...), e.g. (N, C, H, W), got "
            f"{getattr(inputs, 'dtype', type(inputs).__name__)} "
            f"{tuple(getattr(inputs, 'shape', ()))}"
        )
    if (
        not isinstance(labels, torch.Tensor)
        or labels.dtype != torch.long
        or labels.shape != inputs.shape[:1]
    ):
        raise ValueError(
            "labels must be an int64 tensor (N,) matching images "
            f"{tuple(inputs.shape)}, got "
            f"{getattr(labels, 'dtype', type(labels).__name__)} "
            f"{tuple(getattr(labels, 'shape', ()))}"
        )


def accuracy(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 500
) -> float:
    """Fraction of ``images (N, ...)`` whose predicted class (arg max of the logits) is
    ``labels (N,)``.

    Runs in eval mode without gradients, ``batch_size`` images at a time, on the model's
    device; the caller's training mode is restored, even after an error."""
    _check_dataset(images, labels)
    batch_size = check_positive_int("batch_size", batch_size)
    device = next(model.parameters()).device
    correct = torch.zeros((), dtype=torch.long, device=device)
    with eval_mode(model):
        for start in range(0, len(images), batch_size):
            x = images[start : start + batch_size].to(device)  # (b, ...)
            y = labels[start : start + batch_size].to(device)  # (b,)
            # counted on the device: one read-back at the end
            correct += (model(x).argmax(dim=-1) == y).sum()
    return int(correct) / len(images)


def train_classifier(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    steps: int,
    batch_size: int = 128,
    lr: float = 3e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eval_fn: Callable[[nn.Module], Any] | None = None,
    eval_every: int | None = None,
    desc: str = "training",
    show_progress: bool = False,
) -> History:
    """Train ``model`` on ``images (N, ...)``, ``labels (N,)`` with cross-entropy for
    ``steps`` steps.

    Each step draws ``batch_size`` random images (with :func:`attnbook.generator` seeded
    by ``seed``, so ``ATTNBOOK_SEED_OFFSET`` changes them) and, if given, passes them
    through ``augment`` (``(b, ...) -> (b, ...)``, e.g. a wrapper of
    :func:`attnbook.data.random_shift`); the loop is :func:`train` (AdamW, warm-up then
    cosine decay, gradient clipping), which calls ``eval_fn(model)`` every
    ``eval_every`` steps and at the end. Returns its :class:`History`."""
    _check_dataset(images, labels)
    batch_size = check_positive_int("batch_size", batch_size)
    if augment is not None and not callable(augment):
        raise TypeError(f"augment must be callable, got {type(augment).__name__}")
    device = next(model.parameters()).device
    images, labels = images.to(device), labels.to(device)
    g = generator(seed)

    def batch():
        # (batch_size,)
        index = torch.randint(len(images), (batch_size,), generator=g).to(device)
        x = images[index]  # (batch_size, ...)
        if augment is not None:
            shape, x = x.shape, augment(x)
            if x.shape != shape:
                raise ValueError(
                    f"augment must keep the batch's shape {tuple(shape)}, got "
                    f"{tuple(x.shape)}"
                )
        return x, labels[index]

    def loss_fn(model, batch):
        x, y = batch  # (b, ...), (b,)
        return F.cross_entropy(model(x), y)

    return train(
        model,
        batch,
        loss_fn,
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
        eval_fn=eval_fn,
        eval_every=eval_every,
        desc=desc,
        show_progress=show_progress,
    )


__all__ = [
    "History",
    "accuracy",
    "count_parameters",
    "lr_at",
    "make_optimizer",
    "to_device",
    "train",
    "train_classifier",
]
