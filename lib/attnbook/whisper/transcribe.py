"""Audio in, text out: the :class:`Transcriber` (log-mel of a 30 s window, greedy or
beam decoding, the BPE tokenizer, scores of a transcript, word timestamps)."""

from __future__ import annotations

import torch

from ..audio import (
    CHUNK_SECONDS,
    HOP_LENGTH,
    N_SAMPLES,
    SAMPLE_RATE,
    _check_audio,
    _check_sample_rate,
    log_mel_spectrogram,
    pad_or_trim,
)
from ..generation import beam_search, generate, next_token  # the decoding loops
from ..utils import check_positive_int, eval_mode
from .model import Whisper
from .safeguards import (
    COMPRESSION_RATIO_THRESHOLD,
    FALLBACK_TEMPERATURES,
    LOGPROB_THRESHOLD,
    NO_SPEECH_THRESHOLD,
    Decoding,
    apply_timestamp_rules,
    needs_fallback,
)
from .timing import dtw, group_words, is_punctuation, median_filter

# 0.02 s: one encoder position, two mel frames
SECONDS_PER_POSITION = 2 * HOP_LENGTH / SAMPLE_RATE


class Transcriber:
    """Audio in, text out: Whisper's log-mel of a 30 s window, greedy decoding or beam
    search, the BPE tokenizer, and the time of each word.

    ``transcribe(audio (N,) at 16 kHz, up to 30 s, *, beam_size=1) -> str``. The prompt
    is ``[start_token, *task_tokens]`` (for ``tiny.en``: ``<|startoftranscript|>
    <|notimestamps|>``); ``suppress`` lists token ids never to produce (special and
    timestamp tokens, and the checkpoint's list of suppressed symbols).
    ``alignment_heads`` lists the ``(layer, head)`` pairs of cross-attention that
    :meth:`word_timestamps` reads; ``None`` takes every head of the last half of the
    decoder's layers, as Whisper does for a model without published alignment heads.
    ``timestamp_begin`` (the id of ``<|0.00|>``), ``no_timestamps_token`` and
    ``no_speech_token`` (``<|nocaptions|>``) let :meth:`decode` write timestamps and
    measure the no-speech probability.
    """

    def __init__(
        self,
        model: Whisper,
        tokenizer,
        *,
        start_token: int,
        end_token: int,
        task_tokens=(),
        suppress=(),
        suppress_at_start=(),
        max_new_tokens: int = 224,
        alignment_heads=None,
        timestamp_begin: int | None = None,
        no_timestamps_token: int | None = None,
        no_speech_token: int | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.timestamp_begin = timestamp_begin
        self.no_timestamps_token = no_timestamps_token
        self.no_speech_token = no_speech_token
        self.start_token, self.end_token = start_token, end_token
        self.prompt = [start_token, *task_tokens]
        self.suppress, self.suppress_at_start = list(suppress), list(suppress_at_start)
        self.max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        num_layers, num_heads = len(model.decoder.blocks), model.decoder.num_heads
        if alignment_heads is None:
            alignment_heads = [
                (layer, head)
                for layer in range(num_layers // 2, num_layers)
                for head in range(num_heads)
            ]
        self.alignment_heads = [
            (int(layer), int(head)) for layer, head in alignment_heads
        ]
        bad = [
            pair
            for pair in self.alignment_heads
            if not (0 <= pair[0] < num_layers and 0 <= pair[1] < num_heads)
        ]
        if bad or not self.alignment_heads:
            raise ValueError(
                f"alignment_heads must be (layer < {num_layers}, head < {num_heads}) "
                "pairs, "
                f"at least one; got {alignment_heads!r}"
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def log_mel(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE
    ) -> torch.Tensor:
        """``audio (N,)`` -> the model's input ``(n_mels, 3000)``: padded (or cut) to 30
        s first."""
        audio = _check_audio(audio)
        _check_sample_rate(sample_rate)
        if audio.numel() > N_SAMPLES:
            raise ValueError(
                f"audio holds {audio.numel()} samples "
                f"({audio.numel() / SAMPLE_RATE:.1f} s); "
                f"this transcriber reads at most {CHUNK_SECONDS} s "
                f"({N_SAMPLES} samples)"
            )
        return log_mel_spectrogram(
            pad_or_trim(audio.to(self.device)), n_mels=self.model.encoder.n_mels
        )

    def transcribe_tokens(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, beam_size: int = 1
    ) -> list[int]:
        """The transcript's token ids (after the prompt, without the end token): greedy
        with ``beam_size=1`` (:func:`attnbook.generate`, with the KV cache), else
        :func:`attnbook.beam_search` ranking hypotheses by their total log-probability
        (``length_penalty=0``; Whisper's own decoder divides by the length)."""
        beam_size = check_positive_int("beam_size", beam_size)
        # (1, n_mels, 3000) float32; the model casts it
        mel = self.log_mel(audio, sample_rate)[None]
        max_new_tokens = min(self.max_new_tokens, self.model.max_len - len(self.prompt))
        if beam_size > 1:
            tokens, _ = beam_search(
                self.model,
                self.prompt,
                max_new_tokens,
                beam_size=beam_size,
                length_penalty=0.0,
                mel=mel,
                end_token=self.end_token,
                suppress=self.suppress,
                suppress_at_start=self.suppress_at_start,
            )
            new = tokens[0, len(self.prompt) :].tolist()
            return new[:-1] if new and new[-1] == self.end_token else new
        prompt = torch.tensor([self.prompt], device=self.device)  # (1, T0)
        tokens = generate(  # (1, T0 + new)
            self.model,
            prompt,
            max_new_tokens,
            mel=mel,
            end_token=self.end_token,
            suppress=self.suppress,
            suppress_at_start=self.suppress_at_start,
        )
        new = tokens[0, len(self.prompt) :].tolist()
        return new[: new.index(self.end_token)] if self.end_token in new else new

    def transcribe(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, beam_size: int = 1
    ) -> str:
        """The transcript of ``audio (N,)`` (16 kHz, at most 30 s), stripped of
        surrounding spaces."""
        return self.tokenizer.decode(
            self.transcribe_tokens(audio, sample_rate, beam_size=beam_size)
        ).strip()

    def decode(
        self,
        audio: torch.Tensor,
        sample_rate: int = SAMPLE_RATE,
        *,
        timestamps: bool = False,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Decoding:
        """One decoding of ``audio (N,)`` as Whisper's ``DecodingTask`` makes it, with
        the figures its fallback reads (:class:`~attnbook.whisper.safeguards.Decoding`).

        Greedy at ``temperature=0``, else sampled from ``softmax(logits /
        temperature)`` with ``generator``. With ``timestamps=True`` the prompt drops
        ``<|notimestamps|>``, timestamp tokens may be chosen, and
        :func:`~attnbook.whisper.safeguards.apply_timestamp_rules` constrains them. The
        no-speech probability is read from the logits at ``<|startoftranscript|>``
        before any suppression. Without timestamps, greedy decoding gives the tokens of
        :meth:`transcribe_tokens`."""
        if timestamps and (
            self.timestamp_begin is None or self.no_timestamps_token is None
        ):
            raise ValueError(
                "this transcriber has no timestamp tokens: pass timestamp_begin= and "
                "no_timestamps_token= when building it"
            )
        prompt = (
            [t for t in self.prompt if t != self.no_timestamps_token]
            if timestamps
            else self.prompt
        )
        suppress = self.suppress
        if timestamps:  # the timestamps are allowed, the rules take over
            suppress = [t for t in suppress if t < self.timestamp_begin]
        mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
        max_new_tokens = min(self.max_new_tokens, self.model.max_len - len(prompt))
        tokens, total = [], 0.0
        with eval_mode(self.model):
            context = self.model.decoding_context(1, mel=mel)  # (1, S, d)
            caches = self.model.decoding_caches(1, context)
            prompt_ids = torch.tensor([prompt], device=self.device)  # (1, T0)
            logits = self.model.decode_step(prompt_ids, context, caches)[0].float()
            no_speech_prob = float("nan")
            if self.no_speech_token is not None:  # at <|startoftranscript|>
                start = prompt.index(self.start_token)
                no_speech_prob = float(logits[start].softmax(-1)[self.no_speech_token])
            logits = logits[-1]  # (vocab,): the next token's
            for step in range(max_new_tokens):
                logits[suppress] = float("-inf")
                if step == 0 and self.suppress_at_start:
                    logits[self.suppress_at_start] = float("-inf")
                if timestamps:
                    apply_timestamp_rules(
                        logits,
                        tokens,
                        timestamp_begin=self.timestamp_begin,
                        end_token=self.end_token,
                        no_timestamps=self.no_timestamps_token,
                    )
                new = int(next_token(logits[None], temperature, generator)[0])
                total += float(torch.log_softmax(logits, dim=-1)[new])
                if new == self.end_token:
                    break
                tokens.append(new)
                step_ids = torch.tensor([[new]], device=self.device)  # (1, 1)
                logits = self.model.decode_step(step_ids, context, caches)[
                    0, -1
                ].float()
        text_tokens = [
            t
            for t in tokens
            if self.timestamp_begin is None or t < self.timestamp_begin
        ]
        return Decoding(
            tokens,
            self.tokenizer.decode(text_tokens).strip(),
            total,
            no_speech_prob,
            float(temperature),
        )

    def decode_beam(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, beam_size: int = 5
    ) -> Decoding:
        """A beam search of ``beam_size`` (:meth:`transcribe_tokens`) as a
        :class:`~attnbook.whisper.safeguards.Decoding` at temperature 0: its total
        log-probability by :meth:`sequence_log_probabilities` (the end token's
        included), its no-speech probability from the prompt's logits as in
        :meth:`decode`."""
        tokens = self.transcribe_tokens(audio, sample_rate, beam_size=beam_size)
        (total,) = self.sequence_log_probabilities(audio, [tokens], sample_rate)
        no_speech_prob = float("nan")
        if self.no_speech_token is not None:
            mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
            with eval_mode(self.model):
                context = self.model.decoding_context(1, mel=mel)
                caches = self.model.decoding_caches(1, context)
                prompt_ids = torch.tensor([self.prompt], device=self.device)
                logits = self.model.decode_step(prompt_ids, context, caches)[0].float()
            start = self.prompt.index(self.start_token)
            no_speech_prob = float(logits[start].softmax(-1)[self.no_speech_token])
        text = self.tokenizer.decode(tokens).strip()
        return Decoding(tokens, text, total, no_speech_prob, 0.0)

    def decode_with_fallback(
        self,
        audio: torch.Tensor,
        sample_rate: int = SAMPLE_RATE,
        *,
        temperatures=FALLBACK_TEMPERATURES,
        compression_ratio_threshold: float | None = COMPRESSION_RATIO_THRESHOLD,
        logprob_threshold: float | None = LOGPROB_THRESHOLD,
        no_speech_threshold: float | None = NO_SPEECH_THRESHOLD,
        generator: torch.Generator | None = None,
        timestamps: bool = False,
        beam_size: int = 1,
        best_of: int = 1,
    ) -> list[Decoding]:
        """Whisper's ``decode_with_fallback``: decode at each temperature in turn until
        :func:`~attnbook.whisper.safeguards.needs_fallback` says the result will do.
        Returns every attempt, the one kept last.

        Whisper's ``transcribe`` defaults are one decoding per temperature
        (``beam_size=1``, ``best_of=1``); its command line uses ``beam_size=5`` and
        ``best_of=5``: at temperature 0 a beam search of ``beam_size`` (without
        timestamps here), at a higher temperature ``best_of`` samples of which the one
        with the highest log-probability per token is kept (Whisper's ranking without a
        length penalty: the total over the number of tokens)."""
        beam_size = check_positive_int("beam_size", beam_size)
        best_of = check_positive_int("best_of", best_of)
        if beam_size > 1 and timestamps:
            raise ValueError("beam_size > 1 decodes without timestamps here")
        attempts = []
        for temperature in temperatures:
            if temperature == 0 and beam_size > 1:
                beam = self.decode_beam(audio, sample_rate, beam_size=beam_size)
                attempts.append(beam)
            else:
                draws = [
                    self.decode(
                        audio,
                        sample_rate,
                        timestamps=timestamps,
                        temperature=temperature,
                        generator=generator,
                    )
                    for _ in range(best_of if temperature > 0 else 1)
                ]
                attempts.append(
                    max(draws, key=lambda d: d.sum_log_prob / max(1, len(d.tokens)))
                )
            if not needs_fallback(
                attempts[-1],
                compression_ratio_threshold=compression_ratio_threshold,
                logprob_threshold=logprob_threshold,
                no_speech_threshold=no_speech_threshold,
            ):
                break
        return attempts

    def _sequence(self, tokens) -> torch.Tensor:
        """``prompt + tokens + [end_token]`` as a ``(1, T)`` tensor, after checking
        ``tokens``."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        tokens = [int(t) for t in tokens]
        bad = [
            t
            for t in tokens
            if not 0 <= t < self.model.vocab_size or t == self.end_token
        ]
        if bad:
            raise ValueError(
                f"tokens must be transcript ids in [0, {self.model.vocab_size}) "
                "without the end token "
                f"{self.end_token}, got {bad}"
            )
        if len(self.prompt) + len(tokens) + 1 > self.model.max_len:
            raise ValueError(
                f"{len(tokens)} tokens do not fit the decoder's {self.model.max_len} "
                "positions"
            )
        return torch.tensor(
            [self.prompt + tokens + [self.end_token]], device=self.device
        )

    def sequence_log_probability(
        self, audio: torch.Tensor, tokens, sample_rate: int = SAMPLE_RATE
    ) -> float:
        """The total log-probability of the transcript ``tokens`` followed by the end
        token, given the audio: one forward pass without a cache, and the same
        suppression as decoding (suppressed tokens' logits set to ``-inf`` before the
        log-softmax). Greedy and beam hypotheses are scored by this one function
        (:meth:`sequence_log_probabilities` scores several with one encoder pass)."""
        return self.sequence_log_probabilities(audio, [tokens], sample_rate)[0]

    def sequence_log_probabilities(
        self, audio: torch.Tensor, transcripts, sample_rate: int = SAMPLE_RATE
    ) -> list[float]:
        """:meth:`sequence_log_probability` of each transcript (a list of token ids) in
        ``transcripts``; the encoder reads the audio once."""
        if isinstance(transcripts, torch.Tensor) or not all(
            isinstance(t, (list, tuple, torch.Tensor)) for t in transcripts
        ):
            raise TypeError(
                "transcripts must be a list of transcripts, each a list of token ids"
            )
        # each (1, T0 + n + 1)
        sequences = [self._sequence(tokens) for tokens in transcripts]
        mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
        scores = []
        with eval_mode(self.model):
            memory = self.model.encoder(mel)  # (1, S, d), once
            for sequence in sequences:
                # (n+1, V)
                logits = self.model.decoder(sequence[:, :-1], memory)[
                    0, len(self.prompt) - 1 :
                ].float()
                if self.suppress:
                    logits[:, self.suppress] = float("-inf")
                if self.suppress_at_start:
                    logits[0, self.suppress_at_start] = float("-inf")
                # (n + 1,) the transcript and the end token
                targets = sequence[0, len(self.prompt) :]
                scores.append(
                    float(
                        torch.log_softmax(logits, dim=-1)
                        .gather(1, targets[:, None])
                        .sum()
                    )
                )
        return scores

    def alignment_matrix(
        self,
        audio: torch.Tensor,
        tokens,
        sample_rate: int = SAMPLE_RATE,
        *,
        median_width: int = 7,
    ) -> torch.Tensor:
        """How strongly each token sits on each 20 ms of the audio: ``(len(tokens) + 1,
        positions)``.

        As Whisper's ``find_alignment``: the cross-attention weights of the alignment
        heads for ``prompt + tokens + [end]``, cut to the ``N // 320`` encoder positions
        that hold the audio and renormalised (a softmax over the audio alone); each head
        standardised per audio position over the token axis (Whisper's
        ``std_mean(weights, dim=-2)``), median-filtered along time, averaged over the
        heads. Row ``k`` is the query that *predicts* token ``k`` (the last row predicts
        the end).
        """
        audio = _check_audio(audio)
        # encoder positions that hold the audio
        positions = audio.numel() // (2 * HOP_LENGTH)
        if positions < 1:
            raise ValueError(
                f"audio of {audio.numel()} samples is shorter than one encoder "
                "position "
                f"({2 * HOP_LENGTH} samples, 20 ms)"
            )
        sequence = self._sequence(tokens)  # (1, T)
        mel = self.log_mel(audio, sample_rate)[None]  # (1, n_mels, 3000)
        # (layers, h, T, 1500)
        weights = self.model.cross_attention_weights(mel, sequence)[:, 0].float()
        # (H, T, 1500)
        heads = torch.stack(
            [weights[layer, head] for layer, head in self.alignment_heads]
        )
        heads = heads[..., :positions]  # (H, T, positions)
        # = softmax of the scores over the audio
        heads = heads / heads.sum(-1, keepdim=True).clamp_min(1e-30)
        # (H, 1, positions)
        std, mean = torch.std_mean(heads, dim=-2, keepdim=True, unbiased=False)
        heads = (heads - mean) / std.clamp_min(1e-12)
        heads = median_filter(heads, median_width)  # (H, T, positions), along time
        return heads.mean(0)[len(self.prompt) - 1 : -1].cpu()  # (n + 1, positions)

    def word_timestamps(
        self, audio: torch.Tensor, sample_rate: int = SAMPLE_RATE, *, tokens=None
    ) -> list[tuple[str, float, float]]:
        """Each word of the transcript with its start and end in seconds: ``[(word,
        start, end), ...]``.

        ``tokens`` defaults to the greedy transcript. :func:`dtw` finds the cheapest
        monotonic path through ``-alignment_matrix`` (tokens down, 20 ms positions
        across); token ``k`` starts at the first position where the path enters row
        ``k`` and ends where row ``k + 1`` begins.
        :func:`group_words` puts tokens together into words; punctuation stays with its
        word but, as in Whisper (whose ``merge_punctuations`` keeps the word's own
        times), does not count towards its start or end. Whisper's further heuristics
        (clipping words longer than twice the median near sentence ends and pauses) are
        left out.
        """
        audio = _check_audio(audio)
        _check_sample_rate(sample_rate)
        if tokens is None:
            tokens = self.transcribe_tokens(audio, sample_rate)
        tokens = (
            tokens.tolist()
            if isinstance(tokens, torch.Tensor)
            else [int(t) for t in tokens]
        )
        if not tokens:
            return []
        matrix = self.alignment_matrix(audio, tokens, sample_rate)  # (n + 1, positions)
        path = dtw(-matrix)  # (L, 2): (token row, position)
        rows, columns = path[:, 0], path[:, 1]
        # where the path enters a new row
        enters = torch.ones_like(rows, dtype=torch.bool)
        enters[1:] = rows[1:] != rows[:-1]
        # (n + 1,) when each row begins
        starts = columns[enters].double() * SECONDS_PER_POSITION
        pieces = [self.tokenizer.decode([t]) for t in tokens]
        timings = []
        for word in group_words(pieces):
            # the word without its punctuation
            timed = [k for k in word if not is_punctuation(pieces[k])] or word
            text = self.tokenizer.decode([tokens[k] for k in word]).strip()
            timings.append(
                (
                    text,
                    round(float(starts[timed[0]]), 2),
                    round(float(starts[timed[-1] + 1]), 2),
                )
            )
        return timings


__all__ = [
    "Transcriber",
]
