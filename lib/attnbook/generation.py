"""Generating tokens: the library's decoding loops, greedy or sampled (with or without a
KV cache, with or without top-k / top-p truncation), beam search, and speculative
decoding.

Without a cache every step runs the model on the whole sequence so far; with one, each
step runs it on the newest token only, which computes just that token's query, key and
value per layer.

:func:`generate` and :func:`beam_search` drive any module with the decoding interface of
:mod:`attnbook.models` (``max_len``, ``vocab_size``, ``decoding_context``,
``decoding_caches``, ``decode_step``): the GPT, the encoder–decoder, Whisper and chapter
10's speech model, and a wrapped or compiled one of them.
:func:`speculative_generate` drives two of them, a target and a cheaper draft, over one
shared vocabulary; :class:`PromptLookupDraft` is a draft that is no model at all.
:func:`generate_paged` decodes prompts of different lengths greedily, their KV caches
paged into one shared pool of blocks (chapter 18), and returns one tensor per prompt.

One result convention for the three: the tokens come first, a ``(B, T0 + new)``
LongTensor on the model's device with the prompt in front (``B = 1`` for the two that
continue one sequence), and a loop that has more to say returns it second:
:func:`generate` returns ``tokens``; :func:`beam_search` ``(tokens, log_prob)``;
:func:`speculative_generate` ``(tokens, stats)``.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .caches import KVCache, RollingKVCache
from .paging import BlockPool, PagedKVCache
from .utils import (
    check_non_negative_int,
    check_positive_int,
    check_token_ids,
    eval_mode,
)

DECODING_INTERFACE = (
    "max_len",
    "vocab_size",
    "decoding_context",
    "decoding_caches",
    "decode_step",
)


def _check_temperature(temperature) -> float:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature >= 0
        or temperature == float("inf")
    ):
        raise ValueError(
            f"temperature must be a finite number >= 0, got {temperature!r}"
        )
    return float(temperature)


def _check_generator(generator, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            "generator must be a torch.Generator or None, got "
            f"{type(generator).__name__}"
        )
    if generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device} but the logits are on {device}: "
            "make it with attnbook.generator(seed, device=...)"
        )


def _check_top_k(top_k) -> int | None:
    return None if top_k is None else check_positive_int("top_k", top_k)


def _check_top_p(top_p) -> float | None:
    if top_p is None:
        return None
    if (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float))
        or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    return float(top_p)


def _keep_top(logits: torch.Tensor, top_k: int | None, top_p: float | None):
    """:func:`truncate_logits` on arguments already checked (the decoding loops call
    this once a step)."""
    if top_k is not None and top_k < logits.shape[-1]:
        top = logits.topk(top_k, dim=-1).indices  # (..., k)
        # (..., vocab)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_probabilities, order = torch.softmax(logits.float(), dim=-1).sort(
            dim=-1, descending=True
        )  # (..., vocab), most probable first
        # the probability held by the tokens before each one ...
        before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities
        # ... and by those strictly more probable: ties count from their first member
        first = torch.searchsorted(-sorted_probabilities, -sorted_probabilities)
        more_probable = before.gather(-1, first)  # (..., vocab)
        keep = torch.zeros_like(more_probable, dtype=torch.bool).scatter_(
            -1, order, more_probable < top_p
        )
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def truncate_logits(logits: torch.Tensor, *, top_k=None, top_p=None) -> torch.Tensor:
    """``logits (..., vocab)`` with every token outside the kept set at ``-inf``, so
    that a softmax renormalises over the kept ones.

    ``top_k`` keeps the ``k`` largest logits (exactly ``k``: ties at the border are
    broken by ``topk``). ``top_p`` (nucleus) keeps every token whose strictly more
    probable tokens, under ``softmax(logits)``, hold less than ``p``: the smallest set
    of most probable tokens that reaches ``p``, widened to every token tied with its
    last member, so the result does not depend on the tokens' order in the vocabulary.
    The most probable token is always kept. With both, top-k is applied first, and
    top-p counts probability among the ``k`` kept tokens.
    """
    return _keep_top(logits, _check_top_k(top_k), _check_top_p(top_p))


def _probabilities(logits, temperature: float, top_k, top_p) -> torch.Tensor:
    """:func:`sampling_probabilities` on arguments already checked (temperature > 0)."""
    logits = logits.float() / temperature
    if top_k is not None or top_p is not None:
        logits = _keep_top(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def sampling_probabilities(
    logits: torch.Tensor, temperature: float = 1.0, *, top_k=None, top_p=None
) -> torch.Tensor:
    """The distribution that sampling draws from: ``softmax(logits / temperature)`` in
    float32 over the last axis, after :func:`truncate_logits` of the tempered logits
    when ``top_k`` or ``top_p`` is given (so ``top_p`` counts probability at that
    temperature). ``temperature`` must be > 0."""
    temperature = _check_temperature(temperature)
    if temperature == 0:
        raise ValueError(
            "sampling_probabilities needs temperature > 0 (temperature 0 is greedy: "
            "the argmax)"
        )
    return _probabilities(logits, temperature, _check_top_k(top_k), _check_top_p(top_p))


@dataclass(frozen=True)
class DecodingRule:
    """How every decoding loop turns a step's logits into tokens, checked once: the
    suppressed tokens (``suppress`` always, ``suppress_at_start`` at step 0), then
    greedy at ``temperature`` 0 or a draw from ``generator`` of
    :func:`sampling_probabilities` (tempered, truncated to ``top_k`` / ``top_p``).
    :meth:`pick` is the one step of :func:`generate`, :func:`generate_paged` and
    :func:`speculative_generate`; :func:`beam_search` shares its suppression."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    suppress: tuple[int, ...] = ()
    suppress_at_start: tuple[int, ...] = ()

    def banned(self, step: int) -> set[int]:
        """The tokens suppressed at ``step``."""
        at_start = self.suppress_at_start if step == 0 else ()
        return set(self.suppress) | set(at_start)

    def suppressed(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """``logits (..., vocab)`` with the suppressed tokens at ``-inf``, in place."""
        if self.suppress:
            logits[..., list(self.suppress)] = float("-inf")
        if step == 0 and self.suppress_at_start:
            logits[..., list(self.suppress_at_start)] = float("-inf")
        return logits

    def pick(self, logits: torch.Tensor, step: int = 0):
        """``logits (..., vocab)`` -> ``(tokens (...), probabilities (..., vocab))``:
        the argmax (probabilities ``None``) at temperature 0, else a draw from the
        distribution it returns."""
        logits = self.suppressed(logits, step)
        if self.temperature == 0:
            return logits.argmax(dim=-1), None
        probabilities = _probabilities(logits, self.temperature, self.top_k, self.top_p)
        flat = probabilities.reshape(-1, probabilities.shape[-1])  # (N, vocab)
        tokens = torch.multinomial(flat, 1, generator=self.generator)  # (N, 1)
        return tokens.reshape(probabilities.shape[:-1]), probabilities


def decoding_rule(
    temperature=0.0, generator=None, *, top_k=None, top_p=None, device=None, **tokens
) -> DecodingRule:
    """A :class:`DecodingRule` from checked arguments (``tokens``: ``suppress``,
    ``suppress_at_start``, already checked as ids); the generator must be on
    ``device``'s type."""
    temperature = _check_temperature(temperature)
    if temperature > 0 and device is not None:
        _check_generator(generator, device)
    return DecodingRule(
        temperature, _check_top_k(top_k), _check_top_p(top_p), generator,
        **{name: tuple(ids) for name, ids in tokens.items()},
    )  # fmt: skip


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    generator=None,
    *,
    top_k=None,
    top_p=None,
) -> torch.Tensor:
    """Pick the next token from ``logits (B, vocab)``: argmax at temperature 0, else
    sample from
    :func:`sampling_probabilities` (``softmax(logits / temperature)``, truncated to the
    ``top_k`` most probable tokens or the ``top_p`` nucleus if given). Returns ``(B,)``.

    ``top_k`` and ``top_p`` change nothing at temperature 0: the argmax is in every kept
    set."""
    rule = decoding_rule(
        temperature, generator, top_k=top_k, top_p=top_p, device=logits.device
    )
    return rule.pick(logits)[0]


def _check_model(model, caller: str = "generate") -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{caller} needs a torch.nn.Module with the decoding interface, got "
            f"{type(model).__name__}"
        )
    missing = [name for name in DECODING_INTERFACE if not hasattr(model, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} lacks the decoding interface "
            f"{list(DECODING_INTERFACE)}: "
            f"missing {missing} (generate works with GPT, "
            "EncoderDecoderModel, Whisper, "
            "Seq2SeqSpeechModel, or a wrapper of one)"
        )


def _check_token_list(name: str, tokens, vocab_size: int) -> list[int]:
    tokens = [int(t) for t in tokens]
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad}")
    return tokens


def _check_length(model, prompt_len: int, max_new_tokens: int, whose: str = "") -> None:
    """Raise unless ``prompt_len + max_new_tokens`` tokens fit the model: ``max_len``,
    or no limit for a model that says it streams (``max_sequence_len = None``: a
    windowed GPT whose positions need no table)."""
    limit = getattr(model, "max_sequence_len", model.max_len)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds "
            f"{whose}max_len={limit}"
        )


@dataclass(frozen=True)
class _Decoding:
    """What every decoding loop needs, checked once before it starts."""

    prompt: torch.Tensor  # (B, T0) on the model's device
    max_new_tokens: int
    rule: DecodingRule
    end_token: int | None


def _decoding(
    model,
    prompt,
    max_new_tokens,
    *,
    caller: str,
    one_sequence: bool = False,
    end_token=None,
    suppress=(),
    suppress_at_start=(),
    rule=None,
) -> _Decoding:
    """The decoding core's checks, shared by :func:`generate`, :func:`beam_search` and
    :func:`speculative_generate`: the model's interface, ``prompt`` as a ``(B, T0)``
    LongTensor on the model's device (``(T0,)`` and ``(1, T0)`` are one sequence), its
    ids range-checked once, the length, and the suppressed and end tokens (with a clear
    error when nothing is left to choose), and ``rule``: the keywords of
    :func:`decoding_rule` (temperature, generator, top-k, top-p)."""
    _check_model(model, caller)
    max_new_tokens = check_non_negative_int("max_new_tokens", max_new_tokens)
    rule = dict(rule or {})
    prompt = torch.as_tensor(prompt)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(
            "prompt must be a non-empty (B, T) or (T,) tensor of token ids, got "
            f"{tuple(prompt.shape)}"
        )
    if prompt.is_floating_point() or prompt.dtype == torch.bool:
        raise TypeError(f"prompt must hold integer token ids, got dtype {prompt.dtype}")
    if one_sequence and prompt.shape[0] != 1:
        raise ValueError(
            f"{caller} continues one sequence: prompt must be (T,) or (1, T), got "
            f"{tuple(prompt.shape)}"
        )
    _check_length(model, prompt.shape[1], max_new_tokens)
    device = next(model.parameters()).device
    prompt = prompt.to(device=device, dtype=torch.long)
    check_token_ids(prompt, model.vocab_size, name="prompt token ids")  # here, once
    vocab_size = model.vocab_size
    suppress = _check_token_list("suppress", suppress, vocab_size)
    suppress_at_start = _check_token_list(
        "suppress_at_start", suppress_at_start, vocab_size
    )
    if max_new_tokens and len(set(suppress) | set(suppress_at_start)) == vocab_size:
        when = "" if len(set(suppress)) == vocab_size else " at the first step"
        raise ValueError(
            f"every token is suppressed{when} (suppress and suppress_at_start cover "
            f"all {vocab_size}): nothing is left to choose"
        )
    if end_token is not None:
        end_token = _check_token_list("end_token", [end_token], vocab_size)[0]
    rule = decoding_rule(
        **rule, suppress=suppress, suppress_at_start=suppress_at_start, device=device
    )
    return _Decoding(prompt, max_new_tokens, rule, end_token)


def generate(
    model,
    prompt,
    max_new_tokens,
    *,
    use_cache=True,
    temperature=0.0,
    top_k=None,
    top_p=None,
    generator=None,
    end_token=None,
    suppress=(),
    suppress_at_start=(),
    **inputs,
):
    """Continue ``prompt (B, T0)`` (or ``(T0,)``) by up to ``max_new_tokens`` tokens;
    returns ``(B, T0 + new)``.

    ``inputs`` go to the model's ``decoding_context``, computed once: ``source=`` (and
    ``key_padding_mask=``) for an :class:`~attnbook.models.EncoderDecoderModel`,
    ``mel=`` for
    :class:`~attnbook.whisper.Whisper`, ``features=, lengths=`` for chapter 10's speech
    model. Greedy at ``temperature=0``; sampling otherwise, from ``generator`` (on the
    model's device) if given, restricted to the ``top_k`` most probable tokens and/or
    the ``top_p`` nucleus if given (see
    :func:`truncate_logits`; they change nothing at temperature 0).
    Tokens in ``suppress`` are never chosen, those in ``suppress_at_start`` not as the
    first new token (suppressing every token is an error). With ``end_token`` a
    sequence stops there (it is included, and a finished sequence is padded with it);
    the loop ends when every sequence has, so fewer than ``max_new_tokens`` may be
    returned.

    It runs in eval mode without gradients (not inference mode, so the tokens can feed a
    training step) and restores the model's training mode afterwards, even after an
    error. Every argument is checked once, before the loop; the ids are range-checked on
    the prompt: no step reads a tensor back to the host unless ``end_token`` is given
    (then once a step, to stop early).
    """
    run = _decoding(
        model, prompt, max_new_tokens, caller="generate", end_token=end_token,
        suppress=suppress, suppress_at_start=suppress_at_start,
        rule=dict(temperature=temperature, generator=generator, top_k=top_k,
                  top_p=top_p),
    )  # fmt: skip
    prompt, max_new_tokens, end_token = run.prompt, run.max_new_tokens, run.end_token
    decode_step = _decode_step(model)
    B, T0 = prompt.shape
    with eval_mode(model):
        # computed once (an encoder's output)
        context = model.decoding_context(B, **inputs)
        caches = model.decoding_caches(B, context) if use_cache else None
        # (B, T0 + new), filled step by step
        tokens = prompt.new_empty(B, T0 + max_new_tokens)
        tokens[:, :T0] = prompt
        finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)  # (B,)
        end = T0
        for step in range(max_new_tokens):
            # the prompt first, then the newest token (or, uncached, all so far)
            fed = tokens[:, end - 1 : end] if step and use_cache else tokens[:, :end]
            logits = decode_step(fed, context, caches)[:, -1]  # (B, vocab)
            new, _ = run.rule.pick(logits, step)  # (B,)
            if end_token is not None:
                new = new.masked_fill(finished, end_token)
                finished |= new == end_token
            tokens[:, end] = new
            end += 1
            if end_token is not None and bool(finished.all()):
                break
        return tokens[:, :end]


def generate_paged(
    model, prompts, max_new_tokens, *, block_size: int = 16, pool=None
) -> list[torch.Tensor]:
    """Greedy continuation of each of ``prompts`` (token ids ``(T0_i,)``, of any
    lengths) by ``max_new_tokens`` tokens, every sequence's keys and values paged into
    one shared :class:`~attnbook.paging.BlockPool` (vLLM's memory); returns one ``(T0_i
    + new,)`` tensor per prompt, the tokens of ``generate(model, prompt,
    max_new_tokens)``.

    Each sequence has a :class:`~attnbook.paging.PagedKVCache` (its block table) and
    allocates blocks of ``block_size`` tokens as it grows; ``pool`` defaults to just
    the blocks they all need, ``ceil((T0_i + new) / block_size)`` each. Each step runs
    the sequences in turn, one forward each (prompt first, then one token at a time),
    attention reading the sequence's blocks gathered into contiguous keys: the pool is
    shared, the compute is not batched (vLLM's kernels batch it, reading each row's
    block table inside attention). At the end, or on an error, every sequence frees its
    blocks. For decoder-only models (``make_caches(batch_size)`` giving one KV cache
    per layer, as the GPT's)."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError("generate_paged needs at least one prompt")
    runs = [
        _decoding(
            model, prompt, max_new_tokens, caller="generate_paged", one_sequence=True
        )
        for prompt in prompts
    ]
    max_new_tokens = runs[0].max_new_tokens
    if pool is None:
        lengths = [run.prompt.shape[1] + max_new_tokens for run in runs]
        pool = _pool_for(model, lengths, block_size)
    decode_step = _decode_step(model)
    sequences = [PagedKVCache(pool) for _ in runs]
    tokens = [run.prompt for run in runs]  # (1, T0_i + step) each
    try:
        with eval_mode(model):
            for step in range(max_new_tokens):
                for i, (run, sequence) in enumerate(zip(runs, sequences, strict=True)):
                    fed = tokens[i][:, sequence.length :]  # the prompt, then the newest
                    logits = decode_step(fed, None, sequence.layers)[:, -1]  # (1, V)
                    new, _ = run.rule.pick(logits, step)  # (1,)
                    tokens[i] = torch.cat([tokens[i], new[:, None]], dim=1)
    finally:  # the caller's pool gets its blocks back, even after an error
        for sequence in sequences:
            sequence.free()
    return [sequence_tokens[0] for sequence_tokens in tokens]


def _pool_for(model, lengths: list[int], block_size: int) -> BlockPool:
    """Just the blocks of ``block_size`` tokens that sequences of ``lengths`` need in
    ``model``'s layers, sized from the model's own caches."""
    block_size = check_positive_int("block_size", block_size)
    try:  # a GPT's caches, read for their sizes
        caches = model.make_caches(1)
    except (AttributeError, TypeError):  # none, or an encoder-decoder's
        caches = None
    if not isinstance(caches, list) or not all(
        isinstance(cache, (KVCache, RollingKVCache)) for cache in caches
    ):
        raise TypeError(
            "generate_paged needs a decoder-only model whose make_caches(batch_size) "
            f"gives one KV cache per layer, got {type(model).__name__}"
        )
    _, num_kv_heads, _, head_dim = caches[0].keys.shape
    blocks = sum(-(-length // block_size) for length in lengths)
    sizes = dict(device=caches[0].keys.device, dtype=caches[0].keys.dtype)
    return BlockPool(blocks, block_size, len(caches), num_kv_heads, head_dim, **sizes)


def _decode_step(model):
    """``model.decode_step``, run so that a compiled model's code runs: on the module
    that ``torch.compile`` returns, ``decode_step`` resolves to the original module's
    method, whose ``self(...)`` would call the uncompiled forward; called with the
    compiled module as ``self``, it calls the compiled one."""
    original = getattr(model, "_orig_mod", None)
    if isinstance(original, torch.nn.Module) and hasattr(type(original), "decode_step"):
        return functools.partial(type(original).decode_step, model)
    return model.decode_step


def _kv_caches(caches):
    """The caches (:mod:`attnbook.caches`) in a model's (nested) list of caches."""
    if isinstance(caches, (list, tuple)):
        return [cache for item in caches for cache in _kv_caches(item)]
    return [caches]


def _widen(context, beam_size: int):
    """A batch-1 decoding context (a tensor, a tuple of tensors and None, or None) as
    ``beam_size`` rows: views, not copies."""
    if isinstance(context, torch.Tensor):
        return context.expand(beam_size, *context.shape[1:])
    if isinstance(context, (tuple, list)):
        return type(context)(_widen(item, beam_size) for item in context)
    return context


def ngram_blocked(tokens, n: int) -> list[int]:
    """The tokens that would complete an ``n``-gram already in ``tokens`` (a list of
    ints) if appended: every ``tokens[i + n - 1]`` whose ``n - 1`` predecessors equal
    the last ``n - 1`` tokens. ``n = 1``: every token seen."""
    n = check_positive_int("n", n)
    tokens = list(tokens)
    if len(tokens) < n - 1:
        return []
    tail = tokens[len(tokens) - n + 1 :] if n > 1 else []
    return sorted(
        {
            tokens[i + n - 1]
            for i in range(len(tokens) - n + 1)
            if tokens[i : i + n - 1] == tail
        }
    )


class _Beams:
    """Beam search's bookkeeping: the live prefixes and their total log-probabilities,
    the finished hypotheses, and the rule that ranks them (``log_prob / n **
    length_penalty``)."""

    def __init__(self, beam_size, length_penalty, max_new_tokens, end_token, device):
        self.beam_size, self.length_penalty = beam_size, length_penalty
        self.max_new_tokens, self.end_token = max_new_tokens, end_token
        self.scores = torch.full((beam_size,), float("-inf"), device=device)
        self.scores[0] = 0.0  # the beams start identical: only the first is live
        self.prefixes = [[] for _ in range(beam_size)]  # each live beam's new tokens
        self.finished = []  # (rank, score, new tokens) of finished hypotheses

    def rank(self, score: float, length: int) -> float:
        return score / length**self.length_penalty

    def extend(self, log_probs: torch.Tensor, step: int):
        """Keep the ``beam_size`` best extensions of the live prefixes by total
        log-probability, ``log_probs (beam, V)`` this step's; those that end finish,
        taking their slot. Returns ``(rows, tokens)``: the row each surviving beam
        extends and its token, ``(beam,)`` each; ``None`` when the search is over."""
        vocab_size = log_probs.shape[-1]
        candidates = (self.scores[:, None] + log_probs).flatten()  # (beam * V,)
        top = candidates.topk(min(self.beam_size, candidates.numel()))
        rows, tokens, scores = [], [], []
        for score, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if score == float("-inf"):
                break
            row, token = divmod(index, vocab_size)
            if token == self.end_token:
                hypothesis = self.prefixes[row] + [token]
                self.finished.append((self.rank(score, step + 1), score, hypothesis))
            else:
                rows, tokens, scores = rows + [row], tokens + [token], scores + [score]
        if not rows:
            return None
        extended = zip(rows, tokens, strict=True)
        self.prefixes = [self.prefixes[row] + [token] for row, token in extended]
        if step == self.max_new_tokens - 1:  # out of tokens: the live ones compete too
            self.finished += [
                (self.rank(score, step + 1), score, prefix)
                for score, prefix in zip(scores, self.prefixes, strict=True)
            ]
            return None
        best_finished = max((item[0] for item in self.finished), default=float("-inf"))
        if best_finished >= self.rank(scores[0], self.max_new_tokens):
            return None  # no live prefix can overtake the best finished hypothesis
        dead = self.beam_size - len(rows)  # fewer candidates than beams (tiny vocab)
        rows, tokens = rows + [rows[0]] * dead, tokens + [tokens[0]] * dead
        self.prefixes += [self.prefixes[0]] * dead
        device = self.scores.device
        self.scores = torch.tensor(scores + [float("-inf")] * dead, device=device)
        return torch.tensor(rows, device=device), torch.tensor(tokens, device=device)

    def best(self):
        """``(score, new tokens)`` of the best-ranked finished hypothesis."""
        _, score, tokens = max(self.finished, key=lambda item: item[0])
        return score, tokens


def _ban_ngrams(logits, prefixes, prompt_tokens, n: int, rule, step: int) -> None:
    """Set to ``-inf``, in place, each beam's tokens that would repeat an ``n``-gram of
    its sequence (:func:`ngram_blocked`), unless that would ban every token together
    with the suppressed ones (then the n-gram rule yields)."""
    vocab_size = logits.shape[-1]
    for row, prefix in enumerate(prefixes):
        banned = ngram_blocked(prompt_tokens + prefix, n)
        if len(rule.banned(step).union(banned)) < vocab_size:
            logits[row, banned] = float("-inf")


def beam_search(
    model,
    prompt,
    max_new_tokens: int,
    *,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    end_token=None,
    suppress=(),
    suppress_at_start=(),
    no_repeat_ngram: int = 0,
    **inputs,
) -> tuple[torch.Tensor, float]:
    """Beam search over a model with the decoding interface: ``(tokens (1, T0 + new),
    log_prob)``.

    ``tokens`` is the best hypothesis with the prompt in front, as :func:`generate`
    returns it (with ``end_token`` last if it finished), and ``log_prob`` the total
    log-probability of its new tokens under the model (the sum of each step's
    log-softmax, after ``suppress`` tokens, and ``suppress_at_start`` at the first step,
    are set to ``-inf``, as greedy decoding does).

    Each step keeps the ``beam_size`` best extensions of the live prefixes by total
    log-probability; an extension that picks ``end_token`` (if given) is finished and
    takes its slot for that step, so ``beam_size=1`` is greedy decoding, end token and
    length penalty included. Hypotheses are
    ranked by ``log_prob / n ** length_penalty`` with ``n`` new tokens:
    ``length_penalty=0`` ranks by the total, which favours short hypotheses since every
    token adds a log-probability <= 0; ``1`` by the mean per token. A live prefix's rank
    can rise no higher than its total divided by the longest length it could reach, so
    the search stops once the best finished hypothesis ranks above that bound for every
    live prefix (or after ``max_new_tokens``: then the live prefixes compete too).
    A wider beam usually finds a likelier hypothesis
    than greedy decoding, but not always: it prunes, and the greedy prefix can fall out
    of the beam.

    The context (an encoder's output) is computed once and the prompt decoded once with
    batch 1; then each layer's KV caches are widened to ``beam_size`` rows (a static
    cross-attention cache as a view: the source is the same for every beam), and after
    each step the self-attention caches' rows are reordered by the surviving beams'
    indices, so each beam keeps the keys and values of its own prefix. ``inputs`` go to
    the model's ``decoding_context`` (``mel=`` for Whisper).

    ``no_repeat_ngram=n > 0`` blocks n-gram repeats: a beam may not pick a token that
    would complete an n-gram already in its sequence, prompt included (as
    ``transformers``' ``no_repeat_ngram_size``).
    """
    run = _decoding(
        model, prompt, max_new_tokens, caller="beam_search", one_sequence=True,
        end_token=end_token, suppress=suppress, suppress_at_start=suppress_at_start,
    )  # fmt: skip
    beam_size = check_positive_int("beam_size", beam_size)
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(length_penalty, (int, float)) or not 0 <= length_penalty <= 10:
        raise ValueError(
            f"length_penalty must be a number in [0, 10], got {length_penalty!r}"
        )
    no_repeat_ngram = check_non_negative_int("no_repeat_ngram", no_repeat_ngram)
    decode_step, prompt_tokens = _decode_step(model), run.prompt[0].tolist()
    beams = _Beams(
        beam_size, length_penalty, max_new_tokens, run.end_token, run.prompt.device
    )
    with eval_mode(model):
        context = model.decoding_context(1, **inputs)  # (1, S, d): the encoder, once
        caches = model.decoding_caches(1, context)
        logits = decode_step(run.prompt, context, caches)[:, -1]  # (1, V)
        for cache in _kv_caches(caches):  # one row per beam
            cache.repeat(beam_size)
        context = _widen(context, beam_size)  # (beam, S, d), or a tuple, or None
        logits = logits.expand(beam_size, -1)  # (beam, V)
        for step in range(max_new_tokens):
            logits = run.rule.suppressed(logits.float().clone(), step)  # (beam, V)
            if no_repeat_ngram:
                _ban_ngrams(
                    logits, beams.prefixes, prompt_tokens, no_repeat_ngram, run.rule,
                    step,
                )  # fmt: skip
            chosen = beams.extend(torch.log_softmax(logits, dim=-1), step)
            if chosen is None:
                break
            rows, tokens = chosen  # (beam,) each
            for cache in _kv_caches(caches):  # each beam takes over its prefix's
                cache.reorder(rows)
            logits = decode_step(tokens[:, None], context, caches)[:, -1]  # (beam, V)
    score, best = beams.best()
    # (1, T0 + new)
    tokens = torch.cat([run.prompt[0], run.prompt.new_tensor(best)])[None]
    return tokens, float(score)


@dataclass
class SpeculativeStats:
    """What one :func:`speculative_generate` call did: ``new_tokens`` written,
    ``target_calls`` and ``draft_calls`` (forward passes of each model, the prompt's
    included), ``drafted`` (tokens the draft proposed), ``accepted`` (of them, the ones
    the target kept) and ``rejected`` (the ones it turned down: at most one a round,
    since the drafts after a rejected one are never judged)."""

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0

    def count_round(self, drafted: int, accepted: int) -> None:
        """Count one round: ``drafted`` tokens proposed (a draft call each), one target
        call, ``accepted`` of the drafts kept (the first of the others, if any,
        rejected)."""
        self.target_calls += 1
        self.draft_calls += drafted
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted

    @property
    def acceptance_rate(self) -> float:
        """The fraction of drafted tokens accepted (NaN if none was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def per_token_acceptance(self) -> float:
        """The fraction of judged draft tokens accepted, ``accepted / (accepted +
        rejected)``: an estimate of the probability that the target accepts a draft
        token (NaN if none was judged)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def target_calls_per_token(self) -> float:
        """Target forward passes per new token: 1 for ordinary decoding, down to ``1 /
        (num_draft + 1)``."""
        return self.target_calls / self.new_tokens if self.new_tokens else float("nan")


def _leading_true(flags: torch.Tensor) -> int:
    """How many of the 1-D booleans ``flags`` are True before the first False."""
    return int(flags.long().cumprod(dim=0).sum())


def accept_drafts(drafted, p, q=None, uniform=None) -> tuple[int, torch.Tensor]:
    """Speculative decoding's acceptance rule, a pure function: which of the
    ``drafted (k,)`` tokens the target keeps, and what it writes next.

    Greedy (``q`` is ``None``): ``p (k + 1, V)`` are the target's logits at the
    drafts' positions and the one after; a draft is kept while it is the target's
    argmax. Sampling: ``p (k + 1, V)`` and ``q (k, V)`` are the target's and the
    draft's probabilities, ``uniform (k,)`` draws in ``[0, 1)``; draft ``x`` is kept
    while ``uniform * q(x) < p(x)`` (probability ``min(1, p(x) / q(x))``, Leviathan et
    al. 2023). Returns ``(accepted, weights (V,))``: the drafts kept, and the
    distribution of the next token (unnormalised): after a rejection ``max(0, p -
    q)`` at that position (``p`` where that is all zero), after ``k`` acceptances ``p``
    at the last position; greedy, the target's argmax there, one-hot."""
    k = drafted.shape[0]
    if q is None:
        choice = p.argmax(dim=-1)  # (k + 1,) the target's greedy token at each
        accepted = _leading_true(choice[:k] == drafted)
        return accepted, F.one_hot(choice[accepted], p.shape[-1]).float()
    p_drafted = p[:k].gather(1, drafted[:, None])[:, 0]  # (k,) p(x) of each drafted x
    q_drafted = q.gather(1, drafted[:, None])[:, 0]  # (k,) q(x) > 0: x was drawn from q
    accepted = _leading_true(uniform * q_drafted < p_drafted)
    if accepted == k:  # a bonus token from the target after the last draft
        return k, p[k]
    residual = (p[accepted] - q[accepted]).clamp_min(0)  # (V,)
    return accepted, torch.where(residual.sum() > 0, residual, p[accepted])


def speculative_generate(
    target,
    draft,
    prompt,
    max_new_tokens,
    *,
    num_draft: int = 4,
    temperature: float = 0.0,
    generator=None,
) -> tuple[torch.Tensor, SpeculativeStats]:
    """Continue one ``prompt`` (``(T0,)`` or ``(1, T0)``) by ``max_new_tokens`` tokens
    of ``target``, with a cheaper ``draft`` model guessing ahead; returns ``(tokens (1,
    T0 + new), stats)``.

    Each round the draft proposes ``num_draft`` tokens, one cheap call each; the target
    scores all of them in **one** call (its logits at the ``num_draft + 1`` positions)
    and keeps the longest prefix it agrees with, then adds one token of its own, so a
    round writes 1 to ``num_draft + 1`` tokens for one target call:

    - Greedy (``temperature=0``): a drafted token is accepted if it is the target's
      argmax; the first one that is not is replaced by the target's argmax. The tokens
      are those of ``generate(target, prompt, max_new_tokens)``.
    - Sampling: drafted token ``x``, drawn from the draft's ``q = softmax(z_draft /
      temperature)``, is accepted with probability ``min(1, p(x) / q(x))`` under the
      target's ``p``; the first rejected one is replaced by a draw from ``max(0, p -
      q)`` renormalised; after ``num_draft`` acceptances a bonus token is drawn from
      ``p``. Every token is then distributed exactly as if drawn from the target
      (Leviathan et al. 2023; Chen et al. 2023), whatever the draft.

    Both models keep KV caches. Both caches hold every final token but the last;
    rejected draft tokens are rolled back out of them with
    :meth:`~attnbook.caches.KVCache.truncate`. The last round drafts fewer tokens so
    that exactly ``max_new_tokens`` are written. Both models run in eval mode without
    gradients; their training modes are restored afterwards.
    """
    run = _decoding(
        target, prompt, max_new_tokens, caller="speculative_generate",
        one_sequence=True, rule=dict(temperature=temperature, generator=generator),
    )  # fmt: skip
    num_draft = _check_draft(target, draft, num_draft, run)
    prompt, max_new_tokens, rule = run.prompt, run.max_new_tokens, run.rule
    T0 = prompt.shape[1]
    stats = SpeculativeStats(new_tokens=max_new_tokens)
    target_step, draft_step = _decode_step(target), _decode_step(draft)
    with eval_mode(target), eval_mode(draft):
        contexts = [model.decoding_context(1) for model in (target, draft)]
        target_caches, draft_caches = (
            _truncatable_caches(model.decoding_caches(1, context))
            for model, context in zip((target, draft), contexts, strict=True)
        )
        # (1, T0 + new): final tokens, then this round's drafts
        tokens = prompt.new_empty(1, T0 + max_new_tokens)
        tokens[:, :T0] = prompt
        end = T0  # tokens[:, :end] are final
        while end < T0 + max_new_tokens:
            k = min(num_draft, T0 + max_new_tokens - end - 1)  # a round writes <= k + 1
            # 1. the draft proposes k tokens, tokens[end : end + k], one call each
            q = []  # greedy: nothing; sampling: the draft's q at each, (vocab,)
            for i in range(k):
                fed = tokens[:, draft_caches[0].length : end + i]  # what it lacks
                logits = draft_step(fed, contexts[1], draft_caches)[0, -1]  # (vocab,)
                tokens[0, end + i], probabilities = rule.pick(logits)
                q += [] if probabilities is None else [probabilities]
            # 2. the target scores them in one call: positions end - 1 .. end + k - 1
            fed = tokens[:, target_caches[0].length : end + k]
            logits = target_step(fed, contexts[0], target_caches)[0, -(k + 1) :]
            # 3. keep the agreed prefix, then one token of the target's own
            drafted = tokens[0, end : end + k]  # (k,)
            if rule.temperature == 0:
                accepted, weights = accept_drafts(drafted, logits)
                new = weights.argmax()
            else:
                p = _probabilities(logits, rule.temperature, None, None)  # (k + 1, V)
                uniform = torch.rand(k, generator=generator, device=prompt.device)
                q = torch.stack(q) if k else p[:0]  # (k, V)
                accepted, weights = accept_drafts(drafted, p, q, uniform)
                new = torch.multinomial(weights, 1, generator=generator)[0]
            tokens[0, end + accepted] = new
            stats.count_round(k, accepted)
            end += accepted + 1
            # 4. roll the rejected drafts out of both caches: they hold every final
            #    token but the last
            for cache in target_caches:
                cache.truncate(end - 1)
            for cache in draft_caches:
                cache.truncate(min(cache.length, end - 1))
        return tokens, stats


class _TokenHistory:
    """A :class:`PromptLookupDraft`'s cache: the ``length`` tokens it has been fed, in
    ``tokens (max_len,)``, rolled back by :meth:`truncate` as a KV cache is."""

    static, can_truncate = False, True

    def __init__(self, max_len: int, device):
        self.tokens = torch.zeros(max_len, dtype=torch.long, device=device)
        self.length = 0

    def append(self, tokens: torch.Tensor) -> torch.Tensor:
        """Store ``tokens (t,)``; return every token so far, ``(length,)``."""
        end = self.length + tokens.numel()
        if end > self.tokens.numel():
            raise ValueError(
                f"the history holds {self.tokens.numel()} tokens; {end} do not fit"
            )
        self.tokens[self.length : end] = tokens
        self.length = end
        return self.tokens[:end]

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: it holds {self.length}")
        self.length = length


def lookup_next(history: torch.Tensor, ngram: int = 3) -> int:
    """Prompt lookup's guess at the token after ``history (T,)``: find the latest
    earlier place where its last ``ngram`` tokens occurred and return the token that
    followed there; with no such place, try the last ``ngram - 1`` tokens, and so on
    down to one; with no match at all, the last token again."""
    for n in range(min(ngram, len(history) - 1), 0, -1):
        # (T - n, n): every earlier window of n tokens, each followed by a token
        windows = history[:-1].unfold(0, n, 1)
        found = (windows == history[-n:]).all(1).nonzero()
        if len(found):
            return int(history[int(found[-1]) + n])
    return int(history[-1])


class PromptLookupDraft(torch.nn.Module):
    """A draft for :func:`speculative_generate` that is no model: prompt lookup
    decoding. Its guess at each next token is :func:`lookup_next` over every token so
    far, prompt and text written, so it guesses right where the text repeats itself
    (quoting the prompt, or a loop) and costs no model call.

    It has the decoding interface of one sequence: ``vocab_size`` and ``max_len`` are
    the target's; ``decode_step`` returns ``(1, 1, vocab_size)`` logits for the last
    position only, 0 on the guess and ``-inf`` elsewhere, so that greedy decoding and
    sampling at any temperature both propose the guess (with probability 1).
    """

    def __init__(self, vocab_size: int, max_len: int, ngram: int = 3):
        super().__init__()
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.max_len = check_positive_int("max_len", max_len)
        self.ngram = check_positive_int("ngram", ngram)
        # empty: where the draft lives (what .to(device) moves); it has no weights
        self.register_buffer("anchor", torch.zeros(0), persistent=False)

    def decoding_context(self, batch_size: int, **inputs):
        if batch_size != 1 or inputs:
            raise ValueError("a PromptLookupDraft drafts for one sequence, no inputs")
        return None

    def decoding_caches(self, batch_size: int, context) -> list[_TokenHistory]:
        return [_TokenHistory(self.max_len, self.anchor.device)]

    def decode_step(self, tokens: torch.Tensor, context, caches) -> torch.Tensor:
        """Append ``tokens (1, t)`` to the history; logits ``(1, 1, vocab_size)``."""
        history = caches[0].append(tokens[0])
        logits = torch.full((1, 1, self.vocab_size), float("-inf"))
        logits[0, 0, lookup_next(history, self.ngram)] = 0.0
        return logits.to(self.anchor.device)

    def extra_repr(self) -> str:
        sizes = f"vocab_size={self.vocab_size}, max_len={self.max_len}"
        return f"{sizes}, ngram={self.ngram}"


def _check_draft(target, draft, num_draft, run: _Decoding) -> int:
    """The draft's checks: the decoding interface, the target's vocabulary and device,
    room for the tokens; ``num_draft`` a positive int (returned)."""
    _check_model(draft, "speculative_generate")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            "target and draft must share one vocabulary: "
            f"target.vocab_size={target.vocab_size}, "
            f"draft.vocab_size={draft.vocab_size}"
        )
    num_draft = check_positive_int("num_draft", num_draft)
    # the device of its first parameter or buffer (a PromptLookupDraft has no weights)
    draft_device = next(itertools.chain(draft.parameters(), draft.buffers())).device
    if draft_device != run.prompt.device:
        raise ValueError(
            f"target and draft must be on one device, got {run.prompt.device} and "
            f"{draft_device}"
        )
    _check_length(draft, run.prompt.shape[1], run.max_new_tokens, "the draft's ")
    return num_draft


def _truncatable_caches(caches) -> list:
    """A model's self-attention caches (not the static ones), each able to roll back
    rejected drafts (:meth:`~attnbook.caches.Cache.truncate`); one that cannot raises,
    naming it."""
    caches = [cache for cache in _kv_caches(caches) if not cache.static]
    stuck = [cache for cache in caches if not cache.can_truncate]
    if stuck:
        raise ValueError(
            "speculative_generate rolls rejected draft tokens back out of the KV "
            f"caches, which a {type(stuck[0]).__name__} cannot do: use models "
            "whose caches can truncate (KVCache, LatentKVCache)"
        )
    return caches


__all__ = [
    "DecodingRule",
    "PromptLookupDraft",
    "SpeculativeStats",
    "accept_drafts",
    "beam_search",
    "decoding_rule",
    "generate",
    "generate_paged",
    "lookup_next",
    "next_token",
    "ngram_blocked",
    "sampling_probabilities",
    "speculative_generate",
    "truncate_logits",
]
