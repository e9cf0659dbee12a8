"""Cost formulas against hand-computed values and against FLOPs / bytes counted on real modules;
timing and peak-memory helpers; what tests/test_attention.py leaves out of memory-efficient attention."""

import time

import pytest
import torch
from attnbook import (
    GPT,
    FeedForward,
    MultiHeadAttention,
    cost,
    measure,
    memory_efficient_attention,
    scaled_dot_product_attention,
)
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def counted_flops(fn) -> int:
    """FLOPs PyTorch's own counter sees (matrix products only, 2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# --------------------------------------------------------------------------- FLOP formulas


def test_flop_formulas_by_hand():
    n, d = 10, 4
    assert cost.attention_projection_flops(n, d) == 4 * 2 * 10 * 4 * 4 == 1280
    assert cost.attention_score_flops(n, d) == 2 * 10 * 10 * 4 == 800
    assert cost.attention_weighted_sum_flops(n, d) == 800
    assert cost.attention_score_flops(n, d, n_keys=3) == 2 * 10 * 3 * 4
    assert cost.attention_core_flops(n, d) == 1600
    assert cost.attention_layer_flops(n, d) == 1280 + 1600
    assert cost.ffn_flops(n, d) == 2 * 2 * 10 * 4 * 16 == 2560 == 16 * n * d * d
    assert cost.ffn_flops(n, d, hidden=8) == 2 * 2 * 10 * 4 * 8
    assert cost.recurrent_flops(n, d) == 10 * (2 * 4 * 4 + 2 * 4 * 4) == 640 == 4 * n * d * d
    assert cost.recurrent_flops(n, d, input_size=3) == 10 * (2 * 4 * 3 + 2 * 4 * 4)
    assert cost.recurrent_flops(n, d, gates=4) == 4 * 640  # LSTM


def test_attention_layer_flops_equal_counted_flops():
    """The formula is exactly what PyTorch counts for our MultiHeadAttention, for any number of heads."""
    B, n, d = 2, 12, 16
    x = torch.randn(B, n, d)
    for heads in (1, 2, 4):
        layer = MultiHeadAttention(d, heads).eval()
        with torch.no_grad():
            flops = counted_flops(lambda layer=layer: layer(x, x, x))
        assert flops == B * cost.attention_layer_flops(n, d)


def test_ffn_and_recurrent_flops_equal_counted_flops():
    B, n, d = 3, 7, 8
    x = torch.randn(B, n, d)
    with torch.no_grad():
        assert counted_flops(lambda: FeedForward(d)(x)) == B * cost.ffn_flops(n, d)
        assert counted_flops(lambda: FeedForward(d, hidden=5)(x)) == B * cost.ffn_flops(n, d, hidden=5)
        cell = nn.RNNCell(d, d)  # h_t = tanh(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)
        h = torch.zeros(B, d)

        def run():
            state = h
            for t in range(n):
                state = cell(x[:, t], state)

        assert counted_flops(run) == B * cost.recurrent_flops(n, d)


def test_crossover_where_attention_and_recurrence_cost_the_same():
    for d in (16, 64, 512):
        n = cost.crossover_length(d)
        assert n == d
        assert cost.attention_core_flops(n, d) == cost.recurrent_flops(n, d)
        assert cost.attention_core_flops(n // 2, d) < cost.recurrent_flops(n // 2, d)
        assert cost.attention_core_flops(2 * n, d) > cost.recurrent_flops(2 * n, d)


def test_whole_layer_crossover_with_elman_gru_and_lstm():
    """Whole layers: attention 8nd^2 + 4n^2d against 4 gates n d^2 (GRU: n = d, LSTM: n = 2d, Elman: never)."""
    for d in (16, 64, 512):
        assert cost.layer_crossover_length(d, gates=3) == d
        assert cost.layer_crossover_length(d, gates=4) == 2 * d
        assert cost.layer_crossover_length(d, gates=1) is None
        assert cost.layer_crossover_length(d, gates=2) is None
        for gates in (3, 4, 6):
            n = cost.layer_crossover_length(d, gates)
            assert cost.attention_layer_flops(n, d) == cost.recurrent_flops(n, d, gates=gates)
            assert cost.attention_layer_flops(n - 1, d) < cost.recurrent_flops(n - 1, d, gates=gates)
            assert cost.attention_layer_flops(n + 1, d) > cost.recurrent_flops(n + 1, d, gates=gates)
        for n in (1, 2, d, 10 * d):  # never cheaper than an Elman RNN (or a two-gate layer)
            assert cost.attention_layer_flops(n, d) > cost.recurrent_flops(n, d, gates=2)
    assert cost.layer_crossover_length(64, 4) == 128  # by hand: 8 d^2 + 4 n d = 16 d^2 -> n = 2d
    with pytest.raises(ValueError, match="gates must be a positive int"):
        cost.layer_crossover_length(64, 0)
    with pytest.raises(ValueError, match="d must be a positive int"):
        cost.layer_crossover_length(-1, 3)


def test_gru_and_lstm_flops_equal_counted_flops():
    """PyTorch's GRU (3 gates) and LSTM cell (4 gates) do exactly recurrent_flops(gates=3 / 4)."""
    B, n, d, d_in = 2, 5, 8, 6
    x = torch.randn(B, n, d_in)
    with torch.no_grad():
        assert counted_flops(lambda: nn.GRU(d_in, d, batch_first=True)(x)) == B * cost.recurrent_flops(
            n, d, input_size=d_in, gates=3)
        cell = nn.LSTMCell(d_in, d)  # (nn.LSTM's fused CPU kernel is invisible to the FLOP counter)

        def run_lstm():
            state = (torch.zeros(B, d), torch.zeros(B, d))
            for t in range(n):
                state = cell(x[:, t], state)

        assert counted_flops(run_lstm) == B * cost.recurrent_flops(n, d, input_size=d_in, gates=4)


def test_sequential_steps_and_path_length():
    assert cost.sequential_steps("self-attention", 1000) == 1
    assert cost.sequential_steps("recurrent", 1000) == 1000
    assert cost.max_path_length("self-attention", 1000) == 1
    assert cost.max_path_length("recurrent", 1000) == 999
    with pytest.raises(ValueError, match="kind must be one of.*'convolution'"):
        cost.sequential_steps("convolution", 10)
    with pytest.raises(ValueError, match="kind must be one of"):
        cost.max_path_length("rnn", 10)


def test_vit_doubling_the_image_side():
    assert cost.num_patches(224, 16) == 196
    assert cost.num_patches(448, 16) == 784
    assert cost.num_patches((224, 448), 16) == 392
    ratio = cost.attention_score_flops(784, 768) / cost.attention_score_flops(196, 768)
    assert ratio == 16.0
    with pytest.raises(ValueError, match="not a multiple of patch_size=16"):
        cost.num_patches(225, 16)


# --------------------------------------------------------------------------- memory formulas


def test_attention_weights_bytes_equal_the_tensor():
    B, h, n = 2, 3, 17
    q = torch.randn(B, h, n, 8)
    _, weights = scaled_dot_product_attention(q, q, q)
    assert weights.nbytes == cost.attention_weights_bytes(n, h, 4, batch_size=B) == 2 * 3 * 17 * 17 * 4
    assert cost.attention_weights_bytes(n, h, 2, n_keys=5) == 3 * 17 * 5 * 2
    _, half = scaled_dot_product_attention(q.half(), q.half(), q.half())
    assert half.nbytes == cost.attention_weights_bytes(n, h, 2, batch_size=B)


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.float16, 2)])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_kv_cache_formula_equals_the_caches_of_gpt(dtype, size, batch_size):
    """A cache of T tokens holds 2 * layers * T * d * bytes per sequence."""
    layers, d, heads, max_len = 3, 32, 4, 40
    torch.manual_seed(0)
    model = GPT(vocab_size=11, d_model=d, num_heads=heads, num_layers=layers, max_len=max_len).eval()
    caches = model.make_caches(batch_size, dtype=dtype)
    assert len(caches) == layers
    # preallocated for max_len tokens
    assert sum(cache.nbytes() for cache in caches) == cost.kv_cache_bytes(layers, max_len, d, size,
                                                                         batch_size=batch_size)
    # after the model has run on T tokens, the filled part holds one key and one value of width d per token
    T = 9
    with torch.no_grad():
        model.to(dtype)(torch.randint(0, 11, (batch_size, T)), caches)
    filled = 0
    for cache in caches:
        assert cache.length == T
        keys, values = cache.keys[:, :, :T], cache.values[:, :, :T]  # (B, h, T, d/h)
        assert keys.shape == (batch_size, heads, T, d // heads)
        filled += keys.numel() * keys.element_size() + values.numel() * values.element_size()
    assert filled == cost.kv_cache_bytes(layers, T, d, size, batch_size=batch_size)
    assert filled == batch_size * 2 * layers * T * d * size


def test_kv_cache_bytes_by_hand():
    # GPT-2 small: 12 layers, d = 768, 1024 tokens, fp16 -> 36 MiB per sequence
    assert cost.kv_cache_bytes(12, 1024, 768, 2) == 2 * 12 * 1024 * 768 * 2 == 36 * 2**20
    assert cost.kv_cache_bytes(12, 1024, 768, 2, batch_size=8) == 8 * 36 * 2**20


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cost.attention_layer_flops(0, 4), "n must be a positive int, got 0"),
        (lambda: cost.attention_score_flops(4, 2.5), "d must be a positive int, got 2.5"),
        (lambda: cost.ffn_flops(4, 4, hidden=-1), "hidden must be a positive int, got -1"),
        (lambda: cost.recurrent_flops(4, 4, gates=0), "gates must be a positive int"),
        (lambda: cost.kv_cache_bytes(2, 0, 8), "seq_len must be a positive int, got 0"),
        (lambda: cost.kv_cache_bytes(2, 4, 8, batch_size=True), "batch_size must be a positive int"),
        (lambda: cost.attention_weights_bytes(4, num_heads=0), "num_heads must be a positive int"),
        (lambda: cost.num_patches(224, 0), "patch_size must be a positive int"),
    ],
)
def test_bad_sizes_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------- timing helpers


def test_fit_power_law_recovers_the_exponent():
    xs = [16, 32, 64, 128]
    assert measure.fit_power_law(xs, [3 * x**2.5 for x in xs]) == pytest.approx(2.5)
    assert measure.fit_power_law(xs, [7.0] * 4) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="same length >= 2"):
        measure.fit_power_law([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="positive"):
        measure.fit_power_law([1, 2], [0, 1])
    with pytest.raises(ValueError, match="not all be equal"):
        measure.fit_power_law([2, 2], [1, 3])


def test_cost_holds_formulas_only():
    """Timing and memory measurement live in attnbook.measure; cost does not re-export them."""
    for name in ("measure", "measure_interleaved", "peak_memory", "fit_power_law", "num_threads", "synchronize"):
        assert not hasattr(cost, name), name
        assert callable(getattr(measure, name)), name


@pytest.fixture
def fake_clock(monkeypatch):
    """measure's wall clock replaced by a counter that only the timed functions advance."""
    now = [0.0]
    monkeypatch.setitem(measure.CLOCKS, "wall", lambda: now[0])

    def taking(durations, calls, label):
        durations = iter(durations)

        def fn():
            calls.append(label)
            now[0] += next(durations)

        return fn

    return taking


def test_measure_interleaves_and_returns_medians_or_minima(fake_clock):
    calls = []
    a = fake_clock([100.0, 5.0, 1.0, 3.0], calls, "A")  # a warm-up run, then three timed runs
    b = fake_clock([100.0, 2.0, 8.0, 4.0], calls, "B")
    assert measure.measure_interleaved([a, b], repeats=3, warmup=1) == [3.0, 4.0]  # the warm-up is not timed
    assert calls == ["A", "B"] * 4  # warmup, then A, B, A, B, ...
    a, b = fake_clock([5.0, 1.0, 3.0], calls, "A"), fake_clock([2.0, 8.0, 4.0], calls, "B")
    assert measure.measure_interleaved([a, b], repeats=3, warmup=0, summary="min") == [1.0, 2.0]
    assert measure.measure(fake_clock([7.0, 9.0, 8.0], calls, "C"), repeats=3, warmup=0) == 8.0


def test_measure_rejects_bad_arguments():
    def a():
        return None

    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        measure.measure(a, repeats=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 0, got -1"):
        measure.measure(a, warmup=-1)
    with measure.num_threads(1):
        assert measure.measure(lambda: sum(range(1000)), repeats=2, clock="thread") >= 0  # a real clock
    if torch.get_num_threads() > 1:
        with pytest.raises(ValueError, match=r"clock='thread' counts only this thread.*measure.num_threads\(1\)"):
            measure.measure(a, clock="thread")
    with pytest.raises(ValueError, match="clock must be one of"):
        measure.measure(a, clock="cpu")
    with pytest.raises(ValueError, match="summary must be one of"):
        measure.measure(a, summary="mean")
    with pytest.raises(TypeError, match="sequence of callables"):
        measure.measure_interleaved(a)


def test_num_threads_restores_the_previous_setting():
    before = torch.get_num_threads()
    with measure.num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be a positive int"):
        with measure.num_threads(0):
            pass


# --------------------------------------------------------------------------- peak memory


def test_peak_memory_counts_live_tensors_only():
    def two_alive_at_most():
        x = torch.ones(1000, 250)  # 1 MB
        y = x * 2  # 2 MB alive
        del x
        z = y + 1  # 2 MB alive again: x was freed
        return z.view(-1)[:10]  # a view costs nothing

    assert measure.peak_memory(two_alive_at_most) == 2 * 1000 * 250 * 4
    existing = torch.ones(1000, 1000)
    assert measure.peak_memory(lambda: existing[:10].T.reshape(-1)) == 10 * 1000 * 4  # reshape of a transpose copies
    assert measure.peak_memory(lambda: existing[:10].T[3:7].unsqueeze(0)) == 0  # views of a tensor made before
    assert measure.peak_memory(lambda: existing.add_(1)) == 0  # in place
    with pytest.raises(TypeError, match="fn must be callable"):
        measure.peak_memory(42)


def test_naive_attention_stores_the_weights_and_efficient_does_not():
    n, d = 1024, 16
    q, k, v = torch.randn(1, 1, n, d), torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
    weights_bytes = cost.attention_weights_bytes(n)
    naive = measure.peak_memory(lambda: scaled_dot_product_attention(q, k, v))
    efficient = measure.peak_memory(lambda: memory_efficient_attention(q, k, v, block_size=128))
    assert naive >= weights_bytes  # at least one n x n matrix
    assert efficient < 0.1 * weights_bytes  # blocks of 128 x 128 scores instead
    bigger = measure.peak_memory(lambda: memory_efficient_attention(q, k, v, block_size=256))
    assert efficient < bigger  # the extra memory grows with the block, not with n


# ---------------------------------------- memory-efficient attention: what test_attention.py leaves out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_memory_efficient_attention_in_low_precision(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 8) for _ in range(3))
    mask = torch.ones(37, 37, dtype=torch.bool).triu(1)
    reference = memory_efficient_attention(q, k, v, mask, block_size=8)
    out = memory_efficient_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, block_size=8)
    assert out.dtype == dtype
    tolerance = 1e-2 if dtype == torch.float16 else 4e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)
    naive, _ = scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    torch.testing.assert_close(out.float(), naive.float(), atol=tolerance, rtol=tolerance)
    # scores of +-1e4 stay finite in low precision (computed in fp32 inside)
    big = torch.full((1, 3, 4), 100.0, dtype=dtype)
    big[0, 1] = -100.0
    assert torch.isfinite(memory_efficient_attention(big, big, v[0, 0, :3, :].to(dtype)[None], block_size=2)).all()


def test_memory_efficient_attention_broadcasts_batch_dims():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 1, 9, 4), torch.randn(1, 3, 11, 4), torch.randn(1, 1, 11, 5)
    expected, _ = scaled_dot_product_attention(q, k, v)
    out = memory_efficient_attention(q, k, v, block_size=4)
    assert out.shape == (2, 3, 9, 5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the benchmark's pieces, small


def test_benchmark_pieces_run_small():
    from attnbook import bench

    cpu = torch.device("cpu")
    assert not hasattr(bench, "attention_fast_vs_torch")  # retired: it timed PyTorch against itself
    for causal in (False, True):
        ratio, match = bench.efficient_attention_vs_torch(cpu, repeats=1, n=64, heads=2, head_dim=8, is_causal=causal)
        assert ratio > 0 and match
    ratio, match = bench.mha_vs_torch(cpu, repeats=1, batch=1, n=8, d_model=16, heads=2)
    assert ratio > 0 and match
    speedup, identical = bench.kv_cache_speedup(max_new_tokens=3, repeats=1)
    assert speedup > 0 and identical
    assert bench.generate_vs_transformers(max_new_tokens=3, repeats=1) > 0
    assert bench.train_step_vs_transformers(repeats=1, batch=1, length=8) > 0
    memory_ratio, efficient, naive = bench.efficient_attention_peak_memory(cpu, n=2048, head_dim=8)
    assert 2048 * 2048 * 4 <= naive < 1.1 * 2048 * 2048 * 4  # the naive reference holds exactly one n x n matrix
    assert memory_ratio < 0.5


def test_naive_reference_equals_attention():
    from attnbook import bench

    q, k, v = (torch.randn(2, 7, 4) for _ in range(3))
    torch.testing.assert_close(bench.naive_attention(q, k, v), scaled_dot_product_attention(q, k, v)[0])


def test_benchmark_check_fails_on_a_missed_bar(monkeypatch, capsys):
    from attnbook import bench

    monkeypatch.setattr(bench, "efficient_attention_vs_torch", lambda *a, **k: (9.0, True))
    for name in ("efficient_attention_peak_memory",):
        monkeypatch.setattr(bench, name, lambda *a, **k: (0.01, 1, 100))
    monkeypatch.setattr(bench, "kv_cache_speedup", lambda *a, **k: (20.0, True))
    monkeypatch.setattr(bench, "generate_vs_transformers", lambda *a, **k: 0.5)
    monkeypatch.setattr(bench, "generate_vs_floor", lambda *a, **k: 1.1)
    monkeypatch.setattr(bench, "smollm2_generation", lambda *a, **k: dict(
        vs_transformers=0.8, vs_floor=1.1, kv_cache_speedup=9.0, tokens_identical=True))
    monkeypatch.setattr(bench, "train_step_vs_transformers", lambda *a, **k: 0.9)
    monkeypatch.setattr(bench, "mha_vs_torch", lambda *a, **k: (1.0, True))
    assert bench.main(["--quick", "--check"]) == 1
    out = capsys.readouterr().out
    assert "machine: " in out and "torch " in out and "threads" in out
    assert "efficient_attention_vs_torch_1024: 9.000 (bar <= 2.5: MISSED)" in out
    assert "kv_cache_speedup_128: 20.0 (bar >= 15.0: met)" in out
    assert "generate_vs_floor_128: 1.100 (figure, no bar)" in out  # the small GPT's
    assert "smollm2_generate_vs_floor_32: 1.100 (bar <= 1.15: met)" in out
    assert bench.main(["--quick"]) == 0  # without --check the status is 0


# --------------------------------------------------------------------------- profile


def test_time_by_operation_splits_time_among_the_operations_run(capfd):
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def products_then_a_pass():
        for _ in range(20):
            c = a @ b
        return c.exp()

    start = time.perf_counter()  # the profiler's times are wall-clock times too
    seconds = measure.time_by_operation(products_then_a_pass)
    elapsed = time.perf_counter() - start
    assert {"aten::mm", "aten::exp"} <= set(seconds)
    assert all(t >= 0 for t in seconds.values())
    assert seconds["aten::mm"] > seconds["aten::exp"]  # 20 products against one pass
    assert sum(seconds.values()) <= elapsed  # self times: nothing counted twice
    assert "profiler" not in capfd.readouterr().err  # its start/stop lines are hidden
    with pytest.raises(TypeError, match="callable"):
        measure.time_by_operation(torch.ones(3))


def test_time_by_operation_equals_the_profilers_own_self_times(monkeypatch):
    # the same profile summed by PyTorch's key_averages() (in microseconds)
    kept = []
    real_profile = torch.profiler.profile

    def keeping_profile(*args, **kwargs):
        kept.append(real_profile(*args, **kwargs))
        return kept[-1]

    monkeypatch.setattr(torch.profiler, "profile", keeping_profile)
    x = torch.randn(64, 64, requires_grad=True)
    seconds = measure.time_by_operation(lambda: (x @ x).softmax(-1).sum().backward())
    reference = {e.key: e.self_cpu_time_total for e in kept[0].key_averages()}
    assert set(seconds) == set(reference)
    for name, micro in reference.items():
        assert abs(1e6 * seconds[name] - micro) < 0.01, name


def test_time_by_operation_names_a_custom_autograd_function():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    x = torch.randn(10, requires_grad=True)
    seconds = measure.time_by_operation(lambda: Twice.apply(x).sum().backward())
    assert "Twice" in seconds and "TwiceBackward" in seconds
    assert "aten::mul" in seconds
