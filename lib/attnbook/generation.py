"""Generating tokens: greedy or sampled, with or without a KV cache.

Without a cache every step runs the model on the whole sequence so far; with one, each step runs
it on the newest token only, which computes just that token's query, key and value per layer.
"""

from __future__ import annotations

import torch

from .models import GPT, EncoderDecoderModel
from .utils import check_token_ids


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


@torch.no_grad()
def generate(model, prompt, max_new_tokens, *, use_cache=True, temperature=0.0, generator=None,
             source=None, source_padding_mask=None):
    """Continue ``prompt (B, T0)`` (or ``(T0,)``) by ``max_new_tokens`` tokens; returns ``(B, T0 + new)``.

    ``model`` is a :class:`~attnbook.models.GPT`, or an :class:`~attnbook.models.EncoderDecoderModel`
    with ``source (B, S)`` (encoded once; its cross-attention keys and values are cached once) and
    its optional ``source_padding_mask (B, S)``; both are moved to the model's device.
    Greedy at ``temperature=0``; sampling otherwise, from ``generator`` (on the model's device) if given.

    It runs under ``torch.no_grad()`` (not inference mode, so the tokens can feed a training step),
    in eval mode, and restores the model's training mode afterwards, even after an error. The ids are
    range-checked once, on the prompt: no step reads a tensor back to the host.
    """
    if not isinstance(model, (GPT, EncoderDecoderModel)):
        raise TypeError(f"generate works with GPT or EncoderDecoderModel, got {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
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
    vocab_size, ids_name = ((model.target_vocab_size, "target ids") if isinstance(model, EncoderDecoderModel)
                            else (model.vocab_size, "token ids"))
    check_token_ids(prompt, vocab_size, name=ids_name)  # here, once: with max_new_tokens=0 no model runs
    B, T0 = prompt.shape
    if isinstance(model, EncoderDecoderModel):
        if source is None:
            raise ValueError("an EncoderDecoderModel needs source=(B, S) token ids to generate from")
        source = torch.as_tensor(source)
        source = (source[None] if source.dim() == 1 else source).to(device=device, dtype=torch.long)
        if source.shape[0] != B:
            raise ValueError(f"source has batch size {source.shape[0]} but the prompt has {B}")
        if source_padding_mask is not None:
            source_padding_mask = torch.as_tensor(source_padding_mask)
            source_padding_mask = source_padding_mask[None] if source_padding_mask.dim() == 1 else source_padding_mask
            if source_padding_mask.shape != source.shape:
                raise ValueError(f"source_padding_mask {tuple(source_padding_mask.shape)} must have the source's "
                                 f"shape {tuple(source.shape)}")
            source_padding_mask = source_padding_mask.to(device=device, dtype=torch.bool)
    elif source is not None or source_padding_mask is not None:
        raise ValueError("source and source_padding_mask are for an EncoderDecoderModel, not a GPT")

    was_training = model.training
    model.eval()
    try:
        if isinstance(model, EncoderDecoderModel):
            memory = model.encode(source, source_padding_mask)  # (B, S, d), computed once
            caches = model.make_caches(B, memory.shape[1], device) if use_cache else None

            def run(tokens):
                return model.decode(tokens, memory, source_padding_mask, caches, check_ids=False)
        else:
            caches = model.make_caches(B, device) if use_cache else None

            def run(tokens):
                return model(tokens, caches, check_ids=False)

        tokens = prompt.new_empty(B, T0 + max_new_tokens)  # (B, T0 + new), filled step by step
        tokens[:, :T0] = prompt
        if max_new_tokens:
            logits = run(prompt)[:, -1]  # (B, vocab): the prompt is processed once
            for step in range(max_new_tokens):
                end = T0 + step
                tokens[:, end] = next_token(logits, temperature, generator)  # (B,)
                if step + 1 < max_new_tokens:
                    logits = run(tokens[:, end : end + 1] if use_cache else tokens[:, : end + 1])[:, -1]
        return tokens
    finally:
        model.train(was_training)
