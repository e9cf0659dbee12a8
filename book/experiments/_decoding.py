"""Chapter 14's target, 14_decoding: the page's character-level GPT trained as the page
trains it, and what a sampling rule makes it write, measured on prompts from the
held-out text."""

import functools
import re

import attnbook
import torch
import torch.nn.functional as F
from attnbook import data
from attnbook.train import train

T, NEW = 64, 48  # the model's context; new characters per sample
PROMPTS, SAMPLES, PROMPT_LEN = 32, 8, 16  # prompts, samples of each, characters each


@functools.lru_cache(maxsize=1)
def corpus():
    """``(tokenizer, train_ids (N,), val_ids (M,), words)``: the page's text and split;
    ``words``, the set of words (lower case) of the training text."""
    text = data.load_shakespeare()
    tokenizer = data.CharTokenizer.from_text(text)
    train_ids, val_ids = data.train_val_split(tokenizer.encode(text), val_fraction=0.1)
    words = set(re.findall(r"[a-z]+", tokenizer.decode(train_ids).lower()))
    return tokenizer, train_ids, val_ids, words


@functools.cache  # one training per seed and process
def target(seed):
    """The page's target (4 layers, d = 48, 4 heads), initialised from ``seed`` and
    trained 600 steps at 6e-3 on batches of 32 windows drawn from ``seed``, in eval
    mode."""
    tokenizer, train_ids, _, _ = corpus()
    attnbook.seed_everything(seed)
    model = attnbook.GPT(tokenizer.vocab_size, d_model=48, num_heads=4, num_layers=4,
                         max_len=T)  # fmt: skip
    batches = attnbook.generator(seed)

    def next_token_loss(model, batch):
        x, y = batch  # (B, T) each
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    train(
        model,
        lambda: data.random_batch(train_ids, 32, T, generator=batches),
        next_token_loss,
        steps=600,
        lr=6e-3,
        show_progress=False,
    )
    return model.eval()


def repeated_fraction(chars, n=4):
    """The share of the character ``n``-grams of ``chars`` that occurred earlier in
    it (the page's measure of loops)."""
    grams = [chars[i : i + n] for i in range(len(chars) - n + 1)]
    return sum(g in grams[:i] for i, g in enumerate(grams)) / len(grams)


def new_words(prompt, full):
    """The words (lower case) written after ``prompt`` in ``full`` (= prompt +
    continuation), leaving out a word the prompt began and one the end cut off."""
    return [
        m.group().lower()
        for m in re.finditer(r"[A-Za-z]+", full)
        if m.start() >= len(prompt) and m.end() < len(full)
    ]


def measure(model, point, seed):
    """What ``model`` writes under ``point`` (``temperature``, ``top_k``, ``top_p``):
    SAMPLES continuations of NEW characters for each of PROMPTS prompts of the held-out
    text (drawn from ``seed``), sampled from ``seed``. Returns ``{"real": the share of
    their words found among the training text's words, "repeated": the mean share of a
    continuation's character 4-grams seen earlier in it, "distinct": the share of
    distinct words among a prompt's samples' words, averaged over prompts}``."""
    tokenizer, _, val_ids, words = corpus()
    device = next(model.parameters()).device
    starts = torch.randint(len(val_ids) - PROMPT_LEN, (PROMPTS,),
                           generator=attnbook.generator(seed))  # fmt: skip
    prompts = torch.stack([val_ids[s : s + PROMPT_LEN] for s in starts.tolist()])
    rows = prompts.repeat_interleave(SAMPLES, 0).to(device)  # (PROMPTS * SAMPLES, 16)
    settings = {k: point[k] for k in ("temperature", "top_k", "top_p") if k in point}
    tokens = attnbook.generate(model, rows, NEW, generator=attnbook.generator(
        seed, device=device), **settings)  # fmt: skip
    real, repeated, distinct = [], [], []
    for i, prompt in enumerate(prompts):
        prompt_text, group = tokenizer.decode(prompt), []
        for row in tokens[i * SAMPLES : (i + 1) * SAMPLES]:
            full = tokenizer.decode(row.cpu())
            group += new_words(prompt_text, full)
            repeated.append(repeated_fraction(full[len(prompt_text) :]))
        real += [w in words for w in group]
        distinct.append(len(set(group)) / max(len(group), 1))
    return {
        "real": sum(real) / len(real),
        "repeated": sum(repeated) / len(repeated),
        "distinct": sum(distinct) / len(distinct),
    }
