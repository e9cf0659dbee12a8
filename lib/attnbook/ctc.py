"""Chapter 10's "CTC vs seq2seq": two ways to turn a sequence of speech frames into a
label sequence whose alignment to the frames is unknown, on the same encoder; and the
CTC algorithm itself.

The CTC algorithm (Graves et al., 2006), on log-probabilities ``(T, C)`` per utterance:

- :func:`ctc_loss`: the negative log-likelihood ``-log p(y | x)``, the sum over every
  alignment of the labels to the frames, computed by the forward (alpha) recursion over
  the blank-extended label sequence ``_ y1 _ y2 _ ... yU _`` (length ``2U + 1``), in log
  space, for a whole batch at once (a loop over time only). Same shapes and values as
  ``F.ctc_loss(..., reduction="none")``.
- :func:`ctc_log_alpha`: the whole trellis ``log alpha (T, 2U + 1)`` of one utterance
  (for plots), and :func:`ctc_best_alignment`: its single most probable alignment (the
  Viterbi path).
- :func:`ctc_greedy_decode`: best path decoding (the most likely class per frame,
  repeats merged, blanks dropped); :func:`ctc_prefix_beam_search` (Hannun et al., 2014):
  a beam of label *prefixes*, each scored by the sum over all its alignments, which
  finds more probable labellings.

The models:

- :class:`FeatureEncoder`: ``features (B, T, n_features)`` -> one vector per output
  frame (a strided 1D convolution, sinusoidal positions, pre-norm encoder blocks with
  the padding masked).
- :class:`CTCModel`: the encoder and one classification per frame over the classes plus
  a *blank*, trained with ``F.ctc_loss`` (PyTorch's fused version of :func:`ctc_loss`)
  and read by
  :func:`ctc_greedy_decode`.
- :class:`Seq2SeqSpeechModel`: the same encoder plus the library's
  :class:`~attnbook.models.TransformerDecoder`, which writes ``<bos> y1 y2 ... <eos>``
  one token at a time, reading the frames through cross-attention; trained with
  teacher-forced cross-entropy, decoded by :func:`attnbook.generate` (it has the
  decoding interface of :mod:`attnbook.models`).

Both read the spoken-digit task of :func:`attnbook.data.make_digit_sequences` and are
scored with
:func:`attnbook.metrics.error_rate`. Decoding runs in eval mode without gradients and
restores the caller's mode.

Shapes: feature sequences ``(B, T, n_features)`` with ``lengths (B,)``; encoder output
``(B, T', d)`` with ``T' = (T - 1) // stride + 1``; CTC log-probabilities ``(B, T',
num_classes + 1)``; label tokens ``(B, U)``; seq2seq logits ``(B, U, num_classes + 2)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import EncoderBlock
from .generation import generate
from .masks import padding_mask
from .models import TransformerDecoder
from .positions import SinusoidalPositions
from .utils import check_positive_int, eval_mode

# --- the CTC algorithm
# ----------------------------------------------------------------------------
# Log-probabilities y_t(k) of class k at frame t; a label sequence y = (y1 .. yU) is
# extended with blanks to z = (_ y1 _ y2 _ ... yU _), 2U + 1 states. An alignment visits
# z's states left to right, one state per frame, starting in z_0 or z_1 and ending in
# z_2U or z_2U-1; from state s it may stay, step to s + 1, or skip the blank to s + 2
# when z_s+2 is a label different from z_s.

NEG_INF = float("-inf")


def _logsumexp(terms: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch.logsumexp`` over ``dim``, giving ``-inf`` with a zero gradient (not NaN)
    where every term is ``-inf`` (a state no alignment reaches yet)."""
    alive = (terms > NEG_INF).any(dim)
    # no slice of only -inf
    safe = torch.where(alive.unsqueeze(dim), terms, torch.zeros_like(terms))
    return torch.where(alive, torch.logsumexp(safe, dim), NEG_INF)


def _as_lengths(
    name: str, lengths, batch: int, low: int, high: int, device
) -> torch.Tensor:
    """``lengths`` as a LongTensor ``(batch,)`` with values in ``[low, high]``, or a
    ValueError."""
    values = torch.as_tensor(lengths)
    if (
        values.shape != (batch,)
        or values.is_floating_point()
        or values.is_complex()
        or values.dtype == torch.bool
    ):
        raise ValueError(
            f"{name} must be {batch} integers (one per utterance), got {values.dtype} "
            f"{tuple(values.shape)}"
        )
    if batch and (int(values.min()) < low or int(values.max()) > high):
        raise ValueError(f"{name} must lie in [{low}, {high}], got {values.tolist()}")
    return values.long().to(device)


def _check_ctc_inputs(log_probs, targets, input_lengths, target_lengths, blank):
    """Validate the arguments of :func:`ctc_loss`; returns ``(targets, input_lengths,
    target_lengths)`` as LongTensors on ``log_probs``' device."""
    if (
        not isinstance(log_probs, torch.Tensor)
        or not log_probs.is_floating_point()
        or log_probs.dim() != 3
    ):
        raise ValueError(
            f"log_probs must be a float tensor (T, B, C), got "
            f"{getattr(log_probs, 'dtype', type(log_probs))} "
            f"{tuple(getattr(log_probs, 'shape', ()))}"
        )
    T, B, C = log_probs.shape
    if T < 1 or C < 1:
        raise ValueError(
            "log_probs (T, B, C) needs T >= 1 frames and C >= 1 classes, got "
            f"{tuple(log_probs.shape)}"
        )
    if isinstance(blank, bool) or not isinstance(blank, int) or not 0 <= blank < C:
        raise ValueError(f"blank must be a class index in [0, C={C}), got {blank!r}")
    if (
        not isinstance(targets, torch.Tensor)
        or targets.dim() != 2
        or targets.shape[0] != B
        or targets.is_floating_point()
        or targets.dtype == torch.bool
    ):
        hint = (
            "; log_probs looks batch-first (B, T, C): pass log_probs.transpose(0, 1)"
            if isinstance(targets, torch.Tensor)
            and targets.dim() == 2
            and targets.shape[0] == T != B
            else ""
        )
        raise ValueError(
            f"targets must be an integer tensor (B={B}, S) padded after each target "
            "length, got "
            f"{getattr(targets, 'dtype', type(targets))} "
            f"{tuple(getattr(targets, 'shape', ()))}{hint}"
        )
    S = targets.shape[1]
    input_lengths = _as_lengths(
        "input_lengths", input_lengths, B, 1, T, log_probs.device
    )
    target_lengths = _as_lengths(
        "target_lengths", target_lengths, B, 0, S, log_probs.device
    )
    targets = targets.long().to(log_probs.device)  # (B, S)
    # (B, S): True on the labels
    real = torch.arange(S, device=targets.device) < target_lengths[:, None]
    labels = targets[real]
    if labels.numel() and (
        int(labels.min()) < 0 or int(labels.max()) >= C or bool((labels == blank).any())
    ):
        raise ValueError(
            f"targets must hold class indices in [0, C={C}) other than blank={blank} "
            "within their "
            f"target_lengths, got {targets.tolist()}"
        )
    # (B,): equal neighbours
    repeats = (real[:, 1:] & (targets[:, 1:] == targets[:, :-1])).sum(1)
    # (B,): each repeat needs a blank between the two labels
    needed = target_lengths + repeats
    if int(needed.max()) > T:
        b = int(needed.argmax())
        raise ValueError(
            f"target {b} needs at least {int(needed[b])} frames "
            f"({int(target_lengths[b])} labels + "
            f"{int(repeats[b])} repeats) but log_probs has only T={T}; is "
            "log_probs (B, T, C) "
            "instead of (T, B, C)?"
        )
    return targets, input_lengths, target_lengths


def _ctc_alpha(
    log_probs, targets, input_lengths, target_lengths, blank
) -> list[torch.Tensor]:
    """The forward recursion: ``log alpha_t (B, 2S + 1)`` for ``t = 0 .. T - 1``, each
    utterance's frozen after its last frame. Arguments as validated by
    :func:`_check_ctc_inputs`."""
    T, B, _ = log_probs.shape
    S = targets.shape[1]
    real = torch.arange(S, device=targets.device) < target_lengths[:, None]  # (B, S)
    # (B, S): padding read as blanks (never reached)
    labels = torch.where(real, targets, blank)
    extended = labels.new_full((B, 2 * S + 1), blank)  # (B, 2S + 1): _ y1 _ y2 ... yS _
    extended[:, 1::2] = labels
    # skipping the blank from s - 2 to s: only onto a label that differs from the label
    # before
    can_skip = torch.zeros_like(extended, dtype=torch.bool)  # (B, 2S + 1)
    can_skip[:, 3::2] = labels[:, 1:] != labels[:, :-1]
    # (T, B, 2S + 1): log y_t(z_s)
    emit = log_probs.gather(2, extended[None].expand(T, B, 2 * S + 1))
    # alignments start in z_0 or z_1
    start = torch.arange(2 * S + 1, device=log_probs.device) < 2
    alphas = [torch.where(start, emit[0], NEG_INF)]  # (B, 2S + 1) at t = 0
    for t in range(1, T):
        alpha = alphas[-1]
        stay = alpha  # (B, 2S + 1): from s
        step = F.pad(alpha, (1, 0), value=NEG_INF)[:, :-1]  # from s - 1
        # s - 2
        skip = F.pad(alpha, (2, 0), value=NEG_INF)[:, :-2].masked_fill(
            ~can_skip, NEG_INF
        )
        new = _logsumexp(torch.stack([stay, step, skip])) + emit[t]  # (B, 2S + 1)
        # frozen at the end
        alphas.append(torch.where((t < input_lengths)[:, None], new, alpha))
    return alphas


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths,
    target_lengths,
    blank: int = 0,
) -> torch.Tensor:
    """The CTC loss of each utterance: ``-log p(y | x)``, the probability of the labels
    summed over every alignment, by the forward (alpha) recursion in log space. Returns
    ``(B,)``.

    Shapes as ``F.ctc_loss``, time first, so that it is checked against it:
    ``log_probs (T, B, C)`` (log-probabilities; any float values are used as they are;
    the models and :func:`ctc_greedy_decode` are batch first: pass ``(B, T, C)``
    transposed), ``targets (B, S)`` padded after each of
    ``target_lengths (B,)`` (values in ``[0, S]``), ``input_lengths (B,)`` in ``[1,
    T]``. The result equals ``F.ctc_loss(..., reduction="none")``: ``+inf`` where no
    alignment fits in the utterance's frames (fewer than ``U +`` the number of repeated
    neighbours), as ``F.ctc_loss`` without ``zero_infinity``.

    The recursion, with ``alpha_t(s)`` the log-probability of all alignments of ``z_0 ..
    z_s`` to frames ``0 .. t``::

        alpha_t(s) = logsumexp(alpha_t-1(s), alpha_t-1(s - 1), [alpha_t-1(s - 2) if z_s
        != _, z_s-2])
                     + log y_t(z_s)
        log p(y | x) = logsumexp(alpha_T-1(2U), alpha_T-1(2U - 1))

    A ``ValueError`` names the bad argument: wrong dims or batch sizes, lengths out of
    range, labels out of ``[0, C)`` or equal to ``blank``, ``blank`` out of range, or a
    target that needs more frames than ``log_probs`` has at all (usually ``(B, T, C)``
    passed for ``(T, B, C)``).
    """
    targets, input_lengths, target_lengths = _check_ctc_inputs(
        log_probs, targets, input_lengths, target_lengths, blank
    )
    # (B, 2S + 1)
    alpha = _ctc_alpha(log_probs, targets, input_lengths, target_lengths, blank)[-1]
    last = 2 * target_lengths[:, None]  # (B, 1): the final blank z_2U
    end_blank = alpha.gather(1, last)  # (B, 1)
    # z_2U-1
    end_label = alpha.gather(1, (last - 1).clamp_min(0)).masked_fill(last == 0, NEG_INF)
    return -_logsumexp(torch.stack([end_blank, end_label]))[:, 0]  # (B,)


def _check_utterance(log_probs, target, blank):
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2:
        raise ValueError(
            "log_probs must be one utterance's (T, C), got "
            f"{tuple(getattr(log_probs, 'shape', ()))}"
        )
    target = torch.as_tensor(target, dtype=torch.long)
    if target.dim() != 1:
        raise ValueError(
            f"target must be one label sequence (U,), got shape {tuple(target.shape)}"
        )
    T = log_probs.shape[0]
    # a batch of one
    args = (log_probs[:, None], target[None], [T], [len(target)], blank)
    return _check_ctc_inputs(*args)


def ctc_log_alpha(log_probs: torch.Tensor, target, blank: int = 0) -> torch.Tensor:
    """The forward trellis of one utterance: ``log alpha (T, 2U + 1)`` for ``log_probs
    (T, C)`` and ``target (U,)``: ``log alpha[t, s]`` is the log-probability of every
    alignment of the first ``s + 1`` states of ``_ y1 _ ... yU _`` to frames ``0 .. t``
    (``-inf`` where none exists). Row ``T - 1`` at columns ``2U`` and ``2U - 1`` sums to
    ``p(y | x)``; see :func:`ctc_loss`."""
    targets, input_lengths, target_lengths = _check_utterance(log_probs, target, blank)
    alphas = _ctc_alpha(
        log_probs[:, None], targets, input_lengths, target_lengths, blank
    )
    return torch.cat(alphas)  # (T, 2U + 1)


def ctc_best_alignment(log_probs: torch.Tensor, target, blank: int = 0) -> list[int]:
    """The single most probable alignment of ``target (U,)`` to ``log_probs (T, C)``
    (the Viterbi path through the trellis of :func:`ctc_log_alpha`, max in place of the
    sum): one state ``s`` of ``_ y1 _ ... yU _`` per frame (``T`` ints in ``[0, 2U]``).
    Raises ``ValueError`` when no alignment exists (any frame of it would have
    probability 0)."""
    targets, _, _ = _check_utterance(log_probs, target, blank)
    scores = log_probs.detach().double().cpu()  # (T, C)
    U = targets.shape[1]
    # 2U + 1 states
    z = [blank] + [c for label in targets[0].tolist() for c in (label, blank)]
    T, states = scores.shape[0], len(z)
    # best[t][s]: log-probability of the best way to (t, s)
    best = [[NEG_INF] * states for _ in range(T)]
    back = [[0] * states for _ in range(T)]  # the state it came from at t - 1
    for s in range(min(2, states)):
        best[0][s] = float(scores[0, z[s]])
    for t in range(1, T):
        for s in range(states):
            sources = [s, s - 1] + (
                [s - 2] if s >= 2 and z[s] != blank and z[s] != z[s - 2] else []
            )
            source = max((r for r in sources if r >= 0), key=lambda r: best[t - 1][r])
            best[t][s] = best[t - 1][source] + float(scores[t, z[s]])
            back[t][s] = source
    ends = [2 * U] + ([2 * U - 1] if U else [])
    s = max(ends, key=lambda r: best[T - 1][r])
    if best[T - 1][s] == NEG_INF:
        raise ValueError(
            f"no alignment of the target {targets[0].tolist()} to these {T} frames has "
            "a "
            "probability above 0"
        )
    path = [s]
    for t in range(T - 1, 0, -1):
        s = back[t][s]
        path.append(s)
    return path[::-1]


# --- decoding
# -------------------------------------------------------------------------------------


def ctc_greedy_decode(
    log_probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0
) -> list[list[int]]:
    """Best path decoding: the most likely class in each frame, repeats collapsed, then
    blanks dropped.

    ``log_probs (B, T, C)``, batch first as the models' outputs (:func:`ctc_loss` takes
    them time first, as ``F.ctc_loss``), ``lengths (B,)`` -> one list of class ids per
    sequence (``blank`` excluded).
    """
    if log_probs.dim() != 3 or lengths.shape != log_probs.shape[:1]:
        raise ValueError(
            f"need log_probs (B, T, C) and lengths (B,), got {tuple(log_probs.shape)} "
            f"and {tuple(lengths.shape)}"
        )
    best = log_probs.argmax(dim=-1).cpu()  # (B, T)
    out = []
    for path, length in zip(best, lengths.tolist(), strict=True):
        # collapse repeats: a a _ a -> a _ a
        path = torch.unique_consecutive(path[:length])
        out.append([int(c) for c in path if c != blank])  # drop blanks: a _ a -> a a
    return out


def _log_add(a: float, b: float) -> float:
    """``log(exp(a) + exp(b))`` of two Python floats."""
    if a < b:
        a, b = b, a
    return a if b == NEG_INF else a + math.log1p(math.exp(b - a))


def ctc_prefix_beam_search(
    log_probs: torch.Tensor, beam_size: int = 8, blank: int = 0
) -> list[int]:
    """Prefix beam search (Hannun et al., 2014) over one utterance's ``log_probs (T,
    C)``: the most probable labelling it finds (class ids, ``blank`` excluded).

    Best path decoding scores one alignment; here each candidate is a label *prefix*,
    scored by the sum over all its alignments so far, kept as two numbers: the
    log-probability of the alignments that end in a blank and of those that end in the
    prefix's last label. (The split matters for a repeated label: ``a`` then ``a``
    merges unless a blank came between.) Each frame extends every prefix in the beam by
    each class, merges the candidates that read the same, and keeps the ``beam_size``
    most probable. With a beam as wide as the number of prefixes the search is exact: it
    returns ``argmax_y p(y | x)``; ``beam_size=1`` follows the single most probable
    prefix.
    """
    if (
        not isinstance(log_probs, torch.Tensor)
        or not log_probs.is_floating_point()
        or log_probs.dim() != 2
    ):
        raise ValueError(
            f"log_probs must be one utterance's float (T, C), got "
            f"{getattr(log_probs, 'dtype', type(log_probs))} "
            f"{tuple(getattr(log_probs, 'shape', ()))}"
        )
    beam_size = check_positive_int("beam_size", beam_size)
    C = log_probs.shape[1]
    if isinstance(blank, bool) or not isinstance(blank, int) or not 0 <= blank < C:
        raise ValueError(f"blank must be a class index in [0, C={C}), got {blank!r}")
    # prefix -> (log p ending in a blank, log p ending in its last label)
    beam = {(): (0.0, NEG_INF)}
    # one frame: C log-probabilities
    for row in log_probs.detach().double().cpu().tolist():
        candidates: dict[tuple, list[float]] = {}
        for prefix, (ends_blank, ends_label) in beam.items():
            total = _log_add(ends_blank, ends_label)
            same = candidates.setdefault(prefix, [NEG_INF, NEG_INF])
            # a blank: the prefix reads the same
            same[0] = _log_add(same[0], total + row[blank])
            for c, score in enumerate(row):
                if c == blank:
                    continue
                longer = candidates.setdefault(prefix + (c,), [NEG_INF, NEG_INF])
                if prefix and c == prefix[-1]:
                    # a a -> a: merged with the last label
                    same[1] = _log_add(same[1], ends_label + score)
                    # a _ a -> a a: a new label
                    longer[1] = _log_add(longer[1], ends_blank + score)
                else:
                    longer[1] = _log_add(longer[1], total + score)
        ranked = sorted(
            candidates.items(), key=lambda item: _log_add(*item[1]), reverse=True
        )
        beam = {prefix: tuple(scores) for prefix, scores in ranked[:beam_size]}
    return list(max(beam, key=lambda prefix: _log_add(*beam[prefix])))


# --- the models
# ------------------------------------------------------------------------------------


class FeatureEncoder(nn.Module):
    """``features (B, T, n_features)`` -> ``(B, T', d)``: a 1D convolution over the
    frames (kernel 3, GELU; with ``stride=2`` it halves the frame rate, as Whisper's
    stem does), sinusoidal positions, pre-norm encoder blocks (padding masked) and a
    final LayerNorm. One vector per output frame. The features are cast to the weights'
    dtype first (they are float32; the model may be bf16).
    """

    def __init__(
        self,
        n_features: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        stride: int = 2,
        dropout: float = 0.0,
    ):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride!r}")
        self.n_features = check_positive_int("n_features", n_features)
        num_layers = check_positive_int("num_layers", num_layers)
        self.stride = stride
        self.conv = nn.Conv1d(
            n_features, d_model, kernel_size=3, stride=stride, padding=1
        )
        self.positions = SinusoidalPositions(d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(
                d_model, num_heads, 4 * d_model, dropout, activation="gelu", norm="pre"
            )
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many output frames ``lengths`` input frames give: ``(L - 1) // stride +
        1``."""
        return torch.div(lengths - 1, self.stride, rounding_mode="floor") + 1

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        """Returns ``(hidden (B, T', d), key_padding_mask (B, T'), output lengths
        (B,))``."""
        if not isinstance(features, torch.Tensor) or not features.is_floating_point():
            raise TypeError(
                f"features must be a float tensor (B, T, n_features), "
                f"got {getattr(features, 'dtype', type(features))}"
            )
        if features.dim() != 3 or features.shape[-1] != self.n_features:
            raise ValueError(
                f"features must be (B, T, n_features={self.n_features}), got "
                f"{tuple(features.shape)}"
            )
        if (
            not isinstance(lengths, torch.Tensor)
            or lengths.shape != features.shape[:1]
            or int(lengths.min()) < 1
            or int(lengths.max()) > features.shape[1]
        ):
            got = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
            raise ValueError(
                f"lengths must be (B={features.shape[0]},) in [1, "
                f"{features.shape[1]}], got {got}"
            )
        features = features.to(self.conv.weight.dtype)  # (B, T, F) in the model's dtype
        # (B, T): True on real frames
        keep = ~padding_mask(lengths, features.shape[1]).to(features.device)
        # (B, T', d)
        x = F.gelu(self.conv((features * keep[..., None]).transpose(1, 2))).transpose(
            1, 2
        )
        lengths = self.output_lengths(lengths)  # (B,)
        # (B, T')
        key_padding_mask = padding_mask(lengths, x.shape[1]).to(features.device)
        x = self.dropout(self.positions(x))  # (B, T', d)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)  # (B, T', d)
        return self.norm(x), key_padding_mask, lengths


class CTCModel(nn.Module):
    """A :class:`FeatureEncoder` and one classification per output frame over
    ``num_classes + 1`` outputs (0 is the CTC blank, class ``c`` is output ``c + 1``),
    trained with ``F.ctc_loss`` to sum over every alignment.

    ``forward(features (B, T, F), lengths (B,))`` returns ``(log_probs (B, T',
    num_classes + 1), output lengths (B,))``: float32 log-probabilities (whatever the
    model's dtype: the CTC loss sums them over every frame) and how many of the ``T'``
    frames are real in each sequence.
    """

    def __init__(
        self,
        n_features: int,
        num_classes: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        *,
        stride: int = 2,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.encoder = FeatureEncoder(
            n_features, d_model, num_heads, num_layers, stride=stride, dropout=dropout
        )
        self.head = nn.Linear(d_model, num_classes + 1)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        hidden, _, lengths = self.encoder(features, lengths)  # (B, T', d), (B,)
        # (B, T', C + 1) float32, (B,)
        return self.head(hidden).float().log_softmax(dim=-1), lengths

    def loss(self, features, lengths, targets, target_lengths) -> torch.Tensor:
        """CTC loss (mean over the batch of the per-sequence loss divided by its target
        length)."""
        log_probs, lengths = self(features, lengths)  # (B, T', C + 1)
        # (B, U): classes shifted past the blank; padding is ignored
        labels = (targets + 1).clamp_min(0)
        return F.ctc_loss(
            log_probs.transpose(0, 1),
            labels,
            lengths,
            target_lengths,
            blank=0,
            zero_infinity=True,
        )

    def decode(self, features, lengths) -> list[list[int]]:
        """Greedy CTC decoding; class ids ``0 .. num_classes - 1`` per sequence. Runs in
        eval mode without gradients (the caller's mode is restored)."""
        with eval_mode(self):
            log_probs, lengths = self(features, lengths)  # (B, T', C + 1), (B,)
        return [
            [c - 1 for c in path]
            for path in ctc_greedy_decode(log_probs, lengths, blank=0)
        ]


class Seq2SeqSpeechModel(nn.Module):
    """The same encoder, plus a :class:`~attnbook.models.TransformerDecoder` that writes
    the label sequence one token at a time, reading the frames through cross-attention:
    ``<bos> y1 y2 ... <eos>`` (``bos = num_classes``, ``eos = num_classes + 1``).

    ``forward(features (B, T, F), lengths (B,), tokens (B, U)) -> logits (B, U,
    num_classes + 2)``;
    :meth:`decode` writes the labels with :func:`attnbook.generate` (the decoding
    interface: ``features=, lengths=`` are its inputs).
    """

    def __init__(
        self,
        n_features: int,
        num_classes: int,
        d_model: int = 64,
        num_heads: int = 4,
        num_encoder_layers: int = 2,
        num_decoder_layers: int = 1,
        max_len: int = 16,
        *,
        stride: int = 2,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.max_len, self.num_heads = check_positive_int("max_len", max_len), num_heads
        self.vocab_size = num_classes + 2  # the classes, <bos> and <eos>
        self.bos, self.eos = num_classes, num_classes + 1
        self.encoder = FeatureEncoder(
            n_features,
            d_model,
            num_heads,
            num_encoder_layers,
            stride=stride,
            dropout=dropout,
        )
        self.decoder = TransformerDecoder(
            num_classes + 2,
            d_model,
            num_heads,
            num_decoder_layers,
            max_len,
            hidden=4 * d_model,
            dropout=dropout,
            positions="learned",
            head_bias=True,
        )

    def forward(self, features, lengths, tokens) -> torch.Tensor:
        # (B, T', d), (B, T')
        memory, key_padding_mask, _ = self.encoder(features, lengths)
        return self.decoder(tokens, memory, key_padding_mask)  # (B, U, C + 2)

    def loss(self, features, lengths, targets, target_lengths) -> torch.Tensor:
        """Teacher-forced cross-entropy of ``y1 .. yU <eos>`` given ``<bos> y1 ..
        yU``."""
        B, U = targets.shape
        positions = torch.arange(U + 1, device=targets.device)[None, :]  # (1, U + 1)
        # (B, U + 1)
        outputs = torch.cat([targets, targets.new_full((B, 1), -1)], dim=1)
        # <eos> after the labels
        outputs = torch.where(positions == target_lengths[:, None], self.eos, outputs)
        # ignored padding
        outputs = torch.where(positions > target_lengths[:, None], -100, outputs)
        # (B, U + 1)
        inputs = torch.cat(
            [targets.new_full((B, 1), self.bos), outputs[:, :-1].clamp_min(0)], dim=1
        )
        logits = self(features, lengths, inputs)  # (B, U + 1, C + 2)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), outputs.flatten(), ignore_index=-100
        )

    # the decoding interface of attnbook.models, driven by attnbook.generate
    def decoding_context(self, batch_size: int, features=None, lengths=None):
        """``(memory (B, T', d), key_padding_mask (B, T'))`` for ``features (B, T, F)``,
        ``lengths (B,)``, moved to the model's device."""
        if features is None or lengths is None:
            raise ValueError(
                "Seq2SeqSpeechModel generates from speech: pass features=(B, T, F) and "
                "lengths=(B,)"
            )
        device = next(self.parameters()).device
        features, lengths = (
            torch.as_tensor(features).to(device),
            torch.as_tensor(lengths).to(device),
        )
        if features.shape[0] != batch_size:
            raise ValueError(
                f"features have batch size {features.shape[0]} but the prompt has "
                f"{batch_size}"
            )
        # (B, T', d), (B, T')
        memory, key_padding_mask, _ = self.encoder(features, lengths)
        return memory, key_padding_mask

    def decoding_caches(self, batch_size: int, context):
        return self.decoder.make_caches(batch_size, context[0].shape[1])

    def decode_step(self, tokens, context, caches) -> torch.Tensor:
        memory, key_padding_mask = context
        # (B, U, C + 2)
        return self.decoder(tokens, memory, key_padding_mask, caches, check_ids=False)

    def decode(
        self, features, lengths, max_new_tokens: int | None = None
    ) -> list[list[int]]:
        """Greedy decoding with the KV cache until ``<eos>`` (or ``max_new_tokens``, at
        most and by default ``max_len - 1``); class ids per sequence. Runs in eval mode
        without gradients (the caller's mode is restored)."""
        limit = self.max_len - 1  # the prompt <bos> takes one position
        max_new_tokens = (
            limit
            if max_new_tokens is None
            else check_positive_int("max_new_tokens", max_new_tokens)
        )
        if max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens must be at most max_len - 1 = {limit}, got "
                f"{max_new_tokens}"
            )
        device = next(self.parameters()).device
        # (B, 1)
        prompt = torch.full(
            (len(features), 1), self.bos, dtype=torch.long, device=device
        )
        with eval_mode(self):
            tokens = generate(
                self,
                prompt,
                max_new_tokens,
                end_token=self.eos,
                suppress=[self.bos],
                features=features,
                lengths=lengths,
            )  # (B, 1 + new)
        sequences = tokens[:, 1:].cpu().tolist()
        return [
            seq[: seq.index(self.eos)] if self.eos in seq else seq for seq in sequences
        ]


__all__ = [
    "CTCModel",
    "FeatureEncoder",
    "Seq2SeqSpeechModel",
    "ctc_best_alignment",
    "ctc_greedy_decode",
    "ctc_log_alpha",
    "ctc_loss",
    "ctc_prefix_beam_search",
]
