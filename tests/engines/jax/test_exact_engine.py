"""ExactEngine (rollout.exact's sampler): its SampleResults' q equal the exact forward's p bit for bit, for requests of
varied prompt lengths, top-k / top-p and plain, stop tokens, whatever other requests share the call."""

import flax.nnx as nnx
import numpy as np
import pytest

from cisjax.engines.jax.engine import Request
from cisjax.engines.jax.exact_engine import ExactEngine
from cisjax.models import exact, hf_io
from cisjax.rollout.params import SamplingParams
from tests.support.exact import trainer_p

# per prompt: (top_k, top_p)
TRUNCATION = ((0, 1.0), (8, 1.0), (40, 0.9), (0, 0.8), (5, 1.0))


@pytest.mark.parametrize(
    "family,dtype,experts",
    [
        ("qwen2_moe", "bfloat16", "dense"),
        ("qwen3_moe", "float32", "tiles"),
        ("qwen3_moe", "bfloat16", "tiles"),
        ("deepseek_v2", "float32", "gather"),
    ],
)
def test_engine_q_equals_the_exact_forward_p(tiny_hf_dir, family, dtype, experts, monkeypatch):
    if experts == "tiles":  # the tiny models' 8 experts top-2 would take dense: expert tiles as at scale
        monkeypatch.setattr(exact, "DENSE_MAX", 0)
    model, _, _ = hf_io.load(tiny_hf_dir(family), dtype=dtype, param_dtype="float32")
    assert exact.moe_impl(model) == experts
    engine = ExactEngine(*nnx.split(model), max_len=128)
    rng = np.random.default_rng(0)
    requests = [
        Request(
            rng.integers(2, 90, int(rng.integers(2, 14))).tolist(),
            i,
            SamplingParams(
                n=2,
                top_k=k,
                top_p=p,
                max_new_tokens=6 + 2 * i,
                stop_token_ids=[7],
                seed=1,
                return_sampling_mask=True,
            ),
        )
        for i, (k, p) in enumerate(TRUNCATION)
    ]
    results = engine.generate_many(requests)
    tokens = 0
    for r, samples in zip(requests, results):
        assert len(samples) == 2
        for s in samples:
            assert 1 <= len(s.token_ids) <= r.params.max_new_tokens
            assert (s.finish_reason == "stop") == (s.token_ids[-1] == 7)
            assert (sum(s.support[1]) > 0) == r.params.truncates
            q = np.asarray(s.logprobs, np.float32)
            np.testing.assert_array_equal(trainer_p(model, r.prompt, s.token_ids, s.support), q)
            tokens += len(q)
    assert tokens > 40
    # in bf16 the weights the programs only cast came in cast once per call (cast_inputs): the same q
    assert (engine.cast_weights > 0) == (dtype == "bfloat16")
    # the same request alone: the same samples (a row's values do not depend on the batch)
    again = engine.generate_many([requests[2]])[0]
    assert [s.token_ids for s in again] == [s.token_ids for s in results[2]]
    assert [s.logprobs for s in again] == [s.logprobs for s in results[2]]
