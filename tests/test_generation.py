"""generate(): the KV cache changes the cost, never the tokens; bad inputs get clear errors."""

import itertools

import pytest
import torch
from attnbook import GPT, EncoderDecoderModel, EncoderOnlyModel, beam_search, generate, next_token
from attnbook.cost import kv_cache_bytes

VOCAB, SRC_VOCAB = 17, 13


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, d_model=32, num_heads=4, num_layers=2, max_len=48).eval()


@pytest.fixture(scope="module")
def seq2seq():
    torch.manual_seed(1)
    return EncoderDecoderModel(SRC_VOCAB, VOCAB, d_model=32, num_heads=4, num_encoder_layers=2,
                               num_decoder_layers=2, max_len=40).eval()


def both(model, prompt, new, temperature, seed=0, **kwargs):
    """Generate with and without the cache, each sampling from a generator seeded the same."""
    return [generate(model, prompt, new, use_cache=use_cache, temperature=temperature,
                     generator=torch.Generator().manual_seed(seed), **kwargs)
            for use_cache in (True, False)]


@pytest.mark.parametrize("batch, prompt_len", [(1, 1), (1, 6), (3, 4)])
@pytest.mark.parametrize("new", [0, 1, 9, 30])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_gpt_cached_and_uncached_agree(gpt, batch, prompt_len, new, temperature):
    """Greedy: the same tokens. Sampling: the two paths compute the logits with differently shaped products,
    which round differently, so a draw near a boundary may fall either way; what must agree is the logits
    of every step of the cached run and those of the full model on the same tokens, to float32 rounding."""
    prompt = torch.randint(0, VOCAB, (batch, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    step_logits = []  # the last position's logits of every model call, the cached run's first
    hook = gpt.lm_head.register_forward_hook(lambda module, args, out: step_logits.append(out[:, -1]))
    try:
        cached, uncached = both(gpt, prompt, new, temperature, seed=new)
    finally:
        hook.remove()
    for tokens in (cached, uncached):
        assert tokens.shape == (batch, prompt_len + new)
        assert torch.equal(tokens[:, :prompt_len], prompt)
    if temperature == 0:
        assert torch.equal(cached, uncached)
    assert len(step_logits) == 2 * new  # each run: the prompt once, then one call per new token but the last
    with torch.no_grad():
        for step, logits in enumerate(step_logits[:new]):  # (B, vocab) each
            reference = gpt(cached[:, : prompt_len + step])[:, -1]  # uncached, on the cached run's tokens
            torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_of_the_full_model_at_every_step(gpt):
    tokens = torch.tensor([[3, 1, 4]])
    out = generate(gpt, tokens, 6)
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.cat([tokens, gpt(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens)


def test_sampling_depends_on_the_generator_and_temperature(gpt):
    prompt = torch.tensor([1, 2, 3])  # a 1-D prompt is one sequence
    a = generate(gpt, prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(0))
    b = generate(gpt, prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(0))
    c = generate(gpt, prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 23) and torch.equal(a, b) and not torch.equal(a, c)
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert next_token(logits).tolist() == [1]
    samples = next_token(logits.expand(2000, 3), 1.0, torch.Generator().manual_seed(0))
    frequency = torch.bincount(samples, minlength=3) / 2000
    torch.testing.assert_close(frequency, torch.softmax(logits[0], -1), atol=0.03, rtol=0)


def test_cache_feeds_one_token_per_step(gpt):
    """With the cache each step runs the model on the newest token only; without it, on all so far."""
    lengths = {True: [], False: []}
    for use_cache in (True, False):
        hook = gpt.token_embedding.register_forward_hook(
            lambda module, args, out, use_cache=use_cache: lengths[use_cache].append(args[0].shape[1])
        )
        try:
            generate(gpt, torch.tensor([[1, 2, 3, 4]]), 5, use_cache=use_cache)
        finally:
            hook.remove()
    assert lengths[True] == [4, 1, 1, 1, 1]
    assert lengths[False] == [4, 5, 6, 7, 8]


def test_cache_after_generation_has_the_formula_size(gpt):
    """After T tokens, each layer's cache holds T keys and T values: 2 * layers * T * d * bytes in all."""
    caches = gpt.make_caches(1)
    with torch.no_grad():
        gpt(torch.randint(0, VOCAB, (1, 10)), caches)
    filled = sum(c.keys[:, :, : c.length].nbytes + c.values[:, :, : c.length].nbytes for c in caches)
    assert filled == kv_cache_bytes(num_layers=2, seq_len=10, d_model=32, bytes_per_element=4)


def test_generate_restores_training_mode(gpt):
    gpt.train()
    try:
        generate(gpt, torch.tensor([[1]]), 2)
        assert gpt.training
    finally:
        gpt.eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("new", [1, 12])
def test_encoder_decoder_cached_and_uncached_give_identical_tokens(seq2seq, temperature, new):
    source = torch.randint(0, SRC_VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    source_padding_mask = torch.zeros(2, 9, dtype=torch.bool)
    source_padding_mask[1, 6:] = True  # the second source is 6 tokens long
    start = torch.zeros(2, 1, dtype=torch.long)  # a start token
    for mask in (None, source_padding_mask):
        cached, uncached = both(seq2seq, start, new, temperature, source=source, source_padding_mask=mask)
        assert cached.shape == (2, 1 + new)
        assert torch.equal(cached, uncached)


def test_encoder_decoder_computes_cross_attention_keys_once(seq2seq):
    calls = {True: 0, False: 0}
    for use_cache in (True, False):
        hooks = [block.cross_attention.k_proj.register_forward_hook(
            lambda *args, use_cache=use_cache: calls.__setitem__(use_cache, calls[use_cache] + 1))
            for block in seq2seq.decoder.blocks]
        try:
            generate(seq2seq, torch.zeros(1, 1, dtype=torch.long), 6, use_cache=use_cache,
                     source=torch.arange(1, 8))
        finally:
            for hook in hooks:
                hook.remove()
    assert calls[True] == 2  # once per decoder layer
    assert calls[False] == 2 * 6  # every layer at every step


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(prompt=torch.zeros(1, 49, dtype=torch.long), max_new_tokens=0), ValueError,
         r"prompt of 49 tokens \+ max_new_tokens=0 exceeds max_len=48"),
        (dict(prompt=torch.zeros(1, 40, dtype=torch.long), max_new_tokens=9), ValueError,
         r"prompt of 40 tokens \+ max_new_tokens=9 exceeds max_len=48"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an int >= 0, got -1"),
        (dict(max_new_tokens=2.0), ValueError, "max_new_tokens must be an int >= 0, got 2.0"),
        (dict(temperature=-0.5), ValueError, "temperature must be a finite number >= 0, got -0.5"),
        (dict(prompt=torch.zeros(1, 0, dtype=torch.long)), ValueError, "non-empty"),
        (dict(prompt=torch.zeros(1, 2, 3, dtype=torch.long)), ValueError, r"got \(1, 2, 3\)"),
        (dict(prompt=torch.tensor([[1, VOCAB]])), ValueError, r"token ids must lie in \[0, 17\)"),
    ],
)
def test_bad_inputs_raise_clear_errors(gpt, kwargs, error, message):
    arguments = dict(prompt=torch.tensor([[1, 2]]), max_new_tokens=3) | kwargs
    with pytest.raises(error, match=message):
        generate(gpt, arguments.pop("prompt"), arguments.pop("max_new_tokens"), **arguments)


def test_wrong_model_or_missing_source(seq2seq):
    encoder = EncoderOnlyModel(VOCAB, 16, 2, 1, 20)
    with pytest.raises(TypeError, match=r"EncoderOnlyModel lacks the decoding interface.*missing \['decoding_context'"):
        generate(encoder, torch.tensor([[1]]), 2)
    with pytest.raises(TypeError, match="Linear lacks the decoding interface"):
        generate(torch.nn.Linear(2, 2), torch.tensor([[1]]), 2)
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        generate("gpt", torch.tensor([[1]]), 2)
    with pytest.raises(ValueError, match="needs source"):
        generate(seq2seq, torch.tensor([[0]]), 2)


def test_caches_follow_the_keys_dtype_and_reject_a_second_one():
    model = GPT(vocab_size=11, d_model=16, num_heads=2, num_layers=1, max_len=8).eval()
    assert model.make_caches(1)[0].keys.dtype == torch.float32
    caches = model.make_caches(1, dtype=torch.float16)  # empty: the first keys (float32) decide
    model(torch.zeros(1, 2, dtype=torch.long), caches)
    assert caches[0].keys.dtype == torch.float32 and caches[0].length == 2
    with pytest.raises(ValueError, match="KV cache holds torch.float32.*got keys torch.float64"):
        caches[0].append(torch.zeros(1, 2, 1, 8, dtype=torch.float64), torch.zeros(1, 2, 1, 8, dtype=torch.float64))
    model.double()
    assert model.make_caches(1)[0].keys.dtype == torch.float64


# ----------------------------------------------------------------------------- issue 12


def test_generated_tokens_can_feed_a_training_step(gpt):
    """no_grad, not inference mode: the tokens are ordinary tensors a backward pass may use."""
    tokens = generate(gpt, torch.tensor([[1, 2]]), 5)
    assert not tokens.is_inference()
    logits = gpt(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert gpt.lm_head.weight.grad is not None
    gpt.zero_grad(set_to_none=True)


def test_training_mode_restored_after_an_error(gpt):
    gpt.train()
    try:
        with pytest.raises(TypeError, match="generator must be a torch.Generator"):
            generate(gpt, torch.tensor([[1]]), 2, temperature=1.0, generator=3)
        assert gpt.training
        with pytest.raises(ValueError, match="source batch size|source has batch size"):
            generate(EncoderDecoderModel(SRC_VOCAB, VOCAB, 8, 2, 1, 1, 10).train(), torch.tensor([[1]]), 2,
                     source=torch.tensor([[1, 2], [3, 4]]))
    finally:
        gpt.eval()


def test_generate_does_not_read_back_per_token(gpt, monkeypatch):
    """The range check of the ids (a host read-back on a GPU) runs once, on the prompt."""
    import attnbook.utils

    calls = []
    original = torch.aminmax
    monkeypatch.setattr(attnbook.utils.torch, "aminmax", lambda *a, **k: calls.append(1) or original(*a, **k))
    for use_cache in (True, False):
        calls.clear()
        generate(gpt, torch.tensor([[1, 2, 3]]), 10, use_cache=use_cache)
        assert len(calls) == 1


def test_source_and_mask_are_moved_and_cast(seq2seq):
    source = [[1, 2, 3, 0], [4, 5, 0, 0]]
    padding = [[0, 0, 0, 1], [0, 0, 1, 1]]
    start = torch.zeros(2, 1, dtype=torch.long)
    out = generate(seq2seq, start, 4, source=torch.tensor(source, dtype=torch.int32), source_padding_mask=padding)
    expected = generate(seq2seq, start, 4, source=torch.tensor(source),
                        source_padding_mask=torch.tensor(padding, dtype=torch.bool))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), "hot", True])
def test_temperature_validated(gpt, temperature):
    with pytest.raises(ValueError, match="temperature"):
        generate(gpt, torch.tensor([[1]]), 2, temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        next_token(torch.randn(1, 5), temperature)


def test_gpt_without_mask_tensor_equals_explicit_causal_mask(gpt):
    """GPT passes is_causal to its blocks; the blocks with an explicit causal mask give the same logits."""
    from attnbook import causal_mask

    idx = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        x = gpt.positions(gpt.token_embedding(idx))
        for block in gpt.blocks:
            x = block(x, causal_mask(11))
        torch.testing.assert_close(gpt(idx), gpt.lm_head(gpt.final_norm(x)), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- issue 22


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_under_autocast(gpt, seq2seq, use_cache):
    """Under bf16 autocast the keys arrive in bf16 while the model (and so the preallocated caches) are fp32:
    the caches follow the keys. Before, every cached step raised 'KV cache holds torch.float32'."""
    prompt = torch.tensor([[1, 2, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = generate(gpt, prompt, 6, use_cache=use_cache)
        translated = generate(seq2seq, torch.tensor([[0]]), 4, use_cache=use_cache, source=torch.tensor([[1, 2, 3]]))
    assert tokens.shape == (1, 9) and translated.shape == (1, 5)
    assert torch.equal(tokens[:, :3], prompt)


def test_generate_in_bf16_weights(gpt):
    model = GPT(VOCAB, 16, 2, 2, 48).to(torch.bfloat16)
    cached, uncached = (generate(model, torch.tensor([[1, 2]]), 5, use_cache=c) for c in (True, False))
    assert cached.shape == (1, 7)
    # one bf16 path against another: the first new token comes from identical computations
    assert torch.equal(cached[:, :3], uncached[:, :3])


def test_generate_accepts_a_wrapped_model(gpt):
    """generate asks for the decoding interface, not for a class: a compiled model or a user's wrapper works."""
    expected = generate(gpt, torch.tensor([[1, 2]]), 5)
    compiled = torch.compile(gpt, backend="eager")  # an OptimizedModule, not a GPT
    assert not isinstance(compiled, GPT)
    assert torch.equal(generate(compiled, torch.tensor([[1, 2]]), 5), expected)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.max_len, self.vocab_size = inner.max_len, inner.vocab_size

        def decoding_context(self, batch_size, **inputs):
            return self.inner.decoding_context(batch_size, **inputs)

        def decoding_caches(self, batch_size, context):
            return self.inner.decoding_caches(batch_size, context)

        def decode_step(self, tokens, context, caches):
            return self.inner.decode_step(tokens, context, caches)

    wrapped = Wrapper(gpt).train()
    assert torch.equal(generate(wrapped, torch.tensor([[1, 2]]), 5), expected)
    assert wrapped.training and gpt.training  # the caller's mode is restored on the wrapper and inside it
    wrapped.eval()


def test_gpt_refuses_more_or_fewer_caches_than_blocks(gpt):
    caches = gpt.make_caches(1)
    with pytest.raises(ValueError, match=f"one cache per block \\({len(gpt.blocks)}\\), got {len(caches) + 1}"):
        gpt(torch.tensor([[1]]), caches + caches[:1])
    with pytest.raises(ValueError, match="one cache per block"):
        gpt(torch.tensor([[1]]), caches[:-1])


def test_end_token_stops_and_pads(gpt):
    full = generate(gpt, torch.tensor([[1, 2], [3, 4]]), 8)
    end = int(full[0, 4])  # the third new token of the first row
    stopped = generate(gpt, torch.tensor([[1, 2], [3, 4]]), 8, end_token=end)
    for row, full_row in zip(stopped.tolist(), full.tolist(), strict=True):
        new, full_new = row[2:], full_row[2:]
        cut = full_new.index(end) + 1 if end in full_new else len(full_new)
        assert new[:cut] == full_new[:cut]  # identical up to the end token
        assert all(t == end for t in new[cut:])  # then padded with it
    assert stopped.shape[1] < full.shape[1] or end in full[1, 2:].tolist()


def test_suppressed_tokens_are_never_chosen(gpt):
    full = generate(gpt, torch.tensor([[1, 2]]), 6)
    banned = sorted(set(full[0, 2:].tolist()))
    tokens = generate(gpt, torch.tensor([[1, 2]]), 6, suppress=banned)
    assert not set(tokens[0, 2:].tolist()) & set(banned)
    first = generate(gpt, torch.tensor([[1, 2]]), 1, suppress_at_start=[int(full[0, 2])])
    assert int(first[0, 2]) != int(full[0, 2])
    with pytest.raises(ValueError, match=r"suppress must hold token ids in \[0, 17\), got \[17\]"):
        generate(gpt, torch.tensor([[1, 2]]), 2, suppress=[VOCAB])


def sequence_log_probability(model, prompt, continuation):
    """Sum of log p(token | prefix) of ``continuation`` after ``prompt`` under the full model (no cache)."""
    tokens = torch.tensor([list(prompt) + list(continuation)])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(tokens)[0].float(), dim=-1)  # (T, V)
    return sum(float(log_probs[len(prompt) - 1 + i, token]) for i, token in enumerate(continuation))


def test_gpt_beam_search_of_width_1_is_greedy(gpt):
    prompt = [3, 1, 4]
    tokens, score = beam_search(gpt, prompt, 12, beam_size=1)
    assert tokens == generate(gpt, torch.tensor([prompt]), 12)[0].tolist()  # the prompt in front, as generate
    assert score == pytest.approx(sequence_log_probability(gpt, prompt, tokens[3:]), abs=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_gpt_beam_search_wide_enough_is_exact(gpt, length_penalty):
    """A beam as wide as the space (17^2 continuations of 2 tokens) is exhaustive; with no end token every
    hypothesis has 2 new tokens, so the length penalty cannot change the winner."""
    prompt = [5, 2]
    tokens, score = beam_search(gpt, prompt, 2, beam_size=VOCAB * VOCAB, length_penalty=length_penalty)
    best = max(((a, b) for a in range(VOCAB) for b in range(VOCAB)),
               key=lambda pair: sequence_log_probability(gpt, prompt, pair))
    assert tokens == prompt + list(best)
    assert score == pytest.approx(sequence_log_probability(gpt, prompt, best), abs=1e-4)
    assert score >= beam_search(gpt, prompt, 2, beam_size=1)[1] - 1e-6


def test_gpt_beam_search_length_penalty_ranks_by_mean_log_probability(gpt):
    """With an end token, hypotheses differ in length: length_penalty=0 returns the one of highest total,
    1 the one of highest mean per token; each is the best of an exhaustive search by its own rank."""
    prompt, end = [7], 0
    space = [list(c) + [end] for n in range(3) for c in itertools.product(range(1, VOCAB), repeat=n)]
    space += [list(c) for c in itertools.product(range(1, VOCAB), repeat=3)]  # ran out of tokens
    totals = {tuple(c): sequence_log_probability(gpt, prompt, c) for c in space}
    for length_penalty in (0.0, 1.0):
        tokens, score = beam_search(gpt, prompt, 3, beam_size=len(space), length_penalty=length_penalty,
                                    end_token=end)
        best = max(totals, key=lambda c: totals[c] / len(c) ** length_penalty)
        assert tokens == prompt + list(best) and score == pytest.approx(totals[best], abs=1e-4)


def test_seq2seq_beam_search_of_width_1_is_greedy(seq2seq):
    source = torch.tensor([[1, 5, 7, 2, 9]])
    tokens, _ = beam_search(seq2seq, [1], 10, beam_size=1, source=source)
    assert tokens == generate(seq2seq, torch.tensor([[1]]), 10, source=source)[0].tolist()
    wide, score = beam_search(seq2seq, [1], 10, beam_size=5, source=source)
    assert len(wide) == 11 and score < 0


def test_beam_search_rejects_bad_input(gpt):
    for bad in (0, -1, 1.5):
        with pytest.raises((ValueError, TypeError), match="beam_size"):
            beam_search(gpt, [1], 3, beam_size=bad)
    for bad in (-0.5, "1", float("nan")):
        with pytest.raises(ValueError, match="length_penalty"):
            beam_search(gpt, [1], 3, length_penalty=bad)
    with pytest.raises(ValueError, match="max_len"):
        beam_search(gpt, [1] * 40, 9)
    with pytest.raises(ValueError, match="prompt"):
        beam_search(gpt, [VOCAB], 3)
    with pytest.raises(ValueError, match="extra inputs"):
        beam_search(gpt, [1], 3, source=torch.tensor([[1]]))


# ----------------------------------------------------------------------------- issue 26: top-k, top-p, speculative
