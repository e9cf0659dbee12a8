"""Chapter 17's ladder, 17_ladder: from GPT-2 to a Llama-style decoder, one change per
rung, trained on Shakespeare's characters. The rungs, the data and one training, with
the validation loss measured along the way."""

import functools

import attnbook
import torch
import torch.nn.functional as F
from attnbook.data import CharTokenizer, load_shakespeare, random_batch, train_val_split
from attnbook.train import train

L, D, HEADS, LAYERS, BATCH = 32, 64, 4, 2, 16  # context, width, heads, layers, batch
STEPS = 4000  # about 2.8 passes over the training text
EVAL_EVERY = 500  # the validation loss every 500 steps: the curves of the record
RUNGS = {  # each rung: the one before plus one change
    "GPT-2": dict(),
    "+ RoPE": dict(positions="rope"),
    "+ RMSNorm": dict(positions="rope", norm="rms"),
    "+ SwiGLU": dict(positions="rope", norm="rms", activation="swiglu", hidden=171),
    "+ GQA": dict(
        positions="rope", norm="rms", activation="swiglu", hidden=192, num_kv_heads=2
    ),
    "+ QK-norm": dict(
        positions="rope",
        norm="rms",
        activation="swiglu",
        hidden=192,
        num_kv_heads=2,
        qk_norm=True,
    ),
}
MQA = dict(  # beside the ladder: "+ GQA" with one key/value head
    positions="rope", norm="rms", activation="swiglu", hidden=203, num_kv_heads=1
)


@functools.lru_cache(maxsize=1)
def corpus():
    """``(tokenizer, {"train", "val", "test"} -> character ids (N,))``: the held-out
    tenth of the text split in two halves, one to choose rates on, one to compare."""
    text = load_shakespeare()
    tokenizer = CharTokenizer(text)
    train_ids, held_out = train_val_split(tokenizer.encode(text))
    half = len(held_out) // 2
    parts = {"train": train_ids, "val": held_out[:half], "test": held_out[half:]}
    return tokenizer, parts


def held_out_batch(part, device=None):
    """``(x, y)``, each ``(N, L)``: the whole ``"val"`` or ``"test"`` half cut into
    ``N`` windows of ``L`` characters one after another (``y`` is ``x`` moved on by
    one; the few characters left over at the end are left out), on ``device``
    (default: ``attnbook.device()``). No draw: every run is measured on the same
    text."""
    ids = corpus()[1][part]
    n = (len(ids) - 1) // L
    x, y = ids[: n * L].view(n, L), ids[1 : n * L + 1].view(n, L)
    device = device or attnbook.device()
    return x.to(device), y.to(device)


def build(rung, device=None):
    """A fresh ``attnbook.GPT`` of ``rung`` (a key of RUNGS, or ``"MQA"``) on
    ``device`` (default: ``attnbook.device()``)."""
    options = MQA if rung == "MQA" else RUNGS[rung]
    vocab = corpus()[0].vocab_size
    return attnbook.GPT(vocab, D, HEADS, LAYERS, max_len=L, **options).to(
        device or attnbook.device()
    )


def lm_loss(model, batch):
    """Mean next-character cross-entropy of ``model`` on ``batch = (x, y)``."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def held_out_loss(model, batch):
    return lm_loss(model.eval(), batch).item()


def train_rung(rung, rate, seed, steps=STEPS, device=None, eval_fn=None):
    """``rung`` trained for ``steps`` batches of ``BATCH`` windows at rate ``rate``;
    the same batches for every rung and rate of a seed. ``(model, history)``, with
    ``eval_fn(model)`` every ``EVAL_EVERY`` steps in ``history.evals`` if given."""
    device = device or attnbook.device()
    attnbook.seed_everything(seed)
    model = build(rung, device)
    batches = attnbook.generator(seed)
    train_ids = corpus()[1]["train"]
    history = train(
        model,
        lambda: random_batch(train_ids, BATCH, L, generator=batches, device=device),
        lm_loss,
        steps=steps,
        lr=rate,
        show_progress=False,
        eval_fn=eval_fn,
        eval_every=EVAL_EVERY if eval_fn else None,
    )
    return model, history


def run(point, seed, device=None):
    """Train ``point["rung"]`` at ``point["lr"]`` for ``STEPS`` steps: its loss on the
    validation half every ``EVAL_EVERY`` steps (``"val_500"`` ...) and at the end
    (``"val"``), and at the end on the test half (``"test"``)."""
    val = held_out_batch("val", device)
    model, history = train_rung(
        point["rung"], point["lr"], seed, device=device,
        eval_fn=lambda m: held_out_loss(m, val),
    )  # fmt: skip
    figures = {
        f"val_{s}": v for s, v in zip(history.eval_steps, history.evals, strict=True)
    }
    figures["val"] = figures.pop(f"val_{STEPS}")
    figures["test"] = held_out_loss(model, held_out_batch("test", device))
    return figures
