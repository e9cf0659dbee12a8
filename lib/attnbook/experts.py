"""Mixture of experts (chapter 19): a feed-forward layer of many SwiGLU experts, of
which a router picks ``top_k`` per token.

- :class:`MoEFeedForward`: ``(..., d) -> (..., d)``, Mixtral's routing (softmax over
  the experts, the ``top_k`` largest kept and renormalised to sum to 1) and an optional
  expert capacity; ``forward(x, return_routing=True)`` also returns the router's
  choices, a :class:`Routing`, whose properties are the statistics of that forward:
  the load-balancing loss (``aux_loss``), the load (``tokens_per_expert``), the share
  dropped (``dropped``).
- :func:`record_routing` collects every MoE layer's :class:`Routing` of a model's
  forward; :func:`aux_loss` sums their load-balancing losses for training.
- ``GPT(..., activation="swiglu", experts=dict(num_experts=8, top_k=2))`` makes every
  block's feed-forward network an :class:`MoEFeedForward` of width ``hidden``
  (:func:`moe_feed_forward`); :mod:`attnbook.convert` reads transformers' Mixtral.
- :func:`moe_parameters`: a Mixtral-style decoder's total and active parameters.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from .modern import SwiGLU, decoder_parameters
from .utils import check_eps, check_positive_int


class Routing(NamedTuple):
    """The router's choices in one forward over ``N`` tokens: ``experts (N, k)`` the
    chosen experts, most probable first; ``weights (N, k)`` their renormalised weights;
    ``probs (N, E)`` the softmax over all experts (with its gradient); ``kept (N, k)``
    False where an assignment went over its expert's ``capacity`` (``None`` without a
    capacity factor)."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    kept: torch.Tensor
    capacity: int | None

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``(E,)``: the assignments each expert was chosen for (before capacity)."""
        return torch.bincount(self.experts.flatten(), minlength=self.probs.shape[-1])

    @property
    def dropped(self) -> float:
        """The share of the assignments dropped over capacity (0 without tokens)."""
        return 1.0 - self.kept.float().mean().item() if self.kept.numel() else 0.0

    @property
    def aux_loss(self) -> torch.Tensor:
        """Switch Transformer's load-balancing loss ``E sum_i f_i P_i``: ``f_i`` the
        share of tokens that chose expert ``i`` among their ``k`` (before capacity;
        the ``f_i`` sum to ``k``), ``P_i`` the mean router probability; ``k`` when
        balanced, as transformers' ``load_balancing_loss_func``; with gradient; 0 for
        a forward without tokens."""
        tokens, num_experts = self.probs.shape
        if not tokens:
            return self.probs.sum() * 0.0
        fraction = self.tokens_per_expert.float() / tokens  # f_i: sums to top_k
        return num_experts * (fraction * self.probs.mean(0)).sum()


def _check_experts(num_experts, top_k, capacity_factor) -> tuple[int, int, float]:
    num_experts = check_positive_int("num_experts", num_experts)
    top_k = check_positive_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if capacity_factor is not None:
        capacity_factor = check_eps(capacity_factor, "capacity_factor")
    return num_experts, top_k, capacity_factor


def _within_capacity(experts: torch.Tensor, num_experts: int, capacity: int):
    """``(N, k)`` bool: True where assignment ``experts[n, j]`` is among the first
    ``capacity`` that its expert receives, counting in token order."""
    # (N, E): 1 where a token chose an expert (each at most once)
    chosen = experts.new_zeros(experts.shape[0], num_experts).scatter_(1, experts, 1)
    seat = chosen.cumsum(0) - 1  # (N, E): an assignment's place in its expert's queue
    return seat.gather(1, experts) < capacity


class MoEFeedForward(nn.Module):
    """A sparse mixture of ``num_experts`` SwiGLU experts (Shazeer et al. 2017;
    Mixtral's layer): ``(..., d) -> (..., d)``.

    A linear ``router`` (``d -> E``, no bias) scores each token; ``p = softmax``
    over the experts; the ``top_k`` largest ``p_i`` are renormalised to sum to 1
    (Mixtral's rule) and the output is ``sum_j w_j expert_j(x)``. Each of the
    ``experts`` is a :class:`~attnbook.modern.SwiGLU` ``d -> hidden -> d``: ``E (3 d
    hidden) + E d`` parameters, of which ``top_k 3 d hidden + E d`` act on a token.

    With ``capacity_factor`` each expert takes at most ``ceil(capacity_factor N k /
    E)`` of the ``N k`` assignments of a forward's ``N`` tokens, first come first
    served in token order (the first batch row's tokens in sequence order, then the
    next row's; GShard instead seats every token's first choice before any second
    choice). An assignment over capacity is dropped: that expert adds nothing for that
    token and the other weights are not renormalised, so a fully dropped token's
    output is zero and the decoder block's residual connection carries it through
    unchanged. A token's output then depends on the other tokens of the call (the
    batch; a cached decoding step's few tokens are rarely dropped).

    ``forward(x, return_routing=False, record_into=())``: the output, or ``(output,
    routing)`` with the :class:`Routing` of this forward (:meth:`route`), which is also
    appended to each list in ``record_into`` (what :func:`record_routing` passes);
    nothing is kept on the module.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        num_experts: int,
        top_k: int = 2,
        *,
        capacity_factor: float | None = None,
        bias: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        d_model = check_positive_int("d_model", d_model)
        num_experts, top_k, capacity_factor = _check_experts(
            num_experts, top_k, capacity_factor
        )
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(d_model, hidden, bias=bias, dropout=dropout)
            for _ in range(num_experts)
        )

    def route(self, tokens: torch.Tensor) -> Routing:
        """The router's choices for ``tokens (N, d)``: the ``top_k`` experts of each,
        their renormalised weights, and which assignments fit the capacity."""
        probs = self.router(tokens).float().softmax(-1)  # (N, E), in float32
        top, experts = probs.topk(self.top_k, dim=-1)  # (N, k) each
        weights = top / top.sum(-1, keepdim=True)  # renormalised: each row sums to 1
        kept, capacity = torch.ones_like(experts, dtype=torch.bool), None
        if self.capacity_factor is not None:
            seats = self.capacity_factor * len(tokens) * self.top_k / self.num_experts
            capacity = math.ceil(round(seats, 9))  # 2.0000000000000004 seats: 2
            kept = _within_capacity(experts, self.num_experts, capacity)
        return Routing(experts, weights, probs, kept, capacity)

    def forward(self, x: torch.Tensor, *, return_routing=False, record_into=()):
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be (..., d_model={self.d_model}), got shape {tuple(x.shape)}"
            )
        tokens = x.reshape(-1, self.d_model)  # (N, d)
        routing = self.route(tokens)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            # who goes to expert i, and in which of its k slots
            token, slot = torch.where((routing.experts == i) & routing.kept)
            if token.numel():
                y = expert(tokens[token]) * routing.weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
        for routings in record_into:
            routings.append(routing)
        out = out.reshape(x.shape)  # (..., d)
        return (out, routing) if return_routing else out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}"
        )


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[Routing]]:
    """``with record_routing(model) as routings: model(x)``: ``routings`` gets the
    :class:`Routing` of every :class:`MoEFeedForward` call inside the block, in call
    order (one per layer for a GPT's forward), from the forward itself (a forward
    pre-hook passes the list as ``record_into``; the module keeps nothing). Recorders
    nest. A model without such a layer raises."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoEFeedForward layer")
    routings: list[Routing] = []

    def add_list(module, args, kwargs):  # record_into gains this recorder's list
        lists = (*kwargs.get("record_into", ()), routings)
        return args, {**kwargs, "record_into": lists}

    hooks = [m.register_forward_pre_hook(add_list, with_kwargs=True) for m in layers]
    try:
        yield routings
    finally:
        for hook in hooks:
            hook.remove()


def moe_feed_forward(
    d_model, hidden, options, activation="swiglu", bias=False, dropout=0.0
):
    """The :class:`MoEFeedForward` of a decoder block with ``experts=options`` (a dict
    of ``num_experts``, ``top_k``, ``capacity_factor``) and ``activation="swiglu"``;
    ``hidden`` defaults to ``8 d / 3`` as a dense SwiGLU's."""
    if not isinstance(options, dict):
        raise TypeError(
            f"experts must be a dict of keywords, got {type(options).__name__}"
        )
    if activation != "swiglu":
        raise ValueError(f"experts needs activation='swiglu', got {activation!r}")
    hidden = 8 * d_model // 3 if hidden is None else hidden
    return MoEFeedForward(d_model, hidden, **options, bias=bias, dropout=dropout)


def aux_loss(routings) -> torch.Tensor:
    """The sum of the load-balancing losses (:attr:`Routing.aux_loss`) of ``routings``
    (those :func:`record_routing` collected in a forward): a scalar with gradient; add
    ``coefficient * aux_loss(routings)`` to the training loss (Switch Transformer:
    0.01; Mixtral's config: 0.001). transformers pools the layers' counts and
    probabilities before the product instead of summing per-layer losses."""
    routings = list(routings)
    if not routings or not all(isinstance(r, Routing) for r in routings):
        raise ValueError(
            "aux_loss takes the Routing of each MoE layer: run the forward inside "
            "record_routing(model) and pass what it collected"
        )
    return torch.stack([routing.aux_loss for routing in routings]).sum()


def moe_parameters(vocab: int, d_model: int, layers: int, heads: int, kv_heads: int,
                   hidden: int, num_experts: int, top_k: int, *, bias: bool = False,
                   **options) -> tuple[int, int]:  # fmt: skip
    """``(total, active)`` parameters of a Mixtral-style decoder: a
    :func:`~attnbook.modern.decoder_parameters` decoder whose SwiGLU of width
    ``hidden`` is, in every layer, ``num_experts`` of them plus a router (``E d``),
    ``top_k`` acting on each token. Active counts the attention, norms, router,
    ``top_k`` experts, the embedding and output head (as Mixtral's 12.9B does).
    ``options`` go to ``decoder_parameters`` (``head_dim``, ``tie_embeddings``,
    ``qk_norm``); ``bias`` gives every linear layer but the router a bias."""
    num_experts, top_k, _ = _check_experts(num_experts, top_k, None)
    sizes = (vocab, d_model, layers, heads, kv_heads, hidden)
    dense = decoder_parameters(*sizes, bias=bias, **options)  # one expert per layer
    expert = 3 * d_model * hidden + ((2 * hidden + d_model) if bias else 0)
    router = num_experts * d_model
    total = dense + layers * ((num_experts - 1) * expert + router)
    active = dense + layers * ((top_k - 1) * expert + router)
    return total, active


__all__ = [
    "MoEFeedForward",
    "Routing",
    "aux_loss",
    "moe_feed_forward",
    "moe_parameters",
    "record_routing",
]
