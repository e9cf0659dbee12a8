"""Synthesise the speech chapter's clips once, with the offline text-to-speech program espeak-ng.

Run from the repository root (needs `apt-get install espeak-ng`; CI never runs this script):

    .venv/bin/python book/data/speech/make_clips.py

For each line of texts.txt ("name|sentence") it asks espeak-ng for a WAV (22050 Hz mono 16-bit,
voice en-us with the m3 variant, 120 words a minute, 40 ms gaps between words), resamples it to
16 kHz with a polyphase filter (scipy.signal.resample_poly, 320/441), cuts the trailing silence
to 0.15 s and writes name.wav (16 kHz mono 16-bit PCM).
"""

import io
import subprocess
import wave
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

HERE = Path(__file__).parent
VOICE, WORDS_PER_MINUTE, WORD_GAP, RATE = "en-us+m3", 120, 4, 16000  # gap in units of 10 ms


def synthesise(text: str) -> np.ndarray:
    raw = subprocess.run(["espeak-ng", "-v", VOICE, "-s", str(WORDS_PER_MINUTE), "-g", str(WORD_GAP),
                          "--stdout", text],
                         check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(raw)) as f:
        if f.getnchannels() != 1 or f.getsampwidth() != 2:
            raise ValueError(f"espeak-ng gave {f.getnchannels()} channels of {f.getsampwidth()} bytes")
        rate = f.getframerate()
        frames = f.readframes(f.getnframes())
    audio = np.frombuffer(frames, dtype="<i2").astype(np.float64) / 32768.0
    if rate != 22050:
        raise ValueError(f"expected espeak-ng's 22050 Hz, got {rate}")
    return resample_poly(audio, 320, 441)  # 22050 Hz * 320 / 441 = 16000 Hz


def main() -> None:
    for line in (HERE / "texts.txt").read_text().splitlines():
        name, text = line.split("|", 1)
        audio = synthesise(text)
        last_loud = int(np.nonzero(np.abs(audio) > 0.01)[0][-1])
        audio = audio[: last_loud + int(0.15 * RATE)]  # espeak-ng ends with ~0.6 s of silence
        pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype("<i2")
        with wave.open(str(HERE / f"{name}.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(RATE)
            f.writeframes(pcm.tobytes())
        print(f"{name}.wav: {len(pcm) / RATE:.2f} s  {text}")


if __name__ == "__main__":
    main()
