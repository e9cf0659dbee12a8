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
shared vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def truncate_logits(logits: torch.Tensor, *, top_k=None, top_p=None) -> torch.Tensor:
    """``logits (..., vocab)`` with every token outside the kept set at ``-inf``, so
    that a softmax renormalises over the kept ones.

    ``top_k`` keeps the ``k`` largest logits (exactly ``k``: ties at the border are
    broken by ``topk``). ``top_p`` (nucleus) keeps the smallest set of most probable
    tokens whose probability under ``softmax(logits)`` reaches ``p``: a token is kept if
    the tokens more probable than it hold less than ``p``, so the most probable token is
    always kept. With both, top-k is applied first.
    """
    top_k, top_p = _check_top_k(top_k), _check_top_p(top_p)
    if top_k is not None and top_k < logits.shape[-1]:
        top = logits.topk(top_k, dim=-1).indices  # (..., k)
        # (..., vocab)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_probabilities, order = torch.softmax(logits.float(), dim=-1).sort(
            dim=-1, descending=True
        )
        # (..., vocab), most probable first
        cumulative = sorted_probabilities.cumsum(dim=-1)
        before = torch.cat(
            [torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1
        )
        keep = torch.zeros_like(before, dtype=torch.bool).scatter_(
            -1, order, before < top_p
        )
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


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
    logits = logits.float() / temperature
    if top_k is not None or top_p is not None:
        logits = truncate_logits(logits, top_k=top_k, top_p=top_p)
    return torch.softmax(logits, dim=-1)


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
    temperature = _check_temperature(temperature)
    top_k, top_p = _check_top_k(top_k), _check_top_p(top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    _check_generator(generator, logits.device)
    probabilities = sampling_probabilities(
        logits, temperature, top_k=top_k, top_p=top_p
    )
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


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


def _prepare_prompt(prompt, max_new_tokens: int, model, device) -> torch.Tensor:
    """``prompt`` as a ``(B, T0)`` LongTensor on ``device``, its ids range-checked once,
    or a clear error."""
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
    if prompt.shape[1] + max_new_tokens > model.max_len:
        raise ValueError(
            f"prompt of {prompt.shape[1]} tokens + max_new_tokens={max_new_tokens} "
            f"exceeds max_len={model.max_len}"
        )
    prompt = prompt.to(device=device, dtype=torch.long)
    # here, once: with max_new_tokens=0 no model runs
    check_token_ids(prompt, model.vocab_size)
    return prompt


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
    ``source_padding_mask=``) for an :class:`~attnbook.models.EncoderDecoderModel`,
    ``mel=`` for
    :class:`~attnbook.whisper.Whisper`, ``features=, lengths=`` for chapter 10's speech
    model. Greedy at ``temperature=0``; sampling otherwise, from ``generator`` (on the
    model's device) if given, restricted to the ``top_k`` most probable tokens and/or
    the ``top_p`` nucleus if given (see
    :func:`truncate_logits`; they change nothing at temperature 0).
    Tokens in ``suppress`` are never chosen, those in ``suppress_at_start`` not as the
    first new token. With ``end_token`` a sequence stops there (it is included, and a
    finished sequence is padded with it); the loop ends when every sequence has, so
    fewer than ``max_new_tokens`` may be returned.

    It runs in eval mode without gradients (not inference mode, so the tokens can feed a
    training step) and restores the model's training mode afterwards, even after an
    error. The ids are range-checked once, on the prompt: no step reads a tensor back to
    the host unless ``end_token`` is given (then once a step, to stop early).
    """
    _check_model(model)
    max_new_tokens = check_non_negative_int("max_new_tokens", max_new_tokens)
    temperature = _check_temperature(temperature)
    top_k, top_p = _check_top_k(top_k), _check_top_p(top_p)
    device = next(model.parameters()).device
    if temperature > 0:
        _check_generator(generator, device)
    prompt = _prepare_prompt(prompt, max_new_tokens, model, device)
    suppress = _check_token_list("suppress", suppress, model.vocab_size)
    suppress_at_start = _check_token_list(
        "suppress_at_start", suppress_at_start, model.vocab_size
    )
    if end_token is not None:
        end_token = _check_token_list("end_token", [end_token], model.vocab_size)[0]
    B, T0 = prompt.shape

    with eval_mode(model):
        # computed once (an encoder's output)
        context = model.decoding_context(B, **inputs)
        caches = model.decoding_caches(B, context) if use_cache else None
        # (B, T0 + new), filled step by step
        tokens = prompt.new_empty(B, T0 + max_new_tokens)
        tokens[:, :T0] = prompt
        finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        end = T0
        if max_new_tokens:
            # (B, vocab): the prompt, once
            logits = model.decode_step(prompt, context, caches)[:, -1]
            for step in range(max_new_tokens):
                if suppress:
                    logits[:, suppress] = float("-inf")
                if step == 0 and suppress_at_start:
                    logits[:, suppress_at_start] = float("-inf")
                # (B,)
                new = next_token(
                    logits, temperature, generator, top_k=top_k, top_p=top_p
                )
                end = T0 + step + 1
                if end_token is not None:
                    new = new.masked_fill(finished, end_token)
                    finished |= new == end_token
                tokens[:, end - 1] = new
                if end == T0 + max_new_tokens or (
                    end_token is not None and bool(finished.all())
                ):
                    break
                logits = model.decode_step(
                    tokens[:, end - 1 : end] if use_cache else tokens[:, :end],
                    context,
                    caches,
                )[:, -1]  # (B, vocab)
        return tokens[:, :end]


def _kv_caches(caches):
    """The :class:`~attnbook.multihead.KVCache` objects in a model's (nested) list of
    caches."""
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
    **inputs,
) -> tuple[list[int], float]:
    """Beam search over a model with the decoding interface: ``(tokens, log_prob)``.

    ``tokens`` is the best hypothesis with the prompt in front, as :func:`generate`
    returns it (with ``end_token`` last if it finished), and ``log_prob`` the total
    log-probability of its new tokens under the model (the sum of each step's
    log-softmax, after ``suppress`` tokens, and ``suppress_at_start`` at the first step,
    are set to ``-inf``, as greedy decoding does).

    The ``beam_size`` live prefixes of highest total log-probability are extended each
    step; a prefix that picks ``end_token`` (if given) is finished. Hypotheses are
    ranked by ``log_prob / n ** length_penalty`` with ``n`` new tokens:
    ``length_penalty=0`` ranks by the total, which favours short hypotheses since every
    token adds a log-probability <= 0; ``1`` by the mean per token. A live prefix's rank
    can rise no higher than its total divided by the longest length it could reach, so
    the search stops once the best finished hypothesis ranks above that bound for every
    live prefix (or after ``max_new_tokens``: then the live prefixes compete too).
    ``beam_size=1`` is greedy decoding. A wider beam usually finds a likelier hypothesis
    than greedy decoding, but not always: it prunes, and the greedy prefix can fall out
    of the beam.

    The context (an encoder's output) is computed once and the prompt decoded once with
    batch 1; then each layer's KV caches are widened to ``beam_size`` rows (a static
    cross-attention cache as a view: the source is the same for every beam), and after
    each step the self-attention caches' rows are reordered by the surviving beams'
    indices, so each beam keeps the keys and values of its own prefix. ``inputs`` go to
    the model's ``decoding_context`` (``mel=`` for Whisper).
    """
    _check_model(model)
    beam_size = check_positive_int("beam_size", beam_size)
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(length_penalty, (int, float)) or not 0 <= length_penalty <= 10:
        raise ValueError(
            f"length_penalty must be a number in [0, 10], got {length_penalty!r}"
        )
    prompt = [
        int(t)
        for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)
    ]
    if not prompt or len(prompt) + max_new_tokens > model.max_len:
        raise ValueError(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} must be "
            f"non-empty and fit max_len={model.max_len}"
        )
    vocab_size = model.vocab_size
    prompt = _check_token_list("prompt", prompt, vocab_size)
    suppress = _check_token_list("suppress", suppress, vocab_size)
    suppress_at_start = _check_token_list(
        "suppress_at_start", suppress_at_start, vocab_size
    )
    if end_token is not None:
        end_token = _check_token_list("end_token", [end_token], vocab_size)[0]
    if len(set(suppress) | set(suppress_at_start)) == vocab_size:
        raise ValueError(
            "beam search found no hypothesis: every token is suppressed at the first "
            "step"
        )

    def rank(score: float, length: int) -> float:
        return score / length**length_penalty

    device = next(model.parameters()).device
    with eval_mode(model):
        context = model.decoding_context(1, **inputs)  # (1, S, d): the encoder, once
        caches = model.decoding_caches(1, context)
        # (1, V)
        logits = model.decode_step(
            torch.tensor([prompt], device=device), context, caches
        )[:, -1]
        for cache in _kv_caches(caches):  # widen every cache to beam_size rows
            if cache.static:
                # (beam, h, S, d/h): one copy, shared
                cache.keys = cache.keys.expand(beam_size, -1, -1, -1)
                cache.values = cache.values.expand(beam_size, -1, -1, -1)
            else:
                # (beam, h, max_len, d/h): one per beam
                cache.keys = cache.keys.repeat(beam_size, 1, 1, 1)
                cache.values = cache.values.repeat(beam_size, 1, 1, 1)
        # (beam, S, d), or a tuple of such, or None
        context = _widen(context, beam_size)
        logits = logits.expand(beam_size, -1)  # (beam, V)
        scores = torch.full((beam_size,), float("-inf"), device=device)  # (beam,)
        scores[0] = 0.0  # the beams start identical: only the first is live
        prefixes = [[] for _ in range(beam_size)]
        finished = []  # (rank, score, new tokens with end_token) of finished hypotheses
        for step in range(max_new_tokens):
            logits = logits.float().clone()  # (beam, V)
            if suppress:
                logits[:, suppress] = float("-inf")
            if step == 0 and suppress_at_start:
                logits[:, suppress_at_start] = float("-inf")
            # (beam * V,)
            candidates = (scores[:, None] + torch.log_softmax(logits, dim=-1)).flatten()
            top_scores, top_indices = candidates.topk(
                min(2 * beam_size, candidates.numel())
            )
            rows, tokens, new_scores = [], [], []
            for score, index in zip(
                top_scores.tolist(), top_indices.tolist(), strict=True
            ):
                if score == float("-inf") or len(rows) == beam_size:
                    break
                row, token = divmod(index, vocab_size)
                if token == end_token:
                    finished.append(
                        (rank(score, step + 1), score, prefixes[row] + [token])
                    )
                else:
                    rows.append(row)
                    tokens.append(token)
                    new_scores.append(score)
            if not rows:
                break
            prefixes = [
                prefixes[row] + [token] for row, token in zip(rows, tokens, strict=True)
            ]
            best_finished = max((item[0] for item in finished), default=float("-inf"))
            # out of tokens: the live prefixes compete as they are
            if step == max_new_tokens - 1:
                finished += [
                    (rank(score, step + 1), score, prefix)
                    for score, prefix in zip(new_scores, prefixes, strict=True)
                ]
                break
            if best_finished >= rank(new_scores[0], max_new_tokens):
                break  # no live prefix can overtake the best finished hypothesis
            # fewer candidates than beams (a tiny vocabulary): dead rows
            while len(rows) < beam_size:
                rows.append(rows[0])
                tokens.append(tokens[0])
                new_scores.append(float("-inf"))
                prefixes.append(prefixes[0])
            scores = torch.tensor(new_scores, device=device)  # (beam,)
            # (beam,) the row each surviving beam extends
            order = torch.tensor(rows, device=device)
            for cache in _kv_caches(caches):
                # each beam takes over the keys and values of the prefix it extends
                if not cache.static:
                    cache.keys[:, :, : cache.length] = cache.keys[
                        order, :, : cache.length
                    ]
                    cache.values[:, :, : cache.length] = cache.values[
                        order, :, : cache.length
                    ]
            step_tokens = torch.tensor(tokens, device=device)[:, None]  # (beam, 1)
            logits = model.decode_step(step_tokens, context, caches)[:, -1]  # (beam, V)
    _, best_score, best = max(finished, key=lambda item: item[0])
    return prompt + best, float(best_score)


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
    :meth:`~attnbook.multihead.KVCache.truncate`. The last round drafts fewer tokens so
    that exactly ``max_new_tokens`` are written. Both models run in eval mode without
    gradients; their training modes are restored afterwards.
    """
    _check_model(target, "speculative_generate")
    _check_model(draft, "speculative_generate")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            "target and draft must share one vocabulary: "
            f"target.vocab_size={target.vocab_size}, "
            f"draft.vocab_size={draft.vocab_size}"
        )
    max_new_tokens = check_non_negative_int("max_new_tokens", max_new_tokens)
    num_draft = check_positive_int("num_draft", num_draft)
    temperature = _check_temperature(temperature)
    device = next(target.parameters()).device
    draft_device = next(draft.parameters()).device
    if draft_device != device:
        raise ValueError(
            f"target and draft must be on one device, got {device} and {draft_device}"
        )
    if temperature > 0:
        _check_generator(generator, device)
    prompt = _prepare_prompt(prompt, max_new_tokens, target, device)
    if prompt.shape[0] != 1:
        raise ValueError(
            "speculative_generate continues one sequence: prompt must be (T,) or (1, "
            "T), "
            f"got {tuple(prompt.shape)}"
        )
    T0 = prompt.shape[1]
    if T0 + max_new_tokens > draft.max_len:
        raise ValueError(
            f"prompt of {T0} tokens + max_new_tokens={max_new_tokens} exceeds the "
            "draft's "
            f"max_len={draft.max_len}"
        )

    stats = SpeculativeStats(new_tokens=max_new_tokens)
    with eval_mode(target), eval_mode(draft):
        target_context, draft_context = (
            target.decoding_context(1),
            draft.decoding_context(1),
        )
        target_caches = [
            c
            for c in _kv_caches(target.decoding_caches(1, target_context))
            if not c.static
        ]
        draft_caches = [
            c
            for c in _kv_caches(draft.decoding_caches(1, draft_context))
            if not c.static
        ]
        # (1, T0 + new): final tokens, then this round's drafts
        tokens = prompt.new_empty(1, T0 + max_new_tokens)
        tokens[:, :T0] = prompt
        end = T0  # tokens[:, :end] are final
        while end < T0 + max_new_tokens:
            # a round writes at most k + 1 tokens
            k = min(num_draft, T0 + max_new_tokens - end - 1)
            # 1. the draft proposes k tokens, tokens[end : end + k], one call each
            # q of each drafted token's position, (vocab,) each
            draft_probabilities = []
            for i in range(k):
                # what its cache lacks (one token after the first)
                fed = tokens[:, draft_caches[0].length : end + i]
                # (vocab,)
                logits = draft.decode_step(fed, draft_context, draft_caches)[0, -1]
                stats.draft_calls += 1
                if temperature == 0:
                    tokens[0, end + i] = logits.argmax()
                else:
                    q = sampling_probabilities(logits, temperature)  # (vocab,)
                    tokens[0, end + i] = torch.multinomial(q, 1, generator=generator)[0]
                    draft_probabilities.append(q)
            # 2. the target scores them in one call: k + 1 rows, for positions end - 1
            #    .. end + k - 1
            fed = tokens[:, target_caches[0].length : end + k]
            # (k + 1, vocab)
            logits = target.decode_step(fed, target_context, target_caches)[
                0, -(k + 1) :
            ]
            stats.target_calls += 1
            drafted = tokens[0, end : end + k]  # (k,)
            # 3. keep the agreed prefix, then one token of the target's own
            if temperature == 0:
                # (k + 1,) the target's greedy token at each position
                choice = logits.argmax(dim=-1)
                accepted = _leading_true(choice[:k] == drafted)
                new = choice[accepted]
            else:
                p = sampling_probabilities(logits, temperature)  # (k + 1, vocab)
                if k:
                    q = torch.stack(draft_probabilities)  # (k, vocab)
                    # (k,) p(x) of each drafted x
                    p_drafted = p[:k].gather(1, drafted[:, None])[:, 0]
                    # (k,) q(x) > 0: x was drawn from q
                    q_drafted = q.gather(1, drafted[:, None])[:, 0]
                    uniform = torch.rand(k, generator=generator, device=device)  # (k,)
                    # each with prob. min(1, p/q)
                    accepted = _leading_true(uniform * q_drafted < p_drafted)
                else:
                    accepted = 0
                # the first rejected position: draw from max(0, p - q), renormalised
                if accepted < k:
                    residual = (p[accepted] - q[accepted]).clamp_min(0)  # (vocab,)
                    # p = q: never rejected
                    weights = torch.where(residual.sum() > 0, residual, p[accepted])
                # all accepted: a bonus token from the target's distribution after the
                # last draft
                else:
                    weights = p[k]
                # multinomial renormalises
                new = torch.multinomial(weights, 1, generator=generator)[0]
            tokens[0, end + accepted] = new
            stats.drafted += k
            stats.accepted += accepted
            stats.rejected += accepted < k
            end += accepted + 1
            # 4. roll the rejected drafts out of both caches: they hold every final
            #    token but the last
            for cache in target_caches:
                cache.truncate(end - 1)
            for cache in draft_caches:
                cache.truncate(min(cache.length, end - 1))
        return tokens, stats
