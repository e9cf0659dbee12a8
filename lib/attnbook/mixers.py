"""A small causal model whose token mixer is softmax attention, linear attention or a
Mamba block (chapter 20), to compare the three on the same task with everything else
equal.

:class:`MixerModel`: token embeddings plus learned positions; a short causal
convolution, with which each token adds a learned mix of the token before it (as the
models of Zoology and Mamba's own blocks have: a value's position learns its key);
``num_layers`` layers of ``x = x + mixer(LayerNorm(x))``; a final LayerNorm and the
output layer. No feed-forward networks: the mixers alone move information between
tokens.

Trained and scored on multi-query associative recall
(:func:`~attnbook.data.associative_recall`): :func:`train_recall` (each step a batch
with its own number of pairs) and :func:`recall_accuracy` (the share of queries whose
most likely next token is the right value).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .data import AR_IGNORE, associative_recall
from .linear import LinearAttention
from .multihead import MultiHeadAttention
from .positions import LearnedPositions
from .ssm import MambaBlock
from .train import History, train
from .utils import check_positive_int, check_token_ids

MIXERS = ("softmax", "linear", "mamba")


class MixerModel(nn.Module):
    """``forward(tokens (B, T)) -> logits (B, T, vocab_size)``, causal: position ``t``
    reads tokens ``0 .. t`` only.

    ``mixer``: ``"softmax"`` (:class:`~attnbook.multihead.MultiHeadAttention`),
    ``"linear"`` (:class:`~attnbook.linear.LinearAttention`, the same projections, so
    the same parameters) or ``"mamba"`` (:class:`~attnbook.ssm.MambaBlock` with
    ``expand=1`` and ``state_size`` numbers of state per channel; ``num_heads`` is then
    unused). ``self.layers[i]`` is layer ``i``'s mixer.
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        mixer: str,
        *,
        d_model: int = 32,
        num_heads: int = 2,
        num_layers: int = 2,
        state_size: int = 16,
    ):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.max_len = check_positive_int("max_len", max_len)
        num_layers = check_positive_int("num_layers", num_layers)
        self.mixer = mixer
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.positions = LearnedPositions(max_len, d_model)
        # depthwise, kernel 2, padded on both sides and cut to the first T outputs
        self.shift = nn.Conv1d(d_model, d_model, 2, padding=1, groups=d_model)

        def make():
            if mixer == "mamba":
                return MambaBlock(d_model, state_size=state_size, expand=1)
            layer = MultiHeadAttention if mixer == "softmax" else LinearAttention
            return layer(d_model, num_heads)

        self.layers = nn.ModuleList(make() for _ in range(num_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(num_layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)

    def forward(self, tokens):
        check_token_ids(tokens, self.vocab_size, self.max_len, name="tokens")
        T = tokens.shape[1]
        x = self.positions(self.embedding(tokens))  # (B, T, d)
        x = x + self.shift(x.transpose(1, 2))[..., :T].transpose(1, 2)  # t and t - 1
        for layer, norm in zip(self.layers, self.norms, strict=True):
            y = norm(x)
            if self.mixer == "mamba":
                x = x + layer(y)
            else:
                x = x + layer(y, y, y, is_causal=True)[0]
        return self.head(self.norm(x))  # (B, T, vocab_size)


def recall_loss(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy at the queries of ``batch = (inputs (B, T), targets (B, T))``;
    positions whose target is ``AR_IGNORE`` do not count."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def train_recall(
    model: MixerModel,
    *,
    steps: int,
    lr: float,
    generator: torch.Generator,
    batch_size: int = 32,
    max_pairs: int = 8,
    eval_fn=None,
    eval_every: int | None = None,
) -> History:
    """Train ``model`` on associative recall for ``steps`` steps of :func:`train`: each
    step ``batch_size`` sequences of ``model.max_len`` tokens with ``P`` key-value pairs
    and ``P`` queries, ``P`` drawn uniformly from ``1 .. max_pairs``, all of it from
    ``generator``; the loss at the queries (:func:`recall_loss`). ``eval_fn(model)``,
    if given, runs every ``eval_every`` steps and at the end, as in :func:`train`."""
    max_pairs = check_positive_int("max_pairs", max_pairs)
    device = next(model.parameters()).device

    def batch():
        pairs = int(torch.randint(1, max_pairs + 1, (), generator=generator))
        tensors = associative_recall(
            batch_size,
            pairs,
            pairs,
            model.vocab_size,
            model.max_len,
            generator=generator,
        )
        return [t.to(device) for t in tensors]

    return train(
        model, batch, recall_loss, steps=steps, lr=lr, show_progress=False,
        eval_fn=eval_fn, eval_every=eval_every,
    )  # fmt: skip


@torch.no_grad()
def recall_accuracy(model: nn.Module, inputs, targets) -> float:
    """The share of queries (positions whose target is not ``AR_IGNORE``) at which
    ``model``'s most likely next token is the target, on ``inputs, targets (B, T)``; the
    model is put in eval mode."""
    asked = targets != AR_IGNORE
    if not asked.any():
        raise ValueError("targets hold no query (every target is AR_IGNORE)")
    right = model.eval()(inputs).argmax(-1)[asked] == targets[asked]
    return right.float().mean().item()


def recall_by_pairs(
    model: MixerModel,
    max_pairs: int,
    *,
    generator: torch.Generator,
    num_sequences: int = 256,
) -> list[float]:
    """:func:`recall_accuracy` for each number of pairs ``P = 1 .. max_pairs``, on
    ``num_sequences`` sequences with ``P`` pairs and ``P`` queries drawn from
    ``generator`` (a generator seeded alike gives every model the same sequences)."""
    max_pairs = check_positive_int("max_pairs", max_pairs)
    device = next(model.parameters()).device
    shares = []
    for pairs in range(1, max_pairs + 1):
        inputs, targets = associative_recall(
            num_sequences,
            pairs,
            pairs,
            model.vocab_size,
            model.max_len,
            generator=generator,
        )
        shares.append(recall_accuracy(model, inputs.to(device), targets.to(device)))
    return shares


__all__ = [
    "MIXERS",
    "MixerModel",
    "recall_accuracy",
    "recall_by_pairs",
    "recall_loss",
    "train_recall",
]
