"""Generating tokens: the library's decoding loops, greedy or sampled (with or without a KV cache) and
beam search.

Without a cache every step runs the model on the whole sequence so far; with one, each step runs
it on the newest token only, which computes just that token's query, key and value per layer.

:func:`generate` and :func:`beam_search` drive any module with the decoding interface of :mod:`attnbook.models`
(``max_len``, ``vocab_size``, ``decoding_context``, ``decoding_caches``, ``decode_step``): the GPT,
the encoder–decoder, Whisper and chapter 10's speech model, and a wrapped or compiled one of them.
"""

from __future__ import annotations

import torch

from .utils import check_non_negative_int, check_positive_int, check_token_ids, eval_mode

DECODING_INTERFACE = ("max_len", "vocab_size", "decoding_context", "decoding_caches", "decode_step")


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
            or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def _check_generator(generator, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the logits are on {device}: "
                         "make it with attnbook.generator(seed, device=...)")


def next_token(logits: torch.Tensor, temperature: float = 0.0, generator=None) -> torch.Tensor:
    """Pick the next token from ``logits (B, vocab)``: argmax at temperature 0, else sample
    from ``softmax(logits / temperature)``. Returns ``(B,)``."""
    temperature = _check_temperature(temperature)
    if temperature == 0:
        return logits.argmax(dim=-1)
    _check_generator(generator, logits.device)
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"generate needs a torch.nn.Module with the decoding interface, got {type(model).__name__}")
    missing = [name for name in DECODING_INTERFACE if not hasattr(model, name)]
    if missing:
        raise TypeError(f"{type(model).__name__} lacks the decoding interface {list(DECODING_INTERFACE)}: "
                        f"missing {missing} (generate works with GPT, EncoderDecoderModel, Whisper, "
                        "Seq2SeqSpeechModel, or a wrapper of one)")


def _check_token_list(name: str, tokens, vocab_size: int) -> list[int]:
    tokens = [int(t) for t in tokens]
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad}")
    return tokens


def generate(model, prompt, max_new_tokens, *, use_cache=True, temperature=0.0, generator=None, end_token=None,
             suppress=(), suppress_at_start=(), **inputs):
    """Continue ``prompt (B, T0)`` (or ``(T0,)``) by up to ``max_new_tokens`` tokens; returns ``(B, T0 + new)``.

    ``inputs`` go to the model's ``decoding_context``, computed once: ``source=`` (and
    ``source_padding_mask=``) for an :class:`~attnbook.models.EncoderDecoderModel`, ``mel=`` for
    :class:`~attnbook.whisper.Whisper`, ``features=, lengths=`` for chapter 10's speech model.
    Greedy at ``temperature=0``; sampling otherwise, from ``generator`` (on the model's device) if given.
    Tokens in ``suppress`` are never chosen, those in ``suppress_at_start`` not as the first new token.
    With ``end_token`` a sequence stops there (it is included, and a finished sequence is padded with
    it); the loop ends when every sequence has, so fewer than ``max_new_tokens`` may be returned.

    It runs in eval mode without gradients (not inference mode, so the tokens can feed a training
    step) and restores the model's training mode afterwards, even after an error. The ids are
    range-checked once, on the prompt: no step reads a tensor back to the host unless ``end_token``
    is given (then once a step, to stop early).
    """
    _check_model(model)
    max_new_tokens = check_non_negative_int("max_new_tokens", max_new_tokens)
    temperature = _check_temperature(temperature)
    device = next(model.parameters()).device
    if temperature > 0:
        _check_generator(generator, device)
    prompt = torch.as_tensor(prompt)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty (B, T) or (T,) tensor of token ids, got {tuple(prompt.shape)}")
    if prompt.is_floating_point() or prompt.dtype == torch.bool:
        raise TypeError(f"prompt must hold integer token ids, got dtype {prompt.dtype}")
    if prompt.shape[1] + max_new_tokens > model.max_len:
        raise ValueError(
            f"prompt of {prompt.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds max_len={model.max_len}"
        )
    prompt = prompt.to(device=device, dtype=torch.long)
    check_token_ids(prompt, model.vocab_size)  # here, once: with max_new_tokens=0 no model runs
    suppress = _check_token_list("suppress", suppress, model.vocab_size)
    suppress_at_start = _check_token_list("suppress_at_start", suppress_at_start, model.vocab_size)
    if end_token is not None:
        end_token = _check_token_list("end_token", [end_token], model.vocab_size)[0]
    B, T0 = prompt.shape

    with eval_mode(model):
        context = model.decoding_context(B, **inputs)  # computed once (an encoder's output)
        caches = model.decoding_caches(B, context) if use_cache else None
        tokens = prompt.new_empty(B, T0 + max_new_tokens)  # (B, T0 + new), filled step by step
        tokens[:, :T0] = prompt
        finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        end = T0
        if max_new_tokens:
            logits = model.decode_step(prompt, context, caches)[:, -1]  # (B, vocab): the prompt, once
            for step in range(max_new_tokens):
                if suppress:
                    logits[:, suppress] = float("-inf")
                if step == 0 and suppress_at_start:
                    logits[:, suppress_at_start] = float("-inf")
                new = next_token(logits, temperature, generator)  # (B,)
                end = T0 + step + 1
                if end_token is not None:
                    new = new.masked_fill(finished, end_token)
                    finished |= new == end_token
                tokens[:, end - 1] = new
                if end == T0 + max_new_tokens or (end_token is not None and bool(finished.all())):
                    break
                logits = model.decode_step(tokens[:, end - 1 : end] if use_cache else tokens[:, :end],
                                           context, caches)[:, -1]  # (B, vocab)
        return tokens[:, :end]


def _kv_caches(caches):
    """The :class:`~attnbook.multihead.KVCache` objects in a model's (nested) list of caches."""
    if isinstance(caches, (list, tuple)):
        return [cache for item in caches for cache in _kv_caches(item)]
    return [caches]


def _widen(context, beam_size: int):
    """A batch-1 decoding context (a tensor, a tuple of tensors and None, or None) as ``beam_size``
    rows: views, not copies."""
    if isinstance(context, torch.Tensor):
        return context.expand(beam_size, *context.shape[1:])
    if isinstance(context, (tuple, list)):
        return type(context)(_widen(item, beam_size) for item in context)
    return context


def beam_search(model, prompt, max_new_tokens: int, *, beam_size: int = 4, length_penalty: float = 1.0,
                end_token=None, suppress=(), suppress_at_start=(), **inputs) -> tuple[list[int], float]:
    """Beam search over a model with the decoding interface: ``(tokens, log_prob)``.

    ``tokens`` is the best hypothesis with the prompt in front, as :func:`generate` returns it (with
    ``end_token`` last if it finished), and ``log_prob`` the total log-probability of its new tokens
    under the model (the sum of each step's log-softmax, after ``suppress`` tokens, and
    ``suppress_at_start`` at the first step, are set to ``-inf``, as greedy decoding does).

    The ``beam_size`` live prefixes of highest total log-probability are extended each step; a
    prefix that picks ``end_token`` (if given) is finished. Hypotheses are ranked by
    ``log_prob / n ** length_penalty`` with ``n`` new tokens: ``length_penalty=0`` ranks by the total,
    which favours short hypotheses since every token adds a log-probability <= 0; ``1`` by the mean
    per token. A live prefix's rank can rise no higher than its total divided by the longest length
    it could reach, so the search stops once the best finished hypothesis ranks above that bound for
    every live prefix (or after ``max_new_tokens``: then the live prefixes compete too).
    ``beam_size=1`` is greedy decoding. A wider beam usually finds a likelier hypothesis than greedy
    decoding, but not always: it prunes, and the greedy prefix can fall out of the beam.

    The context (an encoder's output) is computed once and the prompt decoded once with batch 1; then
    each layer's KV caches are widened to ``beam_size`` rows (a static cross-attention cache as a
    view: the source is the same for every beam), and after each step the self-attention caches'
    rows are reordered by the surviving beams' indices, so each beam keeps the keys and values of its
    own prefix. ``inputs`` go to the model's ``decoding_context`` (``mel=`` for Whisper).
    """
    _check_model(model)
    beam_size = check_positive_int("beam_size", beam_size)
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(length_penalty, (int, float)) or not 0 <= length_penalty <= 10:
        raise ValueError(f"length_penalty must be a number in [0, 10], got {length_penalty!r}")
    prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    if not prompt or len(prompt) + max_new_tokens > model.max_len:
        raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} must be "
                         f"non-empty and fit max_len={model.max_len}")
    vocab_size = model.vocab_size
    prompt = _check_token_list("prompt", prompt, vocab_size)
    suppress = _check_token_list("suppress", suppress, vocab_size)
    suppress_at_start = _check_token_list("suppress_at_start", suppress_at_start, vocab_size)
    if end_token is not None:
        end_token = _check_token_list("end_token", [end_token], vocab_size)[0]
    if len(set(suppress) | set(suppress_at_start)) == vocab_size:
        raise ValueError("beam search found no hypothesis: every token is suppressed at the first step")

    def rank(score: float, length: int) -> float:
        return score / length**length_penalty

    device = next(model.parameters()).device
    with eval_mode(model):
        context = model.decoding_context(1, **inputs)  # (1, S, d): the encoder, once
        caches = model.decoding_caches(1, context)
        logits = model.decode_step(torch.tensor([prompt], device=device), context, caches)[:, -1]  # (1, V)
        for cache in _kv_caches(caches):  # widen every cache to beam_size rows
            if cache.static:
                cache.keys = cache.keys.expand(beam_size, -1, -1, -1)  # (beam, h, S, d/h): one copy, shared
                cache.values = cache.values.expand(beam_size, -1, -1, -1)
            else:
                cache.keys = cache.keys.repeat(beam_size, 1, 1, 1)  # (beam, h, max_len, d/h): one per beam
                cache.values = cache.values.repeat(beam_size, 1, 1, 1)
        context = _widen(context, beam_size)  # (beam, S, d), or a tuple of such, or None
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
            candidates = (scores[:, None] + torch.log_softmax(logits, dim=-1)).flatten()  # (beam * V,)
            top_scores, top_indices = candidates.topk(min(2 * beam_size, candidates.numel()))
            rows, tokens, new_scores = [], [], []
            for score, index in zip(top_scores.tolist(), top_indices.tolist(), strict=True):
                if score == float("-inf") or len(rows) == beam_size:
                    break
                row, token = divmod(index, vocab_size)
                if token == end_token:
                    finished.append((rank(score, step + 1), score, prefixes[row] + [token]))
                else:
                    rows.append(row)
                    tokens.append(token)
                    new_scores.append(score)
            if not rows:
                break
            prefixes = [prefixes[row] + [token] for row, token in zip(rows, tokens, strict=True)]
            best_finished = max((item[0] for item in finished), default=float("-inf"))
            if step == max_new_tokens - 1:  # out of tokens: the live prefixes compete as they are
                finished += [(rank(score, step + 1), score, prefix)
                             for score, prefix in zip(new_scores, prefixes, strict=True)]
                break
            if best_finished >= rank(new_scores[0], max_new_tokens):
                break  # no live prefix can overtake the best finished hypothesis
            while len(rows) < beam_size:  # fewer candidates than beams (a tiny vocabulary): dead rows
                rows.append(rows[0])
                tokens.append(tokens[0])
                new_scores.append(float("-inf"))
                prefixes.append(prefixes[0])
            scores = torch.tensor(new_scores, device=device)  # (beam,)
            order = torch.tensor(rows, device=device)  # (beam,) the row each surviving beam extends
            for cache in _kv_caches(caches):
                if not cache.static:  # each beam takes over the keys and values of the prefix it extends
                    cache.keys[:, :, : cache.length] = cache.keys[order, :, : cache.length]
                    cache.values[:, :, : cache.length] = cache.values[order, :, : cache.length]
            step_tokens = torch.tensor(tokens, device=device)[:, None]  # (beam, 1)
            logits = model.decode_step(step_tokens, context, caches)[:, -1]  # (beam, V)
    _, best_score, best = max(finished, key=lambda item: item[0])
    return prompt + best, float(best_score)
