"""Chapter 19's mixture of experts: MoEFeedForward's routing, capacity and load-balancing loss by
hand and against transformers' Mixtral layer; the MoE GPT; GPT.from_transformers on a Mixtral;
the parameter counts of Mixtral-8x7B."""

import math

import pytest
import torch
from attnbook import GPT, MoEFeedForward, SwiGLU, generate
from attnbook.convert import gpt_arguments
from attnbook.experts import aux_loss, moe_parameters, record_routing
from conftest import require
from torch import nn

transformers = require("transformers")
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

V, D, H, KV, HIDDEN, E, K = 128, 64, 4, 2, 96, 4, 2
TOL = {"atol": 1e-5, "rtol": 1e-5}


def count(module):
    return sum(p.numel() for p in module.parameters())


def config(**overrides):
    fields = dict(vocab_size=V, hidden_size=D, intermediate_size=HIDDEN, num_hidden_layers=2,
                  num_attention_heads=H, num_key_value_heads=KV, num_local_experts=E, num_experts_per_tok=K,
                  max_position_embeddings=64, initializer_range=0.2, attn_implementation="eager",
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.MixtralConfig(**{**fields, **overrides})


def mixtral(**overrides):
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config(**overrides)).eval()


# ---- routing, capacity and the load-balancing loss by hand

def hand_layer(capacity_factor=None):
    """d = 2, three experts, top-2; the router reads logits (x0, x1, 0), so x = (ln a/c, ln b/c)
    gives probabilities proportional to (a, b, c)."""
    torch.manual_seed(0)
    layer = MoEFeedForward(2, 3, 3, 2, capacity_factor=capacity_factor)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    # probabilities (4, 3, 1)/8, (3, 4, 1)/8, (4, 1, 3)/8, (4, 3, 1)/8
    p = torch.tensor([[4.0, 3.0, 1.0], [3.0, 4.0, 1.0], [4.0, 1.0, 3.0], [4.0, 3.0, 1.0]])
    x = (p[:, :2] / p[:, 2:]).log()
    return layer, x


def test_routing_by_hand():
    layer, x = hand_layer()
    out, routing = layer(x, return_routing=True)
    assert routing.experts.tolist() == [[0, 1], [1, 0], [0, 2], [0, 1]]
    # the top two renormalised: 4/8 and 3/8 become 4/7 and 3/7
    torch.testing.assert_close(routing.weights, torch.tensor([[4, 3], [4, 3], [4, 3], [4, 3]]) / 7)
    e0, e1, e2 = (expert(x) for expert in layer.experts)
    expected = torch.stack([4 * e0[0] + 3 * e1[0], 4 * e1[1] + 3 * e0[1], 4 * e0[2] + 3 * e2[2], 4 * e0[3] + 3 * e1[3]]) / 7
    torch.testing.assert_close(out, expected, **TOL)
    assert routing.tokens_per_expert.tolist() == [4, 3, 1] and routing.capacity is None
    assert routing.dropped == 0.0 and torch.equal(layer(x), out)  # the same without statistics
    # f = (4, 3, 1)/4 tokens, P = (15, 11, 6)/32: 3 (f . P) = 3 (60 + 33 + 6)/128 = 2.3203125
    assert routing.aux_loss.item() == pytest.approx(2.3203125)
    assert not hasattr(layer, "last_routing") and not hasattr(layer, "aux_loss")  # nothing kept


def test_capacity_drops_assignments_in_token_order():
    layer, x = hand_layer(capacity_factor=0.75)  # ceil(0.75 * 4 tokens * 2 / 3 experts) = 2 seats each
    out, routing = layer(x, return_routing=True)
    assert routing.capacity == 2
    # expert 0 seats tokens 0, 1 (not 2, 3), expert 1 tokens 0, 1 (not 3), expert 2 token 2
    assert routing.kept.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert routing.dropped == 3 / 8 and routing.tokens_per_expert.tolist() == [4, 3, 1]  # before drops
    free, _ = hand_layer()
    torch.testing.assert_close(out[:2], free(x)[:2], **TOL)  # tokens 0, 1 lose nothing
    torch.testing.assert_close(out[2], 3 / 7 * layer.experts[2](x[2]), **TOL)  # weight not renormalised
    assert torch.equal(out[3], torch.zeros(2))  # fully dropped: the block's residual carries it
    assert routing.aux_loss.item() == pytest.approx(2.3203125)  # counted before the drops


def test_enough_capacity_drops_nothing():
    torch.manual_seed(0)
    layer = MoEFeedForward(16, 24, E, K, capacity_factor=E / K)  # every expert can seat every token
    x = torch.randn(3, 7, 16)
    out, routing = layer(x, return_routing=True)
    assert routing.capacity == 21 and routing.dropped == 0.0
    layer.capacity_factor = None
    torch.testing.assert_close(out, layer(x), **TOL)


def test_one_expert_is_a_dense_swiglu():
    torch.manual_seed(0)
    layer, dense = MoEFeedForward(16, 24, 1, 1), SwiGLU(16, 24)
    dense.load_state_dict(layer.experts[0].state_dict())
    x = torch.randn(2, 5, 16)
    out, routing = layer(x, return_routing=True)
    torch.testing.assert_close(out, dense(x), **TOL)
    assert routing.aux_loss.item() == pytest.approx(1.0) and routing.tokens_per_expert.tolist() == [10]


# ---- against transformers' Mixtral layer

def test_equals_mixtral_sparse_moe_block_and_its_load_balancing_loss():
    torch.manual_seed(0)
    reference = modeling_mixtral.MixtralSparseMoeBlock(config()).eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(std=0.2)
    ours = MoEFeedForward(D, HIDDEN, E, K)
    with torch.no_grad():
        ours.router.weight.copy_(reference.gate.weight)
        for i, expert in enumerate(ours.experts):
            expert.gate_proj.weight.copy_(reference.experts.gate_up_proj[i, :HIDDEN])
            expert.up_proj.weight.copy_(reference.experts.gate_up_proj[i, HIDDEN:])
            expert.down_proj.weight.copy_(reference.experts.down_proj[i])
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        out, routing = ours(x, return_routing=True)
        torch.testing.assert_close(out, reference(x), **TOL)
        logits, weights, indices = reference.gate(x)
    torch.testing.assert_close(routing.weights, weights, **TOL)
    assert torch.equal(routing.experts, indices)
    expected = modeling_mixtral.load_balancing_loss_func((logits,), E, K)
    assert routing.tokens_per_expert.sum() == 18 * K
    torch.testing.assert_close(routing.aux_loss, expected, **TOL)


# ---- the MoE GPT

def moe_gpt(**experts):
    torch.manual_seed(0)
    return GPT(V, D, H, 2, 32, hidden=HIDDEN, norm="rms", activation="swiglu", positions="rope", bias=False,
               num_kv_heads=KV, experts={"num_experts": E, "top_k": K, **experts})


def test_moe_gpt_trains_with_the_load_balancing_loss():
    model = moe_gpt(capacity_factor=1.0)
    assert all(isinstance(block.feed_forward, MoEFeedForward) for block in model.blocks)
    assert count(model) == moe_parameters(V, D, 2, H, KV, HIDDEN, E, K)[0]
    tokens = torch.randint(V, (2, 16), generator=torch.Generator().manual_seed(1))
    with record_routing(model) as routings:
        logits = model(tokens)
    assert len(routings) == 2 and torch.equal(logits, model(tokens))  # the same without recording
    balance = aux_loss(routings)
    torch.testing.assert_close(balance, routings[0].aux_loss + routings[1].aux_loss)
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) + 0.01 * balance
    loss.backward()
    assert all(block.feed_forward.router.weight.grad.abs().sum() > 0 for block in model.blocks)
    assert routings[0].capacity == math.ceil(32 * K / E)
    with record_routing(model) as outer, record_routing(model) as inner:  # recorders nest
        model(tokens[:1])
    assert len(inner) == len(outer) == 2 and inner[0].capacity == math.ceil(16 * K / E)
    assert all(a is b for a, b in zip(inner, outer, strict=True))
    assert all(not block.feed_forward._forward_pre_hooks for block in model.blocks)  # removed
    for block in model.blocks:  # capacity counts each call's tokens: cached decoding would seat others
        block.feed_forward.capacity_factor = None
    torch.testing.assert_close(generate(model, tokens[:1, :4], 6), generate(model, tokens[:1, :4], 6, use_cache=False))


# ---- GPT.from_transformers on a Mixtral

@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 5}, {"router_jitter_noise": 0.1}],
                         ids=["mixtral", "window", "jitter"])
def test_from_mixtral_logits_and_greedy_tokens(overrides):
    reference = mixtral(**overrides)
    model = GPT.from_transformers(reference)
    assert not model.training and count(model) == count(reference)
    assert model.window == overrides.get("sliding_window")
    tokens = torch.randint(V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
    assert expected.std() > 0.1  # lively logits: a wrong layout would show
    torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=1e-4)
    prompt = tokens[:1, :4]
    expected_tokens = reference.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, 20), expected_tokens)


@pytest.mark.parametrize("overrides, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 32}, "head_dim"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "rope_parameters"),
])
def test_from_mixtral_names_the_field_it_cannot_reproduce(overrides, field):
    reference = mixtral(**overrides)
    with pytest.raises(ValueError, match=field):
        GPT.from_transformers(reference)


def test_from_transformers_refuses_other_models():
    with pytest.raises(TypeError, match="MixtralForCausalLM, got MixtralModel"):
        gpt_arguments(mixtral().model)


# ---- parameters: Mixtral-8x7B on the meta device

def test_moe_parameters_of_mixtral_8x7b():
    with torch.device("meta"):
        reference = transformers.MixtralForCausalLM(transformers.MixtralConfig())  # 8x7B's defaults
    expert = 3 * 4096 * 14336  # one SwiGLU expert's weights
    total, active = moe_parameters(32000, 4096, 32, 32, 8, 14336, 8, 2)
    assert total == count(reference) == 46_702_792_704
    assert active == count(reference) - 32 * (8 - 2) * expert == 12_879_925_248
    assert moe_parameters(V, D, 2, H, KV, HIDDEN, E, K)[0] == count(mixtral())
    assert moe_parameters(V, D, 2, H, KV, HIDDEN, 1, 1, tie_embeddings=True)[1] == count(
        GPT(V, D, H, 2, 8, hidden=HIDDEN, norm="rms", activation="swiglu", positions="rope", bias=False,
            num_kv_heads=KV, tie_embeddings=True)) + 2 * D  # + the router of one expert per layer


# ---- bad inputs

@pytest.mark.parametrize("args, kwargs, match", [
    ((16, 24, 4, 5), {}, "top_k=5 exceeds num_experts=4"),
    ((16, 24, 4, 0), {}, "top_k must be a positive int"),
    ((16, 24, 0, 1), {}, "num_experts must be a positive int"),
    ((16, 24, 4, 2), {"capacity_factor": 0}, "capacity_factor must be a positive number"),
    ((16, 24, 4, 2), {"capacity_factor": -1.0}, "capacity_factor must be a positive number"),
])
def test_moe_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(*args, **kwargs)


def test_moe_rejects_bad_inputs_and_options():
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., d_model=16\)"):
        MoEFeedForward(16, 24, 4)(torch.randn(3, 8))
    with pytest.raises(ValueError, match="experts needs activation='swiglu'"):
        GPT(V, D, H, 1, 8, experts={"num_experts": 2})
    with pytest.raises(TypeError, match="experts must be a dict"):
        GPT(V, D, H, 1, 8, activation="swiglu", experts=4)
    with pytest.raises(ValueError, match="no MoEFeedForward"), record_routing(GPT(V, D, H, 1, 8)):
        pass
    with pytest.raises(ValueError, match="record_routing"):
        aux_loss([])


def test_zero_tokens_give_a_zero_load_balancing_loss():
    torch.manual_seed(0)
    layer = MoEFeedForward(8, 12, num_experts=4, top_k=2, capacity_factor=1.0)
    out, routing = layer(torch.zeros(0, 8), return_routing=True)
    assert out.shape == (0, 8)
    assert routing.aux_loss.item() == 0.0 and routing.dropped == 0.0
    assert routing.tokens_per_expert.tolist() == [0, 0, 0, 0]
