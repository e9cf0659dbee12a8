"""The benchmark's floor: a loop of bare kernels over a GPT's weights that must give generate's tokens."""

import attnbook
import pytest
import torch
from attnbook import bench


def _random_gpt(seed: int, **sizes) -> attnbook.GPT:
    """A tiny GPT as the library initialises it, with its biases and LayerNorm weights moved off 0 and 1
    so that every one of them changes some greedy token of a batch of prompts."""
    torch.manual_seed(seed)
    model = attnbook.GPT(**{**dict(vocab_size=37, d_model=32, num_heads=4, num_layers=2, max_len=40), **sizes})
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def _prompts(seed: int, batch: int = 64, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 37, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 1])
def test_floor_loop_gives_generates_greedy_tokens(seed):
    """64 prompts, 6 new tokens each: a loop that dropped the causal mask of the prompt, shifted the
    positions, lost a bias, read one key too few, used another LayerNorm eps or split the heads in
    another layout changes some of these tokens (each such mistake was tried on it)."""
    model, prompt = _random_gpt(seed), _prompts(seed)
    expected = attnbook.generate(model, prompt, 6)  # (64, 12)
    assert len(set(expected[:, 6].tolist())) >= 3  # the first new token depends on the prompt
    assert torch.equal(bench.floor_generate(model, prompt, 6), expected)


def test_floor_loop_reads_the_models_weights():
    """After a weight changes, generate's tokens change and the floor loop's still equal them:
    it reads the model's weights, not a copy taken earlier or a default."""
    model, prompt = _random_gpt(3), _prompts(3)
    before = attnbook.generate(model, prompt, 4)
    for parameter in (model.blocks[1].self_attention.k_proj.weight, model.positions.table,
                      model.blocks[0].feed_forward.fc2.bias, model.final_norm.bias):
        with torch.no_grad():
            parameter.mul_(-1.5)
        after = attnbook.generate(model, prompt, 4)
        assert not torch.equal(after, before)  # the change matters
        assert torch.equal(bench.floor_generate(model, prompt, 4), after)
        before = after


def test_floor_loop_refuses_what_it_does_not_compute():
    torch.manual_seed(0)
    post_norm = attnbook.GPT(vocab_size=11, d_model=8, num_heads=2, num_layers=1, max_len=8, norm="post")
    with pytest.raises(ValueError, match="pre-norm"):
        bench.floor_generate(post_norm, torch.zeros(1, 2, dtype=torch.long), 3)
    relu = attnbook.GPT(vocab_size=11, d_model=8, num_heads=2, num_layers=1, max_len=8, activation="relu")
    with pytest.raises(ValueError, match="GELU"):
        bench.floor_generate(relu, torch.zeros(1, 2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_len=8"):
        bench.floor_generate(_random_gpt(0, max_len=8), torch.zeros(1, 4, dtype=torch.long), 5)


def test_quick_bench_prints_generate_vs_floor(monkeypatch, capsys):
    monkeypatch.setattr(bench, "GPT_SIZES", dict(vocab_size=256, d_model=32, num_heads=2, num_layers=2, max_len=1024))
    monkeypatch.setattr(bench, "generate_vs_transformers", lambda *a, **k: 0.5)  # transformers: slow to import
    assert bench.main(["--quick", "--only", "generation"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "threads, torch " in out
    assert "mode: quick, only generation" in out
    assert "generate_vs_floor_128: " in out and "(bar <= 1.15: " in out
    assert "efficient_attention" not in out and "train_step" not in out  # --only measured nothing else


def test_generate_vs_floor_raises_when_the_tokens_differ(monkeypatch):
    monkeypatch.setattr(bench, "GPT_SIZES", dict(vocab_size=256, d_model=16, num_heads=2, num_layers=1, max_len=64))
    monkeypatch.setattr(bench, "floor_generate", lambda model, prompt, n: torch.zeros(1, 16 + n, dtype=torch.long))
    with pytest.raises(RuntimeError, match="floor_generate's tokens differ"):
        bench.generate_vs_floor(max_new_tokens=4, repeats=1)


def test_only_rejects_an_unknown_group():
    with pytest.raises(SystemExit):
        bench.main(["--only", "generation,speed"])


def test_floor_bar_is_in_the_table():
    assert bench.BARS["generate_vs_floor"] == ("<=", 1.15)


def test_profile_of_one_decoding_step_counts_the_same_operators_and_more_python_calls():
    report = bench.profile_decode_step(position=32, steps=3)
    lines = report.splitlines()
    assert lines[0] == "one cached step at position 32, one thread" and "ratio" in lines[1]
    counts = {}
    for line in lines[2:]:
        name, rest = line.split(": ", 1)
        operators, python = (int(part.split()[0]) for part in (rest, rest.split("), ")[1]))
        counts[name] = operators, python
        assert "(24 addmm)" in rest  # 4 layers x 6 matrix products, in both
    assert counts["ours"][1] > counts["floor"][1]  # the modules' Python calls
    # the same arithmetic: within a few bookkeeping operators of each other
    assert abs(counts["ours"][0] - counts["floor"][0]) < 0.05 * counts["floor"][0]
