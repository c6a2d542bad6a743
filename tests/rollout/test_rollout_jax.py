"""`cisjax serve --backend jax --mesh` end to end: a server subprocess on the JAX sampler on a serving mesh, against the transformers reference
backend (greedy tokens, logprobs, routing) and `cisjax score` (sampled logprobs); weight updates; bad input."""

import dataclasses

import grpc
import numpy as np
import pytest

from cisjax.engines import transformers_backend
from cisjax.rollout.client import RolloutClient, RolloutError
from cisjax.rollout.params import SamplingParams
from tests.support import engines, hf, servers
from tests.support.engines import engine_params
from tests.support.hf import SERVER_QWEN2_MOE

pytestmark = pytest.mark.slow  # a server subprocess

PROMPTS = [[1, 2, 3, 4], [50, 7], [96, 0, 33, 12, 5, 8]]
GREEDY = engine_params(max_new_tokens=6, greedy=True, return_routing=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_hf_dir):
    return tiny_hf_dir("qwen2_moe", **SERVER_QWEN2_MOE), tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def client(dirs):
    model_dir, export_root = dirs
    port = servers.free_port()
    # on a serving mesh over the 8 CPU devices the test processes have (tests/support/xla_flags.py): weights, activations and
    # KV cache sharded as the trainer's; the greedy parity below holds there
    proc = servers.start(
        "jax",
        model_dir,
        port,
        export_root=export_root,
        env={"JAX_PLATFORMS": "cpu"},
        extra_args=("--mesh", "data=2,fsdp=-1"),
    )
    target = f"127.0.0.1:{port}"
    try:
        servers.wait_serving(proc, target, timeout=180.0)
        assert "sharded over the mesh {'data': 2, 'fsdp': 4," in servers.output(proc)
        with RolloutClient(target, retry_s=10) as c:
            yield c
    finally:
        assert servers.stop(proc) == 0, servers.output(proc)


def _greedy_against_reference(client, model_dir):
    ref = transformers_backend.Backend(model_dir, dtype="float32")
    got = client.generate(PROMPTS, SamplingParams(n=1, greedy=True, max_new_tokens=6, return_routing=True))
    for i, prompt in enumerate(PROMPTS):
        (want,) = ref.generate(prompt, i, GREEDY)
        (s,) = got[i]
        assert s.response_ids == want.token_ids, (i, s.response_ids, want.token_ids)
        np.testing.assert_allclose(s.logprobs, want.logprobs, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(np.sort(s.routing.astype(np.int64), -1), np.sort(want.routing, -1))
        np.testing.assert_array_equal(np.sort(s.prompt_routing.astype(np.int64), -1), np.sort(want.prompt_routing, -1))
    return got


def test_info_and_greedy_equal_the_reference_backend(client, dirs):
    info = client.info()
    assert info["engine"] == "jax" and info["vocab_size"] == 97
    _greedy_against_reference(client, dirs[0])


def test_sampled_logprobs_equal_cisjax_score_and_seeds_reproduce(client, dirs, tmp_path):
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=8, seed=5, stop_token_ids=[5, 9], logprobs=2)
    samples = client.generate(PROMPTS, params)
    before = client.info()["phases"]
    again = client.generate(PROMPTS, params)  # the bucket compiled: this call is counted whole
    phases = client.info()["phases"]
    assert phases["device_kind"] == "cpu"  # the engine's device: the roofline's bandwidth (none listed for a CPU)
    made = {k: phases[k] - before[k] for k in phases if k != "device_kind"}
    assert (
        made["decode_bytes"] > 0
    )  # what its steps read: the weights and the KV cache (tests/engines/jax/test_engine.py)
    assert made["prefill_tokens"] == sum(len(p) for p in PROMPTS) and made["prefill_s"] > 0
    assert made["decode_tokens"] == sum(len(s.response_ids) for per in again for s in per) and made["decode_s"] > 0
    assert [[s.response_ids for s in per] for per in samples] == [[s.response_ids for s in per] for per in again]
    flat = [s for per in samples for s in per]
    assert len({tuple(s.response_ids) for s in samples[0]}) > 1
    for s in flat:
        assert s.finish_reason in ("stop", "length") and len(s.top_ids) == len(s.response_ids)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in (5, 9) and not {5, 9} & set(s.response_ids[:-1])
    ref = engines.rescore(dirs[0], engines.items_of(samples), tmp_path, temperature=0.7)
    for s, r in zip(flat, ref):
        np.testing.assert_allclose(s.logprobs, r["logprobs"], atol=1e-4)
    scored = client.score(engines.items_of(samples), temperature=0.7)
    for s, g in zip(flat, scored):
        np.testing.assert_allclose(g["logprobs"], s.logprobs, atol=1e-4)


def test_sampling_masks_travel(client):
    """return_sampling_mask through the server: each token's support (top-k 4) holds the token sampled; the exact
    support is tests/engines/jax/test_engine.py's."""
    params = SamplingParams(n=2, temperature=0.9, top_k=4, max_new_tokens=5, seed=2, return_sampling_mask=True)
    for per in client.generate(PROMPTS, params):
        for s in per:
            ids, counts = s.support
            assert len(counts) == len(s.response_ids) and all(1 <= c <= 4 for c in counts)
            for tok, support in zip(s.response_ids, np.split(ids, np.cumsum(counts)[:-1]), strict=True):
                assert tok in support and len(set(support.tolist())) == len(support)


def test_weights_update_whole_or_not_at_all(client, dirs):
    model_dir, export_root = dirs
    v0 = client.info()["version"]
    new_dir = export_root / "v1"
    hf.perturbed_export(model_dir, new_dir, seed=3)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=6)
    before = [(s.response_ids, s.logprobs) for s in client.generate(PROMPTS[:1], greedy)[0]]

    from safetensors.numpy import load_file

    tensors = load_file(str(new_dir / "model.safetensors"))
    with pytest.raises(RolloutError, match="lacks"):  # a stream missing tensors: refused, nothing swapped
        client.update_weights_from_tensors(dict(list(tensors.items())[:3]))
    assert client.info()["version"] == v0
    assert [(s.response_ids, s.logprobs) for s in client.generate(PROMPTS[:1], greedy)[0]] == before

    v1 = client.update_weights(str(new_dir), version=v0 + 1)
    assert client.info()["version"] == v1
    got = _greedy_against_reference(client, str(new_dir))
    assert all(s.versions == [v1] * len(s.response_ids) for per in got for s in per)


def test_bad_input_is_refused_and_the_server_keeps_serving(client):
    for prompts, params, match in [
        ([list(range(90)) * 2], SamplingParams(max_new_tokens=8), "context length"),
        ([[1, 200]], SamplingParams(max_new_tokens=4), "outside the vocabulary"),
        ([[1, 2]], SamplingParams(n=0), "n must be"),
        ([[1, 2]], SamplingParams(top_p=1.5), "top_p"),
    ]:
        with pytest.raises(RolloutError, match=match) as err:
            client.generate(prompts, params)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    (ok,) = client.generate([[1, 2]], dataclasses.replace(SamplingParams(), max_new_tokens=3, greedy=True))
    assert len(ok[0].response_ids) == 3
