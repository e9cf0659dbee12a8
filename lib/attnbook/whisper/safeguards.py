"""What Whisper's own ``transcribe`` does around one greedy decoding: timestamp tokens
and their rules, the no-speech probability, and the checks that send a decoding back to
be sampled at a higher temperature.

:func:`apply_timestamp_rules` is Whisper's ``ApplyTimestampRules`` for one sequence;
:func:`split_segments` reads the timestamped tokens back as ``(start, end, tokens)``;
:func:`compression_ratio` is the gzip test for a transcript that loops;
:class:`Decoding` holds one decoding and the figures the fallback reads, and
:func:`needs_fallback` applies Whisper's thresholds to them. The decoding loop itself is
:meth:`attnbook.whisper.Transcriber.decode`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

# Whisper's transcribe defaults
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
# the first timestamp may be at most 1 s: 50 steps of 0.02 s
MAX_INITIAL_TIMESTAMP_INDEX = 50


def apply_timestamp_rules(
    logits: torch.Tensor,
    sampled,
    *,
    timestamp_begin: int,
    end_token: int,
    no_timestamps: int,
    max_initial_timestamp_index: int | None = MAX_INITIAL_TIMESTAMP_INDEX,
) -> torch.Tensor:
    """Whisper's timestamp rules on the next token's ``logits (vocab,)``, in place.

    ``sampled`` lists the tokens decoded so far (after the prompt). Token
    ``timestamp_begin + i`` is the time ``0.02 i`` s. The rules:

    - ``<|notimestamps|>`` is never chosen;
    - timestamps come in pairs (a segment's end, the next one's start), except just
      before the end token: after two timestamps (or one that starts the transcript)
      the next token is text; after one timestamp that follows text, it is a timestamp
      or the end;
    - timestamps never decrease, and a segment's end lies after its start;
    - the first token is a timestamp, at most ``max_initial_timestamp_index`` steps in;
    - if the timestamps together are likelier than the likeliest text token, the next
      token is a timestamp.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be (vocab,), got {tuple(logits.shape)}")
    if not 0 <= end_token < timestamp_begin < logits.shape[0]:
        raise ValueError(
            f"need 0 <= end_token ({end_token}) < timestamp_begin ({timestamp_begin}) "
            f"< vocab ({logits.shape[0]})"
        )
    sampled = [int(t) for t in sampled]
    logits[no_timestamps] = float("-inf")
    last_was_timestamp = len(sampled) >= 1 and sampled[-1] >= timestamp_begin
    penultimate_was_timestamp = len(sampled) < 2 or sampled[-2] >= timestamp_begin
    if last_was_timestamp:
        if penultimate_was_timestamp:  # a pair is complete: text comes next
            logits[timestamp_begin:] = float("-inf")
        else:  # a segment's end: a timestamp or the end token
            logits[:end_token] = float("-inf")
    timestamps = [t for t in sampled if t >= timestamp_begin]
    if timestamps:
        # not before the last one; a segment that has just begun must have text
        last = timestamps[-1]
        first_allowed = (
            last if last_was_timestamp and not penultimate_was_timestamp else last + 1
        )
        logits[timestamp_begin:first_allowed] = float("-inf")
    if not sampled:
        logits[:timestamp_begin] = float("-inf")  # begin with a timestamp
        if max_initial_timestamp_index is not None:
            logits[timestamp_begin + max_initial_timestamp_index + 1 :] = float("-inf")
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    timestamp_log_prob = log_probs[timestamp_begin:].logsumexp(dim=-1)
    if timestamp_log_prob > log_probs[:timestamp_begin].max():
        logits[:timestamp_begin] = float("-inf")
    return logits


def split_segments(
    tokens, timestamp_begin: int, seconds_per_step: float = 0.02
) -> list[tuple[float, float | None, list[int]]]:
    """A timestamped transcript as segments ``[(start, end, text tokens), ...]``.

    ``<|a|> text <|b|>`` is one segment from ``a`` to ``b`` seconds; two timestamps in a
    row close one segment and open the next. Text after the last opening timestamp that
    no timestamp closes gets ``end=None`` (Whisper then takes the end of the audio).
    """
    segments, start, text = [], None, []
    for token in (int(t) for t in tokens):
        if token < timestamp_begin:
            text.append(token)
            continue
        time = round((token - timestamp_begin) * seconds_per_step, 2)
        if start is not None and text:
            segments.append((start, time, text))
            start, text = None, []
        else:
            start = time
    if text:
        segments.append((start, None, text))
    return segments


def compression_ratio(text: str) -> float:
    """``len(text in UTF-8) / len(zlib-compressed)``: Whisper's test for a transcript
    that repeats itself (a loop compresses well; above 2.4, Whisper decodes again)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    data = text.encode("utf-8")
    if not data:
        raise ValueError("text is empty: a compression ratio needs at least one byte")
    return len(data) / len(zlib.compress(data))


@dataclass(frozen=True)
class Decoding:
    """One decoding of a 30 s window, with what Whisper's fallback reads.

    ``tokens``: the new tokens (timestamps included, the end token not); ``text``: the
    transcript without timestamps; ``sum_log_prob``: the total log-probability of the
    tokens and the end token (if reached), each from the log-softmax of the logits after
    suppression and the timestamp rules, not divided by the temperature;
    ``avg_log_prob = sum_log_prob / (len(tokens) + 1)`` (Whisper's count);
    ``no_speech_prob``: the probability of ``<|nocaptions|>`` at
    ``<|startoftranscript|>`` (``nan`` where the model has none); ``temperature``: 0 for
    greedy.
    """

    tokens: list[int]
    text: str
    sum_log_prob: float
    no_speech_prob: float
    temperature: float

    @property
    def avg_log_prob(self) -> float:
        return self.sum_log_prob / (len(self.tokens) + 1)

    @property
    def compression_ratio(self) -> float:
        return compression_ratio(self.text) if self.text else 0.0


def needs_fallback(
    decoding: Decoding,
    *,
    compression_ratio_threshold: float | None = COMPRESSION_RATIO_THRESHOLD,
    logprob_threshold: float | None = LOGPROB_THRESHOLD,
    no_speech_threshold: float | None = NO_SPEECH_THRESHOLD,
) -> bool:
    """Whisper's test for decoding again at the next temperature: the text compresses
    too well (a loop) or its average log-probability is too low; but not if the window
    looks silent (no-speech probability above its threshold and a low average
    log-probability). ``None`` turns a test off."""
    too_low = (
        logprob_threshold is not None and decoding.avg_log_prob < logprob_threshold
    )
    again = too_low or (
        compression_ratio_threshold is not None
        and decoding.compression_ratio > compression_ratio_threshold
    )
    silent = (
        no_speech_threshold is not None
        and decoding.no_speech_prob > no_speech_threshold
        and too_low
    )
    return again and not silent


__all__ = [
    "COMPRESSION_RATIO_THRESHOLD",
    "Decoding",
    "FALLBACK_TEMPERATURES",
    "LOGPROB_THRESHOLD",
    "MAX_INITIAL_TIMESTAMP_INDEX",
    "NO_SPEECH_THRESHOLD",
    "apply_timestamp_rules",
    "compression_ratio",
    "needs_fallback",
    "split_segments",
]
