"""MixerModel (chapter 20): one model, three token mixers, everything else equal."""

import pytest
import torch
from attnbook import MixerModel
from attnbook.data import AR_IGNORE, associative_recall
from attnbook.mixers import (
    MIXERS,
    recall_accuracy,
    recall_by_pairs,
    recall_loss,
    train_recall,
)

V, L = 16, 12


def count(model):
    return sum(p.numel() for p in model.parameters())


def test_softmax_and_linear_have_the_same_parameters_and_mamba_nearly():
    sizes = {m: count(MixerModel(V, L, m, state_size=8)) for m in MIXERS}
    assert sizes["softmax"] == sizes["linear"]
    # Mamba, expand 1 and N = 8: 2 d^2 + d^2 + d (r + 2N) + ... per layer against 4 (d^2 + d)
    assert abs(sizes["mamba"] - sizes["softmax"]) / sizes["softmax"] < 0.01


@pytest.mark.parametrize("mixer", MIXERS)
def test_causal_and_shaped(mixer):
    torch.manual_seed(0)
    model = MixerModel(V, L, mixer, d_model=16).eval()
    tokens = torch.randint(V, (3, L))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % V  # the future of position 6
    with torch.no_grad():
        logits, other = model(tokens), model(changed)
    assert logits.shape == (3, L, V)
    torch.testing.assert_close(logits[:, :7], other[:, :7])
    assert not torch.allclose(logits[:, 7:], other[:, 7:])


def test_softmax_model_equals_the_stack_written_with_pytorch():
    torch.manual_seed(1)
    model = MixerModel(V, L, "softmax", d_model=16, num_heads=2).eval()
    references = [
        torch.nn.MultiheadAttention(16, 2, batch_first=True) for _ in range(2)
    ]
    for layer, reference in zip(model.layers, references, strict=True):
        layer.load_from_torch(reference)
    tokens = torch.randint(V, (2, L))
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    with torch.no_grad():
        x = model.embedding(tokens) + model.positions.table[:L]
        w = model.shift.weight[:, 0]  # (d, 2): taps on t - 1 and t
        before = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        x = x + before * w[:, 0] + x * w[:, 1] + model.shift.bias
        for norm, reference in zip(model.norms, references, strict=True):
            y = norm(x)
            x = x + reference(y, y, y, attn_mask=mask, need_weights=False)[0]
        expected = model.head(model.norm(x))
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="mixer must be one of"):
        MixerModel(V, L, "rwkv")
    with pytest.raises(ValueError, match="num_layers"):
        MixerModel(V, L, "linear", num_layers=0)
    model = MixerModel(V, L, "linear")
    with pytest.raises(ValueError):
        model(torch.full((1, 4), V))  # a token outside the vocabulary
    with pytest.raises(ValueError):
        model(torch.zeros(1, L + 1, dtype=torch.long))  # longer than max_len


class Oracle(torch.nn.Module):
    """Logits that put the most weight on ``answers`` (B, T)."""

    def __init__(self, answers):
        super().__init__()
        self.answers = answers

    def forward(self, inputs):
        return torch.nn.functional.one_hot(self.answers, V).float()


def test_recall_accuracy_counts_only_the_queries():
    inputs, targets = associative_recall(4, 3, 2, V, L, generator=torch.Generator())
    answers = targets.clamp(min=0)  # right at every query, 0 elsewhere
    assert recall_accuracy(Oracle(answers), inputs, targets) == 1.0
    wrong = answers.clone()
    first = (targets != AR_IGNORE).nonzero()[
        :3
    ]  # three of the 8 queries answered wrong
    wrong[first[:, 0], first[:, 1]] = 0
    assert recall_accuracy(Oracle(wrong), inputs, targets) == 5 / 8
    with pytest.raises(ValueError, match="no query"):
        recall_accuracy(Oracle(answers), inputs, torch.full_like(targets, AR_IGNORE))


def test_recall_loss_is_the_cross_entropy_at_the_queries():
    torch.manual_seed(2)
    model = MixerModel(V, L, "linear", d_model=8)
    inputs, targets = associative_recall(3, 2, 2, V, L, generator=torch.Generator())
    asked = targets != AR_IGNORE
    logits = model(inputs)
    expected = torch.nn.functional.cross_entropy(logits[asked], targets[asked])
    torch.testing.assert_close(recall_loss(model, (inputs, targets)), expected)


def test_train_recall_learns_one_pair_and_repeats():
    # one pair: copy the only value; a few steps of the softmax model suffice
    def trained(seed):
        torch.manual_seed(seed)
        model = MixerModel(V, L, "softmax", d_model=16)
        history = train_recall(
            model,
            steps=60,
            lr=1e-2,
            generator=torch.Generator().manual_seed(seed),
            max_pairs=1,
        )
        return model, history

    model, history = trained(0)
    assert len(history.loss) == 60 and history.loss[-1] < history.loss[0] / 2
    inputs, targets = associative_recall(64, 1, 1, V, L, generator=torch.Generator())
    assert recall_accuracy(model, inputs, targets) > 0.9
    assert trained(0)[1].loss == history.loss  # the generator decides the batches


def test_train_recall_evaluates_along_the_way():
    model = MixerModel(V, L, "linear", d_model=16)
    seen = []  # (training mode, share right) at each evaluation
    history = train_recall(
        model, steps=10, lr=1e-3, generator=torch.Generator().manual_seed(0), max_pairs=2,
        eval_fn=lambda m: seen.append(m.training) or len(seen), eval_every=4,
    )  # fmt: skip
    assert history.eval_steps == [4, 8, 10] and history.evals == [1, 2, 3]
    assert seen == [False, False, False] and model.training  # eval mode, then back


class Lookup(torch.nn.Module):
    """Answers every key with the value that followed its first occurrence."""

    vocab_size, max_len = V, L

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))  # a device to read

    def forward(self, inputs):
        answers = torch.zeros_like(inputs)
        for row, tokens in enumerate(inputs.tolist()):
            seen = {}  # key -> the token after its first occurrence (the pairs')
            for key, value in zip(tokens[0::2], tokens[1::2], strict=True):
                seen.setdefault(key, value)
            for t, token in enumerate(tokens):
                answers[row, t] = seen.get(token, 0) if token else 0
        return torch.nn.functional.one_hot(answers, V).float()


def test_recall_by_pairs_scores_each_number_of_pairs():
    shares = recall_by_pairs(Lookup(), 3, generator=torch.Generator().manual_seed(0))
    assert shares == [1.0, 1.0, 1.0]
    never = Lookup()
    never.forward = lambda inputs: torch.nn.functional.one_hot(
        inputs * 0 + 1, V
    ).float()
    assert recall_by_pairs(never, 2, generator=torch.Generator()) == [0.0, 0.0]  # key 1
