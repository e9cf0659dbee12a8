"""Chapter 20's Mamba block: equal to transformers' MambaMixer at the same weights (random tiny
config), the whole-sequence form equal to the step-by-step decode, its states equal to
transformers' cache, the parallel scan, the state's size, and bad inputs."""

import pytest
import torch
from attnbook import MambaBlock
from attnbook.ssm import MambaState, parallel_scan, scan
from conftest import require

transformers = require("transformers")
from transformers.models.mamba.modeling_mamba import MambaMixer  # noqa: E402

D, N, EXPAND, K = 16, 4, 2, 4
E = EXPAND * D
TOL = {"atol": 1e-5, "rtol": 1e-5}


def mixer(**overrides):
    torch.manual_seed(0)
    config = transformers.MambaConfig(**{
        "hidden_size": D, "state_size": N, "expand": EXPAND, "conv_kernel": K,
        "num_hidden_layers": 1, "vocab_size": 32, **overrides})
    return MambaMixer(config, layer_idx=0).eval()


def inputs(T=9, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"use_bias": True, "use_conv_bias": False}])
def test_equals_transformers_mamba_mixer(overrides):
    reference = mixer(**overrides)
    block = MambaBlock.from_transformers(reference)
    x = inputs()
    with torch.no_grad():  # on CPU the mixer runs its PyTorch path (no CUDA kernels)
        torch.testing.assert_close(block(x), reference(x), atol=1e-4, rtol=1e-4)
    names = {name for name, _ in reference.named_parameters()}
    assert {name for name, _ in block.named_parameters()} == names


def test_whole_sequence_equals_step_by_step():
    torch.manual_seed(0)
    block = MambaBlock(D, state_size=N, expand=EXPAND, conv_kernel=K).eval()
    x = inputs()
    with torch.no_grad():
        full = block(x)
        state, steps = None, []
        for t in range(x.shape[1]):
            y, state = block.step(x[:, t], state)
            steps.append(y)
        torch.testing.assert_close(torch.stack(steps, 1), full, **TOL)
        # a prefill, then a decode from its state
        first, state = block.prefill(x[:, :5])
        rest = []
        for t in range(5, x.shape[1]):
            y, state = block.step(x[:, t], state)
            rest.append(y)
        torch.testing.assert_close(torch.cat([first, torch.stack(rest, 1)], 1), full, **TOL)
        # and a prefill in two chunks
        a, state = block.prefill(x[:, :2])
        b, _ = block.prefill(x[:, 2:], state)
        torch.testing.assert_close(torch.cat([a, b], 1), full, **TOL)


def test_states_and_decode_equal_transformers_cache():
    reference = mixer()
    block = MambaBlock.from_transformers(reference)
    x = inputs()
    cache = transformers.DynamicCache(config=reference.config)
    with torch.no_grad():
        ours, state = block.prefill(x[:, :5])
        theirs = [reference(x[:, :5], cache=cache)]
        # transformers keeps the last K inputs of the convolution; the oldest is never used
        torch.testing.assert_close(state.conv, cache.get_conv_state(0)[..., 1:])
        torch.testing.assert_close(state.ssm, cache.get_recurrent_state(0), **TOL)
        outs = [ours]
        for t in range(5, x.shape[1]):
            y, state = block.step(x[:, t], state)
            outs.append(y[:, None])
            theirs.append(reference(x[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(outs, 1), torch.cat(theirs, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parallel", [True, False, None])
@pytest.mark.parametrize("T", [1, 2, 5, 8, 13])
def test_scan_equals_the_loop(T, parallel):
    g = torch.Generator().manual_seed(T)
    a, b = torch.rand(2, T, 3, generator=g), torch.randn(2, T, 3, generator=g)
    h0 = torch.randn(2, 3, generator=g)
    h, states = h0, []
    for t in range(T):
        h = a[:, t] * h + b[:, t]
        states.append(h)
    ours = scan(a, b, h0, parallel=parallel)
    torch.testing.assert_close(ours, torch.stack(states, 1), **TOL)
    torch.testing.assert_close(scan(a, b, parallel=parallel), scan(a, b, 0 * h0))
    if parallel:
        assert torch.equal(parallel_scan(a, b, h0), ours)


def test_scan_takes_the_loop_on_a_cpu():
    # the two ways round differently; the default on a CPU gives the loop's bits
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 64, 3, generator=g), torch.randn(2, 64, 3, generator=g)
    assert torch.equal(scan(a, b), scan(a, b, parallel=False))
    assert not torch.equal(scan(a, b), scan(a, b, parallel=True))


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("T", [1, 2, 5, 13])
def test_scan_gradient_is_the_loops(T, parallel):
    # the scan's own backward (a reverse scan) against autograd through the loop
    g = torch.Generator().manual_seed(T)
    a = torch.rand(2, T, 3, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(2, T, 3, generator=g, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_()
    weights = torch.randn(2, T, 3, generator=g, dtype=torch.float64)

    def loop(a, b, h0):
        h, states = h0, []
        for t in range(T):
            h = a[:, t] * h + b[:, t]
            states.append(h)
        return torch.stack(states, 1)

    def ours(*args):
        return scan(*args, parallel=parallel)

    for initial in (h0, None):
        args = (a, b) if initial is None else (a, b, h0)
        grads = torch.autograd.grad((ours(*args) * weights).sum(), args)
        start = torch.zeros_like(h0) if initial is None else h0
        theirs = torch.autograd.grad((loop(a, b, start) * weights).sum(), args)
        for x, y in zip(grads, theirs, strict=True):
            torch.testing.assert_close(x, y)
    assert torch.autograd.gradcheck(ours, (a, b, h0))


def test_state_size_does_not_depend_on_the_length():
    block = MambaBlock(D, state_size=N, expand=EXPAND, conv_kernel=K)
    assert block.state_bytes() == E * (K - 1 + N) * 4 == 896
    assert block.state_bytes(3, torch.bfloat16) == 3 * E * (K - 1 + N) * 2
    with torch.no_grad():
        for T in (1, 6, 20):
            _, state = block.prefill(inputs(T, B=3))
            assert isinstance(state, MambaState)
            assert state.conv.nbytes + state.ssm.nbytes == block.state_bytes(3)


def test_trains_and_runs_in_bfloat16():
    torch.manual_seed(0)
    block = MambaBlock(D, state_size=N)
    block(inputs()).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())
    y = block.bfloat16()(inputs().bfloat16())
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_bad_inputs_are_named():
    block = MambaBlock(D, state_size=N)
    with pytest.raises(ValueError, match=r"\(B, T, d_model\) with d_model=16.*\(2, 9, 8\)"):
        block(inputs()[..., :8])
    with pytest.raises(ValueError, match=r"\(B, d_model\)"):
        block.step(inputs())
    with pytest.raises(ValueError, match="state must be"):
        block.step(inputs()[:, 0], MambaState(torch.zeros(2, E, 2), torch.zeros(2, E, N)))
    for name in ("state_size", "expand", "conv_kernel", "dt_rank"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int, got 0"):
            MambaBlock(D, **{name: 0})
    with pytest.raises(ValueError, match="d_model must be a positive int, got -1"):
        MambaBlock(-1)
    with pytest.raises(ValueError, match="SiLU"):
        MambaBlock.from_transformers(mixer(hidden_act="gelu"))
