"""Synthesise the word-timing clips once, word by word, with the offline text-to-speech program espeak-ng.

Run from the repository root (needs `apt-get install espeak-ng`; CI never runs this script):

    .venv/bin/python book/data/speech/make_word_clips.py

Each word of each sentence below is synthesised on its own (espeak-ng, voice en-us with the m3
variant, 120 words a minute, 22050 Hz), cut to the span between its first and last non-zero sample
(espeak-ng pads its output with exact zeros), resampled to 16 kHz with a polyphase filter
(scipy.signal.resample_poly, 320/441) and placed in the clip after a silence of known length
(GAPS). So each word's true interval is known to the sample: words.json holds, per clip, the text
and every word's [start, end] in seconds; wordsN.wav is 16 kHz mono 16-bit PCM.
"""

import io
import json
import subprocess
import wave
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

HERE = Path(__file__).parent
VOICE, WORDS_PER_MINUTE, RATE = "en-us+m3", 120, 16000
SENTENCES = {
    "words1": "Old ships sail past rocky islands",
    "words2": "My brother plays guitar every evening",
}
# silence before each word and after the last one, in seconds: varied, so that a word's place in
# the clip cannot be guessed from its rank alone
GAPS = (0.25, 0.15, 0.30, 0.20, 0.35, 0.15, 0.25)


def synthesise_word(word: str) -> np.ndarray:
    raw = subprocess.run(["espeak-ng", "-v", VOICE, "-s", str(WORDS_PER_MINUTE), "--stdout", word],
                         check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(raw)) as f:
        if (f.getnchannels(), f.getsampwidth(), f.getframerate()) != (1, 2, 22050):
            raise ValueError(f"expected espeak-ng's 22050 Hz mono 16-bit, got {f.getparams()}")
        frames = f.readframes(f.getnframes())
    audio = np.frombuffer(frames, dtype="<i2").astype(np.float64) / 32768.0
    sounding = np.nonzero(audio)[0]
    audio = audio[sounding[0] : sounding[-1] + 1]  # espeak-ng's leading and trailing silence is exact zeros
    return resample_poly(audio, 320, 441)  # 22050 Hz * 320 / 441 = 16000 Hz


def main() -> None:
    truth = {}
    for name, text in SENTENCES.items():
        words = text.split()
        pieces, intervals, position = [], [], 0
        for i, word in enumerate(words):
            silence = np.zeros(round(GAPS[i] * RATE))
            spoken = synthesise_word(word)
            pieces += [silence, spoken]
            start = position + len(silence)
            position = start + len(spoken)
            intervals.append([word, round(start / RATE, 4), round(position / RATE, 4)])
        pieces.append(np.zeros(round(GAPS[len(words)] * RATE)))
        audio = np.concatenate(pieces)
        pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype("<i2")
        with wave.open(str(HERE / f"{name}.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(RATE)
            f.writeframes(pcm.tobytes())
        truth[name] = {"text": text, "words": intervals}
        print(f"{name}.wav: {len(pcm) / RATE:.2f} s  {text}")
    lines = [f'  "{name}": {{"text": "{clip["text"]}", "words": [\n' + ",\n".join(
        "    " + json.dumps(interval) for interval in clip["words"]) + "\n  ]}" for name, clip in truth.items()]
    (HERE / "words.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one word a line


if __name__ == "__main__":
    main()
