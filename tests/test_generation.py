"""generate(): the KV cache changes the cost, never the tokens; bad inputs get clear errors."""

import itertools
import math

import pytest
import torch
from attnbook import (
    GPT,
    EncoderDecoderModel,
    EncoderOnlyModel,
    PromptLookupDraft,
    beam_search,
    generate,
    next_token,
    speculative_generate,
)
from attnbook.cost import kv_cache_bytes
from conftest import small_whisper

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
    key_padding_mask = torch.zeros(2, 9, dtype=torch.bool)
    key_padding_mask[1, 6:] = True  # the second source is 6 tokens long
    start = torch.zeros(2, 1, dtype=torch.long)  # a start token
    for mask in (None, key_padding_mask):
        cached, uncached = both(seq2seq, start, new, temperature, source=source, key_padding_mask=mask)
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
    with pytest.raises(ValueError, match="KVCache holds torch.float32.*got torch.float64"):
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
    out = generate(seq2seq, start, 4, source=torch.tensor(source, dtype=torch.int32), key_padding_mask=padding)
    expected = generate(seq2seq, start, 4, source=torch.tensor(source),
                        key_padding_mask=torch.tensor(padding, dtype=torch.bool))
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


# bf16 keeps 8 bits of mantissa: these models' logits (|z| < 2) move by 0.009 at most in bf16
BF16_LOGIT_TOLERANCE = 0.05


def assert_greedy_as_float32(logits32, tokens, prompt_len):
    """``tokens (1, T)`` were decoded greedily in bf16; ``logits32 (T, V)`` are the float32 model's
    logits along them. Each new token must be the float32 argmax unless the float32 top two lie within
    twice the bf16 tolerance (a near tie that rounding may flip: after one, the sequences part)."""
    for step in range(prompt_len, tokens.shape[1]):
        top2 = logits32[step - 1].topk(2).values
        if top2[0] - top2[1] <= 2 * BF16_LOGIT_TOLERANCE:
            break
        assert int(tokens[0, step]) == int(logits32[step - 1].argmax()), step


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_under_autocast(gpt, seq2seq, use_cache):
    """Under bf16 autocast the keys arrive in bf16 while the model (and so the preallocated caches) are
    fp32: the caches follow the keys (before, every cached step raised 'KV cache holds torch.float32').
    The values: each step's logits within the bf16 tolerance of float32's, the tokens float32's."""
    prompt = torch.tensor([[1, 2, 3]])
    source = torch.tensor([[1, 2, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens = generate(gpt, prompt, 6, use_cache=use_cache)
        translated = generate(seq2seq, torch.tensor([[0]]), 4, use_cache=use_cache, source=source)
        with torch.no_grad():
            low = (gpt(tokens)[0].float(), seq2seq(source, translated)[0].float())
    with torch.no_grad():
        full = (gpt(tokens)[0], seq2seq(source, translated)[0])
    for low_logits, logits in zip(low, full, strict=True):
        torch.testing.assert_close(low_logits, logits, rtol=0, atol=BF16_LOGIT_TOLERANCE)
    assert_greedy_as_float32(full[0], tokens, 3)
    assert_greedy_as_float32(full[1], translated, 1)


def test_generate_in_bf16_weights(gpt):
    """bf16 weights, cached and uncached (two computations that round differently): the tokens of
    the float32 model unless a near tie intervenes, the logits within the bf16 tolerance."""
    model = GPT(VOCAB, 32, 4, 2, 48)
    model.load_state_dict(gpt.state_dict())
    model = model.to(torch.bfloat16).eval()
    for use_cache in (True, False):
        tokens = generate(model, torch.tensor([[1, 2]]), 8, use_cache=use_cache)
        with torch.no_grad():
            logits32 = gpt(tokens)[0]
            low = model(tokens)[0].float()
        torch.testing.assert_close(low, logits32, rtol=0, atol=BF16_LOGIT_TOLERANCE)
        assert_greedy_as_float32(logits32, tokens, 2)


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
    # the first row stops at its third new token, the second row wherever it first picks `end`
    second = full[1, 2:].tolist()
    assert stopped.shape[1] == 2 + max(3, second.index(end) + 1 if end in second else 8)


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
    assert torch.equal(tokens, generate(gpt, torch.tensor([prompt]), 12))  # (1, T0 + new), as generate
    assert score == pytest.approx(sequence_log_probability(gpt, prompt, tokens[0, 3:].tolist()), abs=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_gpt_beam_search_wide_enough_is_exact(gpt, length_penalty):
    """A beam as wide as the space (17^2 continuations of 2 tokens) is exhaustive; with no end token every
    hypothesis has 2 new tokens, so the length penalty cannot change the winner."""
    prompt = [5, 2]
    tokens, score = beam_search(gpt, prompt, 2, beam_size=VOCAB * VOCAB, length_penalty=length_penalty)
    best = max(((a, b) for a in range(VOCAB) for b in range(VOCAB)),
               key=lambda pair: sequence_log_probability(gpt, prompt, pair))
    assert tokens[0].tolist() == prompt + list(best)
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
        assert tokens[0].tolist() == prompt + list(best) and score == pytest.approx(totals[best], abs=1e-4)


def test_seq2seq_beam_search_of_width_1_is_greedy(seq2seq):
    source = torch.tensor([[1, 5, 7, 2, 9]])
    tokens, _ = beam_search(seq2seq, [1], 10, beam_size=1, source=source)
    assert torch.equal(tokens, generate(seq2seq, torch.tensor([[1]]), 10, source=source))
    wide, score = beam_search(seq2seq, [1], 10, beam_size=5, source=source)
    assert wide.shape == (1, 11) and wide.dtype == torch.long and score < 0


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


# --- beam search over an encoder-decoder: a small Whisper ----------------------------------------------------------------------------------


def full_log_probability(model, mel, prompt, tokens, end_token, suppress=(), suppress_at_start=()):
    """The total log-probability of tokens (+ end) by one forward pass without a cache."""
    sequence = torch.tensor([prompt + tokens + [end_token]])
    with torch.no_grad():
        logits = model(mel, sequence[:, :-1])[0, len(prompt) - 1 :].float()
    logits[:, list(suppress)] = float("-inf")
    logits[0, list(suppress_at_start)] = float("-inf")
    targets = sequence[0, len(prompt) :]
    return float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum())


def beam(model, prompt, beam_size, max_new_tokens, **kwargs):
    """Beam search ranked by total log-probability: ``(new tokens without the end token, score)``."""
    tokens, score = beam_search(model, prompt, max_new_tokens, beam_size=beam_size, length_penalty=0.0,
                                **kwargs)
    assert tokens.shape[0] == 1 and tokens[0, : len(prompt)].tolist() == list(prompt)
    new = tokens[0, len(prompt):].tolist()
    return (new[:-1] if new and new[-1] == kwargs.get("end_token") else new), score


def test_beam_search_of_width_1_is_greedy_and_scores_its_hypothesis():
    model = small_whisper(3)
    mel = torch.randn(1, 8, 40, generator=torch.Generator().manual_seed(5))
    greedy = generate(model, torch.tensor([[5, 6]]), 9, mel=mel, end_token=29)[0, 2:].tolist()
    greedy = greedy[: greedy.index(29)] if 29 in greedy else greedy
    tokens, score = beam(model, [5, 6], 1, 9, mel=mel, end_token=29)
    assert tokens == greedy
    if len(tokens) < 9:  # finished: the score includes the end token's log-probability
        assert math.isclose(score, full_log_probability(model, mel, [5, 6], tokens, 29), abs_tol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_beam_search_finds_the_best_sequence_of_a_small_space(seed):
    # 3 allowed tokens and the end token, at most 3 new tokens: 1 + 3 + 9 + 27 hypotheses, few enough
    # to score all of them. A beam as wide as the space, with the stopping rule, must find the best.
    model = small_whisper(seed)
    mel = torch.randn(1, 8, 40, generator=torch.Generator().manual_seed(seed))
    allowed, end = [3, 7, 11], 29
    suppress = [t for t in range(30) if t not in allowed + [end]]
    candidates = [list(c) for n in range(0, 3) for c in itertools.product(allowed, repeat=n)]
    scores = {tuple(c): full_log_probability(model, mel, [5], c, end, suppress) for c in candidates}
    best = max(scores, key=scores.get)
    tokens, score = beam(model, [5], 27, 3, mel=mel, end_token=end, suppress=suppress)
    exhausted = [list(c) for c in itertools.product(allowed, repeat=3)]  # 3 tokens: max_new_tokens ran out
    if len(tokens) < 3:
        assert tuple(tokens) == best and math.isclose(score, scores[best], abs_tol=1e-4)
    else:
        assert tokens in exhausted
    # whatever it returns scores at least as well as the greedy hypothesis (by the same full scorer)
    greedy, _ = beam(model, [5], 1, 3, mel=mel, end_token=end, suppress=suppress)
    if len(tokens) < 3 and len(greedy) < 3:
        assert scores[tuple(tokens)] >= scores[tuple(greedy)] - 1e-6


def test_beam_search_reorders_each_beams_cache():
    # the score beam search reports was built step by step with reordered caches; a full forward pass of
    # the hypothesis it returns must give the same number, whichever beams were swapped along the way
    for seed in range(3):
        model = small_whisper(seed)
        mel = torch.randn(1, 8, 40, generator=torch.Generator().manual_seed(10 + seed))
        tokens, score = beam(model, [1, 2], 4, 8, mel=mel, end_token=29, suppress=[0])
        if len(tokens) < 8:
            assert math.isclose(score, full_log_probability(model, mel, [1, 2], tokens, 29, [0]), abs_tol=1e-4)
        else:  # ran out of tokens: the score has no end token
            full = full_log_probability(model, mel, [1, 2], tokens, 29, [0])
            assert score > full


def test_beam_search_runs_in_eval_mode_and_rejects_bad_input():
    model = small_whisper(4, dropout=0.5).train()
    mel = torch.randn(1, 8, 40)
    first = beam(model, [1], 3, 5, mel=mel, end_token=29)
    assert beam(model, [1], 3, 5, mel=mel, end_token=29) == first and model.training
    with pytest.raises(ValueError, match="beam_size must be a positive int, got 0"):
        beam(model, [1], 0, 5, mel=mel, end_token=29)
    with pytest.raises(ValueError, match="max_len=12"):
        beam(model, [1, 2], 2, 11, mel=mel, end_token=29)
    with pytest.raises(ValueError, match=r"end_token must hold token ids in \[0, 30\)"):
        beam(model, [1], 2, 5, mel=mel, end_token=30)
    with pytest.raises(ValueError, match="every token is suppressed"):
        beam(model, [1], 2, 5, mel=mel, end_token=29, suppress=range(30))
    with pytest.raises(TypeError, match="decoding interface"):
        beam(torch.nn.Linear(2, 2), [1], 2, 5, end_token=1)


# ----------------------------------------------------------------------------- issue 26: top-k, top-p, speculative


def test_truncate_logits_keeps_the_top_k_and_the_smallest_nucleus():
    from attnbook import truncate_logits

    logits = torch.randn(50, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    for k in (1, 3, VOCAB, VOCAB + 5):
        kept = truncate_logits(logits, top_k=k).isfinite()
        assert (kept.sum(-1) == min(k, VOCAB)).all()
        smallest_kept = logits.masked_fill(~kept, float("inf")).amin(-1)  # (50,)
        assert (logits.masked_fill(kept, float("-inf")).amax(-1) <= smallest_kept).all()  # none left out is larger
    probabilities = torch.softmax(logits.double(), -1)  # (50, V), no ties in random logits
    for p in (0.01, 0.5, 0.9, 0.999, 1.0):
        kept = truncate_logits(logits, top_p=p).isfinite()
        for row, keep in zip(probabilities, kept, strict=True):
            # the rule token by token, in float64: keep it if the tokens more probable than it
            # hold less than p (not the library's sort and cumulative sum)
            expected = [float(row[row > row[t]].sum()) < p for t in range(VOCAB)]
            assert keep.tolist() == expected
            assert row[keep].sum() >= min(p, 1.0) - 1e-6  # the kept set reaches p
    both = truncate_logits(logits, top_k=4, top_p=0.5).isfinite()
    assert (both.sum(-1) <= 4).all() and (both <= truncate_logits(logits, top_k=4).isfinite()).all()


def test_sampling_probabilities_renormalise_over_the_kept_tokens():
    from attnbook import sampling_probabilities

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    full = torch.softmax(logits / 0.7, -1)
    top2 = sampling_probabilities(logits, 0.7, top_k=2)
    torch.testing.assert_close(top2[0, :2], full[0, :2] / full[0, :2].sum())
    assert top2[0, 2:].abs().sum() == 0
    torch.testing.assert_close(sampling_probabilities(logits, 0.7), full)
    samples = next_token(logits.expand(4000, 5), 1.0, torch.Generator().manual_seed(0), top_p=0.8)
    frequency = torch.bincount(samples, minlength=5) / 4000
    torch.testing.assert_close(frequency, sampling_probabilities(logits, 1.0, top_p=0.8)[0], atol=0.03, rtol=0)
    with pytest.raises(ValueError, match="temperature > 0"):
        sampling_probabilities(logits, 0.0)


def test_top_k_1_and_a_tiny_top_p_are_greedy(gpt):
    prompt = torch.tensor([[3, 1, 4], [1, 5, 9]])
    greedy = generate(gpt, prompt, 20)
    for truncation in (dict(top_k=1), dict(top_p=1e-6)):
        for temperature in (0.5, 2.0):
            sampled = generate(gpt, prompt, 20, temperature=temperature, generator=torch.Generator().manual_seed(1),
                               **truncation)
            assert torch.equal(sampled, greedy)


def test_no_truncation_leaves_sampling_unchanged(gpt):
    """top_k=None/top_p=None (the defaults), top_k >= vocab and top_p=1 all draw the very same tokens."""
    prompt = torch.tensor([[2, 7]])
    runs = [generate(gpt, prompt, 25, temperature=1.2, generator=torch.Generator().manual_seed(3), **kwargs)
            for kwargs in (dict(), dict(top_k=None, top_p=None), dict(top_k=VOCAB), dict(top_p=1.0))]
    assert all(torch.equal(run, runs[0]) for run in runs)


def test_sampled_tokens_stay_in_the_kept_set(gpt):
    prompt = torch.tensor([[4, 4, 2]])
    for kwargs in (dict(top_k=3), dict(top_p=0.6), dict(top_k=5, top_p=0.7)):
        tokens = generate(gpt, prompt, 30, temperature=3.0, generator=torch.Generator().manual_seed(2), **kwargs)
        with torch.no_grad():
            logits = gpt(tokens[:, :-1])[0, 2:] / 3.0  # (30, V): the distribution of each new token
        from attnbook import truncate_logits

        kept = truncate_logits(logits, **kwargs).isfinite()
        assert kept.gather(1, tokens[0, 3:, None]).all()


@pytest.mark.parametrize("top_k", [0, -2, 1.5, True, "3"])
def test_top_k_validated(gpt, top_k):
    with pytest.raises(ValueError, match=f"top_k must be a positive int, got {top_k!r}"):
        generate(gpt, torch.tensor([[1]]), 2, temperature=1.0, top_k=top_k)
    with pytest.raises(ValueError, match="top_k"):
        next_token(torch.randn(1, 5), 1.0, top_k=top_k)


@pytest.mark.parametrize("top_p", [0, 0.0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_top_p_validated(gpt, top_p):
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got"):
        generate(gpt, torch.tensor([[1]]), 2, temperature=1.0, top_p=top_p)
    with pytest.raises(ValueError, match="top_p"):
        next_token(torch.randn(1, 5), 0.0, top_p=top_p)  # validated even where it would not matter


def test_kv_cache_truncate_forgets_the_last_tokens():
    from attnbook import KVCache

    cache = KVCache(1, 2, 8, 4)
    cache.append(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4))
    cache.truncate(3)
    keys, _ = cache.append(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 7.0))
    assert cache.length == 4 and keys[0, 0, :, 0].tolist() == [1, 1, 1, 7]
    for bad in (-1, 5, 2.0, True):
        with pytest.raises(ValueError, match=r"truncate needs a length in \[0, 4\]"):
            cache.truncate(bad)


@pytest.fixture(scope="module")
def drafts(gpt):
    """Three drafts of the module's GPT: itself, a noisy copy (agrees often, not always), and an unrelated
    smaller model (agrees rarely)."""
    import copy

    noisy = copy.deepcopy(gpt)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(0.1 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    torch.manual_seed(5)
    small = GPT(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=1, max_len=48).eval()
    return {"self": gpt, "noisy": noisy, "small": small}


def count_calls(model):
    """A list that gets one entry per forward call of ``model`` (remove the hook with ``.handle.remove()``)."""

    class Calls(list):
        pass

    calls = Calls()
    calls.handle = model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    return calls


@pytest.mark.parametrize("name", ["self", "noisy", "small"])
@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_speculative_greedy_gives_the_targets_greedy_tokens(gpt, drafts, name, num_draft):
    draft = drafts[name]
    total = SpeculativeTotals()
    for seed in range(6):
        prompt = torch.randint(0, VOCAB, (1 + seed,), generator=torch.Generator().manual_seed(seed))
        new = 12 + 5 * seed
        target_calls, draft_calls = count_calls(gpt), count_calls(draft) if draft is not gpt else None
        try:
            tokens, stats = speculative_generate(gpt, draft, prompt, new, num_draft=num_draft)
        finally:
            target_calls.handle.remove()
            if draft_calls is not None:
                draft_calls.handle.remove()
        assert torch.equal(tokens, generate(gpt, prompt, new))
        assert stats.new_tokens == new and 0 <= stats.accepted <= stats.drafted
        if draft is gpt:
            assert len(target_calls) == stats.target_calls + stats.draft_calls
        else:
            assert (len(target_calls), len(draft_calls)) == (stats.target_calls, stats.draft_calls)
            assert target_calls[0] == len(prompt) + min(num_draft, new - 1)  # the prompt and the first drafts
        assert stats.draft_calls == stats.drafted  # one draft call per drafted token
        # every round writes accepted + 1 tokens with one target call, and ends in at most one rejection
        assert stats.accepted + stats.target_calls == new
        assert stats.rejected <= stats.target_calls and stats.accepted + stats.rejected <= stats.drafted
        total.add(stats)
    if name == "self":  # the target agrees with itself: num_draft + 1 tokens per target call
        assert total.accepted == total.drafted
        assert stats.target_calls == -(-new // (num_draft + 1))
    elif name == "noisy":
        assert 0.2 < total.accepted / total.drafted < 1  # both paths: acceptances and rejections
    else:
        assert total.accepted / total.drafted < 0.5


def test_lookup_next_by_hand():
    from attnbook.generation import lookup_next

    assert lookup_next(torch.tensor([5, 6, 7, 1, 5, 6]), 2) == 7  # [5, 6] came before, then 7
    assert lookup_next(torch.tensor([5, 6, 7, 5, 6, 8, 5, 6]), 2) == 8  # the latest match wins
    assert lookup_next(torch.tensor([1, 2, 3, 9, 3]), 2) == 9  # no [9, 3]: the last token alone
    assert lookup_next(torch.tensor([1, 2, 4]), 3) == 4  # no match: the last token again
    assert lookup_next(torch.tensor([4]), 3) == 4


def test_prompt_lookup_draft_keeps_the_targets_greedy_tokens_and_counts_no_model_call(gpt):
    draft = PromptLookupDraft(VOCAB, gpt.max_len, ngram=2)
    assert list(draft.parameters()) == []
    generator = torch.Generator().manual_seed(7)
    loop = torch.randint(0, VOCAB, (5,), generator=generator)
    total = SpeculativeTotals()
    for _ in range(4):
        prompt = torch.cat([torch.randint(0, VOCAB, (3,), generator=generator), loop, loop])
        calls = count_calls(gpt)
        try:
            tokens, stats = speculative_generate(gpt, draft, prompt, 16, num_draft=3)
        finally:
            calls.handle.remove()
        assert torch.equal(tokens, generate(gpt, prompt, 16))
        assert len(calls) == stats.target_calls and stats.draft_calls == stats.drafted
        assert stats.accepted + stats.target_calls == 16
        total.add(stats)
    assert 0 < total.accepted < total.drafted  # a small model's greedy text repeats in part
    # sampling: the draft proposes its guess with probability 1, and the run completes
    tokens, stats = speculative_generate(
        gpt, draft, prompt, 10, num_draft=2, temperature=1.0, generator=torch.Generator().manual_seed(1)
    )
    assert tokens.shape == (1, len(prompt) + 10) and stats.new_tokens == 10


def test_prompt_lookup_draft_rejects_bad_input(gpt):
    for options, match in [(dict(ngram=0), "ngram"), (dict(vocab_size=0), "vocab_size")]:
        arguments = dict(vocab_size=VOCAB, max_len=48) | options
        with pytest.raises(ValueError, match=match):
            PromptLookupDraft(**arguments)
    draft = PromptLookupDraft(VOCAB, 8)
    with pytest.raises(ValueError, match="one sequence"):
        draft.decoding_context(2)
    history = draft.decoding_caches(1, None)[0]
    history.append(torch.arange(6))
    with pytest.raises(ValueError, match="cannot truncate to 7"):
        history.truncate(7)
    with pytest.raises(ValueError, match="holds 8 tokens; 9 do not fit"):
        history.append(torch.arange(3))
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(gpt, PromptLookupDraft(VOCAB + 1, 48), torch.tensor([1, 2]), 4)


class SpeculativeTotals:
    def __init__(self):
        self.accepted = self.drafted = 0

    def add(self, stats):
        self.accepted += stats.accepted
        self.drafted += stats.drafted


def test_speculative_sampling_is_distributed_as_the_target():
    """With 3 tokens the exact distribution of 3 new tokens (27 sequences) is computable: the product of the
    target's softmax at each step. Over n seeded runs, the empirical distribution is within total variation
    E[TV] + sqrt(ln(1/delta) / 2n) of it (E[TV] <= sum_x sqrt(p(x)(1 - p(x)) / n) / 2; McDiarmid, delta = 1e-4),
    while the draft's own distribution is much further away."""
    torch.manual_seed(6)
    target = GPT(vocab_size=3, d_model=16, num_heads=2, num_layers=2, max_len=16).eval()
    draft = GPT(vocab_size=3, d_model=8, num_heads=2, num_layers=1, max_len=16).eval()
    with torch.no_grad():
        for model, scale in ((target, 4.0), (draft, 4.0)):  # sharper, more different distributions
            model.lm_head.weight.mul_(scale)
    prompt = [1, 2]
    sequences = list(itertools.product(range(3), repeat=3))
    for temperature, num_draft in ((1.0, 2), (0.7, 4)):

        def exact(model, temperature):
            with torch.no_grad():
                return torch.tensor([
                    torch.softmax(model(torch.tensor([prompt + list(s)]))[0, 1:-1] / temperature, -1)
                    .gather(1, torch.tensor(s)[:, None]).prod().item() for s in sequences])

        p, q = exact(target, temperature), exact(draft, temperature)
        n = 1000
        counts = torch.zeros(len(sequences))
        generator = torch.Generator().manual_seed(7)
        accepted = drafted = 0
        for _ in range(n):
            tokens, stats = speculative_generate(target, draft, prompt, 3, num_draft=num_draft,
                                                 temperature=temperature, generator=generator)
            counts[sequences.index(tuple(tokens[0, 2:].tolist()))] += 1
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        bound = float(0.5 * (p * (1 - p) / n).sqrt().sum() + (torch.log(torch.tensor(1e4)) / (2 * n)).sqrt())
        tv = 0.5 * float((counts / n - p).abs().sum())
        assert tv < bound < 0.5 * float((q - p).abs().sum())
        assert 0.1 < accepted / drafted < 0.95  # both branches of the rule ran


def test_speculative_sampling_with_itself_as_draft_accepts_everything(gpt):
    tokens, stats = speculative_generate(gpt, gpt, [1, 2, 3], 20, num_draft=4, temperature=1.0,
                                         generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (1, 23) and stats.acceptance_rate == 1.0 and stats.target_calls == 4
    assert stats.rejected == 0 and stats.per_token_acceptance == 1.0
    assert stats.target_calls_per_token == pytest.approx(0.2)


def test_speculative_restores_modes_and_handles_zero_or_one_token(gpt, drafts):
    gpt.train()
    drafts["small"].train()
    try:
        tokens, stats = speculative_generate(gpt, drafts["small"], torch.tensor([[1, 2]]), 0)
        assert tokens.tolist() == [[1, 2]] and stats.target_calls == 0 and stats.acceptance_rate != 1
        tokens, stats = speculative_generate(gpt, drafts["small"], torch.tensor([[1, 2]]), 1)
        assert torch.equal(tokens, generate(gpt, torch.tensor([[1, 2]]), 1))
        assert (stats.target_calls, stats.draft_calls, stats.target_calls_per_token) == (1, 0, 1.0)
        assert gpt.training and drafts["small"].training
    finally:
        gpt.eval()
        drafts["small"].eval()


def test_speculative_rejects_bad_input(gpt, drafts):
    small = drafts["small"]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"num_draft must be a positive int, got {bad!r}"):
            speculative_generate(gpt, small, [1], 3, num_draft=bad)
    other_vocabulary = GPT(vocab_size=VOCAB + 1, d_model=16, num_heads=2, num_layers=1, max_len=48)
    with pytest.raises(ValueError, match=r"share one vocabulary: target.vocab_size=17, draft.vocab_size=18"):
        speculative_generate(gpt, other_vocabulary, [1], 3)
    with pytest.raises(ValueError, match=r"continues one sequence: prompt must be \(T,\) or \(1, T\), got \(2, 3\)"):
        speculative_generate(gpt, small, torch.zeros(2, 3, dtype=torch.long), 3)
    short = GPT(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=1, max_len=8)
    with pytest.raises(ValueError, match="exceeds the draft's max_len=8"):
        speculative_generate(gpt, short, [1, 2], 10)
    with pytest.raises(ValueError, match="exceeds max_len=48"):
        speculative_generate(gpt, small, [1, 2], 47)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(gpt, small, [1], 3, temperature=-1.0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        speculative_generate(gpt, small, [1], 3, temperature=1.0, generator=0)
    with pytest.raises(TypeError, match="speculative_generate needs a torch.nn.Module"):
        speculative_generate(gpt, "small", [1], 3)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 17\)"):
        speculative_generate(gpt, small, [VOCAB], 3)


# ----------------------------------------------------------------------------- issue 36: bugs found by review


def test_beam_search_of_width_1_is_greedy_with_an_end_token_and_a_length_penalty(gpt):
    """A finished hypothesis takes its slot in the beam: with one slot, the end token ends the search as
    greedy decoding ends, whatever the length penalty (the runner-up used to carry on)."""
    for end in range(VOCAB):
        for prompt in ([3, 1, 4], [7], [5, 2]):
            greedy = generate(gpt, torch.tensor([prompt]), 12, end_token=end)
            for length_penalty in (0.0, 0.6, 1.0):
                tokens, _ = beam_search(gpt, prompt, 12, beam_size=1, end_token=end,
                                        length_penalty=length_penalty)
                assert torch.equal(tokens, greedy), (end, prompt, length_penalty)


def reference_beam_search(model, prompt, max_new_tokens, beam_size, length_penalty, end_token):
    """Beam search written plainly, without early stopping: every step recomputes every prefix with the
    full model, the top ``beam_size`` extensions of the live prefixes are kept (those ending in
    ``end_token`` finish), and at the end the finished and the live hypotheses compete by
    ``total / length ** length_penalty``."""
    live, finished = [([], 0.0)], []
    for _ in range(max_new_tokens):
        candidates = []
        for prefix, score in live:
            with torch.no_grad():
                log_probs = torch.log_softmax(model(torch.tensor([prompt + prefix]))[0, -1].float(), -1)
            candidates += [(score + float(lp), prefix + [token]) for token, lp in enumerate(log_probs)]
        candidates.sort(key=lambda item: -item[0])
        live = []
        for score, prefix in candidates[:beam_size]:
            (finished if prefix[-1] == end_token else live).append((prefix, score))
        if not live:
            break
    finished += live
    best, score = max(finished, key=lambda item: item[1] / len(item[0]) ** length_penalty)
    return prompt + best, score


@pytest.mark.parametrize("end", [0, 3, 9])
def test_beam_search_stops_early_only_when_no_live_prefix_can_win(gpt, end):
    """Early stopping must change nothing: against a beam search without it, over a horizon of 8 tokens
    (a bound that used the current length instead of the longest reachable one stops too soon)."""
    for prompt in ([7], [5, 2], [3, 1, 4]):
        for beam_size, length_penalty in ((2, 1.0), (3, 1.0), (3, 0.5), (4, 2.0)):
            expected, score = reference_beam_search(gpt, prompt, 8, beam_size, length_penalty, end)
            tokens, found = beam_search(gpt, prompt, 8, beam_size=beam_size, length_penalty=length_penalty,
                                        end_token=end)
            assert tokens[0].tolist() == expected, (prompt, beam_size, length_penalty)
            assert found == pytest.approx(score, abs=1e-4)


def test_beam_search_takes_the_prompt_shapes_generate_takes(gpt):
    expected, score = beam_search(gpt, [3, 1, 4], 5, beam_size=2)
    for prompt in (torch.tensor([3, 1, 4]), torch.tensor([[3, 1, 4]]), (3, 1, 4)):
        tokens, same = beam_search(gpt, prompt, 5, beam_size=2)
        assert torch.equal(tokens, expected) and same == score
    with pytest.raises(ValueError, match=r"one sequence: prompt must be \(T,\) or \(1, T\), got \(2, 3\)"):
        beam_search(gpt, torch.zeros(2, 3, dtype=torch.long), 5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_token_suppressed_is_a_clear_error(gpt, drafts, temperature):
    everything = list(range(VOCAB))
    message = "every token is suppressed"
    with pytest.raises(ValueError, match=message):
        generate(gpt, torch.tensor([[1, 2]]), 3, temperature=temperature, suppress=everything,
                 generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):  # at the first step only
        generate(gpt, torch.tensor([[1, 2]]), 3, temperature=temperature, suppress=everything[:5],
                 suppress_at_start=everything[5:], generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        beam_search(gpt, [1, 2], 3, suppress=everything)
    # all but one: that one, every time
    assert generate(gpt, torch.tensor([[1, 2]]), 3, temperature=temperature, suppress=everything[1:],
                    generator=torch.Generator().manual_seed(0))[0, 2:].tolist() == [0, 0, 0]


def test_top_p_keeps_tied_tokens_together_in_any_order():
    """The rule: a token is kept when the tokens strictly more probable than it hold less than p, so
    tokens of equal probability are kept or dropped together, wherever they sit in the vocabulary."""
    from attnbook import truncate_logits

    for probabilities, top_p, kept in (
        ([0.4, 0.3, 0.3], 0.5, [True, True, True]),  # each 0.3 has 0.4 before it: < 0.5
        ([0.3, 0.4, 0.3], 0.5, [True, True, True]),
        ([0.3, 0.3, 0.4], 0.5, [True, True, True]),
        ([0.4, 0.3, 0.3], 0.35, [True, False, False]),  # 0.4 is not < 0.35
        ([0.3, 0.3, 0.4], 0.35, [False, False, True]),
        ([0.25, 0.25, 0.25, 0.25], 0.1, [True] * 4),  # nothing is more probable than any of them
        ([0.5, 0.2, 0.2, 0.1], 0.65, [True, True, True, False]),  # each 0.2 has 0.5 before it
        ([0.2, 0.1, 0.5, 0.2], 0.65, [True, False, True, True]),
    ):
        logits = torch.tensor(probabilities).log()
        assert (truncate_logits(logits, top_p=top_p) > float("-inf")).tolist() == kept, (probabilities, top_p)
    # batched rows keep their own ties
    logits = torch.tensor([[0.4, 0.3, 0.3], [0.3, 0.3, 0.4]]).log()
    assert (truncate_logits(logits, top_p=0.5) > float("-inf")).all()


def test_top_k_is_applied_before_top_p():
    """Top-p then counts probability among the k kept tokens, renormalised: with k = 2 the two
    survivors of (0.4, 0.3, 0.2, 0.1) hold 0.571 and 0.429, so p = 0.55 keeps the first alone
    (top-p first would keep two: 0.4 < 0.55 before the second)."""
    from attnbook import truncate_logits

    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    kept = truncate_logits(logits, top_k=2, top_p=0.55) > float("-inf")
    assert kept.tolist() == [True, False, False, False]
    kept = truncate_logits(logits, top_k=3, top_p=0.9) > float("-inf")  # 0.444, 0.333, 0.222
    assert kept.tolist() == [True, True, True, False]


def test_a_compiled_model_runs_its_compiled_code_in_generate(gpt):
    """torch.compile returns a wrapper whose decode_step is the original module's method; generate
    calls it with the wrapper as self, so the step's self(...) is the compiled forward. A counting
    backend sees the frames compiled (none before the fix: the uncompiled forward ran)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(gpt, backend=counter)
    expected = generate(gpt, torch.tensor([[1, 2]]), 5)
    assert torch.equal(generate(compiled, torch.tensor([[1, 2]]), 5), expected)
    assert counter.frame_count > 0
    torch._dynamo.reset()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_runs_in_eval_mode(temperature):
    """A target and a draft with dropout, left in training mode: decoding switches dropout off, so two
    calls with one seed give the same tokens (and, greedy, those of generate), and the modes come back."""
    torch.manual_seed(3)
    target = GPT(vocab_size=VOCAB, d_model=32, num_heads=4, num_layers=2, max_len=48, dropout=0.5).train()
    draft = GPT(vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=1, max_len=48, dropout=0.5).train()
    runs = [speculative_generate(target, draft, [1, 2], 12, temperature=temperature, num_draft=3,
                                 generator=torch.Generator().manual_seed(0))[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    if temperature == 0:
        assert torch.equal(runs[0], generate(target, [1, 2], 12))
    assert target.training and draft.training


# --- n-gram blocking ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ngram_blocked_matches_transformers(n):
    from attnbook.generation import ngram_blocked
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    g = torch.Generator().manual_seed(n)
    processor = NoRepeatNGramLogitsProcessor(n)
    for length in range(0, 30):
        tokens = torch.randint(0, 4, (1, length), generator=g)  # 4 tokens: many repeats
        scores = processor(tokens, torch.zeros(1, 4))
        theirs = torch.nonzero(scores[0] == float("-inf")).flatten().tolist()
        assert ngram_blocked(tokens[0].tolist(), n) == theirs, (tokens, n)


def test_ngram_blocked_by_hand():
    from attnbook.generation import ngram_blocked

    assert ngram_blocked([1, 2, 3, 1, 2], 3) == [3]  # "1 2" was followed by 3
    assert ngram_blocked([1, 2, 3, 1, 2], 2) == [3]  # "2" was followed by 3
    assert ngram_blocked([1, 2, 3], 1) == [1, 2, 3]
    assert ngram_blocked([5], 3) == []
    with pytest.raises(ValueError, match="n"):
        ngram_blocked([1, 2], 0)


def test_beam_search_blocks_repeated_ngrams(gpt):
    prompt = [3, 1, 4]
    for width in (1, 3):
        tokens, score = beam_search(gpt, prompt, 16, beam_size=width, no_repeat_ngram=2)
        seq = tokens[0].tolist()
        pairs = list(zip(seq, seq[1:], strict=False))
        assert len(pairs) == len(set(pairs))  # no bigram twice, prompt included
        new = tokens[0, 3:].tolist()
        # the blocked tokens are set to -inf before the log-softmax, as suppressed ones
        # are: the score is renormalised over the allowed tokens, so no lower
        assert score >= sequence_log_probability(gpt, prompt, new) - 1e-4
    unblocked = beam_search(gpt, prompt, 16, beam_size=1)[0][0].tolist()
    assert len(set(zip(unblocked, unblocked[1:], strict=False))) < len(unblocked) - 1  # it repeats
    for bad in (-1, 1.5, "2"):
        with pytest.raises((ValueError, TypeError), match="no_repeat_ngram"):
            beam_search(gpt, prompt, 4, no_repeat_ngram=bad)


# --- issue 60: the decoding rules at their edges ----------------------------------------------


def test_beam_search_never_lets_ngram_bans_and_suppression_ban_every_token(gpt):
    """Prompt 0..7 with no_repeat_ngram=1 bans 0..7; suppress bans 8..15: after token 16 (the one
    left) every token is banned. The n-gram rule yields then, never the suppression: no suppressed
    token, and a finite score."""
    suppress = list(range(8, 16))
    tokens, score = beam_search(gpt, list(range(8)), 4, beam_size=2, suppress=suppress,
                                no_repeat_ngram=1)
    new = tokens[0, 8:].tolist()
    assert new[0] == 16 and not set(new) & set(suppress), new
    assert math.isfinite(score)
    # the same score as greedy decoding over the tokens left (beam 1 is greedy)
    greedy, greedy_score = beam_search(gpt, list(range(8)), 4, beam_size=1, suppress=suppress,
                                       no_repeat_ngram=1)
    assert not set(greedy[0, 8:].tolist()) & set(suppress) and math.isfinite(greedy_score)


LOG_DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()  # softmax gives them exactly in float32


@pytest.mark.parametrize("top_p, kept", [(0.5, [True, False, False, False]),
                                         (0.5000001, [True, True, False, False]),
                                         (0.75, [True, True, False, False]),
                                         (0.7500001, [True, True, True, True])])
def test_top_p_boundary_a_token_whose_betters_hold_exactly_p_is_dropped(top_p, kept):
    """Token 1 has exactly 0.5 before it: top_p=0.5 is reached without it (the smallest set that
    reaches p), so it is dropped; a hair above 0.5 keeps it."""
    from attnbook import truncate_logits

    assert torch.equal(torch.softmax(LOG_DYADIC, -1), torch.tensor([0.5, 0.25, 0.125, 0.125]))
    truncated = truncate_logits(LOG_DYADIC, top_p=top_p)
    assert torch.isfinite(truncated).tolist() == kept


def test_top_p_boundary_in_the_sampling_distribution():
    from attnbook import sampling_probabilities

    probabilities = sampling_probabilities(LOG_DYADIC, top_p=0.5)
    assert probabilities.tolist() == [1.0, 0.0, 0.0, 0.0]
    probabilities = sampling_probabilities(LOG_DYADIC, top_p=0.75)  # 0.5 and 0.25, renormalised
    torch.testing.assert_close(probabilities, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))


def test_speculative_refuses_a_quantized_cache_naming_it():
    """A draft whose caches are 8-bit cannot roll rejected tokens back: the error names the cache
    (not a sliding window)."""

    class QuantizedGPT(GPT):
        def decoding_caches(self, batch_size, context):
            return self.make_caches(batch_size, kv_bits=8)

    torch.manual_seed(0)
    target = GPT(VOCAB, 16, 2, 1, 32).eval()
    draft = QuantizedGPT(VOCAB, 16, 2, 1, 32).eval()
    for pair in ((target, draft), (draft, target)):
        with pytest.raises(ValueError, match="QuantizedKVCache") as error:
            speculative_generate(*pair, [1, 2], 4)
        assert "window" not in str(error.value)


def left_padded(prompts, pad=0):
    """``prompts`` (lists of ids) left-padded to the longest: ``(ids (B, T), key_padding_mask (B, T))``."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[True] * (longest - len(p)) + [False] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("options", [dict(), dict(positions="rope", num_kv_heads=2),
                                     dict(positions="alibi"), dict(positions="sinusoidal", window=6),
                                     dict(positions="rope", mla=dict(kv_lora_rank=8, qk_rope_head_dim=4,
                                                                   qk_nope_head_dim=4, v_head_dim=8))])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_of_a_left_padded_batch_equals_decoding_each_prompt_alone(options, use_cache):
    torch.manual_seed(0)
    model = GPT(VOCAB, 32, 4, 2, 40, **options).eval()
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    ids, mask = left_padded(prompts)
    out = generate(model, ids, 12, key_padding_mask=mask, use_cache=use_cache)
    assert out.shape == (3, 7 + 12)
    for row, prompt in zip(out, prompts, strict=True):
        alone = generate(model, torch.tensor(prompt), 12, use_cache=use_cache)[0]
        assert torch.equal(row[7 - len(prompt):], alone)


def test_gpt_forward_with_a_padding_mask_gives_each_prompts_own_logits():
    torch.manual_seed(0)
    model = GPT(VOCAB, 32, 4, 2, 40).eval()
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    ids, mask = left_padded(prompts)
    logits = model(ids, key_padding_mask=mask)  # (2, 5, V)
    assert torch.isfinite(logits).all()  # the padding's own rows see nothing: 0, not NaN
    for row, prompt in zip(logits, prompts, strict=True):
        torch.testing.assert_close(row[5 - len(prompt):], model(torch.tensor([prompt]))[0])
    # cached: the prompt, then one token, the mask covering every key so far
    caches = model.make_caches(2)
    model(ids, caches, key_padding_mask=mask)
    step = model(torch.tensor([[7], [7]]), caches,
                 key_padding_mask=torch.cat([mask, torch.zeros(2, 1, dtype=torch.bool)], 1))
    for row, prompt in zip(step, prompts, strict=True):
        torch.testing.assert_close(row[-1], model(torch.tensor([prompt + [7]]))[0, -1])
    with pytest.raises(ValueError, match="key_padding_mask"):
        model(ids, key_padding_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="sink_tokens"):
        GPT(VOCAB, 32, 4, 1, 40, positions="rope", window=4, sink_tokens=1)(ids, key_padding_mask=mask)


# --- speculative acceptance, a pure function ------------------------------------------------------


def test_accept_drafts_greedy_keeps_the_drafts_the_target_agrees_with():
    from attnbook import accept_drafts

    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [0.0, 4.0, 1.0, 2.0], [1.0, 0.0, 2.0, 5.0]])  # argmax 2, 1, 3
    accepted, weights = accept_drafts(torch.tensor([2, 0]), logits)
    assert accepted == 1 and weights.tolist() == [0.0, 1.0, 0.0, 0.0]  # the target's token replaces 0
    accepted, weights = accept_drafts(torch.tensor([2, 1]), logits)
    assert accepted == 2 and weights.argmax() == 3  # both kept, then the target's bonus token
    accepted, weights = accept_drafts(torch.tensor([0, 1]), logits)
    assert accepted == 0 and weights.argmax() == 2  # the first disagrees: nothing after it is judged


def test_accept_drafts_sampling_by_hand():
    """Draft x is kept while uniform * q(x) < p(x); the first one rejected is replaced from
    max(0, p - q); after every draft, a bonus token from p."""
    from attnbook import accept_drafts

    p = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.25, 0.5], [0.125, 0.125, 0.75]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]])
    drafted = torch.tensor([0, 0])  # p/q = 2 (always kept), then 1/2
    accepted, weights = accept_drafts(drafted, p, q, torch.tensor([0.99, 0.5]))
    assert accepted == 1 and weights.tolist() == [0.0, 0.0, 0.25]  # 0.5 * 0.5 = 0.25 is not < 0.25
    accepted, weights = accept_drafts(drafted, p, q, torch.tensor([0.99, 0.49]))
    assert accepted == 2 and weights.tolist() == [0.125, 0.125, 0.75]  # kept: the bonus from p
    accepted, weights = accept_drafts(torch.tensor([1]), p[1:], p[1:2], torch.tensor([0.999]))
    assert accepted == 1  # p = q: always kept
    # rejected where p <= q everywhere but at x: the residual max(0, p - q) is what is left
    accepted, weights = accept_drafts(torch.tensor([1]), p[:2], q[:1], torch.tensor([0.75]))
    assert accepted == 0 and weights.tolist() == [0.25, 0.0, 0.0]


def test_accept_drafts_gives_the_targets_distribution_exactly():
    """One draft drawn from q, kept or replaced: the written token is distributed as p, whatever q
    (Leviathan et al. 2023). Exact, by averaging over a fine grid of uniforms instead of drawing."""
    from attnbook import accept_drafts

    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    grid = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
    written = torch.zeros(3, dtype=torch.float64)
    for x in range(3):
        for u in grid:
            accepted, weights = accept_drafts(torch.tensor([x]), p, q, u[None])
            written += q[0, x] / len(grid) * (torch.eye(3, dtype=torch.float64)[x] if accepted else
                                               weights / weights.sum())
    torch.testing.assert_close(written, p[0], atol=1e-3, rtol=0)


def test_top_k_keeps_exactly_k_when_tokens_tie_at_the_border():
    """Four tokens tie for second place: top_k=2 keeps the best and one of them, exactly two."""
    from attnbook import sampling_probabilities, truncate_logits

    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 1.0]])
    kept = truncate_logits(logits, top_k=2).isfinite()
    assert kept.sum() == 2 and kept[0, 0]
    probabilities = sampling_probabilities(logits, top_k=2)
    assert (probabilities > 0).sum() == 2
    torch.testing.assert_close(probabilities.sum(), torch.tensor(1.0))


def test_sampling_with_top_k_draws_from_k_tokens_whatever_the_ties():
    """Drawn many times with top_k=2, from logits where four tokens tie for second: two tokens
    appear, the best one with probability e / (e + 1)."""
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 2.0, 1.0]).expand(4000, -1)
    drawn = next_token(logits, 1.0, torch.Generator().manual_seed(0), top_k=2)
    assert len(drawn.unique()) == 2 and 0 in drawn.tolist()
    share = (drawn == 0).float().mean().item()
    assert abs(share - math.e / (math.e + 1)) < 0.03
