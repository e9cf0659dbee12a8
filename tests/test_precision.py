"""Every model of the book runs forward, backward and generation in bf16 weights and under bf16 autocast on
the CPU (the speech models are covered in their own test files). A GPU user meets these paths first: fp16 or
bf16 weights, or ``torch.autocast`` around a float32 model."""

import pytest
import torch
from attnbook import GPT, EncoderDecoderModel, EncoderOnlyModel, ViT, generate

BF16 = torch.bfloat16


def gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=19, d_model=32, num_heads=4, num_layers=2, max_len=24)


def seq2seq():
    torch.manual_seed(1)
    return EncoderDecoderModel(13, 19, d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                               max_len=24)


def encoder():
    torch.manual_seed(2)
    return EncoderOnlyModel(19, 32, 4, 2, 24, num_classes=3)


def vit():
    torch.manual_seed(3)
    return ViT(8, 4, num_classes=3, d_model=32, num_heads=4, num_layers=2)


TOKENS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
SOURCE = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
IMAGES = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))


def outputs(name, model):
    """The model's main output on fixed inputs (logits), for one family."""
    if name == "gpt":
        return model(TOKENS)
    if name == "seq2seq":
        return model(SOURCE, TOKENS)
    if name == "encoder":
        return torch.cat([model.mlm_logits(TOKENS).flatten(), model.classify(TOKENS).flatten()])
    return model(IMAGES.to(next(model.parameters()).dtype))


MODELS = {"gpt": gpt, "seq2seq": seq2seq, "encoder": encoder, "vit": vit}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
def test_forward_and_backward_in_bf16(name, mode):
    reference = outputs(name, MODELS[name]().eval()).detach()  # float32
    model = MODELS[name]().eval()
    if mode == "bf16 weights":
        model = model.to(BF16)
        out = outputs(name, model)
    else:
        with torch.autocast("cpu", dtype=BF16):
            out = outputs(name, model)
    assert out.dtype == BF16 and torch.isfinite(out).all()
    # bf16 keeps 8 bits of mantissa: logits of size ~1 agree with float32 to a few hundredths
    torch.testing.assert_close(out.float(), reference, atol=0.1, rtol=0.05)
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", ["gpt", "seq2seq"])
@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
def test_generation_in_bf16(name, mode):
    model = MODELS[name]()
    inputs = {"source": SOURCE} if name == "seq2seq" else {}
    prompt = TOKENS[:, :2]
    if mode == "bf16 weights":
        model = model.to(BF16)
        tokens = [generate(model, prompt, 8, use_cache=c, **inputs) for c in (True, False)]
    else:
        with torch.autocast("cpu", dtype=BF16):
            tokens = [generate(model, prompt, 8, use_cache=c, **inputs) for c in (True, False)]
    for t in tokens:
        assert t.shape == (2, 10) and torch.equal(t[:, :2], prompt)
        assert int(t.min()) >= 0 and int(t.max()) < 19
    # the first new token comes from the same computation with and without the cache
    assert torch.equal(tokens[0][:, 2], tokens[1][:, 2])
