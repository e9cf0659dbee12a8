"""The training loop: the schedule, a loss that falls, evaluations, and clear errors for bad arguments."""

import math

import pytest
import torch
import torch.nn.functional as F
from attnbook import GPT
from attnbook.train import History, lr_at, to_device, train


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
    assert lr_at(5, steps=5, lr=0.1, min_lr_ratio=0.0) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "steps"),
        ({"lr": 0.0}, "lr"),
        ({"warmup": 10}, "warmup"),
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


def test_weight_decay_spares_biases_and_norms():
    model, batch, loss_fn = tiny_problem()
    norm_before = model.blocks[0].norm1.weight.detach().clone()
    train(model, lambda: batch, lambda m, b: 0.0 * loss_fn(m, b), steps=5, lr=1e-1, weight_decay=0.5,
          show_progress=False)
    torch.testing.assert_close(model.blocks[0].norm1.weight, norm_before)  # zero gradient, no decay: unchanged


def test_to_device_moves_nested_tensors():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, "cpu")
    assert moved["n"] == 3 and isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
