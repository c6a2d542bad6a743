"""MoE routing: hand-computed routes (greedy, group-limited, renormalised, scaled) and the sort by expert."""

import jax.numpy as jnp
import numpy as np
import pytest

from cisjax.models import routing


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
