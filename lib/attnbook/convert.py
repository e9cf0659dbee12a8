"""Reading transformers' decoders into our :class:`~attnbook.models.GPT`: the one home
of the conversion (chapters 17 to 19).

- :func:`gpt_arguments`: the GPT keywords that rebuild a ``LlamaForCausalLM``,
  ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``MixtralForCausalLM`` (a mixture of
  experts) or a dense ``DeepseekV3ForCausalLM`` (multi-head latent attention); a config
  field the GPT cannot reproduce raises, naming it;
- :func:`gpt_weights`: the model's tensors under our parameter names, the rows of
  ``W_q`` and ``W_k`` reordered for our RoPE layout
  (:func:`~attnbook.modern.rope_halves_to_pairs`).

:meth:`GPT.from_transformers <attnbook.models.GPT.from_transformers>` builds the GPT
from them and copies the weights (:func:`~attnbook.utils.copy_weights`).
"""

from __future__ import annotations

import torch

from .modern import rope_halves_to_pairs

__all__ = ["SUPPORTED_MODELS", "gpt_arguments", "gpt_weights"]

SUPPORTED_MODELS = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "DeepseekV3ForCausalLM",
    "MixtralForCausalLM",
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
    sizes = dict(
        vocab_size=config.vocab_size, d_model=config.hidden_size,
        num_heads=config.num_attention_heads, num_layers=config.num_hidden_layers,
        max_len=config.max_position_embeddings, hidden=config.intermediate_size,
    )  # fmt: skip
    return dict(
        **sizes, norm="rms", norm_eps=config.rms_norm_eps, activation="swiglu",
        positions="rope", rope_base=_rope_base(config), bias=bias, tie_embeddings=tied,
    )  # fmt: skip


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
    sizes = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
    mla = {name: getattr(config, name) for name in (*sizes, "v_head_dim")}
    return dict(**_shared_arguments(config, bias=False, tied=tied), mla=mla)


def gpt_arguments(model) -> dict:
    """The :class:`~attnbook.models.GPT` keywords that rebuild a transformers
    ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``MistralForCausalLM``: RoPE,
    RMSNorm, SwiGLU, grouped-query attention, QK-norm for Qwen3, Mistral's sliding
    window; a ``MixtralForCausalLM``: Mistral's with ``experts=dict(num_experts=
    num_local_experts, top_k=num_experts_per_tok)`` of width ``intermediate_size``
    (``router_jitter_noise``, multiplicative noise on the layer's input in training
    only, is not reproduced: the logits agree in eval mode); or a
    ``DeepseekV3ForCausalLM`` whose layers are all dense (multi-head latent attention,
    ``mla=``; a mixture-of-experts layer, ``num_key_value_heads`` unlike
    ``num_attention_heads`` or ``attention_bias`` raise).

    Another model class raises a ``TypeError``; a config field we cannot reproduce
    (``hidden_act`` other than SiLU, a ``head_dim`` other than ``hidden_size /
    num_attention_heads``, scaled RoPE, ``attention_bias`` unlike ``mlp_bias``,
    ``attention_dropout``, layers that differ in their window, ``tie_word_embeddings``
    unlike the weights) a ``ValueError`` naming it.
    """
    _check_model(model)
    arguments = _decoder_arguments(model)
    if type(model).__name__ == "MixtralForCausalLM":
        config = model.config
        arguments["experts"] = dict(
            num_experts=config.num_local_experts, top_k=config.num_experts_per_tok
        )
    return arguments


def _decoder_arguments(model) -> dict:
    """:func:`gpt_arguments` but a Mixtral's experts."""
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


def _layer_tensors(layer, prefix: str, arguments: dict) -> dict:
    """One Llama, Qwen3, Mistral or Mixtral layer's tensors under our names: the rows
    of ``W_q``, ``W_k`` (their biases, the QK-norm weights) reordered by
    :func:`~attnbook.modern.rope_halves_to_pairs`; a Mixtral's router ``mlp.gate``, and
    its experts' fused ``gate_up_proj (E, 2 hidden, d)`` split into each expert's
    ``gate_proj`` (first half) and ``up_proj``, ``down_proj (E, d, hidden)`` into each
    expert's ``down_proj``."""
    heads = arguments["num_heads"]
    head_dim = arguments["d_model"] // heads
    rows = {  # the heads whose rows to reorder, per module (a norm has one)
        "self_attn.q_proj": heads,
        "self_attn.k_proj": arguments["num_kv_heads"],
        "self_attn.q_norm": 1,
        "self_attn.k_norm": 1,
    }
    experts = f"{prefix}.feed_forward.experts"
    tensors = {}
    for name, tensor in layer.state_dict().items():
        module, parameter = name.rsplit(".", 1)  # "self_attn.q_proj", "weight"
        if module in rows:
            tensor = rope_halves_to_pairs(tensor, rows[module], head_dim)
        if module == "mlp.gate":
            tensors[f"{prefix}.feed_forward.router.{parameter}"] = tensor
        elif module == "mlp.experts" and parameter == "gate_up_proj":
            for i, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                tensors[f"{experts}.{i}.gate_proj.weight"] = gate
                tensors[f"{experts}.{i}.up_proj.weight"] = up
        elif module == "mlp.experts" and parameter == "down_proj":
            for i, down in enumerate(tensor):
                tensors[f"{experts}.{i}.down_proj.weight"] = down
        else:  # an unknown module keeps its name: copy_weights lists it as unused
            tensors[f"{prefix}.{LAYER_NAMES.get(module, module)}.{parameter}"] = tensor
    return tensors


def gpt_weights(model) -> dict[str, torch.Tensor]:
    """A transformers model's tensors (a class :func:`gpt_arguments` reads) under the
    names of the :class:`~attnbook.models.GPT` it builds, for
    :func:`~attnbook.utils.copy_weights`: each layer's from :func:`_layer_tensors`, or
    a DeepSeek-V3's from :func:`_latent_layer`; the embedding, the final norm and,
    untied, the output head."""
    arguments = gpt_arguments(model)
    tensors = {"token_embedding.weight": model.get_input_embeddings().weight}
    for i, layer in enumerate(model.model.layers):
        if "mla" in arguments:  # DeepSeek-V3
            interleaved = bool(model.config.rope_interleave)
            tensors.update(_latent_layer(layer, f"blocks.{i}", arguments, interleaved))
        else:
            tensors.update(_layer_tensors(layer, f"blocks.{i}", arguments))
    tensors["final_norm.weight"] = model.model.norm.weight
    if not arguments["tie_embeddings"]:
        tensors["lm_head.weight"] = model.lm_head.weight
    return tensors
