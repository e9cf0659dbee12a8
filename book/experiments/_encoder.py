"""Chapter 6's encoder, 06_encoder_only: the page's masked-LM encoder, its
pretraining, and its training as a classifier of real against shuffled lines."""

import functools

import attnbook
import torch
import torch.nn.functional as F
from attnbook import data
from attnbook.train import train

T, SHORT, BATCH = 48, 40, 32  # window, longest line (characters), batch
PRETRAIN_STEPS, PRETRAIN_LR = 800, 3e-3  # the page's masked-LM pretraining


@functools.lru_cache(maxsize=1)
def corpus():
    """``(tokenizer, train_ids (N,), {"fit", "val", "test"} -> (lines, labels (n,)))``:
    the page's text, tokenizer and split; plain lines of at most SHORT characters, half
    of them shuffled. The page's training lines are split in two: the lines of the last
    tenth of the training text are the validation lines (to choose a rate on), the rest
    are trained on; the test lines are the page's, from the held-out text."""
    text = data.load_shakespeare()
    tokenizer = data.CharTokenizer.from_text(text, specials=["<pad>", "<mask>"])
    train_ids, _ = data.train_val_split(tokenizer.encode(text), val_fraction=0.1)
    split_at = len(train_ids)
    fit_at = int(0.9 * split_at)

    def short_lines(part, seed):
        lines = data.verse_lines(part, plain=True)
        return data.shuffled_lines([x for x in lines if len(x) <= SHORT], seed=seed)

    parts = {
        "fit": short_lines(text[:fit_at], seed=0),
        "val": short_lines(text[fit_at:split_at], seed=2),
        "test": short_lines(text[split_at:], seed=1),
    }
    return tokenizer, train_ids, parts


def new_encoder(seed):
    """The page's encoder (d = 64, 4 heads, 2 blocks, feed-forward 2d), initialised
    from ``seed``."""
    tokenizer = corpus()[0]
    attnbook.seed_everything(seed)
    return attnbook.EncoderOnlyModel(
        len(tokenizer), 64, 4, 2, max_len=T, num_classes=2, hidden=128
    )


def pretrain(model, seed):
    """The page's masked-LM pretraining: PRETRAIN_STEPS steps of BATCH windows of T
    characters, batches drawn from ``seed``."""
    tokenizer, train_ids, _ = corpus()
    mask_id, draws = tokenizer.id("<mask>"), attnbook.generator(seed)

    def batches():
        x, _ = data.random_batch(train_ids, BATCH, T, generator=draws)
        return data.mask_tokens(
            x, mask_id, len(tokenizer), first_ordinary=tokenizer.num_specials,
            generator=draws,
        )

    def loss(model, batch):
        inputs, targets = batch  # (B, T) each; -100 where no loss is taken
        logits = model.mlm_logits(inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    steps, lr = PRETRAIN_STEPS, PRETRAIN_LR
    train(model, batches, loss, steps=steps, lr=lr, show_progress=False)
    return model


@torch.no_grad()
def accuracy(model, part):
    """The share of the lines of ``part`` ("val" or "test") classified right."""
    tokenizer, _, parts = corpus()
    lines, labels = parts[part]
    x, padding = data.pad_batch(
        [tokenizer.encode(line) for line in lines], tokenizer.id("<pad>")
    )
    model.eval()
    predictions = torch.cat([
        model.classify(x[i : i + 512], padding[i : i + 512]).argmax(-1)
        for i in range(0, len(x), 512)
    ])
    model.train()
    return (predictions == labels).float().mean().item()


def fine_tune(model, seed, steps, lr):
    """Train ``model`` as a classifier of the fit lines: ``steps`` steps (warm-up, then
    cosine decay) of BATCH lines drawn from ``seed``. Returns ``{"val", "test"}``, its
    accuracies at the end."""
    tokenizer, _, parts = corpus()
    lines, labels = parts["fit"]
    encoded = [tokenizer.encode(line) for line in lines]
    draws = attnbook.generator(seed)

    def batches():
        pick = torch.randint(len(encoded), (BATCH,), generator=draws).tolist()
        x, padding = data.pad_batch([encoded[i] for i in pick], tokenizer.id("<pad>"))
        return x, padding, labels[pick]

    def loss(model, batch):
        x, padding, y = batch  # (B, L), (B, L), (B,)
        return F.cross_entropy(model.classify(x, padding), y)

    train(model, batches, loss, steps=steps, lr=lr, show_progress=False)
    return {"val": accuracy(model, "val"), "test": accuracy(model, "test")}


def run_start(start, lr, steps, seed):
    """One classifier from ``start`` ("scratch" or "pretrained"), trained ``steps``
    steps at rate ``lr``: its accuracies (see :func:`fine_tune`)."""
    model = new_encoder(seed)
    if start == "pretrained":
        model = pretrain(model, seed)
    return fine_tune(model, seed, steps, lr)
