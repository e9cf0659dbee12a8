"""Chapter 20's recall task, multi-query associative recall (Zoology): its layout, that reading the
context answers every query, determinism, and argument checks."""

import pytest
import torch
from attnbook.data import AR_IGNORE, associative_recall


def recall(seed=0, **overrides):
    args = {"batch_size": 16, "num_pairs": 6, "num_queries": 4, "vocab_size": 40, "seq_len": 32,
            **overrides}
    return associative_recall(**args, generator=torch.Generator().manual_seed(seed))


def test_layout_and_every_answer_is_in_the_context():
    inputs, targets = recall()
    assert inputs.shape == targets.shape == (16, 32) and inputs.dtype == targets.dtype == torch.long
    keys, values = inputs[:, 0:12:2], inputs[:, 1:12:2]
    assert ((keys >= 1) & (keys < 20)).all() and ((values >= 20) & (values < 40)).all()
    for row in range(16):
        assert len(set(keys[row].tolist())) == 6 and len(set(values[row].tolist())) == 6
        table = dict(zip(keys[row].tolist(), values[row].tolist(), strict=True))
        asked = (targets[row] != AR_IGNORE).nonzero().squeeze(1)
        assert len(asked) == 4 and (asked >= 12).all() and (asked % 2 == 0).all()
        for position in asked.tolist():  # a queried key; its target is its value
            assert targets[row, position] == table[inputs[row, position].item()]
        others = torch.ones(32, dtype=torch.bool)
        others[:12] = False
        others[asked] = False
        assert (inputs[row, others] == 0).all()  # filler everywhere else
    assert (targets[:, :12] == AR_IGNORE).all()


def test_the_shortest_sequence_fits():
    inputs, targets = recall(num_pairs=3, num_queries=3, seq_len=12)
    assert ((targets != AR_IGNORE).sum(1) == 3).all()
    assert (targets[:, 6::2] != AR_IGNORE).all()  # every slot after the pairs is a query


def test_the_generator_decides_everything():
    a, b = recall(seed=3), recall(seed=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(recall(seed=4)[0], a[0])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_pairs=10 distinct keys .* vocab_size=20"):
        recall(num_pairs=10, vocab_size=20)
    with pytest.raises(ValueError, match="num_queries=7 must be at most num_pairs=6"):
        recall(num_queries=7)
    with pytest.raises(ValueError, match="seq_len=19 is too short.* 20"):
        recall(seq_len=19)
    for name in ("batch_size", "num_pairs", "num_queries", "vocab_size", "seq_len"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            recall(**{name: 0})
