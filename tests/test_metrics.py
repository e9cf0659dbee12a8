"""Error rates: the edit distance, the token error rate of a corpus, and the word error rate of transcripts."""

import random

import pytest
from attnbook import metrics


def test_edit_distance_and_error_rates():
    assert metrics.edit_distance("kitten", "sitting") == 3
    assert metrics.edit_distance([], [1, 2]) == 2
    assert metrics.edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert metrics.error_rate([[1, 2, 3, 4], [5]], [[1, 3, 4], [5, 5]]) == 2 / 5
    assert metrics.normalize_text("Hello, World! It's well-known.") == ["hello", "world", "it's", "well", "known"]
    assert metrics.word_error_rate(["The cat sat."], ["the cat, sat"]) == 0.0
    assert metrics.word_error_rate(["the cat sat on the mat"], ["the cat sat on a mat"]) == 1 / 6
    with pytest.raises(ValueError, match="as many"):
        metrics.error_rate([[1]], [])
    with pytest.raises(ValueError, match="empty"):
        metrics.error_rate([[]], [[1]])
    with pytest.raises(TypeError, match="lists of strings"):
        metrics.word_error_rate("a b", "a b")




def test_edit_distance_is_symmetric_and_counts_each_operation_once():
    assert metrics.edit_distance("abc", "abd") == 1  # one substitution
    assert metrics.edit_distance("abc", "abxc") == 1  # one insertion
    assert metrics.edit_distance("abxc", "abc") == 1  # one deletion
    assert metrics.edit_distance("flaw", "lawn") == metrics.edit_distance("lawn", "flaw") == 2
    assert metrics.normalize_text("") == []
    with pytest.raises(TypeError, match="text must be a str"):
        metrics.normalize_text(["a"])


def test_edit_operations_break_the_distance_down():
    assert metrics.edit_operations("kitten", "sitting") == (2, 0, 1)  # k->s, e->i, +g
    assert metrics.edit_operations("abc", "abd") == (1, 0, 0)
    assert metrics.edit_operations("abxc", "abc") == (0, 1, 0)  # x missed: a deletion
    assert metrics.edit_operations("abc", "abxc") == (0, 0, 1)  # x added: an insertion
    assert metrics.edit_operations([], [1, 2]) == (0, 0, 2)
    assert metrics.edit_operations([1, 2], []) == (0, 2, 0)
    assert metrics.edit_operations([], []) == (0, 0, 0)
    assert metrics.edit_operations("ab", "ba") == (2, 0, 0)  # not a deletion and an insertion
    assert metrics.edit_operations([3, 3, 7], [3, 7]) == (0, 1, 0)  # CTC merging a repeat: a deletion
    rng = random.Random(0)
    for _ in range(300):
        reference = [rng.randrange(3) for _ in range(rng.randrange(7))]
        hypothesis = [rng.randrange(3) for _ in range(rng.randrange(7))]
        subs, dels, ins = metrics.edit_operations(reference, hypothesis)
        assert subs + dels + ins == metrics.edit_distance(reference, hypothesis)
        assert dels - ins == len(reference) - len(hypothesis)
        assert subs <= min(len(reference), len(hypothesis))

