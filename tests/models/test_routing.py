"""MoE routing: hand-computed routes (greedy, group-limited, renormalised, scaled), the sort by expert and the rows
moved into and out of the sorted order (values and gradients)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.models import moe, routing


def _route(p_NxE, **kw):
    """route() on logits = log(p), so that softmax(logits) = p exactly up to fp32 rounding."""
    w, ids = routing.route(jnp.log(jnp.asarray(p_NxE, jnp.float32)), **kw)
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32
    return np.asarray(w), np.asarray(ids)


P_GREEDY = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.125, 0.125, 0.25]]


def test_route_greedy_top_k_softmax():
    w, ids = _route(P_GREEDY, k=2)
    np.testing.assert_array_equal(ids, [[3, 2], [0, 3]])
    np.testing.assert_allclose(w, [[0.4, 0.3], [0.5, 0.25]], rtol=1e-6)
    w, ids = _route(P_GREEDY, k=1)
    np.testing.assert_array_equal(ids, [[3], [0]])
    np.testing.assert_allclose(w, [[0.4], [0.5]], rtol=1e-6)
    # softmax of the raw logits (shift-invariant)
    w, ids = routing.route(jnp.array([[1.0, 3.0, 2.0]]) + 7.0, k=2)
    e = np.exp([1.0, 3.0, 2.0])
    np.testing.assert_array_equal(ids, [[1, 2]])
    np.testing.assert_allclose(w, [[e[1] / e.sum(), e[2] / e.sum()]], rtol=1e-6)


def test_route_norm_topk_prob_and_scaling():
    w, _ = _route(P_GREEDY, k=2, norm_topk_prob=True)
    np.testing.assert_allclose(w, [[4 / 7, 3 / 7], [2 / 3, 1 / 3]], rtol=1e-6)
    w, _ = _route(P_GREEDY, k=2, scaling=2.5)
    np.testing.assert_allclose(w, [[1.0, 0.75], [1.25, 0.625]], rtol=1e-6)


def test_route_group_limited_greedy():
    # 6 experts in 3 groups of 2; group maxima 0.30, 0.28, 0.25 (row 0) and 0.05, 0.40, 0.35 (row 1)
    p = [[0.05, 0.30, 0.28, 0.02, 0.25, 0.10], [0.05, 0.04, 0.40, 0.03, 0.13, 0.35]]
    w, ids = _route(p, k=2)  # greedy: the two largest overall
    np.testing.assert_array_equal(ids, [[1, 2], [2, 5]])
    w, ids = _route(p, k=2, method="group_limited_greedy", n_group=3, topk_group=1)
    np.testing.assert_array_equal(ids, [[1, 0], [2, 3]])  # only the best group's experts
    np.testing.assert_allclose(w, [[0.30, 0.05], [0.40, 0.03]], rtol=1e-6)  # weights not renormalised
    w, ids = _route(p, k=2, method="group_limited_greedy", n_group=3, topk_group=2)
    np.testing.assert_array_equal(ids, [[1, 2], [2, 5]])
    w, ids = _route(p, k=3, method="group_limited_greedy", n_group=3, topk_group=2, scaling=2.0)
    np.testing.assert_array_equal(ids, [[1, 2, 0], [2, 5, 4]])  # row 1 keeps groups 1 and 2
    np.testing.assert_allclose(w, [[0.60, 0.56, 0.10], [0.80, 0.70, 0.26]], rtol=1e-6)


def test_route_rejects_bad_arguments():
    logits = jnp.zeros((2, 6))
    with pytest.raises(ValueError, match="n_group"):
        routing.route(logits, k=2, method="group_limited_greedy", n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="unknown topk method"):
        routing.route(logits, k=2, method="noaux_tc")


def test_sort_by_expert_is_stable_and_counts_every_group():
    ids_NxK = jnp.asarray([[2, 0], [0, 2], [3, 0]], jnp.int32)  # expert 1 empty, 4 past the ids
    order_R, sizes_E = routing.sort_by_expert(ids_NxK, 5)
    np.testing.assert_array_equal(order_R, [1, 2, 5, 0, 3, 4])  # token order within a group
    np.testing.assert_array_equal(sizes_E, [3, 0, 2, 1, 0])
    assert order_R.dtype == jnp.int32 and sizes_E.dtype == jnp.int32


# tokens 0, 1, 2 (k = 2) with experts [[1, 0], [0, 1], [1, 1]]: flat ids [1, 0, 0, 1, 1, 1], sorted (stable) order
# [1, 2, 0, 3, 4, 5] (expert 0: assignments 1, 2; expert 1: 0, 3, 4, 5)
ORDER = [1, 2, 0, 3, 4, 5]


def test_inverse_permutation_by_hand():
    order = jnp.asarray(ORDER, jnp.int32)
    inv = routing.inverse_permutation(order)
    assert inv.tolist() == [2, 0, 1, 3, 4, 5]  # assignment 0 went to place 2, 1 to 0, 2 to 1
    assert order[inv].tolist() == list(range(6)) and inv.dtype == jnp.int32


def test_rows_into_the_sorted_order_by_hand():
    """xs[r] = x[order[r] // 2]. Gradient: a token's row collects the cotangents of its two assignments (summed)."""
    order = jnp.asarray(ORDER, jnp.int32)
    inv = routing.inverse_permutation(order)
    x = jnp.asarray([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    xs = routing.sorted_rows(x, order, inv, 2)
    assert xs.tolist() == [[1, 10], [2, 20], [1, 10], [2, 20], [3, 30], [3, 30]]
    # cotangent c[r] = r + 1 on every column: token 0's rows are sorted places 0 and 2 (1 + 3), token 1's 1 and 3
    # (2 + 4), token 2's 4 and 5 (5 + 6)
    c = jnp.arange(1.0, 7.0)[:, None] * jnp.ones((1, 2))
    dx = jax.grad(lambda x: jnp.sum(routing.sorted_rows(x, order, inv, 2) * c))(x)
    assert dx.tolist() == [[4, 4], [6, 6], [11, 11]]


def test_combine_by_hand():
    """y[n] = sum_j w[n, j] * ys[inv[2n + j]]: assignment a's output is the sorted row at inv[a] (sorted row r holds
    (r, -r); inv = [2, 0, 1, 3, 4, 5]). Gradients: sorted row r gets w[order[r]] * dy[order[r] // 2]; w[n, j] gets
    <ys[inv[2n + j]], dy[n]>."""
    order = jnp.asarray(ORDER, jnp.int32)
    inv = routing.inverse_permutation(order)
    ys = jnp.arange(6.0)[:, None] * jnp.asarray([[1.0, -1.0]])
    w = jnp.asarray([[1.0, 0.5], [0.25, 1.0], [2.0, -1.0]])
    y = routing.combine(ys, w, order, inv)
    # token 0: 1 * 2 + 0.5 * 0; token 1: 0.25 * 1 + 1 * 3; token 2: 2 * 4 - 1 * 5
    assert y[:, 0].tolist() == [2.0, 3.25, 3.0] and (y[:, 1] == -y[:, 0]).all()
    dy = jnp.asarray([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    dys, dw = jax.grad(lambda ys, w: jnp.sum(routing.combine(ys, w, order, inv) * dy), argnums=(0, 1))(ys, w)
    # sorted row r holds assignment order[r] = [1, 2, 0, 3, 4, 5][r]: token order[r] // 2, weight w.flat[order[r]]
    assert dys.tolist() == [[0.5, 0], [0, 0.5], [1, 0], [0, 2], [2, 2], [-1, -1]]
    # <(r, -r), dy[n]> at r = inv[2n + j]: token 0 (2, 0); token 1 (-2, -6); token 2 (0, 0)
    assert dw.tolist() == [[2, 0], [-2, -6], [0, 0]]


def test_combine_sums_in_fp32_in_slot_order():
    """bf16 rows and weights: each token's k products summed in fp32 and rounded once (1 + 2^-8 + 2^-8 = 1 + 2^-7, one
    bf16 unit above 1; bf16 adds would round each tie back to 1)."""
    order = jnp.asarray([0, 1, 2], jnp.int32)
    inv = routing.inverse_permutation(order)
    ys = jnp.asarray([[1.0], [2.0**-8], [2.0**-8]], jnp.bfloat16)
    w = jnp.ones((1, 3), jnp.bfloat16)
    y = routing.combine(ys, w, order, inv)
    assert y.dtype == jnp.bfloat16 and float(y[0, 0]) == 1.0 + 2.0**-7
    dw = jax.grad(lambda w: jnp.sum(routing.combine(ys, w, order, inv).astype(jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16 and dw.tolist() == [[1.0, 2.0**-8, 2.0**-8]]


def test_through_sorted_keeps_the_sorted_rows_not_an_unsorted_copy():
    """The backward of the combine reads the experts' sorted output itself: no residual of [N, k, D] (the un-sorted
    copy autodiff of a gather and an einsum would keep, which a layer scan without remat stores per layer)."""
    n, k, d = 6, 3, 8
    order = jnp.asarray(np.random.default_rng(0).permutation(n * k), jnp.int32)
    x = jnp.ones((n, d))
    w = jnp.ones((n, k))
    _, vjp = jax.vjp(lambda x, w: routing.through_sorted(lambda xs: 2.0 * xs, x, order, w), x, w)
    shapes = [leaf.shape for leaf in jax.tree.leaves(vjp)]
    assert [s for s in shapes if np.prod(s) == n * k * d] == [(n * k, d)], shapes  # the sorted rows, once


def test_through_sorted_by_hand():
    """fn sees the sorted rows (it scales sorted row r by r + 1, so a wrong order shows), and each token's two
    outputs come back to it summed with its weights: token 0's assignments sit at sorted places 2 and 0 (scales 3, 1),
    token 1's at 1 and 3 (2, 4), token 2's at 4 and 5 (5, 6)."""
    order = jnp.asarray(ORDER, jnp.int32)
    x = jnp.asarray([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    w = jnp.asarray([[1.0, 0.5], [0.25, 1.0], [2.0, -1.0]])
    seen = []

    def fn(xs_RxD):
        seen.append(xs_RxD)
        return xs_RxD * jnp.arange(1.0, 7.0)[:, None]

    y = routing.through_sorted(fn, x, order, w)
    assert seen[0].tolist() == [[1, 10], [2, 20], [1, 10], [2, 20], [3, 30], [3, 30]]
    # token 0: 1 * 3 + 0.5 * 1 = 3.5; token 1: 0.25 * 2 + 1 * 4 = 4.5; token 2: 2 * 5 - 1 * 6 = 4
    assert y.tolist() == [[3.5, 35.0], [9.0, 90.0], [12.0, 120.0]]
    # d sum(y) / dx: token n's row gets sum_k w[n, k] * scale(slot): the same numbers per unit of x
    dx = jax.grad(lambda x: jnp.sum(routing.through_sorted(fn, x, order, w)))(x)
    assert dx.tolist() == [[3.5, 3.5], [4.5, 4.5], [4.0, 4.0]]


def test_through_sorted_weighted_by_hand():
    """fn gets the sorted rows and each one's routing weight (sorted row r holds assignment order[r]: weight
    w.flat[order[r]]) and returns the weighted rows; each token's two are summed unweighted (gather_sum). Gradients by
    gathers: the weights' come back from sorted place inv[a] to assignment a, the rows' to their tokens."""
    order = jnp.asarray(ORDER, jnp.int32)
    x = jnp.asarray([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    w = jnp.asarray([[1.0, 0.5], [0.25, 1.0], [2.0, -1.0]])
    seen = []

    def fn(xs_RxD, w_R):
        seen.append(w_R)
        return xs_RxD * jnp.arange(1.0, 7.0)[:, None] * w_R[:, None]

    y = routing.through_sorted_weighted(fn, x, order, w)
    assert seen[0].tolist() == [0.5, 0.25, 1.0, 1.0, 2.0, -1.0]  # w.flat at ORDER = [1, 2, 0, 3, 4, 5]
    # as test_through_sorted_by_hand: token 0: 1 * 3 + 0.5 * 1; token 1: 0.25 * 2 + 1 * 4; token 2: 2 * 5 - 1 * 6
    assert y.tolist() == [[3.5, 35.0], [9.0, 90.0], [12.0, 120.0]]
    dx, dw = jax.grad(lambda x, w: jnp.sum(routing.through_sorted_weighted(fn, x, order, w)), argnums=(0, 1))(x, w)
    assert dx.tolist() == [[3.5, 3.5], [4.5, 4.5], [4.0, 4.0]]
    # d y / d w[n, j] = scale(place of (n, j)) * (x[n] summed over columns: 11, 22, 33): places 2, 0 / 1, 3 / 4, 5
    assert dw.tolist() == [[33.0, 11.0], [44.0, 88.0], [165.0, 198.0]]


def test_gather_sum_sums_in_fp32_and_keeps_nothing_of_the_rows():
    """bf16 rows summed in fp32 in slot order and rounded once (1 + 2^-8 + 2^-8 = 1 + 2^-7); the backward keeps the
    order only (no [R, D] residual: the weighted kernels give their weights' gradient themselves)."""
    order = jnp.asarray([0, 1, 2], jnp.int32)
    inv = routing.inverse_permutation(order)
    ys = jnp.asarray([[1.0], [2.0**-8], [2.0**-8]], jnp.bfloat16)
    y, vjp = jax.vjp(lambda ys: routing.gather_sum(ys, order, inv, 3), ys)
    assert y.dtype == jnp.bfloat16 and float(y[0, 0]) == 1.0 + 2.0**-7
    assert [leaf.shape for leaf in jax.tree.leaves(vjp) if leaf.ndim == 2] == []
    (dys,) = vjp(jnp.asarray([[3.0]], jnp.bfloat16))
    assert dys.dtype == jnp.bfloat16 and dys.tolist() == [[3.0], [3.0], [3.0]]


def test_bf16_gradient_sums_in_fp32():
    """A token's k cotangents summed in fp32 and rounded once: 1 + 2^-8 + 2^-8 = 1 + 2^-7, one bf16 unit above 1
    (bf16 adds one at a time would round the tie 1 + 2^-8 back to 1, twice)."""
    order = jnp.asarray([0, 1, 2], jnp.int32)
    x = jnp.zeros((1, 1), jnp.bfloat16)
    c = jnp.asarray([[1.0], [2.0**-8], [2.0**-8]], jnp.bfloat16)
    _, vjp = jax.vjp(lambda x: routing.sorted_rows(x, order, routing.inverse_permutation(order), 3), x)
    (dx,) = vjp(c)
    assert dx.dtype == jnp.bfloat16 and float(dx[0, 0]) == 1.0 + 2.0**-7


def test_moe_ffn_gradient_has_no_float_scatter():
    """The kernels' dispatch (sorted rows in, un-sorted rows out) moves rows by gathers only, forward and backward: the
    only scatters left are integer ones (the inverse permutation)."""
    n, d, f, e, k = 8, 4, 4, 4, 2
    rng = np.random.default_rng(0)
    x, wg, wu = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((n, d), (e, d, f), (e, d, f)))
    wo = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)
    ids = jnp.asarray([[i % e, (i + 1) % e] for i in range(n)], jnp.int32)
    w = jnp.full((n, k), 0.5, jnp.float32)
    loss = lambda x, wg: jnp.sum(moe.moe_ffn(x, wg, wu, wo, ids, w, impl="ragged") ** 2)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, wg)
    scatters = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name.startswith("scatter")]
    assert scatters and all(jnp.issubdtype(v.aval.dtype, jnp.integer) for s in scatters for v in s.outvars)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)
