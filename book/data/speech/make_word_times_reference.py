"""Reference word times for chapter 10's clips, from openai-whisper's own code (run once; CI never runs it).

Run from the repository root, with openai-whisper beside the book's environment (it is not a dependency
of the book: it is installed into a folder of its own, without its dependencies, which the book's
environment already has, numba included):

    .venv/bin/python -m pip install --no-deps --target /tmp/openai-whisper openai-whisper==20250625 tiktoken==0.14.0 more-itertools
    PYTHONPATH=/tmp/openai-whisper .venv/bin/python book/data/speech/make_word_times_reference.py

It builds openai-whisper's `Whisper` model with tiny.en's dimensions, fills it with the same published
weights our `attnbook.whisper.load_whisper_tiny_en()` reads (copied over from our model, name by name),
sets tiny.en's alignment heads from openai-whisper's own table (`whisper._ALIGNMENT_HEADS["tiny.en"]`),
and for each of the chapter's eight clips (clip1..clip5, words1, words2, and "joined": words1, one
second of silence, words2) writes to word_times_reference.json:

- `tokens`: our greedy transcript's tokens (the alignment is computed for these tokens);
- `find_alignment`: openai-whisper's `whisper.timing.find_alignment` on those tokens and on the log-mel
  spectrogram of the audio padded to 30 s (as its README decodes, and as our `Transcriber` does), followed by its
  `merge_punctuations` (as `add_word_timestamps` does): `[word, start, end]` per word, in seconds,
  before the heuristics of `add_word_timestamps` (which need segment times);
- `transcribe`: openai-whisper's whole `transcribe(..., word_timestamps=True, temperature=0)`, its own
  decoding with timestamp tokens and its heuristics included: `[word, start, end]` per word. Its
  `transcribe` computes the log-mel of the audio padded with 30 s of zeros and then pads the clip's
  frames to 3,000 with zeros in the log-mel domain, not with the padding's own (floor) values: another
  input than the README's, so its words can differ from ours and their times do.
"""

import json
from pathlib import Path

import torch
import whisper as openai_whisper
from attnbook import audio, whisper
from whisper.model import ModelDimensions
from whisper.model import Whisper as OpenAIWhisper
from whisper.timing import find_alignment, merge_punctuations

HERE = Path(__file__).resolve().parent


def openai_model(ours):
    dims = ModelDimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=384, n_audio_head=6,
                           n_audio_layer=4, n_vocab=51864, n_text_ctx=448, n_text_state=384,
                           n_text_head=6, n_text_layer=4)
    model = OpenAIWhisper(dims)
    theirs = model.state_dict()
    mine = ours.state_dict()
    names = {"encoder.conv1": "encoder.stem.convs.0", "encoder.conv2": "encoder.stem.convs.1",
             "encoder.ln_post": "encoder.norm", "decoder.ln": "decoder.norm",
             "decoder.token_embedding": "decoder.token_embedding"}
    parts = {"attn.query": "self_attention.q_proj", "attn.key": "self_attention.k_proj",
             "attn.value": "self_attention.v_proj", "attn.out": "self_attention.out_proj",
             "cross_attn.query": "cross_attention.q_proj", "cross_attn.key": "cross_attention.k_proj",
             "cross_attn.value": "cross_attention.v_proj", "cross_attn.out": "cross_attention.out_proj",
             "mlp.0": "feed_forward.fc1", "mlp.2": "feed_forward.fc2", "attn_ln": "norm1",
             "cross_attn_ln": "norm2", "mlp_ln": None}
    state = {}
    for name in theirs:
        if name == "decoder.positional_embedding":
            state[name] = mine["decoder.positions.table"]
            continue
        if name == "encoder.positional_embedding":
            state[name] = ours.encoder.positions  # the checkpoint's table, as our model has it
            continue
        prefix, _, leaf = name.rpartition(".")
        if prefix in names:
            state[name] = mine[f"{names[prefix]}.{leaf}"]
            continue
        side, _, index, *rest = prefix.split(".")
        rest = ".".join(rest)
        if rest == "mlp_ln":  # the last norm of a block: norm2 in the encoder, norm3 in the decoder
            rest_ours = "norm2" if side == "encoder" else "norm3"
        else:
            rest_ours = parts[rest]
        state[name] = mine[f"{side}.blocks.{index}.{rest_ours}.{leaf}"]
    model.load_state_dict(state)
    model.set_alignment_heads(openai_whisper._ALIGNMENT_HEADS["tiny.en"])
    return model.eval()


def main():
    transcriber = whisper.load_whisper_tiny_en(device="cpu")
    model = openai_model(transcriber.model)
    tokenizer = openai_whisper.tokenizer.get_tokenizer(multilingual=False)
    texts = dict(line.split("|", 1) for line in (HERE / "texts.txt").read_text().splitlines())
    clips = {name: audio.read_wav(HERE / f"{name}.wav")[0] for name in [*texts, "words1", "words2"]}
    clips["joined"] = torch.cat([clips["words1"], torch.zeros(16000), clips["words2"]])
    out = {}
    for name, clip in clips.items():
        tokens = transcriber.transcribe_tokens(clip)
        # the audio padded to 30 s, then its log-mel (openai-whisper's README way, and ours)
        segment = openai_whisper.log_mel_spectrogram(openai_whisper.pad_or_trim(clip))
        frames = len(clip) // openai_whisper.audio.HOP_LENGTH  # the audio's own frames
        alignment = find_alignment(model, tokenizer, tokens, segment, frames)
        merge_punctuations(alignment, "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、")
        found = [[t.word.strip(), round(float(t.start), 2), round(float(t.end), 2)]
                 for t in alignment if t.word]
        result = model.transcribe(clip, word_timestamps=True, temperature=0.0,
                                  condition_on_previous_text=False, fp16=False, language="en")
        whole = [[w["word"].strip(), round(float(w["start"]), 2), round(float(w["end"]), 2)]
                 for segment in result["segments"] for w in segment["words"]]
        out[name] = {"tokens": tokens, "find_alignment": found, "transcribe": whole}
        print(name, found, whole, sep="\n  ")
    lines = [f'  "{name}": {json.dumps(entry)}' for name, entry in out.items()]
    (HERE / "word_times_reference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    main()
