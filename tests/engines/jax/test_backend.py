"""cisjax.engines.jax.backend in process: requests waiting together run as one batch, each with its own parameters,
and a weight update holds back the work queued after it."""

import dataclasses
import threading

from cisjax.engines.jax.backend import Backend
from tests.support.engines import engine_params

BASE = engine_params(n=2, max_new_tokens=6, seed=4)
REQUESTS = [
    ([1, 2, 3], 0, dataclasses.replace(BASE, greedy=True)),
    ([50, 7, 9, 11, 4], 1, dataclasses.replace(BASE, temperature=0.6, top_k=5, max_new_tokens=3)),
    ([8], 2, dataclasses.replace(BASE, top_p=0.8, logprobs=2, stop_token_ids=frozenset({3, 4}))),
]


def _tokens(samples):
    return [(s.token_ids, s.finish_reason) for s in samples]


def test_waiting_requests_run_as_one_batch_with_their_own_parameters(tiny_hf_dir):
    backend = Backend(tiny_hf_dir("qwen2_moe"), dtype="float32")
    try:
        alone = [backend.sampler.generate([p], [i], q)[0] for p, i, q in REQUESTS]
        batches = []
        generate_many = backend.sampler.generate_many
        backend.sampler.generate_many = lambda reqs: batches.append(len(reqs)) or generate_many(reqs)

        release, loading = threading.Event(), threading.Event()
        backend.load_directory = lambda *_: (loading.set(), release.wait(30))  # an update that takes a while
        updater = threading.Thread(target=backend.update, args=("directory", None, 1))
        updater.start()
        assert loading.wait(30)
        futs = [backend.submit_generate(p, i, q) for p, i, q in REQUESTS]  # queued behind the update
        assert not any(f.done() for f in futs)
        release.set()
        updater.join(30)
        got = [f.result(120) for f in futs]
        assert batches == [3]  # the three, waiting together, in one program
        for one, batched, (_, _, q) in zip(alone, got, REQUESTS):
            assert _tokens(batched) == _tokens(one)
            assert all(len(s.token_ids) <= q.max_new_tokens for s in batched)
        assert got[2][0].top_ids is not None and len(got[2][0].top_ids[0]) == 2 and got[0][0].top_ids is None
    finally:
        backend.close()


def test_score_compiles_one_program_per_length_bucket(tiny_hf_dir):
    backend = Backend(tiny_hf_dir("qwen2_moe"), dtype="float32")
    try:
        for prompt, response, top_k in [([1, 2], [3, 4, 5], 0), ([7] * 9, [8] * 6, 0), ([1] * 10, [2] * 10, 0)]:
            out = backend.score(prompt, response, 1.0, top_k)
            assert len(out["logprobs"]) == len(response)
        backend.score([1, 2], [3], 1.0, 2)
        # lengths 5 and 15 share the 16 bucket, 20 takes 32; top-2 logprobs are another program
        assert backend.score_shapes == {(16, 0), (32, 0), (16, 2)}
    finally:
        backend.close()
