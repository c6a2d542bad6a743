"""`cisjax serve --backend jax --exact` end to end: a server subprocess on the exact sampler, its sampled logprobs
bit for bit the trainer's exact forward on the same fp32 weights (bf16 compute), before and after a weight update."""

import dataclasses

import numpy as np
import pytest

from cisjax.models import hf_io
from cisjax.rollout.client import RolloutClient
from cisjax.rollout.params import SamplingParams
from tests.support import hf, servers
from tests.support.exact import trainer_p

pytestmark = pytest.mark.slow  # a server subprocess

PROMPTS = [[1, 2, 3, 4], [50, 7], [96, 0, 33, 12, 5, 8]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=7, seed=4, stop_token_ids=[5])


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_hf_dir):
    model_dir, export_root = tiny_hf_dir("qwen2_moe"), tmp_path_factory.mktemp("exports")
    port = servers.free_port()
    proc = servers.start("jax", model_dir, port, export_root=export_root, dtype="bfloat16", extra_args=("--exact",))
    target = f"127.0.0.1:{port}"
    try:
        servers.wait_serving(proc, target, timeout=180.0)
        assert "jax-exact engine" in servers.output(proc) and "bfloat16, fp32 weights" in servers.output(proc)
        with RolloutClient(target, retry_s=10) as c:
            yield c, model_dir, export_root
    finally:
        assert servers.stop(proc) == 0, servers.output(proc)


def _assert_exact(client, model_dir, truncate=False):
    """Every sampled token's logprob equals the exact forward's p of it on the weights in `model_dir` (fp32, computed
    in bf16, as the trainer's), its row alone; with `truncate`, renormalised over the support sent back."""
    model, _, _ = hf_io.load(model_dir, dtype="bfloat16", param_dtype="float32")
    params = dataclasses.replace(PARAMS, top_k=6, return_sampling_mask=True) if truncate else PARAMS
    tokens = 0
    for prompt, per in zip(PROMPTS, client.generate(PROMPTS, params)):
        assert len(per) == 2
        for s in per:
            want = trainer_p(model, prompt, s.response_ids, s.support if truncate else None)
            np.testing.assert_array_equal(np.asarray(s.logprobs, np.float32), want)
            tokens += len(want)
    assert tokens >= 12


def test_info_names_the_exact_engine(served):
    client, _, _ = served
    info = client.info()
    assert info["engine"] == "jax-exact" and info["dtype"] == "bfloat16"


def test_sampled_logprobs_are_the_exact_forwards(served):
    client, model_dir, _ = served
    _assert_exact(client, model_dir)
    _assert_exact(client, model_dir, truncate=True)


def test_published_weights_stay_exact(served):
    """A trainer's publish (UpdateWeights of an fp32 export): the samples are the exact forward's on the new weights."""
    client, model_dir, export_root = served
    new_dir = export_root / "v1"
    hf.perturbed_export(model_dir, new_dir, seed=7)
    before = client.generate(PROMPTS[:1], PARAMS)[0][0].logprobs
    v1 = client.update_weights(str(new_dir), version=client.info()["version"] + 1)
    assert client.info()["version"] == v1
    _assert_exact(client, str(new_dir))
    assert client.generate(PROMPTS[:1], PARAMS)[0][0].logprobs != before
