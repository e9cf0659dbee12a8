"""The CTC algorithm (Graves et al., 2006), on log-probabilities ``(T, C)`` per
utterance; chapter 10's two speech models that it is compared with live in
:mod:`attnbook.speech`.

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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .utils import check_positive_int

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


__all__ = [
    "ctc_best_alignment",
    "ctc_greedy_decode",
    "ctc_log_alpha",
    "ctc_loss",
    "ctc_prefix_beam_search",
]
