"""The measures of chapter 14's recorded experiment (book/experiments/_decoding.py):
by hand, and on an untrained model whose greedy samples must agree with each other."""

import sys
from pathlib import Path

import attnbook
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "book"))
from experiments import _decoding  # noqa: E402


def test_repeated_fraction_counts_ngrams_seen_earlier():
    # "abab": the 2-grams ab, ba, ab; the third was seen -> 1/3
    assert _decoding.repeated_fraction("abab", n=2) == pytest.approx(1 / 3)
    assert _decoding.repeated_fraction("abcdefgh") == 0.0
    # "aaaaaa": six 1-grams, all but the first seen before
    assert _decoding.repeated_fraction("aaaaaa", n=1) == pytest.approx(5 / 6)


def test_new_words_leave_out_the_prompts_word_and_the_cut_one():
    prompt = "HAMLET:\nI wi"
    # "will" began in the prompt; "pla" is cut by the end; "go", "to" and "the" count
    full = prompt + "ll go to the pla"
    assert _decoding.new_words(prompt, full) == ["go", "to", "the"]
    # a word that ends the prompt and one that ends exactly at a space both behave
    assert _decoding.new_words("I will ", "I will Go home\n") == ["go", "home"]
    assert _decoding.new_words("x", "x") == []


@pytest.mark.parametrize("point", [
    {"rule": "greedy", "temperature": 0.0},
    {"rule": "top-p", "temperature": 1.0, "top_p": 0.9},
])
def test_measure_gives_shares_and_greedy_samples_repeat_each_other(point):
    tokenizer = _decoding.corpus()[0]
    attnbook.seed_everything(0)
    model = attnbook.GPT(tokenizer.vocab_size, d_model=16, num_heads=2, num_layers=1,
                         max_len=_decoding.T).eval()  # fmt: skip
    figures = _decoding.measure(model, point, seed=0)
    assert set(figures) == {"real", "repeated", "distinct"}
    assert all(0 <= value <= 1 for value in figures.values())
    if point["rule"] == "greedy":  # the 8 samples of a prompt are one text, 8 times
        assert figures["distinct"] <= 1 / _decoding.SAMPLES + 1e-9
    again = _decoding.measure(model, point, seed=0)
    assert again == figures  # the prompts and the draws come from the seed
