"""Chapter 17's ladder, 17_ladder: from GPT-2 to a Llama-style decoder, one change per
rung, trained on Shakespeare's characters. The rungs, the data and one training of 150
steps."""

import functools

import attnbook
import torch
import torch.nn.functional as F
from attnbook.data import CharTokenizer, load_shakespeare, random_batch, train_val_split
from attnbook.train import train

L, D, HEADS, LAYERS, BATCH = 32, 64, 4, 2, 16  # context, width, heads, layers, batch
STEPS = 150  # the page's training on a CPU
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
HELD_OUT_SEEDS = {"val": 998, "test": 999}  # the windows of each held-out half


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
    """``(x, y)``, each ``(128, L)``: 128 fixed windows of the ``"val"`` or ``"test"``
    half, on ``device`` (default: ``attnbook.device()``). The same windows under every
    seed offset: a run with other seeds is measured on the text the record was."""
    device = device or attnbook.device()
    ids = corpus()[1][part]
    draws = torch.Generator().manual_seed(HELD_OUT_SEEDS[part])  # no offset: data
    return random_batch(ids, 128, L, generator=draws, device=device)


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


def train_rung(rung, rate, seed, steps=STEPS, device=None):
    """``rung`` trained for ``steps`` batches of ``BATCH`` windows at rate ``rate``;
    the same batches for every rung and rate of a seed."""
    device = device or attnbook.device()
    attnbook.seed_everything(seed)
    model = build(rung, device)
    batches = attnbook.generator(seed)
    train_ids = corpus()[1]["train"]
    train(
        model,
        lambda: random_batch(train_ids, BATCH, L, generator=batches, device=device),
        lm_loss,
        steps=steps,
        lr=rate,
        show_progress=False,
    )
    return model


def run(point, seed, device=None):
    """Train ``point["rung"]`` at ``point["lr"]``; its loss on the validation half."""
    model = train_rung(point["rung"], point["lr"], seed, device=device)
    return {"val": held_out_loss(model, held_out_batch("val", device))}
