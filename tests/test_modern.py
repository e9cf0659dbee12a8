"""Chapter 17's pieces (RMSNorm, SwiGLU, grouped-query attention, QK-norm, RoPE's two layouts,
the parameter count, GPT.from_transformers), each against the transformers module it mirrors,
built tiny and random in the test; and the default GPT, bit-identical to what it was before them."""

import hashlib

import pytest
import torch
from attnbook import (
    GPT,
    GroupedQueryAttention,
    KVCache,
    MultiHeadAttention,
    RMSNorm,
    RotaryMultiHeadAttention,
    SwiGLU,
    apply_rope,
    generate,
    repeat_kv,
)
from attnbook.blocks import DecoderOnlyBlock
from attnbook.convert import gpt_arguments
from attnbook.models import decoder_block
from attnbook.modern import decoder_parameters, rope_halves_to_pairs
from conftest import require
from torch import nn

transformers = require("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

V, D, H, KV, HIDDEN, MAX = 64, 32, 4, 2, 48, 64
HEAD_DIM = D // H
TOL = {"atol": 1e-5, "rtol": 1e-5}


def count(module):
    return sum(p.numel() for p in module.parameters())


def sizes(**overrides):
    """A tiny config's fields (initialised wider than by default, so the logits are not all ~0)."""
    fields = dict(vocab_size=V, hidden_size=D, intermediate_size=HIDDEN, num_hidden_layers=2,
                  num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=MAX,
                  initializer_range=0.2, attn_implementation="eager", bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    return {**fields, **overrides}


def llama(**overrides):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes(**overrides))).eval()


def qwen3(**overrides):
    torch.manual_seed(0)
    fields = sizes(**{"head_dim": HEAD_DIM, **overrides})
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()
    with torch.no_grad():  # QK-norm weights start at one: make them random, so their order matters
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def mistral(**overrides):
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(**sizes(**overrides))).eval()


def causal_bias(T):
    """transformers' eager attention adds its mask: (1, 1, T, T), -inf above the diagonal."""
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


def rotary_embeddings(config, T):
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.zeros(1, T, config.hidden_size)
    return rotary(x, torch.arange(T)[None])  # cos, sin: (1, T, head_dim)


# ---- the default GPT: same modules, names, creation order and initial values as before chapter 17

def fingerprint(model):
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


# captured with the library before chapter 17's options (torch 2.13, CPU generator): a change in
# the modules a default builds, their names, order or initialisation changes these
BEFORE = {
    "gpt": (lambda: GPT(50, 32, 4, 2, 16), "56c4d23e66b41eb8"),
    "gpt_rope_window": (lambda: GPT(50, 32, 4, 2, 16, positions="rope", window=4, hidden=48,
                                    activation="relu", norm="post"), "00e3dcdb84835f91"),
    "gpt_alibi": (lambda: GPT(50, 32, 4, 2, 16, positions="alibi", dropout=0.1), "85950e92c86e3f82"),
    "mha": (lambda: MultiHeadAttention(32, 4), "a02c396cb6e1d80b"),
    "rotary": (lambda: RotaryMultiHeadAttention(32, 4, bias=False), "881deca6113e1132"),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_defaults_initialise_bit_identically_to_before(name):
    build, expected = BEFORE[name]
    torch.manual_seed(0)
    assert fingerprint(build()) == expected


def test_default_gpt_has_no_new_attributes_in_its_modules():
    model = GPT(50, 32, 4, 2, 16)
    attention = model.blocks[0].self_attention
    assert type(attention) is MultiHeadAttention and model.num_kv_heads == 4
    assert not hasattr(attention, "q_norm") and not hasattr(attention, "num_kv_heads")
    assert "norm" not in repr(attention) and model.lm_head.weight is not model.token_embedding.weight


# ---- RMSNorm and SwiGLU

def test_rms_norm_equals_torch_and_llama():
    torch.manual_seed(0)
    ours, torch_norm = RMSNorm(D, eps=1e-5), nn.RMSNorm(D, eps=1e-5)
    llama_norm = modeling_llama.LlamaRMSNorm(D, eps=1e-5)
    assert [name for name, _ in ours.named_parameters()] == ["weight"]
    assert torch.equal(ours.weight, torch.ones(D))
    with torch.no_grad():
        ours.weight.normal_()
    torch_norm.load_state_dict(ours.state_dict())
    llama_norm.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, D) * 4
    torch.testing.assert_close(ours(x), torch_norm(x), **TOL)
    torch.testing.assert_close(ours(x), llama_norm(x), **TOL)
    half = x.bfloat16()  # computed in float32 as Llama does
    ours.bfloat16(), llama_norm.bfloat16()
    torch.testing.assert_close(ours(half), llama_norm(half))
    assert RMSNorm(D).eps == 1e-6


def test_rms_norm_rejects_bad_inputs():
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(D, eps=0)
    with pytest.raises(ValueError, match="d must be a positive int"):
        RMSNorm(0)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., d=32\)"):
        RMSNorm(D)(torch.randn(2, 16))


def test_swiglu_equals_llama_mlp():
    torch.manual_seed(0)
    ours = SwiGLU(D, HIDDEN)
    reference = modeling_llama.LlamaMLP(transformers.LlamaConfig(**sizes()))
    assert [name for name, _ in ours.named_parameters()] == [name for name, _ in reference.named_parameters()]
    assert count(ours) == 3 * D * HIDDEN  # no biases
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(ours(x), reference(x), **TOL)


# ---- grouped-query attention

def test_repeat_kv_equals_transformers():
    x = torch.randn(2, 3, 5, 4)
    for repeats in (1, 2, 4):
        assert torch.equal(repeat_kv(x, repeats), modeling_llama.repeat_kv(x, repeats))


def test_grouped_attention_is_full_attention_with_shared_key_value_heads():
    """Key/value head g serves query heads g r .. g r + r - 1: a full MultiHeadAttention whose
    key and value heads are the grouped ones repeated computes the same."""
    torch.manual_seed(0)
    grouped = GroupedQueryAttention(D, H, num_kv_heads=KV).eval()
    assert grouped.k_proj.out_features == grouped.v_proj.out_features == KV * HEAD_DIM
    full = MultiHeadAttention(D, H).eval()
    full.load_state_dict({
        name: repeat_kv(t.view(1, KV, HEAD_DIM, -1), H // KV).reshape(D, *t.shape[1:])
        if name.startswith(("k_proj", "v_proj")) else t
        for name, t in grouped.state_dict().items()
    })
    x = torch.randn(2, 6, D)
    out, weights = grouped(x, x, x, is_causal=True)
    expected, expected_weights = full(x, x, x, is_causal=True)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)
    fused, _ = grouped(x, x, x, need_weights=False, is_causal=True)
    torch.testing.assert_close(fused, expected, **TOL)


def permuted_from(reference, ours, heads, kv_heads):
    """Copy a transformers attention's weights into ours, W_q and W_k (and QK-norm) reordered for our RoPE."""
    state = {}
    for name, tensor in reference.state_dict().items():
        module = name.split(".")[0]
        rows = {"q_proj": heads, "k_proj": kv_heads, "q_norm": 1, "k_norm": 1}.get(module)
        if rows is not None:
            tensor = rope_halves_to_pairs(tensor, rows, HEAD_DIM)
        state[name.replace("o_proj", "out_proj")] = tensor
    ours.load_state_dict(state)
    return ours


@pytest.mark.parametrize("kv_heads", [H, KV, 1])
def test_grouped_rotary_attention_equals_llama_attention(kv_heads):
    config = transformers.LlamaConfig(**sizes(num_key_value_heads=kv_heads, attention_bias=True))
    torch.manual_seed(0)
    reference = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for projection in (reference.q_proj, reference.k_proj, reference.v_proj, reference.o_proj):
            projection.bias.normal_()
    ours = GroupedQueryAttention(D, H, num_kv_heads=kv_heads, rope_base=10000.0)
    ours = permuted_from(reference, ours.eval(), H, kv_heads)
    x = torch.randn(2, 9, D)
    expected, expected_weights = reference(x, rotary_embeddings(config, 9), causal_bias(9))
    out, weights = ours(x, x, x, is_causal=True)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)


def test_qk_norm_attention_equals_qwen3_attention():
    config = transformers.Qwen3Config(**sizes(head_dim=HEAD_DIM, rms_norm_eps=1e-5))
    torch.manual_seed(0)
    reference = modeling_qwen3.Qwen3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        reference.q_norm.weight.uniform_(0.5, 1.5)
        reference.k_norm.weight.uniform_(0.5, 1.5)
    ours = GroupedQueryAttention(D, H, bias=False, num_kv_heads=KV, qk_norm=True, qk_norm_eps=1e-5,
                                 rope_base=10000.0)
    assert [n for n, _ in ours.named_parameters()][-2:] == ["q_norm.weight", "k_norm.weight"]
    ours = permuted_from(reference, ours.eval(), H, KV)
    x = torch.randn(2, 9, D)
    expected, _ = reference(x, rotary_embeddings(config, 9), causal_bias(9))
    torch.testing.assert_close(ours(x, x, x, is_causal=True)[0], expected, **TOL)


def test_grouped_attention_caches_only_its_key_value_heads():
    torch.manual_seed(0)
    attention = GroupedQueryAttention(D, H, num_kv_heads=1, qk_norm=True, rope_base=10000.0).eval()
    x = torch.randn(2, 7, D)
    full, _ = attention(x, x, x, is_causal=True)
    cache = KVCache(2, 1, 7, HEAD_DIM)
    steps = [attention(x[:, :3], x[:, :3], x[:, :3], cache=cache, is_causal=True)[0]]
    steps += [attention(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache, is_causal=True)[0]
              for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert cache.keys.shape == (2, 1, 7, HEAD_DIM)


@pytest.mark.parametrize("window", [None, 4])
def test_grouped_gpt_with_caches_equals_without_and_its_caches_shrink(window):
    torch.manual_seed(0)
    options = dict(positions="rope", norm="rms", activation="swiglu", window=window)
    model = GPT(V, D, H, 2, 24, num_kv_heads=KV, qk_norm=True, **options).eval()
    prompt = torch.randint(V, (2, 5))
    torch.testing.assert_close(generate(model, prompt, 6), generate(model, prompt, 6, use_cache=False))
    tokens = torch.randint(V, (2, 10))
    caches = model.make_caches(2)
    stepped = torch.cat([model(tokens[:, :4], caches)] + [model(tokens[:, t : t + 1], caches) for t in range(4, 10)], 1)
    torch.testing.assert_close(stepped, model(tokens), **TOL)
    full_heads = GPT(V, D, H, 2, 24, **options)
    grouped_bytes = sum(cache.nbytes() for cache in model.make_caches(2))
    assert sum(cache.nbytes() for cache in full_heads.make_caches(2)) == grouped_bytes * (H // KV)
    assert all(cache.keys.shape[1] == KV for cache in model.make_caches(2))


# ---- RoPE's two layouts

def test_rope_halves_to_pairs_keeps_the_scores_of_transformers_rotation():
    """Scores q . k with transformers' rotation (halves) and the original weights equal ours (pairs)
    with the rows of W_q and W_k reordered."""
    config = transformers.LlamaConfig(**sizes(rope_theta=500000.0))
    torch.manual_seed(0)
    w_q, w_k = torch.randn(H * HEAD_DIM, D), torch.randn(KV * HEAD_DIM, D)
    x, T = torch.randn(2, 11, D), 11
    cos, sin = rotary_embeddings(config, T)
    q = (x @ w_q.T).view(2, T, H, HEAD_DIM).transpose(1, 2)
    k = repeat_kv((x @ w_k.T).view(2, T, KV, HEAD_DIM).transpose(1, 2), H // KV)
    q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    theirs = q @ k.transpose(-1, -2)
    q = (x @ rope_halves_to_pairs(w_q, H, HEAD_DIM).T).view(2, T, H, HEAD_DIM).transpose(1, 2)
    k = (x @ rope_halves_to_pairs(w_k, KV, HEAD_DIM).T).view(2, T, KV, HEAD_DIM).transpose(1, 2)
    ours = apply_rope(q, base=500000.0) @ repeat_kv(apply_rope(k, base=500000.0), H // KV).transpose(-1, -2)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


def test_rope_halves_to_pairs_by_hand_and_bad_shapes():
    rows = torch.arange(8.0)  # one head of 8: (0, 4), (1, 5), (2, 6), (3, 7)
    assert rope_halves_to_pairs(rows, 1, 8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    two_heads = torch.arange(8.0)[:, None].expand(8, 3)
    assert rope_halves_to_pairs(two_heads, 2, 4)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        rope_halves_to_pairs(torch.randn(12, 4), 2, 4)
    with pytest.raises(ValueError, match="head_dim even"):
        rope_halves_to_pairs(torch.randn(6, 4), 2, 3)


def test_rope_base_reaches_apply_rope():
    torch.manual_seed(0)
    attention = RotaryMultiHeadAttention(D, H, rope_base=500000.0)
    q, k = torch.randn(1, H, 5, HEAD_DIM), torch.randn(1, H, 5, HEAD_DIM)
    rotated_q, rotated_k = attention.encode_positions(q, k, 3)
    torch.testing.assert_close(rotated_q, apply_rope(q, 3, 500000.0))
    torch.testing.assert_close(rotated_k, apply_rope(k, 3, 500000.0))
    assert not torch.allclose(rotated_q, apply_rope(q, 3))
    attention.rotary.set_scaling(2.0, "ntk")
    torch.testing.assert_close(attention.encode_positions(q, k, 3)[0],
                               apply_rope(q, 3, 500000.0, scale=2.0, method="ntk"))
    model = GPT(V, D, H, 1, 16, positions="rope", rope_base=500000.0)
    assert model.blocks[0].self_attention.rope_base == 500000.0


# ---- the parameter count

def test_decoder_parameters_equals_our_gpt_and_transformers():
    formula = dict(vocab=V, d_model=D, layers=2, heads=H, kv_heads=KV, hidden=HIDDEN)
    for tie in (False, True):
        for qk_norm in (False, True):
            for bias in (False, True):
                model = GPT(V, D, H, 2, 16, positions="rope", norm="rms", activation="swiglu", hidden=HIDDEN,
                            num_kv_heads=KV, qk_norm=qk_norm, bias=bias, tie_embeddings=tie)
                expected = decoder_parameters(**formula, tie_embeddings=tie, qk_norm=qk_norm, bias=bias)
                assert count(model) == expected, (tie, qk_norm, bias)
    assert count(llama()) == decoder_parameters(**formula)
    assert count(llama(attention_bias=True, mlp_bias=True)) == decoder_parameters(**formula, bias=True)
    assert count(mistral(tie_word_embeddings=True)) == decoder_parameters(**formula, tie_embeddings=True)
    # Qwen3's head_dim may differ from d_model / heads (GPT.from_transformers refuses it; the formula does not)
    wide_heads = qwen3(head_dim=16, tie_word_embeddings=True)
    assert count(wide_heads) == decoder_parameters(**formula, head_dim=16, tie_embeddings=True, qk_norm=True)


# ---- GPT's options

def test_modern_gpt_modules():
    model = GPT(V, D, H, 2, 16, positions="rope", norm="rms", norm_eps=1e-5, activation="swiglu", hidden=HIDDEN,
                num_kv_heads=KV, qk_norm=True, bias=False, tie_embeddings=True)
    block = model.blocks[0]
    assert isinstance(block.norm1, RMSNorm) and block.norm1.eps == 1e-5 and isinstance(model.final_norm, RMSNorm)
    assert isinstance(block.feed_forward, SwiGLU) and block.feed_forward.up_proj.out_features == HIDDEN
    assert block.self_attention.q_norm.eps == 1e-5
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, nn.Linear))
    assert model.lm_head.weight is model.token_embedding.weight
    assert GPT(V, D, H, 1, 16, activation="swiglu").blocks[0].feed_forward.up_proj.out_features == 8 * D // 3
    plain = GPT(V, D, H, 1, 16, bias=False)  # GELU MLP and attention without biases, LayerNorms kept
    assert [n for n, _ in plain.named_parameters() if n.endswith("bias")] == [
        "blocks.0.norm1.bias", "blocks.0.norm2.bias", "final_norm.bias"]
    assert plain(torch.randint(V, (1, 5))).shape == (1, 5, V)


# ---- GPT.from_transformers

MODELS = {
    "llama": lambda: llama(),
    "llama_biases_tied_base": lambda: llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen3": lambda: qwen3(num_key_value_heads=1),
    "qwen3_every_layer_sliding": lambda: qwen3(use_sliding_window=True, sliding_window=5, max_window_layers=0),
    "mistral": lambda: mistral(sliding_window=5),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_transformers_logits_generation_and_parameters(name):
    reference = MODELS[name]()
    model = GPT.from_transformers(reference)
    assert not model.training and count(model) == count(reference)
    tokens = torch.randint(V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
    assert expected.std() > 0.1  # lively logits: a wrong layout would show
    torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
    prompt = tokens[:1, :4]
    expected_tokens = reference.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 20), expected_tokens)
    if name in ("mistral", "qwen3_every_layer_sliding"):  # the window matters: without it the logits past it differ
        assert model.window == 5
        unwindowed = GPT(**{**gpt_arguments(reference), "window": None})
        unwindowed.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert not torch.allclose(unwindowed(tokens)[:, 5:], expected[:, 5:], atol=1e-3)


def test_from_transformers_keeps_the_models_dtype():
    model = GPT.from_transformers(llama().to(torch.bfloat16))
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("build, field", [
    (lambda: llama(hidden_act="gelu"), "hidden_act"),
    (lambda: llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope_parameters"),
    (lambda: llama(attention_bias=True), "attention_bias"),
    (lambda: llama(mlp_bias=True), "mlp_bias"),
    (lambda: llama(head_dim=16), "head_dim"),
    (lambda: llama(attention_dropout=0.1), "attention_dropout"),
    (lambda: qwen3(attention_bias=True), "attention_bias"),
    (lambda: qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=1), "layer_types"),
])
def test_from_transformers_names_the_field_it_cannot_reproduce(build, field):
    reference = build()
    with pytest.raises(ValueError, match=field):
        GPT.from_transformers(reference)


def test_from_transformers_refuses_a_tie_the_weights_do_not_have():
    reference = llama()
    reference.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        GPT.from_transformers(reference)


@pytest.mark.parametrize("model", [lambda: llama().model, lambda: nn.Linear(2, 2)])
def test_from_transformers_refuses_other_models(model):
    with pytest.raises(TypeError, match="LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM"):
        GPT.from_transformers(model())


# ---- bad inputs

def test_num_heads_must_be_divisible_by_num_kv_heads():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        GroupedQueryAttention(D, H, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        GroupedQueryAttention(D, H, num_kv_heads=0)
    with pytest.raises(TypeError):  # chapter 3's attention has no grouped heads
        MultiHeadAttention(D, H, num_kv_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        GPT(V, D, H, 1, 16, num_kv_heads=3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(norm="middle"), "norm must be 'post', 'pre' or 'rms', got 'middle'"),
    (dict(activation="swish"), r"activation must be one of \['gelu', 'relu', 'swiglu'\], got 'swish'"),
    (dict(rope_base=500000.0), "rope_base needs positions='rope'"),
    (dict(positions="rope", rope_base=1.0), "rope_base must be a number > 1"),
    (dict(norm="rms", norm_eps=0.0), "norm_eps must be a positive number"),
])
def test_gpt_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPT(V, D, H, 1, 16, **kwargs)


def test_pytorch_weights_do_not_load_into_modern_modules():
    with pytest.raises(ValueError, match="grouped keys and values nor QK-norm"):
        GroupedQueryAttention(D, H, num_kv_heads=KV).load_from_torch(nn.MultiheadAttention(D, H, batch_first=True))
    reference = nn.TransformerEncoderLayer(D, H, batch_first=True, norm_first=True)
    block = decoder_block(GPT(V, D, H, 1, 8, norm="rms").config)
    assert isinstance(block, DecoderOnlyBlock)
    with pytest.raises(ValueError, match="LayerNorm and a two-layer MLP; this block has RMSNorm"):
        block.load_from_torch(reference)


def test_benchmark_floor_refuses_what_it_does_not_compute():
    from attnbook import bench

    prompt = torch.zeros(1, 2, dtype=torch.long)
    for kwargs, match in [(dict(num_kv_heads=KV), "GroupedQueryAttention"),
                          (dict(qk_norm=True), "GroupedQueryAttention"),
                          (dict(activation="swiglu"), "GELU"), (dict(norm="rms"), "pre-norm")]:
        with pytest.raises(ValueError, match=match):
            bench.floor_generate(GPT(V, D, H, 1, 8, **kwargs), prompt, 3)
    torch.manual_seed(0)
    no_biases = GPT(V, D, H, 1, 8, bias=False).eval()
    assert torch.equal(bench.floor_generate(no_biases, prompt, 3), generate(no_biases, prompt, 3))
