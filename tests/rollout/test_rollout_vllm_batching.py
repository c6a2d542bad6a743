"""vLLM backend under concurrency: calls batched by the engine, weight updates between them, cancellation, routing capture."""

import os
import threading
import time

import grpc
import numpy as np
import pytest

if os.environ.get("CISJAX_SKIP_VLLM") == "1":
    pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine", allow_module_level=True)
import vllm  # noqa: E402,F401  (a broken or missing install must fail the suite, not skip it)

from cisjax.rollout.client import RolloutClient, RolloutError  # noqa: E402
from cisjax.rollout.params import SamplingParams  # noqa: E402
from tests.rollout.test_rollout_vllm import PROMPTS, TINY, _Server  # noqa: E402
from tests.support import engines  # noqa: E402
from tests.support.hf import VLLM_QWEN2_MOE  # noqa: E402

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): the real vLLM engine

CALLS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [93, 2], [38, 4, 6, 2, 6], [43, 3, 8, 3]]


# vLLM's CPU KV blocks hold 128 tokens and only whole blocks are prefix-cached: room for prompts that share one
MAX_POSITIONS = 512


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_hf_dir):
    model_dir = tiny_hf_dir("qwen2_moe", seed=3, max_position_embeddings=MAX_POSITIONS, **VLLM_QWEN2_MOE)
    return model_dir, tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def server(dirs):
    s = _Server(*dirs)
    yield s.target
    assert s.stop() == 0


@pytest.fixture
def client(server):
    with RolloutClient(server, retry_s=10) as c:
        yield c


def _concurrently(target, fns):
    """Run fn(client) for each fn on its own thread and client; results in order, with the wall time."""
    results, errors = [None] * len(fns), []

    def worker(i, fn):
        try:
            with RolloutClient(target, retry_s=10) as c:
                results[i] = fn(c)
        except Exception as err:  # noqa: BLE001  (re-raised below)
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i, fn)) for i, fn in enumerate(fns)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results, time.monotonic() - t0


def test_concurrent_calls_are_batched_and_equal_to_serial(client, server):
    params = SamplingParams(n=2, max_new_tokens=24, seed=17, logprobs=2)
    serial = [client.generate([p], params)[0] for p in CALLS]
    concurrent, wall = _concurrently(server, [lambda c, p=p: c.generate([p], params)[0] for p in CALLS])
    for i, (a, b) in enumerate(zip(serial, concurrent)):
        for sa, sb in zip(a, b):
            assert sa.response_ids == sb.response_ids, f"call {i}: batching changed the sampled tokens"
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5, err_msg=f"call {i}")
    # the engine worked on the calls at once: their generation windows overlap, so their summed
    # durations exceed the wall time of the whole batch (one at a time, the sum stays below it)
    busy = sum(s.timing["generate_s"] for per in concurrent for s in per[:1])
    assert busy > 1.5 * wall, (busy, wall)


def test_prompts_of_one_call_are_batched(client):
    samples = client.generate(CALLS, SamplingParams(n=1, max_new_tokens=24, seed=5))
    starts = [s.timing["queue_s"] for per in samples for s in per]
    ends = [s.timing["queue_s"] + s.timing["generate_s"] for per in samples for s in per]
    assert max(starts) < min(ends), "the prompts of one request ran one after another"


def test_cancelled_call_leaves_the_engine_serving(client, server):
    with RolloutClient(server, timeout_s=0.3, retry_s=0) as hasty:
        with pytest.raises(RolloutError) as err:
            hasty.generate(CALLS, SamplingParams(n=64, max_new_tokens=120, seed=1))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    out = client.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=4, seed=2))
    assert len(out[0][0].response_ids) == 4


def test_routing_matches_cisjax(client, dirs):
    """Routed expert ids captured from vLLM's routers (Generate and Score) equal cisjax's XLA fp32 routing at every
    input position: the prompt's (from the prefill, run anew for each of a prompt's samples) and the response's."""
    model_dir, _ = dirs
    samples = client.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=7, seed=11, return_routing=True))
    items = [(s.prompt_ids, s.response_ids) for per in samples for s in per]
    scored = client.score(items, routing=True, logprobs=2)
    *refs, (ref_alone, _) = engines.routing_of_positions(model_dir, items + [(PROMPTS[2], [])])
    layers_k = (TINY["num_hidden_layers"], TINY["num_experts_per_tok"])
    assert TINY["num_experts"] <= 256
    for i, (s, sc, (ref_prompt, ref)) in enumerate(zip([s for per in samples for s in per], scored, refs)):
        assert ref.shape == (len(s.response_ids), *layers_k)
        assert s.prompt_routing.shape == sc["prompt_routing"].shape == (len(s.prompt_ids) - 1, *layers_k)
        for ids in (s.routing, s.prompt_routing, sc["routing"], sc["prompt_routing"]):
            assert ids.dtype == np.uint8  # <= 256 experts: one byte an id
        engines.assert_routing_matches(s.routing, ref, f"generate {i}")
        engines.assert_routing_matches(sc["routing"], ref, f"score {i}")
        engines.assert_routing_matches(s.prompt_routing, ref_prompt, f"generate {i} prompt")
        # the same prompt positions on the same weights: Generate's prefill routes as Score's, id for id
        np.testing.assert_array_equal(s.prompt_routing, sc["prompt_routing"], err_msg=f"sequence {i}")
    # an empty response: the prompt's positions alone; a one-token prompt: no position at all
    alone, one = client.score([(PROMPTS[2], []), ([7], [])], routing=True)
    assert alone["routing"].shape == one["routing"].shape == one["prompt_routing"].shape == (0, *layers_k)
    engines.assert_routing_matches(alone["prompt_routing"], ref_alone, "score without a response")
    plain = client.score(items, logprobs=2)
    for r, q in zip(plain, scored):  # capture changes nothing (batched vs alone: last-bit differences only)
        np.testing.assert_allclose(r["logprobs"], q["logprobs"], atol=1e-5)
        assert r["topk_ids"] == q["topk_ids"]


def _generate_alone(c, prompt, prompt_id, params):
    """One prompt's samples in a Generate call of its own, sent with its `prompt_id` (so with the seeds it gets in a
    larger call: the per-sample seed mixes in the prompt id)."""
    from cisjax.rollout import samples as samples_lib

    rp = c.pb.rollout_pb2
    p = rp.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
        seed=params.seed,
        logprobs=params.logprobs,
        return_routing=True,
    )
    req = rp.GenerateRequest(prompts=[rp.Prompt(token_ids=prompt, id=prompt_id)], params=p)
    got = [samples_lib.from_message(r.sample, prompt_id, prompt) for r in c.stub.Generate(req, timeout=120)]
    return sorted(got, key=lambda s: s.sample_index)


def test_routing_calls_are_batched_and_equal_to_alone(client, dirs):
    """Several prompts x n samples with routing in one Generate call run batched in one routing phase, prompts that
    share a prefix of more than a KV block (and the n samples of each prompt) reading it from the prefix cache; yet
    every sample gets the routing of all its positions, equal to what it gets in a call of its own, to Score's of
    each sequence alone (a fresh prefix cache each) and to cisjax's XLA routing."""
    model_dir, _ = dirs
    rng = np.random.default_rng(1)
    shared = rng.integers(0, TINY["vocab_size"], 150).tolist()  # > 128: its first block is cached
    prompts = [shared + rng.integers(0, TINY["vocab_size"], k).tolist() for k in (3, 20, 41)]
    prompts += [rng.integers(0, TINY["vocab_size"], 133).tolist(), CALLS[1], [7]]
    params = SamplingParams(n=3, max_new_tokens=9, seed=21, logprobs=1, return_routing=True)
    together = client.generate(prompts, params)
    flat = [s for per in together for s in per]
    starts = [s.timing["queue_s"] for s in flat]
    ends = [s.timing["queue_s"] + s.timing["generate_s"] for s in flat]
    assert max(starts) < min(ends), "the routing calls of one request ran one after another"

    layers_k = (TINY["num_hidden_layers"], TINY["num_experts_per_tok"])
    refs = engines.routing_of_positions(model_dir, [(s.prompt_ids, s.response_ids) for s in flat])
    for i, prompt in enumerate(prompts):
        alone = _generate_alone(client, prompt, i, params)
        for s, a in zip(together[i], alone):
            where = f"prompt {i} sample {s.sample_index}"
            assert s.response_ids == a.response_ids, where  # the same seeds: the same sample
            np.testing.assert_allclose(s.logprobs, a.logprobs, atol=1e-5, err_msg=where)
            assert s.prompt_routing.shape == (len(prompt) - 1, *layers_k), where
            assert s.routing.shape == (len(s.response_ids), *layers_k), where
            np.testing.assert_array_equal(s.prompt_routing, a.prompt_routing, err_msg=where)
            np.testing.assert_array_equal(s.routing, a.routing, err_msg=where)
    for n, (s, (ref_prompt, ref)) in enumerate(zip(flat, refs)):
        where = f"prompt {s.prompt_index} sample {s.sample_index}"
        engines.assert_routing_matches(s.prompt_routing, ref_prompt, where + " prompt")
        engines.assert_routing_matches(s.routing, ref, where)
        if (
            n % 3 == 1
        ):  # a sample of each prompt scored alone: a call, a routing phase and an empty prefix cache of its own
            (sc,) = client.score([(s.prompt_ids, s.response_ids)], routing=True)
            np.testing.assert_array_equal(s.prompt_routing, sc["prompt_routing"], err_msg=where)
            np.testing.assert_array_equal(s.routing, sc["routing"], err_msg=where)


def test_routing_and_plain_calls_together(client, server):
    """Routing calls and plain calls sent at once: the plain ones wait out the routing phase (or the other way round)
    and get the samples they get alone; the routing ones their routing."""
    plain = SamplingParams(n=2, max_new_tokens=12, seed=4)
    routed = SamplingParams(n=2, max_new_tokens=12, seed=4, return_routing=True)
    serial = [client.generate([p], plain)[0] for p in CALLS]
    fns = [lambda c, p=p, sp=routed if i % 2 else plain: c.generate([p], sp)[0] for i, p in enumerate(CALLS)]
    concurrent, _ = _concurrently(server, fns)
    layers_k = (TINY["num_hidden_layers"], TINY["num_experts_per_tok"])
    for i, (a, b) in enumerate(zip(serial, concurrent)):
        for sa, sb in zip(a, b):
            assert sa.response_ids == sb.response_ids, f"call {i}"
            if i % 2:
                assert sb.routing.shape == (len(sb.response_ids), *layers_k)
                assert sb.prompt_routing.shape == (len(CALLS[i]) - 1, *layers_k)
            else:
                assert sb.routing is None


def test_update_waits_for_calls_in_flight(client, server, dirs):
    """An UpdateWeights sent while calls generate: each sample has one version, the calls in flight
    finish on the old weights, later calls get the new ones. (Last: it changes the served weights.)"""
    from safetensors.numpy import load_file

    model_dir, _ = dirs
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    rng = np.random.default_rng(0)
    changed = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in tensors.items()}
    before = client.info()["version"]
    # 6 x 64 samples of 100 tokens: long enough to still be generating when the update is sent (6 x 16 finished
    # within the 0.5 s this test used to wait, on a quiet machine)
    params = SamplingParams(n=64, max_new_tokens=100, seed=8)
    box = {}

    def in_flight():
        with RolloutClient(server, retry_s=10) as c:
            box["samples"] = c.generate(CALLS, params)

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.2)  # let the calls reach the engine
    assert t.is_alive(), "the calls finished before the update was sent: nothing was in flight"
    new = client.update_weights_from_tensors(changed, version=before + 1)
    t.join(300)
    assert new == before + 1 and "samples" in box
    for per in box["samples"]:
        for s in per:
            assert len(set(s.versions)) == 1, "a sample mixes weights versions"
            assert s.versions[0] == before
    after = client.generate(CALLS[:1], params)
    assert {s.version for s in after[0]} == {before + 1}
