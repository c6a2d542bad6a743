"""Sampling's flat token arrays, the probed positions and the engine sides, on a stand-in client (no engine)."""

from types import SimpleNamespace

import numpy as np
import pytest

from cisjax import errors
from cisjax.mismatch import sample as sample_lib
from cisjax.mismatch import sides

VOCAB = 50


class FakeClient:
    """generate(): the given responses (one sample per prompt), logprobs -0.1 * (position + 1); routing [R, L=2, k=2]."""

    def __init__(self, responses):
        self.responses = responses
        self.params = None

    def generate(self, prompts, params):
        self.params = params
        out = []
        for p, r in zip(prompts, self.responses):
            routing = np.arange(len(r) * 4).reshape(len(r), 2, 2) % 7
            lps = [-0.1 * (i + 1) for i in range(len(r))]
            out.append(
                [SimpleNamespace(prompt_ids=p, response_ids=r, logprobs=lps, routing=routing, finish_reason="stop")]
            )
        return out


def _sampled(responses=([3, 4, 5], [6], [7, 8, 9, 10])):
    client = FakeClient(list(responses))
    prompts = [[1, 2]] * len(responses)
    s = sample_lib.sample(client, prompts, n=1, max_new_tokens=8, stop_ids=[0], seed=3, routing=True, vocab_size=VOCAB)
    return s, client


def test_sample_flattens_the_responses():
    s, client = _sampled()
    assert client.params.seed == 3 and client.params.return_routing and client.params.temperature == 1.0
    assert s.n_tokens == 8
    np.testing.assert_array_equal(s.token_id_N, [3, 4, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(s.seq_id_N, [0, 0, 0, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(s.position_N, [0, 1, 2, 0, 0, 1, 2, 3])
    np.testing.assert_allclose(s.logq_N, [-0.1, -0.2, -0.3, -0.1, -0.1, -0.2, -0.3, -0.4])
    with pytest.raises(RuntimeError, match="no response tokens"):
        _sampled(([], []))
    with pytest.raises(errors.UserError, match="outside --model's vocabulary"):
        _sampled(([3, VOCAB],))


def test_probes_truncate_each_sequence_after_its_last_probe():
    s, _ = _sampled()
    probes = sample_lib.choose_probes(s, 3, seed=4, topk=True)
    assert probes.count == 3 and np.all(np.diff(probes.index_T) > 0)
    np.testing.assert_array_equal(probes.routing_index, probes.index_T)
    np.testing.assert_array_equal(probes.seq_of_T, s.seq_id_N[probes.index_T])
    assert list(probes.seqs) == sorted(set(probes.seq_of_T.tolist()))
    for seq, item in zip(probes.seqs, probes.items):
        last = max(int(p) for q, p in zip(probes.seq_of_T, probes.position_of_T) if q == seq)
        assert list(item.response_ids) == list(s.items[seq].response_ids[: last + 1])
    # top-K records of the truncated items: ids [position][K] = (token index, 0); the probes read their own row
    records = [
        {
            "topk_ids": [[int(np.flatnonzero(s.seq_id_N == seq)[pos]), 0] for pos in range(len(it.response_ids))],
            "topk_logprobs": [[-1.0, -2.0]] * len(it.response_ids),
        }
        for seq, it in zip(probes.seqs, probes.items)
    ]
    ids, lps = probes.topk_at(records)
    assert ids.shape == lps.shape == (3, 2)
    np.testing.assert_array_equal(ids[:, 0], probes.index_T)
    none = sample_lib.choose_probes(s, 0, seed=4, topk=False)
    assert none.count == 0 and none.items == []
    np.testing.assert_array_equal(none.routing_index, np.arange(8))


def test_routing_array_is_layer_major_at_the_tokens():
    per_seq = [np.arange(12).reshape(3, 2, 2), np.arange(12, 16).reshape(1, 2, 2)]
    arr = sides.routing_array(per_seq, np.array([1, 3]), 4, "test")
    assert arr.shape == (2, 2, 2) and arr.dtype == np.int16
    np.testing.assert_array_equal(arr[:, 0], per_seq[0][1])
    np.testing.assert_array_equal(arr[:, 1], per_seq[1][0])
    with pytest.raises(RuntimeError, match="routing of 4 tokens for 5"):
        sides.routing_array(per_seq, np.array([0]), 5, "test")


@pytest.mark.parametrize("engine", ["vllm", "jax"])
def test_the_samplers_side_is_the_sampling(engine):
    s, _ = _sampled()
    probes = sample_lib.choose_probes(s, 0, seed=0, topk=False)
    spec = SimpleNamespace(topk=0, routing=True)
    side = sides.sampling_side(engine, None, {"dtype": "float32"}, s, probes, spec)
    assert side.label == f"{engine}/float32 (sampling)" and side.topk is None and side.control is None
    np.testing.assert_array_equal(side.logp_N, s.logq_N)
    assert side.routing_LxTxK.shape == (2, 8, 2) and dict(side.timings) == {}
