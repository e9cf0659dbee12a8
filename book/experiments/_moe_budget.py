"""Chapter 19's comparison, 19_mixture_of_experts: a mixture of experts (4 SwiGLU
experts of width 96, top-2, the Switch Transformer's balancing loss weighted 0.01)
against dense SwiGLU networks of equal active (width 192) and equal total (width 384)
parameters, the rest of the model the same. The models and one training, with the
validation loss measured along the way."""

import attnbook
from attnbook.data import random_batch
from attnbook.experts import aux_loss, record_routing
from attnbook.train import train
from experiments._ladder import corpus, held_out_batch, held_out_loss, lm_loss

L, D, HEADS, LAYERS, BATCH = 32, 64, 4, 2, 16  # context, width, heads, layers, batch
STEPS = 4000  # about 2.8 passes over the training text
EVAL_EVERY = 500  # the validation loss every 500 steps: the curves of the record
E, K, EXPERT = 4, 2, 96  # experts, experts a token, an expert's width
BALANCE = 0.01  # the balancing loss's weight, as in the Switch Transformer
MOE = "MoE, 4 experts, top-2"
MODELS = {  # name: the GPT keywords that differ
    "dense, equal active": dict(hidden=K * EXPERT),
    MOE: dict(hidden=EXPERT, experts=dict(num_experts=E, top_k=K)),
    "dense, equal total": dict(hidden=E * EXPERT),
}


def build(name, device=None):
    """A fresh ``attnbook.GPT`` with ``MODELS[name]``'s feed-forward networks on
    ``device`` (default: ``attnbook.device()``)."""
    vocab = corpus()[0].vocab_size
    return attnbook.GPT(
        vocab, D, HEADS, LAYERS, max_len=L, positions="rope", norm="rms",
        activation="swiglu", bias=False, **MODELS[name],
    ).to(device or attnbook.device())  # fmt: skip


def training_loss(model, batch):
    """The language-modelling loss, plus ``BALANCE`` times the balancing loss for a
    model with experts."""
    if model.config.experts is None:
        return lm_loss(model, batch)
    with record_routing(model) as routings:  # each MoE layer's, in this forward
        loss = lm_loss(model, batch)
    return loss + BALANCE * aux_loss(routings)


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
        training_loss,
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
    val = held_out_batch("val", device)
    model, history = train_model(
        point["model"], point["lr"], seed, device=device,
        eval_fn=lambda m: held_out_loss(m, val),
    )  # fmt: skip
    figures = {
        f"val_{s}": v for s, v in zip(history.eval_steps, history.evals, strict=True)
    }
    figures["val"] = figures.pop(f"val_{STEPS}")
    figures["test"] = held_out_loss(model, held_out_batch("test", device))
    return figures
