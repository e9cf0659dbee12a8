"""Every model of the library on a CUDA device: forward, backward and generation, in float32 and under
``torch.autocast("cuda", dtype=torch.float16)``.

Every test is marked ``gpu`` (``make gpu-test`` runs ``pytest -m gpu``) and runs once per device:
``cuda``, skipped with the reason "no CUDA device" where there is none, and ``cpu``, the same bodies
on the CPU (autocast to float16 there too), skipped unless ``ATTNBOOK_GPU_TESTS_ON_CPU=1`` so that
``make test`` does not run them twice. In float32 each model's output on the device is compared with
the same model's on the CPU (TF32 off, so they agree to 1e-4); under autocast with a tolerance that
float16 keeps (logits of a few units come out within about 1e-2 of float32).
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager, nullcontext

import attnbook
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
    pytest.param("cpu", marks=pytest.mark.skipif(
        os.environ.get("ATTNBOOK_GPU_TESTS_ON_CPU") != "1",
        reason="the GPU tests' bodies on the CPU: set ATTNBOOK_GPU_TESTS_ON_CPU=1")),
]
PRECISIONS = ["fp32", "fp16-autocast"]
VOCAB = 50


@pytest.fixture(params=DEVICES)
def device(request):
    """The device a test runs on, with TF32 off on CUDA (cuDNN's convolutions use it by default), so that
    float32 on the GPU is float32 and agrees with the CPU."""
    if request.param != "cuda":
        yield request.param
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield request.param
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(params=PRECISIONS)
def precision(request):
    return request.param


@contextmanager
def running(device: str, precision: str):
    """float32 as it is, or everything inside under float16 autocast on ``device``."""
    context = torch.autocast(device, dtype=torch.float16) if precision == "fp16-autocast" else nullcontext()
    with context:
        yield


def on_device(build, device: str):
    """A freshly seeded model moved to ``device``, and an identical copy left on the CPU (the reference)."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model).eval()
    return model.to(device), reference


def check_output(out: torch.Tensor, reference: torch.Tensor, device: str, precision: str) -> None:
    """On the device, finite, and equal to the CPU's float32 output (to what float16 keeps, under autocast)."""
    assert out.device.type == device, f"output on {out.device}, expected {device}"
    assert out.shape == reference.shape
    assert torch.isfinite(out).all()
    tolerance = 1e-4 if precision == "fp32" else 5e-2
    torch.testing.assert_close(out.detach().float().cpu(), reference.float(), atol=tolerance, rtol=tolerance)


def check_backward(model: torch.nn.Module, loss: torch.Tensor) -> None:
    """``loss`` backpropagates to every parameter of ``model``: gradients present, finite, not all zero."""
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert [name for name, p in parameters.items() if p.grad is None] == []
    assert all(p.grad.device == p.device and torch.isfinite(p.grad).all() for p in parameters.values())
    assert any(p.grad.abs().sum() > 0 for p in parameters.values())


def check_generation(cached: torch.Tensor, uncached: torch.Tensor, prompt: torch.Tensor, new_tokens: int,
                     vocab_size: int, precision: str) -> None:
    """Both generations extend the prompt by ``new_tokens`` valid ids; with the cache they are the
    uncached tokens (under autocast, where the two paths round differently, the first new token)."""
    B, T0 = prompt.shape
    assert cached.shape == uncached.shape == (B, T0 + new_tokens)
    assert cached.device == prompt.device
    assert torch.equal(cached[:, :T0], prompt)
    assert int(cached.min()) >= 0 and int(cached.max()) < vocab_size
    if precision == "fp32":
        assert torch.equal(cached, uncached)
    else:
        assert torch.equal(cached[:, : T0 + 1], uncached[:, : T0 + 1])


def tokens(batch: int, length: int, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------- text


def test_gpt(device, precision):
    model, reference = on_device(lambda: attnbook.GPT(VOCAB, 32, 4, 2, 32), device)
    ids = tokens(2, 9)
    with running(device, precision):
        logits = model(ids.to(device))  # (2, 9, VOCAB)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten().to(device))
    if precision == "fp16-autocast":
        assert logits.dtype == torch.float16  # autocast ran the projections in float16
    with torch.no_grad():
        check_output(logits, reference(ids), device, precision)
    check_backward(model, loss)
    prompt = ids[:, :3].to(device)
    with running(device, precision):
        cached = attnbook.generate(model, prompt, 10)
        uncached = attnbook.generate(model, prompt, 10, use_cache=False)
    check_generation(cached, uncached, prompt, 10, VOCAB, precision)
    assert model.training  # generate restored the caller's mode


@pytest.mark.parametrize("mixer", ["softmax", "linear", "mamba"])
def test_mixer_model(device, precision, mixer):
    # chapter 20's model: linear attention and Mamba's scan sum in float32 under autocast
    model, reference = on_device(lambda: attnbook.MixerModel(VOCAB, 16, mixer), device)
    ids = tokens(2, 16)
    with running(device, precision):
        logits = model(ids.to(device))  # (2, 16, VOCAB)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten().to(device))
    with torch.no_grad():
        check_output(logits, reference(ids), device, precision)
    check_backward(model, loss)


def test_encoder_decoder(device, precision):
    model, reference = on_device(lambda: attnbook.EncoderDecoderModel(30, VOCAB, d_model=32, num_heads=4,
                                                                      num_encoder_layers=1, num_decoder_layers=1,
                                                                      max_len=24), device)
    source, target = tokens(2, 7, 30, seed=2), tokens(2, 6)
    key_padding_mask = attnbook.padding_mask(torch.tensor([7, 4]), 7)  # (2, 7): True at padding
    with running(device, precision):
        logits = model(source.to(device), target.to(device), key_padding_mask.to(device))  # (2, 6, VOCAB)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target[:, 1:].flatten().to(device))
    with torch.no_grad():
        check_output(logits, reference(source, target, key_padding_mask), device, precision)
    check_backward(model, loss)
    prompt = target[:, :1].to(device)
    inputs = dict(source=source.to(device), key_padding_mask=key_padding_mask.to(device))
    with running(device, precision):
        cached = attnbook.generate(model, prompt, 8, **inputs)
        uncached = attnbook.generate(model, prompt, 8, use_cache=False, **inputs)
    check_generation(cached, uncached, prompt, 8, VOCAB, precision)


def test_encoder_only(device, precision):
    model, reference = on_device(lambda: attnbook.EncoderOnlyModel(VOCAB, 32, 4, 2, 16, num_classes=3), device)
    ids = tokens(2, 10)
    key_padding_mask = attnbook.padding_mask(torch.tensor([10, 6]), 10)  # (2, 10)
    labels = torch.tensor([0, 2])
    with running(device, precision):
        mlm = model.mlm_logits(ids.to(device), key_padding_mask.to(device))  # (2, 10, VOCAB)
        classes = model.classify(ids.to(device), key_padding_mask.to(device))  # (2, 3)
        loss = (F.cross_entropy(mlm.flatten(0, 1).float(), ids.flatten().to(device))
                + F.cross_entropy(classes.float(), labels.to(device)))
    with torch.no_grad():
        check_output(mlm, reference.mlm_logits(ids, key_padding_mask), device, precision)
        check_output(classes, reference.classify(ids, key_padding_mask), device, precision)
    check_backward(model, loss)


# ---------------------------------------------------------------------------------------- images


def test_vit(device, precision):
    model, reference = on_device(lambda: attnbook.ViT(16, 4, num_classes=5, d_model=32, num_heads=4,
                                                      num_layers=2), device)
    images = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    with running(device, precision):
        logits = model(images.to(device))  # (2, 5)
        loss = F.cross_entropy(logits.float(), torch.tensor([1, 4], device=device))
    with torch.no_grad():
        check_output(logits, reference(images), device, precision)
    check_backward(model, loss)
    with running(device, precision):
        weights = model.attention_weights(images.to(device))  # per block (2, 4, 17, 17)
    expected = reference.attention_weights(images)
    assert len(weights) == 2 and model.training
    for ours, theirs in zip(weights, expected, strict=True):
        assert ours.shape == (2, 4, 17, 17)
        check_output(ours, theirs, device, precision)
        row_sums = ours.float().sum(dim=-1)
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-2, rtol=0)


# ---------------------------------------------------------------------------------------- speech


def test_whisper(device, precision):
    model, reference = on_device(lambda: attnbook.Whisper(n_mels=16, d_model=64, num_heads=2, num_encoder_layers=1,
                                                          num_decoder_layers=1, vocab_size=VOCAB, max_frames=30,
                                                          max_len=16), device)
    mel = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(4))  # (B, n_mels, 2S): 20 audio frames
    ids = tokens(2, 5)
    with running(device, precision):
        logits = model(mel.to(device), ids.to(device))  # (2, 5, VOCAB)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten().to(device))
    with torch.no_grad():
        check_output(logits, reference(mel, ids), device, precision)
    check_backward(model, loss)
    prompt = ids[:, :2].to(device)
    with running(device, precision):
        cached = attnbook.generate(model, prompt, 6, mel=mel.to(device))
        uncached = attnbook.generate(model, prompt, 6, use_cache=False, mel=mel.to(device))
    check_generation(cached, uncached, prompt, 6, VOCAB, precision)


def speech_batch():
    """Two feature sequences of 20 and 13 frames (13 features each) and their labels (-1 pads)."""
    features = torch.randn(2, 20, 13, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([20, 13])
    targets = torch.tensor([[3, 1, 4], [5, 9, -1]])
    target_lengths = torch.tensor([3, 2])
    return features, lengths, targets, target_lengths


def test_ctc(device, precision):
    model, reference = on_device(lambda: attnbook.CTCModel(13, 10, d_model=32, num_heads=4, num_layers=1), device)
    features, lengths, targets, target_lengths = speech_batch()
    args = [t.to(device) for t in (features, lengths, targets, target_lengths)]
    with running(device, precision):
        log_probs, out_lengths = model(*args[:2])  # (2, 10, 11), (2,)
        loss = model.loss(*args)
    with torch.no_grad():
        expected, expected_lengths = reference(features, lengths)
        check_output(log_probs, expected, device, precision)
    assert out_lengths.cpu().tolist() == expected_lengths.tolist() == [10, 7]
    check_backward(model, loss)
    with running(device, precision):
        decoded = model.decode(*args[:2])
    assert len(decoded) == 2 and all(0 <= c < 10 for seq in decoded for c in seq)
    assert all(len(seq) <= n for seq, n in zip(decoded, [10, 7], strict=True))
    if precision == "fp32":
        assert decoded == reference.decode(features, lengths)


def test_seq2seq_speech(device, precision):
    model, reference = on_device(lambda: attnbook.Seq2SeqSpeechModel(13, 10, d_model=32, num_heads=4,
                                                                     num_encoder_layers=1, num_decoder_layers=1,
                                                                     max_len=8), device)
    features, lengths, targets, target_lengths = speech_batch()
    args = [t.to(device) for t in (features, lengths, targets, target_lengths)]
    inputs = torch.tensor([[10, 3, 1, 4], [10, 5, 9, 0]])  # <bos> (= num_classes) and the labels
    with running(device, precision):
        logits = model(*args[:2], inputs.to(device))  # (2, 4, 12)
        loss = model.loss(*args)
    with torch.no_grad():
        check_output(logits, reference(features, lengths, inputs), device, precision)
    check_backward(model, loss)
    with running(device, precision):
        decoded = model.decode(*args[:2])
        short = model.decode(*args[:2], max_new_tokens=3)
    assert len(decoded) == 2 and all(0 <= c < 10 for seq in decoded for c in seq)
    assert all(len(seq) <= 7 for seq in decoded) and all(len(seq) <= 3 for seq in short)
    assert [seq[:3] for seq in decoded] == short  # greedy: a shorter run is a prefix of the longer one
    if precision == "fp32":
        assert decoded == reference.decode(features, lengths)
