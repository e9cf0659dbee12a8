"""measure.flop_counter: PyTorch's FLOP counter, with fused attention on a CPU counted."""

import attnbook
import torch
import torch.nn.functional as F
from attnbook.measure import flop_counter
from torch.utils.flop_counter import FlopCounterMode


def _counts(counter):
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_fused_attention_forward_and_backward_by_hand():
    B, h, n_q, n_k, d, d_v = 2, 3, 5, 7, 4, 4  # (d_v != d runs unfused, as bmm)
    q = torch.randn(B, h, n_q, d, requires_grad=True)
    k = torch.randn(B, h, n_k, d, requires_grad=True)
    v = torch.randn(B, h, n_k, d_v, requires_grad=True)
    with flop_counter() as forward:
        out = F.scaled_dot_product_attention(q, k, v)
    assert list(_counts(forward)) == ["aten._scaled_dot_product_flash_attention_for_cpu"]
    # Q K^T and A V, 2 FLOPs a multiply-add
    assert forward.get_total_flops() == 2 * B * h * n_q * n_k * (d + d_v) == 3_360
    with flop_counter() as backward:
        out.sum().backward()
    # the scores again, then dA, dV, dQ, dK
    assert backward.get_total_flops() == 2 * B * h * n_q * n_k * (3 * d + 2 * d_v) == 8_400


def test_pytorch_alone_counts_fused_cpu_attention_as_zero():
    q = k = v = torch.randn(1, 2, 8, 4)
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v)
    with flop_counter() as ours:
        F.scaled_dot_product_attention(q, k, v)
    assert plain.get_total_flops() == 0  # the gap flop_counter fills
    assert ours.get_total_flops() == 2 * 2 * 8 * 8 * (4 + 4)


def test_vit_fused_path_counts_what_the_explicit_path_multiplies():
    attnbook.seed_everything(0)
    model = attnbook.ViT(28, 4, num_classes=10, d_model=32, num_heads=4, num_layers=3)
    x = torch.rand(2, 1, 28, 28)
    with flop_counter() as fused:
        model(x).sum().backward()
    for block in model.blocks:  # the weights path: the same products as two bmm each
        block.record_weights = True
    with flop_counter() as explicit:
        model(x).sum().backward()
    fused, explicit = _counts(fused), _counts(explicit)
    scores = 2 * 2 * 4 * 50 * 50 * 8 * 3  # one (B h, 50, 8) @ (B h, 8, 50) per layer
    assert fused["aten._scaled_dot_product_flash_attention_for_cpu"] == 2 * scores
    # explicit backward: 4 products; the fused one recomputes the scores first
    assert explicit["aten.bmm"] == 2 * scores + 4 * scores
    assert (
        fused["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == 5 * scores
    )
    for op in ("aten.addmm", "aten.mm", "aten.convolution"):
        assert fused[op] == explicit[op]
