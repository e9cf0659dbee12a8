"""Chapter 18's multi-head latent attention (DeepSeek-V2/V3): the module against transformers'
DeepseekV3Attention with the same weights, its expanded and absorbed computations against each
other, its latent cache (bytes, stepping, surgery), a GPT built with it (training, cached
generation), GPT.from_transformers on a dense DeepSeek-V3, the cost formulas, and bad inputs."""

import pytest
import torch
from attnbook import (
    GPT,
    LatentKVCache,
    MultiHeadLatentAttention,
    cost,
    generate,
    speculative_generate,
)
from attnbook.convert import _latent_layer
from attnbook.measure import flop_counter
from conftest import require
from torch import nn

transformers = require("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

V, D, H, MAX = 64, 32, 4, 64
RANK, Q_RANK, ROPE, NOPE, VD = 16, 24, 8, 12, 10
MLA = dict(kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VD)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def count(module):
    return sum(p.numel() for p in module.parameters())


def config(**overrides):
    """A tiny dense DeepSeek-V3 config (initialised wider than by default, so the logits are lively)."""
    fields = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=RANK, q_lora_rank=Q_RANK,
                  qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VD, first_k_dense_replace=2,
                  max_position_embeddings=MAX, initializer_range=0.2, attn_implementation="eager",
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.DeepseekV3Config(**{**fields, **overrides})


def randomise_norms_and_biases(module):
    """Norm weights start at one and biases at zero: make them random, so their place matters."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "layernorm" in name or "norm.weight" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                parameter.normal_()


def deepseek(**overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config(**overrides)).eval()
    randomise_norms_and_biases(model)
    return model


def ours_from(reference, interleaved, **options):
    """Our module with a DeepseekV3Attention's weights, mapped as GPT.from_transformers maps them."""
    cfg = reference.config
    holder = nn.Module()
    holder.self_attn = reference
    arguments = dict(num_heads=H, mla=dict(MLA))
    state = {name.removeprefix("x.self_attention."): tensor
             for name, tensor in _latent_layer(holder, "x", arguments, interleaved).items()}
    ours = MultiHeadLatentAttention(D, H, bias=cfg.attention_bias, q_lora_rank=cfg.q_lora_rank, **MLA, **options)
    ours.load_state_dict(state)
    return ours.eval()


def causal_bias(T):
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


# ---- the module against transformers'

@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
@pytest.mark.parametrize("q_lora_rank, bias, interleave", [
    (Q_RANK, False, True), (None, False, True), (Q_RANK, True, False), (None, True, False)])
def test_attention_equals_deepseek_v3_attention(mode, q_lora_rank, bias, interleave):
    cfg = config(q_lora_rank=q_lora_rank, attention_bias=bias, rope_interleave=interleave,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(0)
    reference = modeling_deepseek_v3.DeepseekV3Attention(cfg, layer_idx=0).eval()
    for parameter in reference.parameters():  # wider than the default init
        nn.init.normal_(parameter, std=0.3)
    randomise_norms_and_biases(reference)
    ours = ours_from(reference, interleave, mode=mode, rope_base=500.0)
    assert count(ours) == count(reference)
    x = torch.randn(2, 9, D)
    rotary = modeling_deepseek_v3.DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(9)[None])
    expected, expected_weights = reference(x, rotary, causal_bias(9))
    out, weights = ours(x, x, x, is_causal=True)
    assert expected.std() > 0.1
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)
    assert ours.softmax_scale == reference.scaling == (NOPE + ROPE) ** -0.5


def test_modules_and_parameter_count():
    low_rank = MultiHeadLatentAttention(D, H, q_lora_rank=Q_RANK, **MLA)
    assert [n for n, _ in low_rank.named_parameters()] == [
        "q_down.weight", "q_norm.weight", "q_up.weight", "kv_down.weight", "k_rope.weight", "kv_norm.weight",
        "kv_up.weight", "out_proj.weight"]
    expected = (D * Q_RANK + Q_RANK + Q_RANK * H * (NOPE + ROPE) + D * RANK + D * ROPE + RANK
                + RANK * H * (NOPE + VD) + H * VD * D)
    assert count(low_rank) == expected
    plain = MultiHeadLatentAttention(D, H, bias=True, **MLA)
    assert plain.q_down is None and plain.q_proj.bias is None and plain.kv_up.bias is None
    assert plain.kv_down.bias is not None and plain.out_proj.bias is not None


# ---- expanded == absorbed, and the cache

def test_expanded_equals_absorbed_with_masks_and_gradients():
    torch.manual_seed(0)
    expanded = MultiHeadLatentAttention(D, H, q_lora_rank=Q_RANK, **MLA).eval()
    absorbed = MultiHeadLatentAttention(D, H, q_lora_rank=Q_RANK, **MLA, mode="absorbed").eval()
    absorbed.load_state_dict(expanded.state_dict())
    x = torch.randn(2, 7, D, requires_grad=True)
    padding = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    for kwargs in (dict(is_causal=True), dict(key_padding_mask=padding), dict(mask=torch.randn(7, 7))):
        out, weights = expanded(x, x, x, **kwargs)
        out_absorbed, weights_absorbed = absorbed(x, x, x, **kwargs)
        torch.testing.assert_close(out_absorbed, out, **TOL)
        torch.testing.assert_close(weights_absorbed, weights, **TOL)
        fused, none = absorbed(x, x, x, need_weights=False, **kwargs)
        assert none is None
        torch.testing.assert_close(fused, out, **TOL)
    grad = torch.autograd.grad(expanded(x, x, x, is_causal=True)[0].square().sum(), x)[0]
    grad_absorbed = torch.autograd.grad(absorbed(x, x, x, is_causal=True)[0].square().sum(), x)[0]
    torch.testing.assert_close(grad_absorbed, grad, atol=1e-4, rtol=1e-5)
    expanded.mode = "absorbed"  # a switch of the same module
    torch.testing.assert_close(expanded(x, x, x, is_causal=True)[0], absorbed(x, x, x, is_causal=True)[0], **TOL)


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
def test_cache_holds_only_latents_and_rope_keys_and_stepping_equals_the_full_pass(mode):
    torch.manual_seed(0)
    attention = MultiHeadLatentAttention(D, H, **MLA, mode=mode).eval()
    x = torch.randn(2, 9, D)
    full, _ = attention(x, x, x, is_causal=True)
    cache = attention.make_cache(2, 12)
    steps = [attention(x[:, :4], x[:, :4], x[:, :4], cache=cache, is_causal=True)[0]]
    steps += [attention(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache, is_causal=True)[0]
              for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert cache.length == 9 and cache.key_len(1) == 10
    assert cache.latents.shape == (2, 12, RANK) and cache.rope_keys.shape == (2, 12, ROPE)
    latents, rope_keys = attention.latents(x)
    torch.testing.assert_close(cache.latents[:, :9], latents, **TOL)
    torch.testing.assert_close(cache.rope_keys[:, :9], rope_keys, **TOL)
    assert cache.nbytes() == 2 * 12 * (RANK + ROPE) * 4 == 2 * 12 * cost.latent_kv_bytes_per_token(RANK, ROPE)
    assert attention.make_cache(2, 12, dtype=torch.bfloat16).nbytes() == 2 * 12 * (RANK + ROPE) * 2


def test_latent_cache_surgery():
    cache = LatentKVCache(1, 6, RANK, ROPE)
    latents, rope_keys = torch.randn(1, 4, RANK), torch.randn(1, 4, ROPE)
    cache.append(latents, rope_keys)
    cache.repeat(3)
    assert cache.latents.shape == (3, 6, RANK) and torch.equal(cache.latents[2, :4], latents[0])
    cache.latents[1, :4] += 1
    cache.reorder(torch.tensor([1, 1, 0]))
    assert torch.equal(cache.latents[0, :4], latents[0] + 1) and torch.equal(cache.latents[2, :4], latents[0])
    cache.truncate(2)
    assert cache.length == 2 and cache.can_truncate and not cache.static
    kept, _ = cache.append(torch.zeros(3, 1, RANK), torch.zeros(3, 1, ROPE))
    assert kept.shape == (3, 3, RANK) and torch.equal(kept[:, 2], torch.zeros(3, RANK))


def test_latent_cache_rejects_bad_inputs():
    cache = LatentKVCache(2, 4, RANK, ROPE)
    with pytest.raises(ValueError, match=r"latents \(B=2, t, 16\) and rope_keys \(B=2, t, 8\)"):
        cache.append(torch.randn(2, 1, RANK + 1), torch.randn(2, 1, ROPE))
    with pytest.raises(ValueError, match="share dtype"):
        cache.append(torch.randn(2, 1, RANK), torch.randn(2, 1, ROPE).double())
    with pytest.raises(ValueError, match="holds 4 tokens; cannot add 5"):
        cache.append(torch.randn(2, 5, RANK), torch.randn(2, 5, ROPE))
    cache.append(torch.randn(2, 1, RANK), torch.randn(2, 1, ROPE))
    with pytest.raises(ValueError, match="one generation must keep one dtype"):
        cache.append(torch.randn(2, 1, RANK).bfloat16(), torch.randn(2, 1, ROPE).bfloat16())
    with pytest.raises(ValueError, match=r"truncate needs a length in \[0, 1\]"):
        cache.truncate(2)
    with pytest.raises(ValueError, match="repeat widens a cache of batch 1"):
        cache.repeat(2)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
        LatentKVCache(1, 4, 0, ROPE)


# ---- a GPT with latent attention

def latent_gpt(mode="expanded", q_lora_rank=None, **options):
    torch.manual_seed(0)
    return GPT(V, D, H, 2, 24, positions="rope", norm="rms", activation="swiglu", bias=False,
               mla=dict(MLA, q_lora_rank=q_lora_rank, mode=mode), **options).eval()


@pytest.mark.parametrize("mode, q_lora_rank", [("expanded", None), ("absorbed", Q_RANK)])
def test_gpt_generates_the_same_with_its_latent_caches(mode, q_lora_rank):
    model = latent_gpt(mode, q_lora_rank)
    caches = model.make_caches(2)
    assert all(isinstance(cache, LatentKVCache) for cache in caches) and len(caches) == 2
    tokens = torch.randint(V, (2, 10), generator=torch.Generator().manual_seed(1))
    stepped = torch.cat([model(tokens[:, :4], caches)] + [model(tokens[:, t : t + 1], caches) for t in range(4, 10)], 1)
    torch.testing.assert_close(stepped, model(tokens), **TOL)
    prompt = tokens[:, :3]
    assert torch.equal(generate(model, prompt, 12), generate(model, prompt, 12, use_cache=False))
    # greedy speculative decoding rolls the latent caches back and must give the target's tokens
    draft = GPT(V, D, H, 1, 24, positions="rope", mla=dict(MLA, kv_lora_rank=8)).eval()
    speculative, _ = speculative_generate(model, draft, prompt[:1], 12, num_draft=3)
    assert torch.equal(speculative, generate(model, prompt[:1], 12))


def test_gpt_with_latent_attention_trains_and_its_cache_is_small():
    model = latent_gpt(q_lora_rank=Q_RANK).train()
    tokens = torch.randint(V, (4, 12), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    latent_bytes = sum(cache.nbytes() for cache in model.make_caches(1))
    full_bytes = sum(cache.nbytes() for cache in GPT(V, D, H, 2, 24, positions="rope").make_caches(1))
    assert latent_bytes == 2 * 24 * (RANK + ROPE) * 4 and full_bytes == 2 * 24 * 2 * D * 4


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
def test_gpt_with_latent_attention_in_bfloat16_and_under_autocast(mode):
    model = latent_gpt(mode, Q_RANK)
    prompt = torch.randint(V, (1, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(prompt)
        logits.float().sum().backward()
        assert generate(model, prompt, 4).shape == (1, 7)
    half = model.to(torch.bfloat16)
    assert half(prompt).dtype == torch.bfloat16 and generate(half, prompt, 4).shape == (1, 7)


# ---- GPT.from_transformers on a dense DeepSeek-V3

MODELS = {
    "low_rank_queries": lambda: deepseek(),
    "plain_queries_tied": lambda: deepseek(q_lora_rank=None, tie_word_embeddings=True),
    "halves_rope_base": lambda: deepseek(rope_interleave=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_from_transformers_logits_and_generation(name):
    reference = MODELS[name]()
    model = GPT.from_transformers(reference)
    assert not model.training and count(model) == count(reference)
    tokens = torch.randint(V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert expected.std() > 0.1  # lively logits: a wrong layout would show
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
        for block in model.blocks:
            block.self_attention.mode = "absorbed"
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
    prompt = tokens[:1, :4]
    expected_tokens = reference.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 20), expected_tokens)


def small_moe(**overrides):
    return deepseek(first_k_dense_replace=1, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                    moe_intermediate_size=8, **overrides)


@pytest.mark.parametrize("build, field", [
    (small_moe, "first_k_dense_replace"),
    (lambda: deepseek(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 16, "mscale": 1.0,
                                       "mscale_all_dim": 1.0}), "rope_parameters"),
    (lambda: deepseek(attention_bias=True), "attention_bias"),
    (lambda: deepseek(num_key_value_heads=2), "num_key_value_heads"),
    (lambda: deepseek(hidden_act="gelu"), "hidden_act"),
    (lambda: deepseek(attention_dropout=0.1), "attention_dropout"),
])
def test_from_transformers_names_the_deepseek_field_it_cannot_reproduce(build, field):
    reference = build()
    with pytest.raises(ValueError, match=field):
        GPT.from_transformers(reference)


def test_deepseek_v3_published_sizes():
    """The sizes chapter 18 quotes are transformers' DeepseekV3Config defaults (DeepSeek-V3's config)."""
    published = transformers.DeepseekV3Config()
    sizes = {name: getattr(published, name) for name in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
    assert sizes == dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
                         q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    assert cost.latent_kv_bytes_per_token(512, 64, 2) == 1152  # bf16, per layer
    assert cost.kv_bytes_per_token(128, 128, 2) == 65536  # 128 heads of 128, keys and values


# ---- the cost formulas

def test_bytes_per_token_equal_the_caches():
    for kv_heads in (H, 2, 1):  # MHA, GQA, MQA
        model = GPT(V, D, H, 1, 8, positions="rope", num_kv_heads=kv_heads)
        assert model.make_caches(1)[0].nbytes() == 8 * cost.kv_bytes_per_token(kv_heads, D // H)
    assert cost.kv_bytes_per_token(H, D // H) == 2 * D * 4 == cost.kv_cache_bytes(1, 1, D)
    assert LatentKVCache(3, 5, RANK, ROPE, dtype=torch.float16).nbytes() == 15 * cost.latent_kv_bytes_per_token(
        RANK, ROPE, 2)


def test_decode_flops_by_hand():
    # d=2, h=1, r=1, r_h=2, n_h=1, v=1, n=3: query 2*2*1*3 = 12, latent and RoPE key 2*2*3 = 12, output 2*1*1*2 = 4
    common = 12 + 12 + 4
    # expanded: up-projection 2*3*1*1*(1+1) = 12, scores 2*3*1*3 = 18, sum 2*3*1*1 = 6
    assert cost.latent_decode_flops(3, 2, 1, 1, 2, 1, 1) == common + 12 + 18 + 6
    # absorbed: W_UK 2*1*1*1 = 2, scores 2*3*1*(1+2) = 18, latent sum 2*3*1*1 = 6, W_UV 2*1*1*1 = 2
    assert cost.latent_decode_flops(3, 2, 1, 1, 2, 1, 1, mode="absorbed") == common + 2 + 18 + 6 + 2
    # a low-rank query (q_r = 1): 2*2*1 + 2*1*1*3 = 10 in place of 12
    assert cost.latent_decode_flops(3, 2, 1, 1, 2, 1, 1, q_lora_rank=1) == common - 2 + 36


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
@pytest.mark.parametrize("q_lora_rank", [None, Q_RANK])
def test_decode_flops_equal_the_flop_counter(mode, q_lora_rank):
    torch.manual_seed(0)
    attention = MultiHeadLatentAttention(D, H, q_lora_rank=q_lora_rank, **MLA, mode=mode).eval()
    x = torch.randn(1, 11, D)
    cache = attention.make_cache(1, 11)
    with torch.no_grad():
        attention(x[:, :10], x[:, :10], x[:, :10], cache=cache, is_causal=True, need_weights=False)
        with flop_counter() as counter:
            attention(x[:, 10:], x[:, 10:], x[:, 10:], cache=cache, is_causal=True, need_weights=False)
    expected = cost.latent_decode_flops(11, D, H, RANK, ROPE, NOPE, VD, q_lora_rank=q_lora_rank, mode=mode)
    assert counter.get_total_flops() == expected


def test_absorbed_decoding_is_cheaper_at_deepseek_v3_sizes():
    sizes = dict(d_model=7168, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                 v_head_dim=128, q_lora_rank=1536)
    expanded = cost.latent_decode_flops(4096, **sizes)
    absorbed = cost.latent_decode_flops(4096, **sizes, mode="absorbed")
    per_token = (cost.latent_decode_flops(4097, **sizes) - expanded,
                 cost.latent_decode_flops(4097, **sizes, mode="absorbed") - absorbed)
    assert per_token == (2 * 128 * (512 * 256 + 128 + 64 + 128), 2 * 128 * (2 * 512 + 64))
    assert expanded > 50 * absorbed


# ---- bad inputs

@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_lora_rank=D + 1), "kv_lora_rank=33 exceeds d_model=32"),
    (dict(q_lora_rank=D + 1), "q_lora_rank=33 exceeds d_model=32"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int, got 0"),
    (dict(qk_nope_head_dim=-1), "qk_nope_head_dim must be a positive int, got -1"),
    (dict(v_head_dim=2.0), "v_head_dim must be a positive int, got 2.0"),
    (dict(q_lora_rank=0), "q_lora_rank must be a positive int"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(mode="compressed"), r"mode must be one of \('expanded', 'absorbed'\), got 'compressed'"),
    (dict(dropout=1.5), "dropout must be a number in"),
    (dict(rope_base=1.0), "rope_base must be a number > 1"),
])
def test_attention_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadLatentAttention(D, H, **{**MLA, **kwargs})


def test_attention_rejects_bad_calls():
    attention = MultiHeadLatentAttention(D, H, **MLA)
    x = torch.randn(1, 3, D)
    with pytest.raises(ValueError, match="self-attention"):
        attention(x, torch.randn(1, 3, D), torch.randn(1, 3, D))
    with pytest.raises(ValueError, match=r"query must be \(B, T, d_model=32\)"):
        bad = torch.randn(1, 3, D + 1)
        attention(bad, bad, bad)
    with pytest.raises(ValueError, match="mode must be one of"):
        attention.mode = "fast"
    with pytest.raises(ValueError, match="mode must be one of"):
        cost.latent_decode_flops(3, 2, 1, 1, 2, 1, 1, mode="fast")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(), ValueError, "mla needs positions='rope'"),
    (dict(positions="rope", window=4), ValueError, "window=None, num_kv_heads=None, qk_norm=False"),
    (dict(positions="rope", num_kv_heads=2), ValueError, "num_kv_heads=2"),
    (dict(positions="rope", qk_norm=True), ValueError, "qk_norm=True"),
])
def test_gpt_rejects_latent_attention_with_options_it_cannot_combine(kwargs, error, match):
    with pytest.raises(error, match=match):
        GPT(V, D, H, 1, 16, mla=dict(MLA), **kwargs)
    with pytest.raises(TypeError, match="mla must be a dict"):
        GPT(V, D, H, 1, 16, positions="rope", mla=[RANK])
