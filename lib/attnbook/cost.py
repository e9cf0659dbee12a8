"""What attention costs: FLOP and memory formulas.

Counting convention: one multiply-add is **2 FLOPs**, so a matrix product ``(n, a) @ (a,
b)`` costs ``2 n a b`` FLOPs. Softmax, layer norm, biases and activations are ``O(n^2
h)`` or ``O(n d)`` element-wise work and are left out of the formulas (they are small
next to the products).

Shapes, for one sequence of ``n`` tokens of width ``d`` (``h`` heads of width ``d /
h``):

========================  ===============================  ==========================
piece                     what is multiplied               FLOPs
========================  ===============================  ==========================
Q, K, V, output proj.     4 x ``(n, d) @ (d, d)``          ``4 * 2 n d^2 = 8 n d^2``
scores ``Q K^T``          h x ``(n, d/h) @ (d/h, n)``      ``2 n^2 d``
weighted sum ``A V``      h x ``(n, n) @ (n, d/h)``        ``2 n^2 d``
feed-forward              ``(n, d) @ (d, H)``, back        ``2 * 2 n d H`` (``16 n d^2``
at ``H = 4d``) recurrent (Elman) layer   n x (``W_x x_t + W_h h_{t-1}``)  ``n (2 d d_in
+ 2 d^2)`` ========================  ===============================
==========================

So self-attention's own work grows as ``n^2 d`` and a recurrent layer's as ``n d^2``;
the two are equal at ``n = d`` (:func:`crossover_length`, the comparison of Vaswani et
al.'s Table 1). Whole layers, per token: attention ``8 d^2 + 4 n d`` against ``4 gates
d^2``: never cheaper than an Elman RNN, equal to a GRU at ``n = d`` and to an LSTM at
``n = 2d`` (:func:`layer_crossover_length`). Attention needs ``O(1)`` sequential steps;
a recurrent layer needs ``n`` of them, one per token.

Memory: the attention weights are ``h n^2`` numbers per layer and sequence
(:func:`attention_weights_bytes`); a KV cache of ``T`` tokens is ``2 * layers * T * d``
numbers per sequence (:func:`kv_cache_bytes`); per token and layer
:func:`kv_bytes_per_token` (multi-head, grouped-query, multi-query attention) and
:func:`latent_kv_bytes_per_token` (multi-head latent attention, chapter 18, whose
decoding FLOPs :func:`latent_decode_flops` counts in its two modes).

Measuring what these formulas predict (timing, peak memory, fitting a power law) is
:mod:`attnbook.measure`'s job.
"""

from __future__ import annotations

from .utils import check_positive_int

LAYER_KINDS = ("self-attention", "recurrent")


# --------------------------------------------------------------------------- FLOPs


def attention_projection_flops(n: int, d: int) -> int:
    """FLOPs of the four ``d x d`` projections (queries, keys, values, output) on ``n``
    tokens: ``4 * 2 n d^2 = 8 n d^2``. The same for any number of heads."""
    n, d = check_positive_int("n", n), check_positive_int("d", d)
    return 4 * 2 * n * d * d


def attention_score_flops(n: int, d: int, n_keys: int | None = None) -> int:
    """FLOPs of the scores ``Q K^T``: ``2 n m d`` for ``n`` queries and ``m`` keys (``m
    = n`` by default).

    Split into ``h`` heads of width ``d / h`` it is ``h * 2 n m (d / h)``: the same
    total."""
    n, d = check_positive_int("n", n), check_positive_int("d", d)
    m = n if n_keys is None else check_positive_int("n_keys", n_keys)
    return 2 * n * m * d


def attention_weighted_sum_flops(n: int, d: int, n_keys: int | None = None) -> int:
    """FLOPs of the weighted sum of the values ``A V``, ``(n, m) @ (m, d)``: ``2 n m
    d``."""
    n, d = check_positive_int("n", n), check_positive_int("d", d)
    m = n if n_keys is None else check_positive_int("n_keys", n_keys)
    return 2 * n * m * d


def attention_core_flops(n: int, d: int) -> int:
    """FLOPs of attention itself (scores and weighted sum, no projections): ``4 n^2 d``,
    the ``O(n^2 d)`` term."""
    return attention_score_flops(n, d) + attention_weighted_sum_flops(n, d)


def attention_layer_flops(n: int, d: int) -> int:
    """FLOPs of a whole self-attention layer on ``n`` tokens of width ``d``: ``8 n d^2 +
    4 n^2 d``."""
    return attention_projection_flops(n, d) + attention_core_flops(n, d)


def ffn_flops(n: int, d: int, hidden: int | None = None) -> int:
    """FLOPs of the position-wise feed-forward network ``d -> hidden -> d`` on ``n``
    tokens: ``2 * (2 n d hidden) = 4 n d hidden``; ``16 n d^2`` at the default ``hidden
    = 4 d``."""
    n, d = check_positive_int("n", n), check_positive_int("d", d)
    hidden = 4 * d if hidden is None else check_positive_int("hidden", hidden)
    return 2 * 2 * n * d * hidden


def recurrent_flops(
    n: int, d: int, input_size: int | None = None, gates: int = 1
) -> int:
    """FLOPs of a recurrent layer with hidden size ``d`` over ``n`` tokens of width
    ``input_size`` (default ``d``): each step computes ``W_x x_t + W_h h_{t-1}`` for
    every gate, so ``n * gates * (2 d input_size + 2 d^2)``; ``4 n d^2`` for an Elman
    RNN (``gates=1``), ``3x`` that for a GRU (``gates=3``), ``4x`` for an LSTM
    (``gates=4``). This is ``O(n d^2)``."""
    n, d = check_positive_int("n", n), check_positive_int("d", d)
    input_size = (
        d if input_size is None else check_positive_int("input_size", input_size)
    )
    gates = check_positive_int("gates", gates)
    return n * gates * (2 * d * input_size + 2 * d * d)


def crossover_length(d: int) -> int:
    """The length ``n`` where attention's own ``4 n^2 d`` equals an Elman RNN's ``4 n
    d^2``: ``n = d``.

    This is the comparison of Vaswani et al.'s Table 1: it leaves out attention's ``8 n
    d^2`` of projections. For whole layers see :func:`layer_crossover_length`."""
    return check_positive_int("d", d)


def layer_crossover_length(d: int, gates: int) -> int | None:
    """The length ``n`` where a whole self-attention layer costs as many FLOPs as a
    recurrent layer.

    Per token, ``8 d^2 + 4 n d`` (:func:`attention_layer_flops` / ``n``) against ``gates
    * 4 d^2`` (:func:`recurrent_flops` / ``n``), equal at ``n = (gates - 2) d``: ``d``
      for a GRU (``gates=3``),
    ``2d`` for an LSTM (``gates=4``); shorter sequences make attention the cheaper
    layer. ``None`` for ``gates <= 2``: attention's projections alone cost ``8 d^2`` per
    token, as much as a two-gate step and twice an Elman step (``gates=1``), so
    attention is never the cheaper layer."""
    d, gates = check_positive_int("d", d), check_positive_int("gates", gates)
    return (gates - 2) * d if gates > 2 else None


def sequential_steps(kind: str, n: int) -> int:
    """Operations that must run one after another: 1 for ``"self-attention"`` (all
    tokens at once), ``n`` for ``"recurrent"`` (step ``t`` needs ``h_{t-1}``)."""
    n = check_positive_int("n", n)
    if kind == "self-attention":
        return 1
    if kind == "recurrent":
        return n
    raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")


def max_path_length(kind: str, n: int) -> int:
    """Longest path a signal travels between two of ``n`` tokens in one layer: 1 for
    ``"self-attention"`` (every token sees every token), ``n - 1`` for ``"recurrent"``
    (token 1 reaches token ``n`` through ``n - 1`` hidden-state updates)."""
    n = check_positive_int("n", n)
    if kind == "self-attention":
        return 1
    if kind == "recurrent":
        return n - 1
    raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")


LATENT_MODES = ("expanded", "absorbed")


def latent_decode_flops(
    context_len: int,
    d_model: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    *,
    q_lora_rank: int | None = None,
    mode: str = "expanded",
) -> int:
    """FLOPs of one layer of multi-head latent attention
    (:class:`~attnbook.latent.MultiHeadLatentAttention`) for one decoded token that
    attends to ``n = context_len`` tokens (itself included), their latents cached.

    With ``d`` = ``d_model``, ``h`` heads, ``r`` = ``kv_lora_rank``, ``r_h`` =
    ``qk_rope_head_dim``, ``n_h`` = ``qk_nope_head_dim``, ``v`` = ``v_head_dim``, both
    modes pay the new token's projections: its query ``2 d h (n_h + r_h)`` (or ``2 d
    q_r + 2 q_r h (n_h + r_h)`` with ``q_lora_rank = q_r``), its latent and RoPE key
    ``2 d (r + r_h)``, the output ``2 h v d``. Then

    - ``"expanded"``: up-project every cached latent to keys and values ``2 n r h (n_h
      + v)``, scores ``2 n h (n_h + r_h)``, weighted sum ``2 n h v``;
    - ``"absorbed"``: fold ``W_UK`` into the query ``2 h n_h r``, scores over the
      latents ``2 n h (r + r_h)``, latent-weighted sum ``2 n h r``, ``W_UV`` on it ``2 h
      r v``.

    Per context token that is ``2 h (r (n_h + v) + n_h + r_h + v)`` expanded against
    ``2 h (2 r + r_h)`` absorbed. Matrix products only, as everywhere in this module
    (the RMSNorms, RoPE and softmax are left out).
    """
    n = check_positive_int("context_len", context_len)
    d = check_positive_int("d_model", d_model)
    h = check_positive_int("num_heads", num_heads)
    r = check_positive_int("kv_lora_rank", kv_lora_rank)
    r_h = check_positive_int("qk_rope_head_dim", qk_rope_head_dim)
    n_h = check_positive_int("qk_nope_head_dim", qk_nope_head_dim)
    v = check_positive_int("v_head_dim", v_head_dim)
    if mode not in LATENT_MODES:
        raise ValueError(f"mode must be one of {LATENT_MODES}, got {mode!r}")
    if q_lora_rank is None:
        query = 2 * d * h * (n_h + r_h)
    else:
        q_r = check_positive_int("q_lora_rank", q_lora_rank)
        query = 2 * d * q_r + 2 * q_r * h * (n_h + r_h)
    projections = query + 2 * d * (r + r_h) + 2 * h * v * d
    if mode == "expanded":
        return projections + 2 * n * h * (r * (n_h + v) + n_h + r_h + v)
    return projections + 2 * h * n_h * r + 2 * n * h * (2 * r + r_h) + 2 * h * r * v


# --------------------------------------------------------------------------- memory


def attention_weights_bytes(
    n: int,
    num_heads: int = 1,
    bytes_per_element: int = 4,
    *,
    n_keys: int | None = None,
    batch_size: int = 1,
) -> int:
    """Bytes of the attention weights: ``batch_size * h * n * m * bytes`` (one ``n x m``
    matrix per head; ``m = n`` keys by default). 4 bytes per element in fp32, 2 in
    fp16/bf16."""
    n, h = check_positive_int("n", n), check_positive_int("num_heads", num_heads)
    m = n if n_keys is None else check_positive_int("n_keys", n_keys)
    size = check_positive_int("bytes_per_element", bytes_per_element)
    return check_positive_int("batch_size", batch_size) * h * n * m * size


def kv_cache_bytes(
    num_layers: int,
    seq_len: int,
    d_model: int,
    bytes_per_element: int = 4,
    *,
    batch_size: int = 1,
) -> int:
    """Bytes of a KV cache holding ``seq_len`` tokens: ``2 * layers * T * d * bytes``
    per sequence.

    The 2 is keys and values; each layer stores, for every token, one key and one value
    of width ``d_model`` (``h`` heads of ``d_model / h``), i.e. tensors ``(B, h, T,
    d/h)`` twice per layer."""
    layers, T = (
        check_positive_int("num_layers", num_layers),
        check_positive_int("seq_len", seq_len),
    )
    d, size = (
        check_positive_int("d_model", d_model),
        check_positive_int("bytes_per_element", bytes_per_element),
    )
    return check_positive_int("batch_size", batch_size) * 2 * layers * T * d * size


def kv_bytes_per_token(
    num_kv_heads: int, head_dim: int, bytes_per_element: int = 4
) -> int:
    """Bytes a KV cache holds per token and layer: ``2 * num_kv_heads * head_dim *
    bytes`` (a key and a value for each key/value head). Multi-head attention has
    ``num_kv_heads = h`` (``2 d`` numbers), grouped-query attention a divisor of ``h``,
    multi-query attention 1. Times layers and tokens: :func:`kv_cache_bytes`."""
    heads = check_positive_int("num_kv_heads", num_kv_heads)
    head_dim = check_positive_int("head_dim", head_dim)
    size = check_positive_int("bytes_per_element", bytes_per_element)
    return 2 * heads * head_dim * size


def latent_kv_bytes_per_token(
    kv_lora_rank: int, qk_rope_head_dim: int, bytes_per_element: int = 4
) -> int:
    """Bytes a multi-head latent attention cache
    (:class:`~attnbook.caches.LatentKVCache`) holds per token and layer: ``(kv_lora_rank
    + qk_rope_head_dim) * bytes``, one latent and one RoPE key shared by every head.
    DeepSeek-V3 (``512 + 64``, bf16): 1152 bytes, as much as grouped-query attention
    with 2.25 key/value heads of 128."""
    r = check_positive_int("kv_lora_rank", kv_lora_rank)
    rope = check_positive_int("qk_rope_head_dim", qk_rope_head_dim)
    return (r + rope) * check_positive_int("bytes_per_element", bytes_per_element)


def num_patches(image_size: int | tuple[int, int], patch_size: int) -> int:
    """Tokens of a ViT: an ``H x W`` image cut into ``p x p`` patches gives ``(H / p)(W
    / p)`` tokens (``image_size`` is ``H`` for a square image, or ``(H, W)``). ``H`` and
    ``W`` must be multiples of ``p``."""
    height, width = (
        (image_size, image_size)
        if not isinstance(image_size, (tuple, list))
        else image_size
    )
    height, width = (
        check_positive_int("image height", height),
        check_positive_int("image width", width),
    )
    p = check_positive_int("patch_size", patch_size)
    if height % p or width % p:
        raise ValueError(
            f"image size {height}x{width} is not a multiple of patch_size={p}"
        )
    return (height // p) * (width // p)


__all__ = [
    "LATENT_MODES",
    "LAYER_KINDS",
    "attention_core_flops",
    "attention_layer_flops",
    "attention_projection_flops",
    "attention_score_flops",
    "attention_weighted_sum_flops",
    "attention_weights_bytes",
    "crossover_length",
    "ffn_flops",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "latent_decode_flops",
    "latent_kv_bytes_per_token",
    "layer_crossover_length",
    "max_path_length",
    "num_patches",
    "recurrent_flops",
    "sequential_steps",
]
