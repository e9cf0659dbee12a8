"""Generating tokens: the library's one decoding loop, greedy or sampled, with or without a KV cache.

Without a cache every step runs the model on the whole sequence so far; with one, each step runs
it on the newest token only, which computes just that token's query, key and value per layer.

:func:`generate` drives any module with the decoding interface of :mod:`attnbook.models`
(``max_len``, ``vocab_size``, ``decoding_context``, ``decoding_caches``, ``decode_step``): the GPT,
the encoder–decoder, Whisper and chapter 10's speech model, and a wrapped or compiled one of them.
"""

from __future__ import annotations

import torch

from .utils import check_non_negative_int, check_token_ids, eval_mode

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
