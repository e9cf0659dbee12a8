"""Whisper's safeguards around a decoding: the timestamp rules (checked token by token on a
small vocabulary, by hand, against the rules of Whisper's ``ApplyTimestampRules``), reading
segments back, the compression ratio, the fallback test, and ``Transcriber.decode`` on
``tiny.en``, which must give greedy decoding's tokens and the scoring function's
log-probability."""

import math
import zlib
from pathlib import Path

import pytest
import torch
from attnbook import audio, whisper
from attnbook.whisper.safeguards import Decoding

CLIPS = Path(__file__).resolve().parents[1] / "book" / "data" / "speech"
# a small vocabulary: text 0-4, end 5, specials 6-9, timestamps 10-19 (0.00-0.18 s)
END, NO_TIMESTAMPS, TB, V = 5, 8, 10, 20


def allowed(sampled, logits=None, max_initial=3):
    logits = torch.zeros(V) if logits is None else logits.clone()
    whisper.apply_timestamp_rules(
        logits,
        sampled,
        timestamp_begin=TB,
        end_token=END,
        no_timestamps=NO_TIMESTAMPS,
        max_initial_timestamp_index=max_initial,
    )
    return set(torch.nonzero(logits > float("-inf")).flatten().tolist())


def test_the_first_token_is_an_early_timestamp():
    assert allowed([]) == {10, 11, 12, 13}  # at most 3 steps in
    assert allowed([], max_initial=None) == set(range(10, 20))


def test_a_timestamp_that_opens_the_transcript_is_followed_by_text():
    # timestamps would win on mass over one text token: give text the edge
    logits = torch.zeros(V)
    logits[:TB] = 5.0
    assert allowed([12], logits) == set(range(0, 8)) | {9}  # no timestamp, no <|notimestamps|>


def test_text_may_be_followed_by_a_later_timestamp_only():
    logits = torch.zeros(V)
    logits[:TB] = 5.0
    # after <|0.04|> text: timestamps 10-12 are forbidden (a segment must have length)
    assert allowed([12, 3], logits) == set(range(0, 8)) | {9} | set(range(13, 20))


def test_a_segment_end_is_followed_by_a_timestamp_or_the_end():
    # <|0.04|> text <|0.10|>: no text; the next segment may start at 0.10 (not before)
    logits = torch.zeros(V)
    logits[END] = 5.0  # the end likelier than the timestamps together
    assert allowed([12, 3, 15], logits) == {END, 6, 7, 9} | set(range(15, 20))


def test_a_complete_pair_is_followed_by_text():
    logits = torch.zeros(V)
    logits[:TB] = 5.0
    assert allowed([12, 3, 15, 15], logits) == set(range(0, 8)) | {9}


def test_timestamps_win_when_together_likelier_than_any_text_token():
    logits = torch.zeros(V)  # after text: 7 timestamps (13-19) at 0 vs text tokens at 0
    assert allowed([12, 3], logits) == set(range(13, 20))  # mass 7 > 1: timestamps only
    logits[0] = math.log(8.0)  # one text token likelier than the 7 together
    assert 0 in allowed([12, 3], logits)


def test_timestamp_rules_reject_bad_input():
    with pytest.raises(ValueError, match="vocab"):
        whisper.apply_timestamp_rules(
            torch.zeros(2, V), [], timestamp_begin=TB, end_token=END, no_timestamps=8
        )
    with pytest.raises(ValueError, match="end_token"):
        whisper.apply_timestamp_rules(
            torch.zeros(V), [], timestamp_begin=TB, end_token=TB, no_timestamps=8
        )


def test_split_segments_reads_pairs_and_an_open_end():
    tokens = [TB + 0, 1, 2, TB + 50, TB + 50, 3, TB + 100]
    assert whisper.split_segments(tokens, TB) == [(0.0, 1.0, [1, 2]), (1.0, 2.0, [3])]
    assert whisper.split_segments([TB + 5, 1, 2], TB) == [(0.1, None, [1, 2])]
    assert whisper.split_segments([], TB) == []


def test_compression_ratio_is_bytes_over_zlib_bytes():
    text = "Attention is all you need."
    assert whisper.compression_ratio(text) == len(text) / len(zlib.compress(text.encode()))
    assert whisper.compression_ratio(text) < 2.4
    assert whisper.compression_ratio("please, " * 20) > 2.4  # a loop compresses well
    with pytest.raises(ValueError, match="empty"):
        whisper.compression_ratio("")
    with pytest.raises(TypeError, match="str"):
        whisper.compression_ratio(b"bytes")


def decoding(text="a fine transcript", avg=-0.3, no_speech=0.1):
    tokens = [1, 2, 3]
    return Decoding(tokens, text, avg * (len(tokens) + 1), no_speech, 0.0)


def test_needs_fallback_follows_whispers_three_tests():
    assert not whisper.needs_fallback(decoding())
    assert decoding(avg=-0.3).avg_log_prob == pytest.approx(-0.3)
    assert whisper.needs_fallback(decoding(text="please, " * 20))  # a loop
    assert whisper.needs_fallback(decoding(avg=-1.5))  # unsure
    assert not whisper.needs_fallback(decoding(avg=-1.5, no_speech=0.9))  # silence
    # silent-looking but sure: a loop is still a loop
    assert whisper.needs_fallback(decoding(text="please, " * 20, no_speech=0.9))
    assert not whisper.needs_fallback(decoding(avg=-1.5), logprob_threshold=None)


@pytest.fixture(scope="module")
def clip1():
    return audio.read_wav(CLIPS / "clip1.wav")[0]


def test_decode_is_greedy_decoding_scored_by_the_scoring_function(transcriber, clip1):
    result = transcriber.decode(clip1)
    assert result.tokens == transcriber.transcribe_tokens(clip1)
    assert result.text == transcriber.transcribe(clip1)
    expected = transcriber.sequence_log_probability(clip1, result.tokens)
    assert result.sum_log_prob == pytest.approx(expected, abs=1e-4)
    assert result.temperature == 0.0 and 0 <= result.no_speech_prob < 0.6


def test_decode_with_timestamps_obeys_the_rules(transcriber, clip1):
    result = transcriber.decode(clip1, timestamps=True)
    tb = transcriber.timestamp_begin
    assert tb <= result.tokens[0] <= tb + 50  # an early first timestamp
    segments = whisper.split_segments(result.tokens, tb)
    assert segments and all(end is not None and end > start for start, end, _ in segments)
    assert result.text == transcriber.transcribe(clip1)  # the same words
    assert all(end <= clip1.numel() / 16000 + 0.02 for _, end, _ in segments)


def test_silence_has_a_high_no_speech_probability(transcriber):
    assert transcriber.decode(torch.zeros(16000)).no_speech_prob > 0.6


def test_fallback_stops_at_the_first_good_decoding(transcriber, clip1):
    attempts = transcriber.decode_with_fallback(clip1, generator=torch.Generator())
    assert len(attempts) == 1 and attempts[0].temperature == 0.0
    # a threshold nothing meets: every temperature is tried, sampled from the generator
    attempts = transcriber.decode_with_fallback(
        clip1, logprob_threshold=0.0, no_speech_threshold=None,
        generator=torch.Generator().manual_seed(0),
    )
    assert [a.temperature for a in attempts] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_decode_without_timestamp_ids_refuses_timestamps(transcriber, clip1):
    plain = whisper.Transcriber(
        transcriber.model, transcriber.tokenizer, start_token=transcriber.start_token,
        end_token=transcriber.end_token, task_tokens=transcriber.prompt[1:],
    )
    with pytest.raises(ValueError, match="timestamp"):
        plain.decode(clip1, timestamps=True)
    assert math.isnan(plain.decode(clip1).no_speech_prob)


def test_beam_decoding_is_the_beam_transcript_with_its_score(transcriber, clip1):
    result = transcriber.decode_beam(clip1, beam_size=3)
    assert result.tokens == transcriber.transcribe_tokens(clip1, beam_size=3)
    expected = transcriber.sequence_log_probability(clip1, result.tokens)
    assert result.sum_log_prob == pytest.approx(expected, abs=1e-6)
    greedy = transcriber.decode(clip1)
    assert result.no_speech_prob == pytest.approx(greedy.no_speech_prob, abs=1e-5)
    assert result.temperature == 0.0


def test_fallback_with_a_beam_and_best_of(transcriber, clip1):
    # a threshold nothing meets: the beam at 0, then best_of samples at each temperature
    attempts = transcriber.decode_with_fallback(
        clip1, temperatures=(0.0, 0.6), logprob_threshold=0.0, no_speech_threshold=None,
        generator=torch.Generator().manual_seed(0), beam_size=2, best_of=3,
    )
    assert attempts[0].tokens == transcriber.transcribe_tokens(clip1, beam_size=2)
    # the kept sample is the best per token of the three the same generator draws
    generator = torch.Generator().manual_seed(0)
    transcriber.decode_beam(clip1, beam_size=2)  # the beam draws nothing
    draws = [transcriber.decode(clip1, temperature=0.6, generator=generator) for _ in range(3)]
    best = max(draws, key=lambda d: d.sum_log_prob / max(1, len(d.tokens)))
    assert attempts[1].tokens == best.tokens and attempts[1].temperature == 0.6
    with pytest.raises(ValueError, match="beam_size"):
        transcriber.decode_with_fallback(clip1, beam_size=0)
    with pytest.raises(ValueError, match="best_of"):
        transcriber.decode_with_fallback(clip1, best_of=0)
    with pytest.raises(ValueError, match="timestamps"):
        transcriber.decode_with_fallback(clip1, beam_size=2, timestamps=True)
