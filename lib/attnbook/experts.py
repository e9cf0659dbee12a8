"""Mixture of experts (chapter 19): a feed-forward layer of many SwiGLU experts, of
which a router picks ``top_k`` per token, and the bridge from transformers' Mixtral.

- :class:`MoEFeedForward`: ``(..., d) -> (..., d)``, Mixtral's routing (softmax over
  the experts, the ``top_k`` largest kept and renormalised to sum to 1), an optional
  expert capacity, and after each forward the load-balancing loss (``aux_loss``), the
  load (``tokens_per_expert``), the fraction dropped (``dropped``) and the router's
  choices (``last_routing``, a :class:`Routing`).
- ``GPT(..., activation="swiglu", experts=dict(num_experts=8, top_k=2))`` makes every
  block's feed-forward network an :class:`MoEFeedForward` of width ``hidden``;
  :func:`aux_loss` sums its blocks' losses for training.
- :func:`moe_parameters`: a Mixtral-style decoder's total and active parameters.
- :func:`gpt_arguments` and :func:`gpt_weights`: chapter 17's (in
  :mod:`attnbook.modern`), and a ``MixtralForCausalLM``'s:
  :meth:`GPT.from_transformers <attnbook.models.GPT.from_transformers>` reads them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from . import modern
from .modern import LAYER_NAMES, SwiGLU, decoder_parameters, rope_halves_to_pairs
from .utils import check_eps, check_positive_int


class Routing(NamedTuple):
    """The router's choices in one forward over ``N`` tokens (detached):
    ``experts (N, k)`` the chosen experts, most probable first; ``weights (N, k)``
    their renormalised weights; ``probs (N, E)`` the softmax over all experts;
    ``kept (N, k)`` False where an assignment went over its expert's capacity."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    kept: torch.Tensor


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

    After each forward: ``aux_loss`` (Switch Transformer's load-balancing loss, ``E
    sum_i f_i P_i`` with ``f_i`` the fraction of tokens that chose expert ``i`` among
    their ``k`` (before capacity; the ``f_i`` sum to ``k``) and ``P_i`` the mean
    router probability: ``k`` when balanced, as transformers'
    ``load_balancing_loss_func``; it keeps its gradient), ``tokens_per_expert``
    ``(E,)`` (the assignments each expert was chosen for), ``capacity`` (``None``
    without a ``capacity_factor``), ``dropped`` (the fraction of assignments dropped)
    and ``last_routing`` (a :class:`Routing`).
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
        self.aux_loss = self.tokens_per_expert = self.last_routing = None
        self.capacity = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must be (..., d_model={self.d_model}), got shape {tuple(x.shape)}"
            )
        tokens = x.reshape(-1, self.d_model)  # (N, d)
        probs = self.router(tokens).float().softmax(-1)  # (N, E), in float32
        top, experts = probs.topk(self.top_k, dim=-1)  # (N, k) each
        weights = top / top.sum(-1, keepdim=True)  # renormalised: each row sums to 1
        kept = torch.ones_like(experts, dtype=torch.bool)
        self.capacity = None
        if self.capacity_factor is not None:
            seats = (
                self.capacity_factor * tokens.shape[0] * self.top_k / self.num_experts
            )
            self.capacity = math.ceil(round(seats, 9))  # 2.0000000000000004 seats: 2
            kept = _within_capacity(experts, self.num_experts, self.capacity)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where((experts == i) & kept)  # who goes to expert i
            if token.numel():
                y = expert(tokens[token]) * weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
        self._record(probs, experts, weights, kept)
        return out.reshape(x.shape)

    def _record(self, probs, experts, weights, kept) -> None:
        """The load-balancing loss and the statistics of this forward."""
        ones = torch.ones_like(experts).flatten()
        counts = experts.new_zeros(self.num_experts).scatter_add_(
            0, experts.flatten(), ones
        )  # (E,): how many assignments chose each expert
        fraction = counts.float() / max(probs.shape[0], 1)  # f_i: sums to top_k
        # P_i, the mean router probability: 0 for a call without tokens (not NaN)
        mean_probs = probs.mean(0) if probs.shape[0] else probs.sum(0)
        self.aux_loss = self.num_experts * (fraction * mean_probs).sum()
        self.tokens_per_expert = counts
        self.last_routing = Routing(experts, weights.detach(), probs.detach(), kept)

    @property
    def dropped(self) -> float:
        """The fraction of the last forward's assignments dropped over capacity."""
        if self.last_routing is None or not self.last_routing.kept.numel():
            return 0.0
        return 1.0 - self.last_routing.kept.float().mean().item()

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}"
        )


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


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the load-balancing losses of ``model``'s :class:`MoEFeedForward`
    layers in its last forward (a scalar with gradient): add ``coefficient *
    aux_loss(model)`` to the training loss (Switch Transformer: 0.01; Mixtral's
    config: 0.001). transformers pools the layers' counts and probabilities before
    the product instead of summing per-layer losses."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not losses:
        raise ValueError(f"{type(model).__name__} has no MoEFeedForward layer")
    if any(loss is None for loss in losses):
        raise ValueError("run a forward first: no load-balancing loss recorded yet")
    return torch.stack(losses).sum()


def moe_parameters(
    vocab: int,
    d_model: int,
    layers: int,
    heads: int,
    kv_heads: int,
    hidden: int,
    num_experts: int,
    top_k: int,
    *,
    bias: bool = False,
    **options,
) -> tuple[int, int]:
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


# --- reading transformers' Mixtral
# ----------------------------------------------------------------------------------

SUPPORTED_MODELS = (*modern.SUPPORTED_MODELS, "MixtralForCausalLM")


def _is_mixtral(model) -> bool:
    """True for a ``MixtralForCausalLM``; ``False`` for a model chapter 17 reads; a
    ``TypeError`` for anything else."""
    import transformers

    if isinstance(model, transformers.MixtralForCausalLM):
        return True
    classes = tuple(getattr(transformers, name) for name in modern.SUPPORTED_MODELS)
    if not isinstance(model, classes):
        raise TypeError(
            f"model must be one of {', '.join(SUPPORTED_MODELS)}, got "
            f"{type(model).__name__}"
        )
    return False


def gpt_arguments(model) -> dict:
    """The :class:`~attnbook.models.GPT` keywords that rebuild a transformers
    ``MixtralForCausalLM``: Mistral's (:func:`attnbook.modern.gpt_arguments`: RoPE,
    RMSNorm, grouped-query attention, ``sliding_window`` as ``window``, the same
    ``ValueError`` for a field we cannot reproduce) with ``experts=dict(num_experts=
    num_local_experts, top_k=num_experts_per_tok)`` of width ``intermediate_size``.
    ``router_jitter_noise`` (multiplicative noise on the layer's input, in training
    only) is not reproduced: the logits agree in eval mode, and training our GPT adds
    no jitter. Any other model goes to :func:`attnbook.modern.gpt_arguments`."""
    if not _is_mixtral(model):
        return modern.gpt_arguments(model)
    config = model.config
    arguments = modern._decoder_arguments(model)
    arguments["experts"] = dict(
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok
    )
    return arguments


def _mixtral_layer(layer, prefix: str, heads: int, kv_heads: int, head_dim: int):
    """One Mixtral layer's tensors under our names: the rows of ``W_q`` and ``W_k``
    reordered (:func:`~attnbook.modern.rope_halves_to_pairs`); the router
    ``mlp.gate``; the experts' fused ``gate_up_proj (E, 2 hidden, d)`` split into each
    expert's ``gate_proj`` (first half) and ``up_proj``, ``down_proj (E, d,
    hidden)`` into each expert's ``down_proj``."""
    rows = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}
    tensors = {}
    for name, tensor in layer.state_dict().items():
        module, parameter = name.rsplit(".", 1)  # "mlp.experts", "gate_up_proj"
        if module in rows:
            tensor = rope_halves_to_pairs(tensor, rows[module], head_dim)
        if module == "mlp.gate":
            tensors[f"{prefix}.feed_forward.router.{parameter}"] = tensor
        elif module == "mlp.experts" and parameter == "gate_up_proj":
            for i, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                expert = f"{prefix}.feed_forward.experts.{i}"
                tensors[f"{expert}.gate_proj.weight"] = gate
                tensors[f"{expert}.up_proj.weight"] = up
        elif module == "mlp.experts" and parameter == "down_proj":
            for i, down in enumerate(tensor):
                tensors[f"{prefix}.feed_forward.experts.{i}.down_proj.weight"] = down
        else:  # an unknown module keeps its name: copy_weights lists it as unused
            tensors[f"{prefix}.{LAYER_NAMES.get(module, module)}.{parameter}"] = tensor
    return tensors


def gpt_weights(model) -> dict[str, torch.Tensor]:
    """A transformers ``MixtralForCausalLM``'s tensors under the names of the
    :class:`~attnbook.models.GPT` that :func:`gpt_arguments` builds (see
    :func:`_mixtral_layer`); any other model's from
    :func:`attnbook.modern.gpt_weights`."""
    if not _is_mixtral(model):
        return modern.gpt_weights(model)
    arguments = gpt_arguments(model)
    heads, kv_heads = arguments["num_heads"], arguments["num_kv_heads"]
    head_dim = arguments["d_model"] // heads
    return modern._decoder_tensors(
        model,
        arguments,
        lambda layer, prefix: _mixtral_layer(layer, prefix, heads, kv_heads, head_dim),
    )


__all__ = [
    "MoEFeedForward",
    "Routing",
    "aux_loss",
    "gpt_arguments",
    "gpt_weights",
    "moe_feed_forward",
    "moe_parameters",
]
