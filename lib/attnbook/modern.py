"""Today's decoder (chapter 17): the pieces that turn chapter 6's GPT-2-style decoder
into a Llama-style one, and the bridge from transformers' Llama, Qwen3 and Mistral.

- :class:`RMSNorm`: LayerNorm without the mean and the bias, ``(..., d) -> (..., d)``.
- :class:`SwiGLU`: the gated feed-forward network, ``(..., d) -> (..., hidden) -> (...,
  d)``.
- Grouped-query attention and QK-norm are options of
  :class:`~attnbook.multihead.MultiHeadAttention` (``num_kv_heads=``, ``qk_norm=``);
  ``GPT(..., positions="rope", norm="rms", activation="swiglu", bias=False,
  num_kv_heads=...)`` is a Llama.
- :func:`rope_halves_to_pairs`: transformers rotates the pairs ``(x[i], x[i + d/2])``
  of a head, :func:`~attnbook.positions.apply_rope` the pairs ``(x[2i], x[2i+1])``;
  reordering the rows of ``W_q`` and ``W_k`` maps one onto the other.
- :func:`decoder_parameters`: the parameter count of such a decoder.
- :func:`gpt_arguments` and :func:`gpt_weights`: what
  :meth:`GPT.from_transformers <attnbook.models.GPT.from_transformers>` reads from a
  ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``MistralForCausalLM`` (and, for
  chapter 18, a dense ``DeepseekV3ForCausalLM``: multi-head latent attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .utils import check_eps, check_positive_int


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang and Sennrich 2019): ``x / sqrt(mean(x^2) + eps) *
    weight`` over the last dimension, ``(..., d) -> (..., d)``.

    LayerNorm without subtracting the mean and without a bias: ``d`` parameters
    (``weight``, ones at first). Equal to ``torch.nn.RMSNorm(d, eps=eps)``; computed in
    float32 whatever the input's dtype, as Llama does.
    """

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        d = check_positive_int("d", d)
        self.normalized_shape, self.eps = (d,), check_eps(eps)
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(
                f"x must be (..., d={self.normalized_shape[0]}), got shape "
                f"{tuple(x.shape)}"
            )
        x32 = x.float()
        # (..., d): each vector divided by its root mean square
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class SwiGLU(nn.Module):
    """Llama's feed-forward network, a SiLU-gated linear unit (Shazeer 2020):
    ``down(silu(gate(x)) * up(x))``, ``(..., d) -> (..., hidden) -> (..., d)``.

    Three ``nn.Linear`` layers ``gate_proj``, ``up_proj`` (``d -> hidden``) and
    ``down_proj`` (``hidden -> d``), without biases unless ``bias=True``: ``3 d
    hidden`` parameters, as many as a two-layer MLP of width ``1.5 hidden``. With
    ``dropout`` the gated hidden units are dropped in training.
    """

    def __init__(
        self, d_model: int, hidden: int, *, bias: bool = False, dropout: float = 0.0
    ):
        super().__init__()
        d_model = check_positive_int("d_model", d_model)
        hidden = check_positive_int("hidden", hidden)
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (..., hidden)
        return self.down_proj(self.dropout(gated))  # (..., d)


def rope_halves_to_pairs(
    weight: torch.Tensor, num_heads: int, head_dim: int
) -> torch.Tensor:
    """The rows of a query or key projection ``(num_heads * head_dim, d)`` (or its bias
    ``(num_heads * head_dim,)``; a per-head norm weight ``(head_dim,)`` with
    ``num_heads=1``) reordered within each head: row ``2i`` of a head is its row ``i``,
    row ``2i + 1`` its row ``i + head_dim / 2``.

    transformers' RoPE rotates each head's pairs ``(x[i], x[i + head_dim/2])`` by ``p
    theta_i``, :func:`~attnbook.positions.apply_rope` the pairs ``(x[2i], x[2i+1])``
    by the same angle: with the rows reordered, our rotated queries and keys are theirs
    reordered, and the scores ``q . k`` are the same.
    """
    num_heads = check_positive_int("num_heads", num_heads)
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim % 2 or weight.dim() == 0 or weight.shape[0] != num_heads * head_dim:
        raise ValueError(
            f"weight must have num_heads * head_dim = {num_heads} * {head_dim} rows "
            f"(head_dim even), got shape {tuple(weight.shape)}"
        )
    # 0, d/2, 1, d/2 + 1, ...: row 2i takes row i, row 2i + 1 takes row i + d/2
    order = torch.arange(head_dim, device=weight.device).view(2, -1).T.flatten()
    heads = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return heads[:, order].reshape(weight.shape)


def decoder_parameters(
    vocab: int,
    d_model: int,
    layers: int,
    heads: int,
    kv_heads: int,
    hidden: int,
    *,
    head_dim: int | None = None,
    tie_embeddings: bool = False,
    qk_norm: bool = False,
    bias: bool = False,
) -> int:
    """The parameters of a Llama-style decoder (RoPE, RMSNorm, SwiGLU): token embedding
    ``vocab d``; per layer the attention (``W_q``, ``W_o``: ``d heads head_dim`` each;
    ``W_k``, ``W_v``: ``d kv_heads head_dim`` each; with ``qk_norm`` two norms of
    ``head_dim``), the SwiGLU (``3 d hidden``) and two RMSNorms (``2 d``); a final
    RMSNorm (``d``) and the output head (``vocab d``, none when tied to the embedding).

    ``head_dim`` defaults to ``d_model / heads`` (Qwen3 sets it apart). With ``bias``
    every linear layer of the attention and the feed-forward network has a bias.
    """
    sizes = dict(vocab=vocab, d_model=d_model, layers=layers, heads=heads)
    sizes.update(kv_heads=kv_heads, hidden=hidden)
    for name, value in sizes.items():
        check_positive_int(name, value)
    if head_dim is None:
        head_dim = d_model // heads
    head_dim = check_positive_int("head_dim", head_dim)
    q, kv = heads * head_dim, kv_heads * head_dim  # widths of W_q and of W_k, W_v
    attention = 2 * d_model * q + 2 * d_model * kv + (2 * head_dim if qk_norm else 0)
    feed_forward = 3 * d_model * hidden
    if bias:
        attention += q + 2 * kv + d_model
        feed_forward += 2 * hidden + d_model
    layer = attention + feed_forward + 2 * d_model
    head = 0 if tie_embeddings else vocab * d_model
    return vocab * d_model + layers * layer + d_model + head


# --- reading transformers' Llama, Qwen3 and Mistral
# ----------------------------------------------------------------------------------

SUPPORTED_MODELS = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "DeepseekV3ForCausalLM",
)
LAYER_NAMES = {  # their module in a layer -> ours in a block
    "self_attn.q_proj": "self_attention.q_proj",
    "self_attn.k_proj": "self_attention.k_proj",
    "self_attn.v_proj": "self_attention.v_proj",
    "self_attn.o_proj": "self_attention.out_proj",
    "self_attn.q_norm": "self_attention.q_norm",
    "self_attn.k_norm": "self_attention.k_norm",
    "mlp.gate_proj": "feed_forward.gate_proj",
    "mlp.up_proj": "feed_forward.up_proj",
    "mlp.down_proj": "feed_forward.down_proj",
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
}
LATENT_NAMES = {  # DeepSeek-V3's attention modules -> MultiHeadLatentAttention's
    "self_attn.q_proj": "self_attention.q_proj",
    "self_attn.q_a_proj": "self_attention.q_down",
    "self_attn.q_a_layernorm": "self_attention.q_norm",
    "self_attn.q_b_proj": "self_attention.q_up",
    "self_attn.kv_a_layernorm": "self_attention.kv_norm",
    "self_attn.kv_b_proj": "self_attention.kv_up",
    "self_attn.o_proj": "self_attention.out_proj",
}


def _check_model(model) -> None:
    import transformers

    classes = tuple(getattr(transformers, name) for name in SUPPORTED_MODELS)
    if not isinstance(model, classes):
        raise TypeError(
            f"model must be one of {', '.join(SUPPORTED_MODELS)}, got "
            f"{type(model).__name__}"
        )


def _rope_base(config) -> float:
    """RoPE's base from ``config.rope_parameters`` (transformers 5) or the older
    ``rope_theta`` and ``rope_scaling``; anything but the default RoPE raises."""
    parameters = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    for name, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        rope_type = value.get("rope_type", value.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"{name} has rope_type={rope_type!r}: GPT.from_transformers reproduces "
                "the default RoPE only"
            )
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _window(config) -> int | None:
    """The sliding window of every layer (Mistral's ``sliding_window``; Qwen3's when
    all its ``layer_types`` slide), or ``None``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Llama has no window, Mistral's is in every layer
        return window
    kinds = set(layer_types)
    if len(kinds) > 1:
        raise ValueError(
            f"layer_types mixes {sorted(kinds)}: a GPT has one window for every layer"
        )
    return window if kinds == {"sliding_attention"} else None


def _shared_arguments(config, *, bias: bool, tied: bool) -> dict:
    """The GPT keywords every decoder we read shares: sizes, RMSNorm, SwiGLU, RoPE."""
    return dict(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_layers=config.num_hidden_layers,
        max_len=config.max_position_embeddings,
        hidden=config.intermediate_size,
        norm="rms",
        norm_eps=config.rms_norm_eps,
        activation="swiglu",
        positions="rope",
        rope_base=_rope_base(config),
        bias=bias,
        tie_embeddings=tied,
    )


def _deepseek_arguments(config, tied: bool) -> dict:
    """:func:`gpt_arguments` of a ``DeepseekV3ForCausalLM``: multi-head latent
    attention (``mla=``), dense SwiGLU layers only."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    dense = config.first_k_dense_replace
    if dense is None or dense < layers:
        raise ValueError(
            f"first_k_dense_replace={dense} < num_hidden_layers={layers}: the layers "
            "from there on are mixture-of-experts (chapter 19); a GPT reads a DeepSeek "
            "whose layers are all dense"
        )
    if config.num_key_value_heads != heads:
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} differs from "
            f"num_attention_heads={heads}: latent attention expands one key and "
            "value per query head"
        )
    if config.attention_bias:
        raise ValueError(
            "attention_bias=True: a GPT's bias= would also give the SwiGLU biases, "
            "which DeepSeek's has not"
        )
    return dict(
        **_shared_arguments(config, bias=False, tied=tied),
        mla=dict(
            kv_lora_rank=config.kv_lora_rank,
            q_lora_rank=config.q_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim,
            qk_nope_head_dim=config.qk_nope_head_dim,
            v_head_dim=config.v_head_dim,
        ),
    )


def gpt_arguments(model) -> dict:
    """The :class:`~attnbook.models.GPT` keywords that rebuild a transformers
    ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``MistralForCausalLM``: RoPE,
    RMSNorm, SwiGLU, grouped-query attention, QK-norm for Qwen3, Mistral's sliding
    window; or a ``DeepseekV3ForCausalLM`` whose layers are all dense (multi-head
    latent attention, ``mla=``; a mixture-of-experts layer, ``num_key_value_heads``
    unlike ``num_attention_heads`` or ``attention_bias`` raise).

    Another model class raises a ``TypeError``; a config field we cannot reproduce
    (``hidden_act`` other than SiLU, a ``head_dim`` other than ``hidden_size /
    num_attention_heads``, scaled RoPE, ``attention_bias`` unlike ``mlp_bias``,
    ``attention_dropout``, layers that differ in their window, ``tie_word_embeddings``
    unlike the weights) a ``ValueError`` naming it.
    """
    _check_model(model)
    return _decoder_arguments(model)


def _decoder_arguments(model) -> dict:
    """:func:`gpt_arguments` without checking the model's class (chapter 19 reads a
    Mixtral's attention with it)."""
    config = model.config
    d_model, heads = config.hidden_size, config.num_attention_heads
    if config.hidden_act != "silu":
        raise ValueError(
            f"hidden_act={config.hidden_act!r}: our SwiGLU gates with SiLU ('silu')"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout={config.attention_dropout}: a GPT's dropout also acts "
            "outside the attention; set it to 0"
        )
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    if bool(config.tie_word_embeddings) != tied:
        raise ValueError(
            f"tie_word_embeddings={config.tie_word_embeddings} but the model's output "
            f"head is{'' if tied else ' not'} its input embedding"
        )
    if config.model_type == "deepseek_v3":
        return _deepseek_arguments(config, tied)
    head_dim = getattr(config, "head_dim", None) or d_model // heads
    if head_dim * heads != d_model:
        raise ValueError(
            f"head_dim={head_dim} is not hidden_size / num_attention_heads = "
            f"{d_model} / {heads}: our heads split d_model"
        )
    attention_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(
            f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: a GPT's bias= "
            "covers the attention's and the feed-forward's linear layers together"
        )
    return dict(
        **_shared_arguments(config, bias=attention_bias, tied=tied),
        window=_window(config),
        num_kv_heads=config.num_key_value_heads,
        qk_norm=hasattr(model.model.layers[0].self_attn, "q_norm"),  # Qwen3
    )


def _latent_layer(layer, prefix: str, arguments: dict, interleaved: bool) -> dict:
    """One DeepSeek-V3 layer's tensors under our names: ``kv_a_proj_with_mqa`` split
    into ``kv_down`` (the latent's rows) and ``k_rope`` (the RoPE key's); with
    ``rope_interleave=False`` the RoPE rows of the queries and of the key reordered by
    :func:`rope_halves_to_pairs` (with ``True`` DeepSeek rotates pairs as we do)."""
    mla, heads = arguments["mla"], arguments["num_heads"]
    nope, rope = mla["qk_nope_head_dim"], mla["qk_rope_head_dim"]

    def query_rows(w):  # (h (nope + rope), ...): each head's last rope rows reordered
        if interleaved:
            return w
        rows = w.reshape(heads, nope + rope, *w.shape[1:])
        rotary = rows[:, nope:].reshape(heads * rope, *w.shape[1:])
        rotary = rope_halves_to_pairs(rotary, heads, rope).reshape(rows[:, nope:].shape)
        return torch.cat([rows[:, :nope], rotary], dim=1).reshape(w.shape)

    tensors = {}
    for name, tensor in layer.state_dict().items():
        module, parameter = name.rsplit(".", 1)
        if module == "self_attn.kv_a_proj_with_mqa":
            latent, rotary = tensor.split([mla["kv_lora_rank"], rope])
            if not interleaved:
                rotary = rope_halves_to_pairs(rotary, 1, rope)
            tensors[f"{prefix}.self_attention.kv_down.{parameter}"] = latent
            tensors[f"{prefix}.self_attention.k_rope.{parameter}"] = rotary
            continue
        if module in ("self_attn.q_proj", "self_attn.q_b_proj"):
            tensor = query_rows(tensor)
        ours = LATENT_NAMES.get(module) or LAYER_NAMES.get(module, module)
        tensors[f"{prefix}.{ours}.{parameter}"] = tensor
    return tensors


def gpt_weights(model) -> dict[str, torch.Tensor]:
    """A transformers ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or
    ``MistralForCausalLM``'s tensors under the names of the
    :class:`~attnbook.models.GPT` that :func:`gpt_arguments` builds (for
    :func:`~attnbook.utils.copy_weights`), the rows of ``W_q``, ``W_k`` (their biases,
    the QK-norm weights) reordered by :func:`rope_halves_to_pairs`; a
    ``DeepseekV3ForCausalLM``'s too (see :func:`_latent_layer`)."""
    arguments = gpt_arguments(model)
    heads, kv_heads = arguments["num_heads"], arguments.get("num_kv_heads")
    head_dim = arguments["d_model"] // heads
    # the heads whose rows to reorder, per module (a norm over head_dim has one)
    rows = {
        "self_attn.q_proj": heads,
        "self_attn.k_proj": kv_heads,
        "self_attn.q_norm": 1,
        "self_attn.k_norm": 1,
    }

    def layer_tensors(layer, prefix):
        if "mla" in arguments:  # DeepSeek-V3
            interleaved = bool(model.config.rope_interleave)
            return _latent_layer(layer, prefix, arguments, interleaved)
        tensors = {}
        for name, tensor in layer.state_dict().items():
            module, parameter = name.rsplit(".", 1)  # "self_attn.q_proj", "weight"
            if module in rows:
                tensor = rope_halves_to_pairs(tensor, rows[module], head_dim)
            # an unknown module keeps its name: copy_weights lists it as unused
            ours = LAYER_NAMES.get(module, module)
            tensors[f"{prefix}.{ours}.{parameter}"] = tensor
        return tensors

    return _decoder_tensors(model, arguments, layer_tensors)


def _decoder_tensors(model, arguments: dict, layer_tensors) -> dict[str, torch.Tensor]:
    """A transformers decoder's tensors under our GPT's names: the embedding, each
    layer's from ``layer_tensors(layer, "blocks.i")``, the final norm and, untied,
    the output head."""
    tensors = {"token_embedding.weight": model.get_input_embeddings().weight}
    for i, layer in enumerate(model.model.layers):
        tensors.update(layer_tensors(layer, f"blocks.{i}"))
    tensors["final_norm.weight"] = model.model.norm.weight
    if not arguments["tie_embeddings"]:
        tensors["lm_head.weight"] = model.lm_head.weight
    return tensors


__all__ = [
    "RMSNorm",
    "SwiGLU",
    "decoder_parameters",
    "gpt_arguments",
    "gpt_weights",
    "rope_halves_to_pairs",
]
