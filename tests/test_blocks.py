"""The position-wise feed-forward network and the encoder/decoder blocks, against nn.Transformer*Layer."""

import pytest
import torch
from attnbook import (
    DecoderBlock,
    EncoderBlock,
    FeedForward,
    KVCache,
    MultiHeadAttention,
    RotaryMultiHeadAttention,
    causal_mask,
    padding_mask,
)
from torch import nn

TOL = {"atol": 1e-5, "rtol": 1e-5}
NORMS = [("post", False), ("pre", True)]  # ours, nn's norm_first
ACTIVATIONS = ["relu", "gelu"]


def count(module):
    return sum(p.numel() for p in module.parameters())


def randomize(module, seed=0):
    """Random values for every parameter (nn starts biases at 0 and LayerNorm gains at 1), so that
    copying each of them is tested; LayerNorm gains stay near 1."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            gain = name.startswith("norm") and name.endswith("weight")
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if gain else 0.3 * torch.randn_like(p))
    return module


# ---------------------------------------------------------------------------------------------
# FeedForward


@pytest.mark.parametrize("d", [1, 4, 64, 512])
def test_feed_forward_parameter_count(d):
    assert count(FeedForward(d)) == 8 * d * d + 5 * d


def test_feed_forward_of_the_paper():
    ffn = FeedForward(512)
    assert count(ffn) == 2_099_712
    assert ffn.fc1.weight.shape == (2048, 512) and ffn.fc2.weight.shape == (512, 2048)


@pytest.mark.parametrize("d, hidden", [(8, 3), (16, 100), (5, 5)])
def test_feed_forward_custom_hidden(d, hidden):
    ffn = FeedForward(d, hidden)
    assert count(ffn) == 2 * d * hidden + hidden + d
    assert ffn(torch.randn(2, 3, d)).shape == (2, 3, d)


@pytest.mark.parametrize("activation, function", [("relu", torch.relu), ("gelu", nn.functional.gelu)])
def test_feed_forward_is_the_mlp_formula(activation, function):
    torch.manual_seed(0)
    ffn = FeedForward(6, 10, activation=activation)
    x = torch.randn(2, 4, 6)
    W1, b1, W2, b2 = ffn.fc1.weight, ffn.fc1.bias, ffn.fc2.weight, ffn.fc2.bias
    torch.testing.assert_close(ffn(x), function(x @ W1.T + b1) @ W2.T + b2)


def test_feed_forward_is_position_wise():
    """The same MLP on every token: permuting tokens permutes outputs; each token alone gives the same."""
    torch.manual_seed(0)
    ffn = FeedForward(8).eval()
    x = torch.randn(3, 7, 8)
    out = ffn(x)
    permutation = torch.randperm(7)
    torch.testing.assert_close(ffn(x[:, permutation]), out[:, permutation])
    for t in range(7):
        torch.testing.assert_close(ffn(x[:, t]), out[:, t])  # one token at a time: no mixing
    # changing one token changes only that token's output
    x2 = x.clone()
    x2[:, 3] += 1
    changed = (ffn(x2) - out).abs().amax(dim=(0, 2))
    assert changed[3] > 0 and bool((changed[torch.arange(7) != 3] == 0).all())


def test_feed_forward_dropout_only_in_training():
    torch.manual_seed(0)
    ffn = FeedForward(8, dropout=0.5)
    x = torch.randn(2, 5, 8)
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn(x))
    ffn.train()
    assert not torch.allclose(ffn(x), ffn(x))


def test_dropout_layer_is_free_at_zero_and_rejects_what_nn_dropout_rejects():
    from attnbook.blocks import dropout_layer

    assert isinstance(dropout_layer(0.0), nn.Identity)
    layer = dropout_layer(0.25)
    assert isinstance(layer, nn.Dropout) and layer.p == 0.25
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="dropout probability"):
            dropout_layer(bad)
    # a block built without dropout calls no dropout at all, with it it drops
    assert not any(isinstance(m, nn.Dropout) for m in EncoderBlock(8, 2).modules())
    assert sum(isinstance(m, nn.Dropout) for m in EncoderBlock(8, 2, dropout=0.1).modules()) == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"d": 0}, "d must be a positive int, got 0"),
    ({"d": 4, "hidden": 0}, "hidden must be a positive int, got 0"),
    ({"d": 4.0}, "d must be a positive int, got 4.0"),
    ({"d": 4, "activation": "tanh"}, "activation must be one of.*'tanh'"),
])
def test_feed_forward_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeedForward(**kwargs)


# ---------------------------------------------------------------------------------------------
# EncoderBlock vs nn.TransformerEncoderLayer


def encoder_pair(d, h, hidden, activation, norm_first, seed=0):
    reference = nn.TransformerEncoderLayer(d, h, hidden, dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm_first)
    randomize(reference, seed).eval()
    ours = EncoderBlock(d, h, hidden, activation=activation, norm="pre" if norm_first else "post")
    return reference, ours.eval().load_from_torch(reference)


@pytest.mark.parametrize("norm, norm_first", NORMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "causal+padding"])
def test_encoder_block_matches_nn(norm, norm_first, activation, masks):
    d, h, hidden = 16, 4, 24
    reference, ours = encoder_pair(d, h, hidden, activation, norm_first)
    x = torch.randn(3, 6, d)
    mask = causal_mask(6) if "causal" in masks else None
    key_padding_mask = padding_mask([6, 4, 1]) if "padding" in masks else None
    expected = reference(x, src_mask=mask, src_key_padding_mask=key_padding_mask)
    out = ours(x, mask, key_padding_mask=key_padding_mask)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("norm, norm_first", NORMS)
def test_encoder_block_matches_nn_with_float_mask_and_default_width(norm, norm_first):
    d, h = 32, 8
    reference = randomize(nn.TransformerEncoderLayer(d, h, 4 * d, dropout=0.0, batch_first=True,
                                                     norm_first=norm_first), seed=1).eval()
    ours = EncoderBlock(d, h, norm=norm).eval().load_from_torch(reference)  # hidden defaults to 4 d
    x = torch.randn(2, 5, d)
    float_mask = torch.randn(5, 5)
    torch.testing.assert_close(ours(x, float_mask), reference(x, src_mask=float_mask), **TOL)


@pytest.mark.parametrize("norm, norm_first", NORMS)
def test_encoder_block_matches_nn_without_grad(norm, norm_first):
    """Under no_grad nn takes its fused fast path; the numbers still agree."""
    reference, ours = encoder_pair(16, 4, 32, "relu", norm_first)
    x = torch.randn(3, 5, 16)
    key_padding_mask = padding_mask([5, 3, 1])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), **TOL)
        torch.testing.assert_close(ours(x, key_padding_mask=key_padding_mask),
                                   reference(x, src_key_padding_mask=key_padding_mask), **TOL)


@pytest.mark.parametrize("norm, norm_first", NORMS)
def test_encoder_block_gradients_match_nn(norm, norm_first):
    reference, ours = encoder_pair(8, 2, 16, "gelu", norm_first)
    x = torch.randn(2, 4, 8)
    reference(x, src_mask=causal_mask(4)).square().sum().backward()
    ours(x, causal_mask(4)).square().sum().backward()
    torch.testing.assert_close(ours.feed_forward.fc1.weight.grad, reference.linear1.weight.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.norm1.weight.grad, reference.norm1.weight.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.self_attention.out_proj.weight.grad, reference.self_attn.out_proj.weight.grad,
                               atol=1e-4, rtol=1e-4)


def test_post_and_pre_norm_differ():
    reference, post = encoder_pair(16, 4, 32, "relu", False)
    pre = EncoderBlock(16, 4, 32, norm="pre").eval()
    pre.load_state_dict(post.state_dict())
    x = torch.randn(2, 5, 16)
    assert not torch.allclose(post(x), pre(x), atol=1e-3)
    # post-norm ends in a LayerNorm (with our random gain and bias): each output token is normalised
    out = post(x)
    normalised = (out - post.norm2.bias) / post.norm2.weight
    torch.testing.assert_close(normalised.mean(-1), torch.zeros(2, 5), atol=1e-4, rtol=0)


def test_encoder_block_with_rotary_attention():
    block = EncoderBlock(16, 4, attention_class=RotaryMultiHeadAttention).eval()
    assert isinstance(block.self_attention, RotaryMultiHeadAttention)
    x = torch.randn(2, 5, 16)
    assert block(x, causal_mask(5)).shape == (2, 5, 16)


@pytest.mark.parametrize("attention_class", [MultiHeadAttention, RotaryMultiHeadAttention])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_encoder_block_with_cache_equals_full_causal(attention_class, norm):
    """Used as a decoder-only block: token by token with a KV cache equals the causal pass."""
    torch.manual_seed(0)
    B, T, d, h = 2, 7, 16, 4
    block = EncoderBlock(d, h, norm=norm, attention_class=attention_class).eval()
    x = torch.randn(B, T, d)
    with torch.no_grad():
        full = block(x, causal_mask(T))
        cache = KVCache(B, h, T, d // h)
        prompt = block(x[:, :3], causal_mask(3), cache=cache)
        steps = [block(x[:, t : t + 1], cache=cache) for t in range(3, T)]
    torch.testing.assert_close(torch.cat([prompt, *steps], dim=1), full, **TOL)


# ---------------------------------------------------------------------------------------------
# DecoderBlock vs nn.TransformerDecoderLayer


def decoder_pair(d, h, hidden, activation, norm_first, seed=0):
    reference = nn.TransformerDecoderLayer(d, h, hidden, dropout=0.0, activation=activation,
                                           batch_first=True, norm_first=norm_first)
    randomize(reference, seed).eval()
    ours = DecoderBlock(d, h, hidden, activation=activation, norm="pre" if norm_first else "post")
    return reference, ours.eval().load_from_torch(reference)


@pytest.mark.parametrize("norm, norm_first", NORMS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("masks", ["none", "causal", "causal+padding"])
def test_decoder_block_matches_nn(norm, norm_first, activation, masks):
    d, h, hidden = 16, 4, 24
    reference, ours = decoder_pair(d, h, hidden, activation, norm_first)
    x, memory = torch.randn(3, 5, d), torch.randn(3, 8, d)
    tgt_mask = causal_mask(5) if "causal" in masks else None
    if "padding" in masks:
        tgt_padding, memory_padding = padding_mask([5, 3, 2]), padding_mask([8, 6, 1])
        # our self-attention takes one mask: the causal mask and the target padding as (B, T, T)
        mask = tgt_mask[None] | tgt_padding[:, None, :]
    else:
        tgt_padding = memory_padding = None
        mask = tgt_mask
    expected = reference(x, memory, tgt_mask=tgt_mask, tgt_key_padding_mask=tgt_padding,
                         memory_key_padding_mask=memory_padding)
    out = ours(x, memory, mask, key_padding_mask=memory_padding)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("norm, norm_first", NORMS)
def test_decoder_block_matches_nn_with_memory_mask(norm, norm_first):
    reference, ours = decoder_pair(16, 2, 32, "gelu", norm_first, seed=3)
    x, memory = torch.randn(2, 4, 16), torch.randn(2, 6, 16)
    memory_mask = torch.rand(4, 6) < 0.4
    memory_mask[:, 0] = False
    expected = reference(x, memory, tgt_mask=causal_mask(4), memory_mask=memory_mask)
    torch.testing.assert_close(ours(x, memory, causal_mask(4), memory_mask), expected, **TOL)


def test_decoder_block_is_causal():
    """With the causal mask, changing a later target token leaves earlier outputs unchanged."""
    torch.manual_seed(0)
    block = DecoderBlock(16, 4).eval()
    x, memory = torch.randn(1, 6, 16), torch.randn(1, 4, 16)
    out = block(x, memory, causal_mask(6))
    x2 = x.clone()
    x2[0, 4] += 1.0
    out2 = block(x2, memory, causal_mask(6))
    torch.testing.assert_close(out2[:, :4], out[:, :4])
    assert not torch.allclose(out2[:, 4:], out[:, 4:])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_block_with_caches_equals_full(norm):
    """Self-attention cache grows token by token; the cross-attention cache is static (memory projected once)."""
    torch.manual_seed(0)
    B, T, S, d, h = 2, 6, 5, 16, 4
    block = DecoderBlock(d, h, norm=norm).eval()
    x, memory = torch.randn(B, T, d), torch.randn(B, S, d)
    with torch.no_grad():
        full = block(x, memory, causal_mask(T))
        self_cache = KVCache(B, h, T, d // h)
        cross_cache = KVCache(B, h, S, d // h, static=True)
        steps = []
        for t in range(T):
            steps.append(block(x[:, t : t + 1], memory, self_cache=self_cache, cross_cache=cross_cache))
            if t == 0:
                block.cross_attention.k_proj.register_forward_hook(lambda *_: (_ for _ in ()).throw(
                    AssertionError("memory projected again")))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
    assert self_cache.length == T and cross_cache.length == S


# ---------------------------------------------------------------------------------------------
# shapes, recorded weights, bad inputs


@pytest.mark.parametrize("B, T, d, h", [(1, 1, 8, 1), (2, 5, 16, 4), (3, 9, 24, 6)])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_every_block_maps_btd_to_btd(B, T, d, h, norm):
    x = torch.randn(B, T, d)
    assert FeedForward(d)(x).shape == (B, T, d)
    encoder = EncoderBlock(d, h, norm=norm)
    decoder = DecoderBlock(d, h, norm=norm)
    assert encoder(x).shape == (B, T, d)
    assert decoder(x, torch.randn(B, T + 2, d)).shape == (B, T, d)
    # a stack keeps one vector per token: no pooling between blocks
    y = x
    for block in [EncoderBlock(d, h, norm=norm) for _ in range(3)]:
        y = block(y)
        assert y.shape == (B, T, d)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_encoder_records_weights(norm):
    torch.manual_seed(0)
    block = EncoderBlock(16, 4, norm=norm).eval()
    x = torch.randn(2, 5, 16)
    block(x)
    assert block.weights is None  # not recorded by default (the fast path runs)
    block.record_weights = True
    out = block(x, causal_mask(5))
    assert block.weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(block.weights.sum(-1), torch.ones(2, 4, 5))
    assert bool((block.weights[..., causal_mask(5)] == 0).all())
    block.record_weights = False
    torch.testing.assert_close(block(x, causal_mask(5)), out, **TOL)  # the same output either way


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_records_weights(norm):
    torch.manual_seed(0)
    block = DecoderBlock(16, 4, norm=norm).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    block(x, memory)
    assert block.self_weights is None and block.cross_weights is None
    block.record_weights = True
    out = block(x, memory, causal_mask(5), key_padding_mask=padding_mask([7, 3]))
    assert block.self_weights.shape == (2, 4, 5, 5)
    assert block.cross_weights.shape == (2, 4, 5, 7)
    torch.testing.assert_close(block.self_weights.sum(-1), torch.ones(2, 4, 5))
    torch.testing.assert_close(block.cross_weights.sum(-1), torch.ones(2, 4, 5))
    assert bool((block.cross_weights[1, ..., 3:] == 0).all())
    block.record_weights = False
    torch.testing.assert_close(block(x, memory, causal_mask(5), key_padding_mask=padding_mask([7, 3])),
                               out, **TOL)


def test_block_parameter_counts():
    d, h = 64, 8
    attention, ffn, norm = 4 * (d * d + d), 8 * d * d + 5 * d, 2 * d
    assert count(EncoderBlock(d, h)) == attention + ffn + 2 * norm
    assert count(DecoderBlock(d, h)) == 2 * attention + ffn + 3 * norm
    assert count(EncoderBlock(d, h)) == count(nn.TransformerEncoderLayer(d, h, 4 * d, batch_first=True))
    assert count(DecoderBlock(d, h)) == count(nn.TransformerDecoderLayer(d, h, 4 * d, batch_first=True))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    block = EncoderBlock(16, 4, dropout=0.3)
    x = torch.randn(2, 5, 16)
    block.eval()
    torch.testing.assert_close(block(x), block(x))
    block.train()
    assert not torch.allclose(block(x), block(x))


@pytest.mark.parametrize("block_class", [EncoderBlock, DecoderBlock])
@pytest.mark.parametrize("kwargs, match", [
    ({"norm": "middle"}, "norm must be 'post' or 'pre', got 'middle'"),
    ({"norm": "Post"}, "got 'Post'"),
    ({"activation": "swish"}, r"activation must be one of \['gelu', 'relu'\], got 'swish'"),
    ({"activation": "ReLU"}, "got 'ReLU'"),
])
def test_bad_norm_or_activation_raises(block_class, kwargs, match):
    with pytest.raises(ValueError, match=match):
        block_class(16, 4, **kwargs)


@pytest.mark.parametrize("block_class", [EncoderBlock, DecoderBlock])
def test_indivisible_heads_raise(block_class):
    with pytest.raises(ValueError, match="d_model=16.*num_heads=3"):
        block_class(16, 3)


def test_decoder_block_mismatched_memory_raises():
    block = DecoderBlock(16, 4)
    with pytest.raises(ValueError, match=r"\(2, 5, 16\).*\(3, 7, 16\).*batch size"):
        block(torch.randn(2, 5, 16), torch.randn(3, 7, 16))
    with pytest.raises(ValueError, match=r"\(2, 5, 16\).*\(2, 7, 8\).*d_model"):
        block(torch.randn(2, 5, 16), torch.randn(2, 7, 8))


def test_encoder_block_wrong_width_raises():
    block = EncoderBlock(16, 4)
    with pytest.raises(ValueError, match=r"d_model=16.*\(2, 5, 12\)"):
        block(torch.randn(2, 5, 12))


# ----------------------------------------------------------------------------- issue 12


@pytest.mark.parametrize("block_class", ["encoder", "decoder"])
def test_is_causal_equals_the_causal_mask(block_class):
    torch.manual_seed(21)
    x, memory = torch.randn(2, 6, 16), torch.randn(2, 4, 16)
    if block_class == "encoder":
        block = EncoderBlock(16, 4, norm="pre").eval()
        expected, flagged = block(x, causal_mask(6)), block(x, is_causal=True)
    else:
        block = DecoderBlock(16, 4, norm="pre").eval()
        expected, flagged = block(x, memory, causal_mask(6)), block(x, memory, is_causal=True)
    torch.testing.assert_close(flagged, expected, atol=1e-5, rtol=1e-5)


def test_block_arguments_after_dropout_are_keyword_only():
    with pytest.raises(TypeError):
        EncoderBlock(16, 4, None, 0.0, "gelu")
    with pytest.raises(TypeError):
        DecoderBlock(16, 4, None, 0.0, "gelu")


def test_weights_kept_only_when_recorded():
    block = EncoderBlock(16, 4).eval()
    x = torch.randn(1, 3, 16)
    block(x)
    assert block.weights is None
    block.record_weights = True
    block(x)
    assert block.weights.shape == (1, 4, 3, 3)


@pytest.mark.parametrize("block_class, torch_class", [(EncoderBlock, nn.TransformerEncoderLayer),
                                                      (DecoderBlock, nn.TransformerDecoderLayer)])
def test_load_from_torch_checks_norm_activation_and_eps(block_class, torch_class):
    reference = torch_class(16, 4, 64, batch_first=True)
    with pytest.raises(ValueError, match="norm_first=True"):
        block_class(16, 4).load_from_torch(torch_class(16, 4, 64, batch_first=True, norm_first=True))
    with pytest.raises(ValueError, match="activation"):
        block_class(16, 4, activation="gelu").load_from_torch(reference)
    with pytest.raises(ValueError, match="layer_norm_eps"):
        block_class(16, 4, layer_norm_eps=1e-6).load_from_torch(reference)
    with pytest.raises(ValueError, match="activation"):  # tanh-approximated GELU is another function
        block_class(16, 4, activation="gelu").load_from_torch(
            torch_class(16, 4, 64, batch_first=True, activation=nn.GELU(approximate="tanh")))
    block_class(16, 4, activation="gelu").load_from_torch(torch_class(16, 4, 64, batch_first=True, activation="gelu"))


@pytest.mark.parametrize("reference, message", [
    (dict(d_model=32, nhead=4, dim_feedforward=128), "reference has hidden=128; this block has hidden=64"),
    (dict(d_model=48, nhead=4, dim_feedforward=64), "reference has d_model=48; this block has d_model=32"),
    (dict(d_model=32, nhead=8, dim_feedforward=64), "reference has num_heads=8; this block has num_heads=4"),
])
def test_loading_a_layer_of_other_sizes_names_them(reference, message):
    """Not torch's RuntimeError from load_state_dict: a ValueError naming the sizes that differ."""
    layer = nn.TransformerEncoderLayer(**reference, dropout=0.0, batch_first=True)
    with pytest.raises(ValueError, match=message):
        EncoderBlock(32, 4, 64).load_from_torch(layer)
    decoder_layer = nn.TransformerDecoderLayer(**reference, dropout=0.0, batch_first=True)
    with pytest.raises(ValueError, match=message):
        DecoderBlock(32, 4, 64).load_from_torch(decoder_layer)


def test_one_builder_makes_every_stack_of_blocks():
    from attnbook.blocks import DecoderBlock, stack_blocks

    stack = stack_blocks(3, 32, 4, 64, 0.1, activation="gelu", norm="pre")
    assert len(stack) == 3 and all(type(b) is EncoderBlock for b in stack)
    assert stack[0].norm_position == "pre" and stack[0].feed_forward.activation_name == "gelu"
    assert stack[0] is not stack[1]  # three blocks, not one shared
    assert all(type(b) is DecoderBlock for b in stack_blocks(2, 32, 4, block=DecoderBlock))
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        stack_blocks(0, 32, 4)
    # every model of the library builds its stack with it: the same blocks, the same names
    import attnbook

    gpt = attnbook.GPT(11, 32, 4, 2, 16)
    vit = attnbook.ViT(28, 7, 10, 32, 4, 2)
    for model in (gpt, vit):
        assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2


def test_a_block_is_composed_from_the_modules_it_is_given():
    """Chapter 5's block takes any attention, feed-forward network and norms: an EncoderBlock is
    that block with the original's modules, and a GPT's blocks are composed the same way."""
    from attnbook.blocks import Block, DecoderOnlyBlock
    from attnbook.modern import RMSNorm, SwiGLU

    torch.manual_seed(0)
    encoder = EncoderBlock(16, 4, norm="pre").eval()
    composed = Block(encoder.self_attention, encoder.feed_forward, encoder.norm1, encoder.norm2,
                     norm_position="pre").eval()
    x = torch.randn(2, 5, 16)
    assert torch.equal(composed(x, causal_mask(5)), encoder(x, causal_mask(5)))
    causal = DecoderOnlyBlock(encoder.self_attention, encoder.feed_forward, encoder.norm1, encoder.norm2,
                              norm_position="pre").eval()
    assert torch.equal(causal(x), encoder(x, is_causal=True))  # causal unless told otherwise
    llama_like = DecoderOnlyBlock(MultiHeadAttention(16, 4, bias=False), SwiGLU(16, 24), RMSNorm(16), RMSNorm(16))
    assert llama_like(x).shape == x.shape and llama_like.norm_position == "pre"
    with pytest.raises(ValueError, match="norm must be 'post' or 'pre', got 'rms'"):
        Block(encoder.self_attention, encoder.feed_forward, encoder.norm1, encoder.norm2, norm_position="rms")
    import attnbook

    gpt = attnbook.GPT(11, 16, 4, 1, 8)
    assert type(gpt.blocks[0]) is DecoderOnlyBlock and type(gpt.blocks[0].self_attention) is MultiHeadAttention
