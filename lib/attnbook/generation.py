"""Generating tokens: greedy or sampled, with or without a KV cache.

Without a cache every step runs the model on the whole sequence so far; with one, each step runs
it on the newest token only, which computes just that token's query, key and value per layer.
"""

from __future__ import annotations

import torch

from .models import GPT, EncoderDecoderModel


def next_token(logits: torch.Tensor, temperature: float = 0.0, generator=None) -> torch.Tensor:
    """Pick the next token from ``logits (B, vocab)``: argmax at temperature 0, else sample
    from ``softmax(logits / temperature)``. Returns ``(B,)``."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, prompt, max_new_tokens, *, use_cache=True, temperature=0.0, generator=None,
             source=None, source_padding_mask=None):
    """Continue ``prompt (B, T0)`` (or ``(T0,)``) by ``max_new_tokens`` tokens; returns ``(B, T0 + new)``.

    ``model`` is a :class:`~attnbook.models.GPT`, or an :class:`~attnbook.models.EncoderDecoderModel`
    with ``source (B, S)`` (encoded once; its cross-attention keys and values are cached once).
    Greedy at ``temperature=0``; sampling otherwise, from ``generator`` if given.
    """
    if not isinstance(model, (GPT, EncoderDecoderModel)):
        raise TypeError(f"generate works with GPT or EncoderDecoderModel, got {type(model).__name__}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompt = torch.as_tensor(prompt)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty (B, T) or (T,) tensor of token ids, got {tuple(prompt.shape)}")
    if prompt.shape[1] + max_new_tokens > model.max_len:
        raise ValueError(
            f"prompt of {prompt.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds max_len={model.max_len}"
        )
    device = next(model.parameters()).device
    prompt = prompt.to(device=device, dtype=torch.long)
    B = prompt.shape[0]
    was_training = model.training
    model.eval()

    if isinstance(model, EncoderDecoderModel):
        if source is None:
            raise ValueError("an EncoderDecoderModel needs source=(B, S) token ids to generate from")
        source = torch.as_tensor(source, device=device)
        source = source[None] if source.dim() == 1 else source
        memory = model.encode(source, source_padding_mask)  # (B, S, d), computed once
        caches = model.make_caches(B, memory.shape[1], device) if use_cache else None

        def run(tokens):
            return model.decode(tokens, memory, source_padding_mask, caches)
    else:
        caches = model.make_caches(B, device) if use_cache else None

        def run(tokens):
            return model(tokens, caches)

    tokens = prompt
    if max_new_tokens:
        logits = run(prompt)[:, -1]  # (B, vocab): the prompt is processed once
        for step in range(max_new_tokens):
            new = next_token(logits, temperature, generator)  # (B,)
            tokens = torch.cat([tokens, new[:, None]], dim=1)
            if step + 1 < max_new_tokens:
                logits = run(new[:, None] if use_cache else tokens)[:, -1]
    model.train(was_training)
    return tokens
