"""Error rates of sequence outputs: the edit distance, and the token and word error
rates built on it.

- :func:`edit_distance`: Levenshtein's distance, the fewest substitutions, insertions
  and deletions.
- :func:`edit_operations`: how many of each kind a cheapest alignment needs (the error
  breakdown).
- :func:`error_rate`: total edit distance over total reference length, for a corpus of
  token sequences (chapter 10 scores the spoken-digit models with it).
- :func:`normalize_text` and :func:`word_error_rate`: the word error rate (WER) of
  transcripts, after lower-casing and removing punctuation (chapter 10 scores Whisper
  with it).
"""

from __future__ import annotations

import re


def edit_distance(reference, hypothesis) -> int:
    """Levenshtein distance between two sequences: the fewest substitutions, insertions
    and deletions."""
    reference, hypothesis = list(reference), list(hypothesis)
    # row i - 1 of the table: distances from reference[:i - 1]
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, start=1):
        current = [i]
        for j, h in enumerate(hypothesis, start=1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h))
            )
        previous = current
    return previous[-1]


def edit_operations(reference, hypothesis) -> tuple[int, int, int]:
    """``(substitutions, deletions, insertions)`` turning ``reference`` into
    ``hypothesis`` along a cheapest alignment: they sum to :func:`edit_distance`. A
    deletion is a reference token the hypothesis misses, an insertion a hypothesis token
    with no reference token.

    Several cheapest alignments can exist (``ab`` -> ``ba``: two substitutions, or a
    deletion and an insertion); this one has the most substitutions. The counts are then
    unique: ``deletions - insertions = len(reference) - len(hypothesis)`` fixes the
    rest.
    """
    reference, hypothesis = list(reference), list(hypothesis)
    # cell (i, j): (edits, deletions + insertions, substitutions, deletions, insertions)
    # of the best alignment of reference[:i] with hypothesis[:j]; tuples compare edits
    # first, then indels
    # row 0: insert all
    previous = [(j, j, 0, 0, j) for j in range(len(hypothesis) + 1)]
    for i, r in enumerate(reference, start=1):
        current = [(i, i, 0, i, 0)]  # column 0: delete all
        for j, h in enumerate(hypothesis, start=1):
            e, n, sub, dele, ins = previous[j - 1]
            # match or substitution
            diagonal = (e + (r != h), n, sub + (r != h), dele, ins)
            e, n, sub, dele, ins = previous[j]
            deletion = (e + 1, n + 1, sub, dele + 1, ins)
            e, n, sub, dele, ins = current[j - 1]
            insertion = (e + 1, n + 1, sub, dele, ins + 1)
            current.append(min(diagonal, deletion, insertion))
        previous = current
    return previous[-1][2:]


def error_rate(references, hypotheses) -> float:
    """Total edit distance over total reference length (the token, or word, error rate
    of a corpus)."""
    references, hypotheses = list(references), list(hypotheses)
    if len(references) != len(hypotheses) or not references:
        raise ValueError(
            "need as many hypotheses as references (at least one), got "
            f"{len(references)} "
            f"and {len(hypotheses)}"
        )
    total = sum(len(r) for r in references)
    if total == 0:
        raise ValueError("the references are all empty: the error rate is undefined")
    return (
        sum(edit_distance(r, h) for r, h in zip(references, hypotheses, strict=True))
        / total
    )


def normalize_text(text: str) -> list[str]:
    """Lower-case words without punctuation (``"Hello, world."`` -> ``["hello",
    "world"]``)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """The word error rate of transcripts against reference texts, after
    :func:`normalize_text`."""
    if isinstance(references, str) or isinstance(hypotheses, str):
        raise TypeError(
            "references and hypotheses must be lists of strings, not one string"
        )
    return error_rate(
        [normalize_text(r) for r in references], [normalize_text(h) for h in hypotheses]
    )


__all__ = [
    "edit_distance",
    "edit_operations",
    "error_rate",
    "normalize_text",
    "word_error_rate",
]
