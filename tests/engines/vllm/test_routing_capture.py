"""The vLLM backend's routing capture bookkeeping (`RoutingStore`) on hand-made steps: rows split per request along the
model runner's layout, padding trimmed, prefix-cached positions taken from the request that computed them, clear errors."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cisjax.engines.vllm.routing_capture import RoutingStore

LAYERS, K = 2, 2


class _Runner:
    """What the store reads of vLLM's V1 model runner."""

    def __init__(self, prompts: dict):
        self.requests = {rid: SimpleNamespace(prompt_token_ids=list(p)) for rid, p in prompts.items()}
        self.input_batch = None
        self.is_padding = torch.zeros(64, dtype=torch.bool)

    def layout(self, req_ids, starts):
        self.input_batch = SimpleNamespace(
            num_reqs=len(req_ids), req_ids=list(req_ids), num_computed_tokens_cpu=np.asarray(starts)
        )


def _step(store, runner, req_ids, counts, starts, rows, *, padded=None):
    """One forward: the layout recorded, then every layer's ids as the routers report them, then the split.
    `rows` [tokens, layers, k]; `padded`: that many rows in all, the extra ones padding."""
    runner.layout(req_ids, starts)
    store.begin(runner, np.asarray(counts))
    if padded is not None:
        rows = np.concatenate([rows, np.full((padded - len(rows), LAYERS, K), 99, rows.dtype)])
        runner.is_padding[:] = False
        runner.is_padding[sum(counts) : padded] = True
    for layer in range(LAYERS):
        store.ids.append((layer, rows[:, layer]))
    store.end(runner, LAYERS)


def _ids(rng, n):
    return rng.integers(0, 8, (n, LAYERS, K)).astype(np.int32)


def test_rows_split_per_request_and_position():
    """Prefill of a (5 tokens) and b (3), then a decode step laid out b before a: each gets its own rows in order."""
    rng = np.random.default_rng(0)
    runner, store = _Runner({"a": range(5), "b": [7, 8, 9]}), RoutingStore()
    pre, dec = _ids(rng, 8), _ids(rng, 2)
    _step(store, runner, ["a", "b"], [5, 3], [0, 0], pre)
    _step(store, runner, ["b", "a"], [1, 1], [3, 5], dec, padded=4)  # 2 padding rows, trimmed
    np.testing.assert_array_equal(store.positions("a", 6), np.concatenate([pre[:5], dec[1:]]))
    np.testing.assert_array_equal(store.positions("b", 4), np.concatenate([pre[5:], dec[:1]]))
    np.testing.assert_array_equal(store.positions("a", 5), pre[:5])  # a request's forward of its last token unused


def test_cached_prefix_comes_from_the_request_that_computed_it():
    """b reads a's first 4 positions from the prefix cache (in the step that computes them), c reads b's first 8, of
    which b computed 4..7 and read 0..3: c's rows are a's, then b's, then its own."""
    rng = np.random.default_rng(1)
    a, b = list(range(10)), [0, 1, 2, 3, 20, 21, 22, 23, 50, 51, 52, 53]
    c = b + [60, 61]
    runner, store = _Runner({"a": a, "b": b, "c": c, "d": [90, 1, 2, 3, 4, 5, 40, 41]}), RoutingStore()
    s1, s2 = _ids(rng, 18), _ids(rng, 6)
    _step(store, runner, ["a", "b"], [10, 8], [0, 4], s1)
    _step(store, runner, ["c"], [6], [8], s2)
    np.testing.assert_array_equal(store.positions("b", 12), np.concatenate([s1[:4], s1[10:]]))
    np.testing.assert_array_equal(store.positions("c", 14), np.concatenate([s1[:4], s1[10:14], s2]))
    # d starts at position 6 as if cached, but no request of the phase has its first 6 tokens
    _step(store, runner, ["d"], [2], [6], _ids(rng, 2))
    with pytest.raises(RuntimeError, match="positions 0..5 of request d came from the prefix cache"):
        store.positions("d", 8)


def test_recomputed_rows_overwrite():
    """A request preempted and recomputed from position 0: its later rows stand."""
    rng = np.random.default_rng(2)
    runner, store = _Runner({"a": range(4)}), RoutingStore()
    first, again = _ids(rng, 4), _ids(rng, 4)
    _step(store, runner, ["a"], [4], [0], first)
    _step(store, runner, ["a"], [4], [0], again)
    np.testing.assert_array_equal(store.positions("a", 4), again)


@pytest.mark.parametrize(
    "change, message",
    [
        ("fewer", r"MoE layer 0 routed 3 tokens in a step that scheduled 4"),
        ("more", r"routed 5 tokens in a step that scheduled 4, and the extra rows are not the model runner's padding"),
        ("no step", "the routers ran in a forward that no scheduled step laid out"),
    ],
)
def test_rows_that_do_not_fit_the_layout_are_refused(change, message):
    rng = np.random.default_rng(3)
    runner, store = _Runner({"a": range(2), "b": range(2)}), RoutingStore()
    runner.layout(["a", "b"], [0, 0])
    store.begin(runner, np.asarray([2, 2]))
    if change == "no step":
        store.step = None
    rows = _ids(rng, {"fewer": 3, "more": 5}.get(change, 4))
    for layer in range(LAYERS):
        store.ids.append((layer, rows[:, layer]))
    with pytest.raises(RuntimeError, match=message):
        store.end(runner, LAYERS)


def test_positions_never_captured_are_an_error():
    rng = np.random.default_rng(4)
    runner, store = _Runner({"a": range(4)}), RoutingStore()
    _step(store, runner, ["a"], [3], [0], _ids(rng, 3))
    with pytest.raises(RuntimeError, match="request a has no routing for 2 of its 5 positions"):
        store.positions("a", 5)
    with pytest.raises(RuntimeError, match="no forward of request z was captured"):
        store.positions("z", 1)
