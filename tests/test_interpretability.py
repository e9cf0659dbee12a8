"""Chapter 16's library pieces: the previous-token and induction scores, the repeated and
periodic token sequences, the attention-only transformer and head ablation."""

import copy

import attnbook
import numpy as np
import pytest
import torch
from attnbook import induction_score, previous_token_score
from attnbook.interpretability import (
    AttentionOnlyTransformer,
    ablate_heads,
    composition_score,
    copying_score,
    head_circuits,
    periodic_tokens,
    repeated_tokens,
)


def random_causal_weights(*shape, seed=0):
    """Softmax of random scores with the future blocked: (..., T, T), rows sum to 1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(*shape, generator=g)
    T = shape[-1]
    scores = scores.masked_fill(attnbook.causal_mask(T), float("-inf"))
    return torch.softmax(scores, -1)


def uniform_causal_weights(T):
    allowed = (~attnbook.causal_mask(T)).float()  # (T, T): 1 where key <= query
    return allowed / allowed.sum(-1, keepdim=True)


# --- the scores -----------------------------------------------------------------------------------


def test_previous_token_score_matches_a_loop():
    w = random_causal_weights(2, 3, 7, 7)
    expected = torch.zeros(2, 3)
    for t in range(1, 7):
        expected += w[..., t, t - 1]
    torch.testing.assert_close(previous_token_score(w), expected / 6)


@pytest.mark.parametrize("period", [1, 2, 3, 5])
def test_induction_score_matches_a_loop(period):
    T = 2 * period + 1
    w = random_causal_weights(2, 4, T, T, seed=period)
    expected = torch.stack([w[..., t, t - period + 1] for t in range(period, T)]).mean(
        0
    )
    torch.testing.assert_close(induction_score(w, period), expected)


def test_perfect_patterns_score_one():
    T, period = 10, 5
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(T - 1)] = (
        1  # each query on the token before
    )
    assert previous_token_score(previous).item() == 1.0
    induction = torch.eye(T)
    for t in range(period, T):
        induction[t] = 0
        induction[t, t - period + 1] = 1  # the token after the earlier copy
    assert induction_score(induction, period).item() == 1.0
    assert previous_token_score(induction).item() == 0.0
    assert induction_score(previous, period).item() == 0.0


def test_uniform_attention_scores_the_mean_of_one_over_t_plus_one():
    T, period = 12, 6
    w = uniform_causal_weights(T)
    previous = sum(1 / (t + 1) for t in range(1, T)) / (T - 1)
    induction = sum(1 / (t + 1) for t in range(period, T)) / (T - period)
    assert previous_token_score(w).item() == pytest.approx(previous)
    assert induction_score(w, period).item() == pytest.approx(induction)


def test_scores_keep_the_leading_dimensions_and_dtype():
    w = random_causal_weights(2, 3, 4, 8, 8).double()
    assert previous_token_score(w).shape == (2, 3, 4)
    assert induction_score(w, 4).shape == (2, 3, 4)
    assert induction_score(w, 4).dtype == torch.float64


@pytest.mark.parametrize("period", [0, -1, 2.0, True, None, "3"])
def test_induction_score_rejects_a_bad_period(period):
    with pytest.raises(ValueError, match="period"):
        induction_score(uniform_causal_weights(8), period)


@pytest.mark.parametrize("period", [8, 9])
def test_induction_score_needs_more_tokens_than_the_period(period):
    with pytest.raises(ValueError, match=f"T > period.*T=8, period={period}"):
        induction_score(uniform_causal_weights(8), period)


@pytest.mark.parametrize(
    "score", [previous_token_score, lambda w: induction_score(w, 2)]
)
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 6, 5), (6,)])
def test_scores_reject_non_square_weights(score, shape):
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\).*" + str(shape[-1])):
        score(torch.rand(shape))


@pytest.mark.parametrize(
    "score", [previous_token_score, lambda w: induction_score(w, 2)]
)
def test_scores_reject_integer_and_non_tensor_weights(score):
    with pytest.raises(TypeError, match="float"):
        score(torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor.*list"):
        score([[1.0, 0.0], [0.5, 0.5]])


def test_previous_token_score_needs_two_tokens():
    with pytest.raises(ValueError, match="T >= 2.*T=1"):
        previous_token_score(torch.ones(3, 1, 1))


# --- the data ---------------------------------------------------------------------------------------


def test_repeated_tokens_repeat_their_first_half():
    x = repeated_tokens(5, 7, 11, generator=torch.Generator().manual_seed(0))
    assert x.shape == (5, 14) and x.dtype == torch.long
    assert torch.equal(x[:, 7:], x[:, :7])
    assert 0 <= int(x.min()) and int(x.max()) < 11
    again = repeated_tokens(5, 7, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, again)


def test_periodic_tokens_repeat_with_their_own_period():
    x, periods = periodic_tokens(
        64, 30, 3, 9, 50, generator=torch.Generator().manual_seed(1)
    )
    assert x.shape == (64, 30) and periods.shape == (64,)
    assert 3 <= int(periods.min()) and int(periods.max()) <= 9
    assert len(set(periods.tolist())) > 1  # the period changes from row to row
    for row, p in zip(x, periods.tolist(), strict=True):
        assert torch.equal(row[p:], row[:-p])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(length=-2), "length"),
        (dict(min_period=0), "min_period"),
        (dict(min_period=6, max_period=5), "min_period=6 must be <= max_period=5"),
        (dict(vocab_size=1.5), "vocab_size"),
    ],
)
def test_periodic_tokens_reject_bad_sizes(kwargs, match):
    args = (
        dict(batch_size=2, length=10, min_period=2, max_period=5, vocab_size=8) | kwargs
    )
    with pytest.raises(ValueError, match=match):
        periodic_tokens(**args)


@pytest.mark.parametrize(
    "args,match",
    [((0, 3, 5), "batch_size"), ((2, 0, 5), "period"), ((2, 3, -1), "vocab_size")],
)
def test_repeated_tokens_reject_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        repeated_tokens(*args)


# --- the model ----------------------------------------------------------------------------------


def small_model(num_layers=2, seed=0):
    torch.manual_seed(seed)
    return AttentionOnlyTransformer(13, 16, 2, num_layers, 20).eval()


def test_model_shapes_and_causal_weights():
    model = small_model(num_layers=3)
    x = torch.randint(13, (4, 9))
    logits, weights = model(x, return_weights=True)
    assert logits.shape == (4, 9, 13) and len(weights) == 3
    for w in weights:
        assert w.shape == (4, 2, 9, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(4, 2, 9))
        assert (
            w.masked_select(attnbook.causal_mask(9)) == 0
        ).all()  # no weight on the future
    torch.testing.assert_close(
        model(x), logits, atol=1e-5, rtol=1e-5
    )  # fused path = explicit


def test_model_matches_pytorch_attention_layers():
    model = small_model()
    references = []
    for layer in model.blocks:
        reference = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        with torch.no_grad():
            reference.in_proj_weight.copy_(
                torch.cat(
                    [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]
                )
            )
            reference.in_proj_bias.copy_(
                torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias])
            )
            reference.out_proj.load_state_dict(layer.out_proj.state_dict())
        references.append(reference.eval())
    x = torch.randint(13, (3, 11))
    with torch.no_grad():
        h = model.token_embedding(x) + model.positions.table[:11]
        for reference in references:
            h = (
                h
                + reference(
                    h, h, h, attn_mask=attnbook.causal_mask(11), need_weights=False
                )[0]
            )
        torch.testing.assert_close(model(x), model.lm_head(h), atol=1e-5, rtol=1e-5)


def test_one_layer_logits_do_not_see_the_future():
    model = small_model(num_layers=1)
    x = torch.randint(13, (2, 10))
    changed = x.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 13
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :6], model(changed)[:, :6])


@pytest.mark.parametrize(
    "name", ["vocab_size", "d_model", "num_heads", "num_layers", "max_len"]
)
def test_model_rejects_bad_sizes(name):
    args = dict(vocab_size=13, d_model=16, num_heads=2, num_layers=2, max_len=20) | {
        name: 0
    }
    with pytest.raises(ValueError, match=name):
        AttentionOnlyTransformer(**args)


def test_model_rejects_bad_tokens():
    model = small_model()
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        model(torch.tensor([[0, 13]]))
    with pytest.raises(ValueError, match="max_len=20"):
        model(torch.zeros(1, 21, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\) LongTensor"):
        model(torch.zeros(5))


# --- ablation -----------------------------------------------------------------------------------


def test_zero_ablation_equals_zeroing_the_heads_output_columns():
    model = small_model()
    x = torch.randint(13, (3, 12))
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.blocks[0].out_proj.weight[:, 8:16] = 0  # head 1 of 2, head_dim 8
        expected = edited(x)
        before = model(x)
        with ablate_heads(model.blocks[0], [1]):
            ablated = model(x)
        after = model(x)
    torch.testing.assert_close(ablated, expected)
    assert not torch.allclose(ablated, before)
    torch.testing.assert_close(after, before)  # the hook is gone
    assert model.blocks[0].out_proj.weight[:, 8:16].abs().sum() > 0  # weights untouched


def test_mean_ablation_uses_the_heads_mean_output():
    torch.manual_seed(0)
    attention = attnbook.MultiHeadAttention(12, 3).eval()
    x = torch.randn(4, 5, 12)
    with torch.no_grad():
        q = attnbook.split_heads(attention.q_proj(x), 3)
        k = attnbook.split_heads(attention.k_proj(x), 3)
        v = attnbook.split_heads(attention.v_proj(x), 3)
        heads = attnbook.merge_heads(attnbook.scaled_dot_product_attention(q, k, v)[0])
        heads[..., 4:8] = heads[..., 4:8].mean(dim=(0, 1))  # head 1 -> its mean output
        expected = attention.out_proj(heads)
        with ablate_heads(attention, 1, mode="mean"):
            out, _ = attention(x, x, x)
    torch.testing.assert_close(out, expected)


def test_ablation_leaves_the_attention_weights_alone():
    model = small_model()
    x = torch.randint(13, (2, 8))
    with torch.no_grad():
        _, weights = model(x, return_weights=True)
        with ablate_heads(model.blocks[1], [0, 1]):
            logits, ablated_weights = model(x, return_weights=True)
    torch.testing.assert_close(ablated_weights[1], weights[1])  # heads still attend
    bias_only = model.blocks[1].out_proj.bias
    h = model.positions(model.token_embedding(x))
    with torch.no_grad():
        h = (
            h + model.blocks[0](h, h, h, is_causal=True)[0] + bias_only
        )  # layer 1 adds its bias
        torch.testing.assert_close(logits, model.lm_head(h))


def test_ablation_hook_is_removed_after_an_error():
    model = small_model()
    x = torch.randint(13, (2, 8))
    with torch.no_grad():
        before = model(x)
        with pytest.raises(RuntimeError, match="inside"):
            with ablate_heads(model.blocks[0], [0, 1]):
                raise RuntimeError("inside")
        torch.testing.assert_close(model(x), before)
    assert not model.blocks[0].out_proj._forward_pre_hooks


def test_nested_and_empty_ablations():
    model = small_model()
    x = torch.randint(13, (2, 8))
    with torch.no_grad():
        before = model(x)
        with ablate_heads(model.blocks[0], []):
            torch.testing.assert_close(model(x), before)
        with (
            ablate_heads(model.blocks[0], [0]),
            ablate_heads(model.blocks[0], [np.int64(1)]),
        ):
            both = model(x)
        with ablate_heads(model.blocks[0], (0, 1)):
            torch.testing.assert_close(model(x), both)


@pytest.mark.parametrize("heads", [[2], [0, 5], [-1], 2])
def test_ablation_rejects_a_head_out_of_range(heads):
    model = small_model()
    bad = [h for h in ([heads] if isinstance(heads, int) else heads) if not 0 <= h < 2][
        0
    ]
    with pytest.raises(ValueError, match=f"head index {bad} out of range.*num_heads=2"):
        with ablate_heads(model.blocks[0], heads):
            pass
    assert not model.blocks[0].out_proj._forward_pre_hooks


@pytest.mark.parametrize("heads", [[True], [0.0], [None]])
def test_ablation_rejects_heads_that_are_not_ints(heads):
    with pytest.raises(ValueError, match="head index"):
        with ablate_heads(small_model().blocks[0], heads):
            pass


@pytest.mark.parametrize("heads", ["0", None, 1.0])
def test_ablation_rejects_heads_that_are_not_a_list(heads):
    with pytest.raises(TypeError, match="heads must be"):
        with ablate_heads(small_model().blocks[0], heads):
            pass


def test_ablation_rejects_a_module_without_heads_and_a_bad_mode():
    with pytest.raises(TypeError, match="num_heads.*Linear"):
        with ablate_heads(torch.nn.Linear(4, 4), [0]):
            pass
    with pytest.raises(ValueError, match="mode.*'half'"):
        with ablate_heads(small_model().blocks[0], [0], mode="half"):
            pass


# --- circuits read off the weights ------------------------------------------------


def bias_free_attention(d=12, h=3, seed=0):
    torch.manual_seed(seed)
    return attnbook.MultiHeadAttention(d, h, bias=False).eval()


@pytest.mark.parametrize("head", [0, 2])
def test_head_circuits_give_the_heads_scores_and_output(head):
    attention = bias_free_attention()
    d, head_dim = 12, 4
    x = torch.randn(1, 7, d)
    w_qk, w_ov = head_circuits(attention, head)
    assert w_qk.shape == w_ov.shape == (d, d)
    with torch.no_grad():
        _, weights = attention(x, x, x)  # (1, h, 7, 7)
        scores = x[0] @ w_qk @ x[0].T / head_dim**0.5  # x_t^T W_QK x_s
        torch.testing.assert_close(weights[0, head], torch.softmax(scores, -1))
        others = [i for i in range(3) if i != head]
        with ablate_heads(attention, others):  # only this head writes
            out, _ = attention(x, x, x)
        torch.testing.assert_close(out[0], weights[0, head] @ (x[0] @ w_ov.T))


def test_composition_score_by_hand():
    d = 8
    eye = torch.eye(d)
    e1 = torch.zeros(d, d)
    e1[0, 0] = 1
    e2 = torch.zeros(d, d)
    e2[1, 1] = 1
    assert composition_score(eye, eye).item() == pytest.approx(1 / d**0.5)
    assert composition_score(e1, e1).item() == pytest.approx(1.0)
    assert composition_score(e2, e1).item() == 0.0  # reads what the other never writes
    a, b = torch.randn(d, d), torch.randn(d, d)
    expected = torch.linalg.norm(a @ b) / (torch.linalg.norm(a) * torch.linalg.norm(b))
    torch.testing.assert_close(composition_score(a, b), expected)
    assert 0 <= composition_score(a, b) <= 1


@pytest.mark.parametrize("rank", [None, 4, 16])
def test_composition_score_of_random_matrices(rank):
    # the docstring's claim: independent random matrices, full rank or products of rank r,
    # give a mean squared score of 1 / d (so a score of about 1 / sqrt(d)), whatever r
    d, pairs = 32, 400
    g = torch.Generator().manual_seed(0)

    def random_matrix():
        if rank is None:
            return torch.randn(d, d, generator=g)
        return torch.randn(d, rank, generator=g) @ torch.randn(rank, d, generator=g)

    scores = torch.stack(
        [composition_score(random_matrix(), random_matrix()) for _ in range(pairs)]
    )
    assert scores.pow(2).mean().item() == pytest.approx(1 / d, rel=0.05)
    assert scores.mean().item() == pytest.approx(1 / d**0.5, rel=0.05)


def test_copying_score_by_hand():
    assert copying_score(torch.eye(5)).item() == pytest.approx(1.0)
    assert copying_score(-torch.eye(5)).item() == pytest.approx(-1.0)
    assert copying_score(torch.diag(torch.tensor([2.0, -1.0]))).item() == pytest.approx(
        1 / 3
    )
    rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # eigenvalues +i and -i
    assert copying_score(rotation).item() == pytest.approx(0.0, abs=1e-7)
    # W_U W_OV W_E of a head whose OV circuit is the identity, with W_U = W_E^T: copies
    embedding = torch.randn(16, 4)  # (V, d)
    assert copying_score(embedding @ torch.eye(4) @ embedding.T).item() > 0.999


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.randn(3, 4), torch.randn(4, 4)), ValueError, "square"),
        ((torch.randn(4, 4), torch.randn(3, 3)), ValueError, "same shape"),
        ((torch.zeros(4, 4), torch.randn(4, 4)), ValueError, "zero matrix"),
        (([[1.0]], torch.randn(1, 1)), ValueError, "square"),
    ],
)
def test_composition_score_rejects_bad_matrices(args, error, match):
    with pytest.raises(error, match=match):
        composition_score(*args)


def test_copying_score_and_head_circuits_reject_bad_inputs():
    with pytest.raises(ValueError, match="square"):
        copying_score(torch.randn(3, 4))
    with pytest.raises(ValueError, match="all 0"):
        copying_score(torch.zeros(3, 3))
    attention = bias_free_attention()
    with pytest.raises(ValueError, match="out of range"):
        head_circuits(attention, 3)
    with pytest.raises(TypeError, match="one int"):
        head_circuits(attention, [0, 1])
    with pytest.raises(TypeError, match="multi-head attention"):
        head_circuits(torch.nn.Linear(4, 4), 0)
