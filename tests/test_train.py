"""The training loop: the schedule, a loss that falls, evaluations, weight decay, clear errors for bad
arguments; the classifier helpers (train_classifier, accuracy, count_parameters)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import GPT
from attnbook.train import (
    History,
    accuracy,
    count_parameters,
    lr_at,
    to_device,
    train,
    train_classifier,
)
from torch import nn


def test_schedule_warmup_then_cosine():
    steps, lr, warmup = 100, 1e-3, 10
    at = [lr_at(s, steps=steps, lr=lr, warmup=warmup, min_lr_ratio=0.1) for s in range(steps + 1)]
    assert at[0] == pytest.approx(lr / warmup)  # first step: one warm-up increment
    assert at[warmup - 1] == pytest.approx(lr)  # warm-up ends at the peak
    assert at[warmup] == pytest.approx(lr)  # cosine starts at the peak
    assert at[(warmup + steps) // 2] == pytest.approx(0.55 * lr)  # half way: the middle of [min_lr, lr]
    assert at[steps] == pytest.approx(0.1 * lr)  # the end: min_lr
    assert all(a < b for a, b in zip(at[: warmup - 1], at[1:warmup], strict=True))  # rises linearly
    assert all(a >= b for a, b in zip(at[warmup:-1], at[warmup + 1 :], strict=True))  # then only falls


def test_schedule_without_warmup_starts_at_peak():
    assert lr_at(0, steps=5, lr=0.1) == pytest.approx(0.1)
    assert lr_at(0, steps=np.int64(5), lr=0.1, warmup=np.int64(0)) == pytest.approx(0.1)  # NumPy ints are ints
    assert lr_at(5, steps=5, lr=0.1, min_lr_ratio=0.0) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "steps must be a positive int, got 0"),
        ({"steps": True}, "steps must be a positive int, got True"),
        ({"lr": 0.0}, "lr"),
        ({"warmup": 10}, "warmup"),
        ({"warmup": -1}, "warmup must be an int >= 0, got -1"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_schedule_bad_arguments(kwargs, message):
    args = {"steps": 10, "lr": 1e-3, "warmup": 0, "min_lr_ratio": 0.1} | kwargs
    with pytest.raises(ValueError, match=message):
        lr_at(0, **args)


def tiny_problem(seed=0):
    """A GPT that must memorize two fixed sequences: the loss can fall fast."""
    torch.manual_seed(seed)
    model = GPT(vocab_size=11, d_model=32, num_heads=4, num_layers=1, max_len=16)
    data = torch.randint(11, (2, 17), generator=torch.Generator().manual_seed(seed))
    batch = (data[:, :-1], data[:, 1:])

    def loss_fn(m, b):
        x, y = b
        return F.cross_entropy(m(x).flatten(0, 1), y.flatten())  # (B*T, V) vs (B*T,)

    return model, batch, loss_fn


def test_loss_falls_on_a_tiny_batch():
    model, batch, loss_fn = tiny_problem()
    history = train(model, lambda: batch, loss_fn, steps=60, lr=1e-2, show_progress=False)
    assert isinstance(history, History)
    assert len(history.loss) == len(history.lr) == 60
    assert history.loss[0] == pytest.approx(math.log(11), rel=0.2)  # starts near a uniform guess
    assert history.loss[-1] < 0.3 * history.loss[0]  # and memorizes the batch
    assert history.seconds > 0
    assert len(history.smoothed_loss(5)) == 60


def test_batches_from_an_iterator_and_eval_hook():
    model, batch, loss_fn = tiny_problem()
    calls = []

    def eval_fn(m):
        calls.append(m.training)
        return {"loss": float(loss_fn(m, batch))}

    history = train(model, iter([batch] * 20), loss_fn, steps=20, lr=1e-2, eval_fn=eval_fn, eval_every=5,
                    show_progress=False)
    assert history.eval_steps == [5, 10, 15, 20]
    assert calls == [False] * 4  # evaluated in eval mode
    assert model.training  # and put back into training mode
    assert history.evals[-1]["loss"] < history.evals[0]["loss"]


def test_iterator_that_runs_out_raises():
    model, batch, loss_fn = tiny_problem()
    with pytest.raises(ValueError, match="ran out after 3 of 10 steps"):
        train(model, [batch] * 3, loss_fn, steps=10, lr=1e-2, show_progress=False)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"steps": 0}, ValueError, "steps"),
        ({"steps": 2.5}, ValueError, "steps"),
        ({"lr": 0}, ValueError, "lr"),
        ({"lr": -1e-3}, ValueError, "lr"),
        ({"warmup": 10}, ValueError, "warmup"),
        ({"clip": 0}, ValueError, "clip"),
        ({"weight_decay": -1}, ValueError, "weight_decay"),
        ({"eval_every": 0}, ValueError, "eval_every"),
        ({"eval_every": 2.5}, ValueError, "eval_every must be a positive int"),
        ({"warmup": 1.5}, ValueError, "warmup must be an int >= 0"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    model, batch, loss_fn = tiny_problem()
    args = {"steps": 10, "lr": 1e-3, "show_progress": False} | kwargs
    with pytest.raises(error, match=message):
        train(model, lambda: batch, loss_fn, **args)


def test_bad_model_batches_and_loss():
    model, batch, loss_fn = tiny_problem()
    with pytest.raises(TypeError, match="nn.Module"):
        train(lambda x: x, lambda: batch, loss_fn, steps=1, lr=1e-3)
    with pytest.raises(TypeError, match="callable or an iterable"):
        train(model, 3, loss_fn, steps=1, lr=1e-3, show_progress=False)
    with pytest.raises(ValueError, match="scalar"):
        train(model, lambda: batch, lambda m, b: m(b[0]).mean(-1), steps=1, lr=1e-3, show_progress=False)


def test_weight_decay_is_decoupled_and_spares_biases_and_norms():
    """With a zero gradient AdamW's update is 0, so only the decoupled decay moves a weight: each step
    multiplies every matrix by (1 - lr_t * weight_decay), lr_t from the loop's schedule (lr_at, with
    its default warm-up of steps // 20); biases and norm parameters (1-D) are not decayed at all."""
    model, batch, loss_fn = tiny_problem()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    steps, lr, weight_decay = 40, 1e-1, 0.5
    history = train(model, lambda: batch, lambda m, b: 0.0 * loss_fn(m, b), steps=steps, lr=lr,
                    weight_decay=weight_decay, show_progress=False)
    rates = [lr_at(step, steps=steps, lr=lr, warmup=steps // 20) for step in range(steps)]
    assert history.lr == pytest.approx(rates, rel=1e-12)
    factor = math.prod(1 - rate * weight_decay for rate in rates)
    assert factor < 0.5  # far from 1: a decay that is not applied (or applied once) cannot pass
    decayed = spared = 0
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-5, atol=1e-7, msg=name)
            decayed += 1
        else:
            assert torch.equal(p.detach(), before[name]), name  # zero gradient, no decay: bit for bit unchanged
            spared += 1
    assert decayed >= 4 and spared >= 4  # embeddings and linear weights; biases and norms


def test_to_device_moves_nested_tensors():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, "cpu")
    assert moved["n"] == 3 and isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)


# ---------------------------------------------------------------------------------------------
# classifiers


def test_count_parameters_counts_trainable_ones_only():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    assert count_parameters(model) == (3 * 4 + 4) + (4 * 2 + 2)
    model[0].weight.requires_grad_(False)
    assert count_parameters(model) == 4 + (4 * 2 + 2)


class Threshold(nn.Module):
    """Class 1 when the first feature is above 5.5: a classifier whose accuracy is known exactly."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):  # (B, F) -> (B, 2)
        score = self.scale * (x[:, 0] - 5.5)  # (B,)
        return torch.stack([-score, score], dim=-1)


def test_accuracy_is_the_exact_fraction_and_restores_the_mode():
    inputs = torch.arange(11.0)[:, None]  # 0, 1, ..., 10: predicted 1 for the last five
    labels = torch.ones(11, dtype=torch.long)
    model = Threshold().train()
    assert accuracy(model, inputs, labels, batch_size=3) == 5 / 11  # batches of 3, 3, 3, 2
    assert accuracy(model, inputs, 1 - labels, batch_size=np.int64(4)) == 6 / 11
    assert model.training
    with pytest.raises(ValueError, match="labels must be an int64"):
        accuracy(model, inputs, labels.float())
    with pytest.raises(ValueError, match="images must be a float tensor"):
        accuracy(model, labels, labels)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        accuracy(model, inputs, labels, batch_size=0)
    broken = Threshold().train()
    broken.forward = lambda x: x[:, 99]  # an error inside: the mode is restored all the same
    with pytest.raises(IndexError):
        accuracy(broken, inputs, labels)
    assert broken.training


def test_train_classifier_draws_seeded_batches(monkeypatch):
    monkeypatch.delenv("ATTNBOOK_SEED_OFFSET", raising=False)
    inputs = torch.rand(32, 3)
    labels = (inputs[:, 0] > 0.5).long()

    def run(seed):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        history = train_classifier(model, inputs, labels, steps=5, batch_size=8, seed=seed)
        return history.loss, model.weight.detach()

    loss_a, weight_a = run(0)
    loss_b, weight_b = run(0)
    assert loss_a == loss_b and torch.equal(weight_a, weight_b)  # the same batches for the same seed
    loss_c, _ = run(1)
    assert loss_c != loss_a
    monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", "1")
    loss_shifted = run(0)[0]  # seed 0 at offset 1 draws other batches than any seed of offset 0
    assert loss_shifted != loss_a and loss_shifted != loss_c
    assert run(0)[0] == loss_shifted
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        train_classifier(nn.Linear(3, 2), inputs, labels, steps=5, batch_size=0)
    with pytest.raises(ValueError, match="labels must be an int64 tensor .N,. matching"):
        train_classifier(nn.Linear(3, 2), inputs, labels[:5], steps=5)


def test_train_classifier_augments_each_batch_and_evaluates():
    inputs = torch.rand(32, 3)
    labels = (inputs[:, 0] > 0.5).long()
    seen = []

    def augment(x):
        seen.append(x.clone())
        return x + 1.0

    model = nn.Linear(3, 2)
    calls = []
    history = train_classifier(
        model,
        inputs,
        labels,
        steps=6,
        batch_size=8,
        augment=augment,
        eval_fn=lambda m: calls.append(m.training) or len(calls),
        eval_every=2,
    )
    assert len(seen) == 6 and all(x.shape == (8, 3) for x in seen)
    # the batches handed to augment are rows of the training set
    assert all((x[:, None] == inputs[None]).all(-1).any(1).all() for x in seen)
    assert history.eval_steps == [2, 4, 6] and history.evals == [1, 2, 3]
    assert calls == [False, False, False]  # evaluated in eval mode
    with pytest.raises(TypeError, match="augment must be callable, got int"):
        train_classifier(model, inputs, labels, steps=2, augment=3)
    with pytest.raises(
        ValueError, match=r"augment must keep the batch's shape \(8, 3\)"
    ):
        train_classifier(
            model, inputs, labels, steps=2, batch_size=8, augment=lambda x: x[:4]
        )
