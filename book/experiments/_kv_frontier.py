"""Chapter 18's frontier, 18_kv_economics: test loss against the bytes a model caches a
token, for grouped-query attention with 4, 2 and 1 key/value heads and multi-head
latent attention with latents of 8 to 64 numbers, every model at close to the same
parameters. The models, the data and one training, with the validation loss measured
along the way."""

import attnbook
from attnbook.data import random_batch
from attnbook.train import train
from experiments._ladder import corpus, held_out_loss, lm_loss

L, D, HEADS, LAYERS, BATCH = 64, 64, 4, 2, 16  # context, width, heads, layers, batch
STEPS = 3000  # about four passes over the training text
EVAL_EVERY = 500  # the validation loss every 500 steps: the curves of the record
COMMON = dict(positions="rope", norm="rms", activation="swiglu", bias=False)
ROPE_KEY, HEAD = 8, 16  # MLA's shared RoPE key, and its heads' key and value widths


def latent(rank):
    """MLA's keywords for a latent of ``rank`` numbers."""
    return dict(
        kv_lora_rank=rank, qk_rope_head_dim=ROPE_KEY, qk_nope_head_dim=HEAD,
        v_head_dim=HEAD,
    )  # fmt: skip


MODELS = {  # each with a SwiGLU width that brings it within 0.2% of MHA's parameters
    "MHA": dict(hidden=171),
    "GQA, 2 KV heads": dict(hidden=192, num_kv_heads=2),
    "MQA": dict(hidden=203, num_kv_heads=1),
    "MLA, r=64": dict(hidden=136, mla=latent(64)),
    "MLA, r=32": dict(hidden=168, mla=latent(32)),
    "MLA, r=16": dict(hidden=184, mla=latent(16)),
    "MLA, r=8": dict(hidden=192, mla=latent(8)),
}


def held_out_windows(part, device=None):
    """``(x, y)``, each ``(N, L)``: the whole ``"val"`` or ``"test"`` half cut into
    ``N`` windows of ``L`` characters one after another (``y`` is ``x`` moved on by
    one), on ``device`` (default: ``attnbook.device()``). Every run is measured on the
    same text."""
    ids = corpus()[1][part]
    n = (len(ids) - 1) // L
    x, y = ids[: n * L].view(n, L), ids[1 : n * L + 1].view(n, L)
    device = device or attnbook.device()
    return x.to(device), y.to(device)


def build(name, device=None):
    """A fresh ``attnbook.GPT`` of ``MODELS[name]`` on ``device`` (default:
    ``attnbook.device()``)."""
    vocab = corpus()[0].vocab_size
    return attnbook.GPT(
        vocab, D, HEADS, LAYERS, max_len=L, **COMMON, **MODELS[name]
    ).to(device or attnbook.device())


def train_model(name, rate, seed, steps=STEPS, device=None, eval_fn=None):
    """``MODELS[name]`` trained for ``steps`` batches of ``BATCH`` windows at rate
    ``rate``; the same batches for every model and rate of a seed. ``(model,
    history)``, with ``eval_fn(model)`` every ``EVAL_EVERY`` steps in
    ``history.evals`` if given."""
    device = device or attnbook.device()
    attnbook.seed_everything(seed)
    model = build(name, device)
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
    """Train ``point["model"]`` at ``point["lr"]`` for ``STEPS`` steps: its loss on
    the validation half every ``EVAL_EVERY`` steps (``"val_500"`` ...) and at the end
    (``"val"``), and at the end on the test half (``"test"``)."""
    val = held_out_windows("val", device)
    model, history = train_model(
        point["model"], point["lr"], seed, device=device,
        eval_fn=lambda m: held_out_loss(m, val),
    )  # fmt: skip
    figures = {
        f"val_{s}": v for s, v in zip(history.eval_steps, history.evals, strict=True)
    }
    figures["val"] = figures.pop(f"val_{STEPS}")
    figures["test"] = held_out_loss(model, held_out_windows("test", device))
    return figures
