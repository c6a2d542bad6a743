"""Rollout service end to end: a transformers-backend server subprocess, checked against `cisjax score`."""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from cisjax.commands.generate import add_args as generate_add_args
from cisjax.commands.generate import run as generate_run
from cisjax.rollout.client import RolloutClient, RolloutError
from cisjax.rollout.params import SamplingParams
from tests.support import engines, servers
from tests.support.hf import SERVER_QWEN2_MOE, hf_forward, tiny_hf_config

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): server subprocesses

VOCAB = 97
TOKEN = "s3cret-test-token"
TINY = tiny_hf_config("qwen2_moe", **SERVER_QWEN2_MOE)
assert TINY["vocab_size"] == VOCAB
PROMPTS = [[1, 2, 3, 4], [50, 7], [96, 0, 33, 12, 5, 8]]


_free_port = servers.free_port


def _start(model_dir, port, export_root=None, token=None, host="127.0.0.1"):
    return servers.start(
        "transformers", model_dir, port, export_root=export_root, token=token, host=host, env={"OMP_NUM_THREADS": "1"}
    )


def _wait(proc, target):
    servers.wait_serving(proc, target, timeout=300.0)


_stop = servers.stop


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_hf_dir):
    model_dir = tiny_hf_dir("qwen2_moe", **SERVER_QWEN2_MOE)
    return model_dir, tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def server(dirs):
    """A token-protected server on 127.0.0.1 (auth is tested without leaving localhost)."""
    model_dir, export_root = dirs
    port = _free_port()
    proc = _start(model_dir, port, export_root=export_root, token=TOKEN)
    target = f"127.0.0.1:{port}"
    _wait(proc, target)
    yield target
    assert _stop(proc) == 0  # graceful shutdown on SIGTERM


@pytest.fixture
def client(server):
    with RolloutClient(server, token=TOKEN, retry_s=10) as c:
        yield c


rescore, _items = engines.rescore, engines.items_of


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_are_the_sampling_distribution(client, dirs, tmp_path, temperature):
    model_dir, _ = dirs
    version = client.info()["version"]
    assert client.info()["phases"] is None  # timed apart by the JAX sampler only
    plain = client.generate(
        PROMPTS,
        SamplingParams(n=3, temperature=temperature, max_new_tokens=8, seed=3, stop_token_ids=[5, 9, 11], logprobs=3),
    )
    # top-k sampling: q is renormalised over the k survivors
    topk = client.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, top_k=5, max_new_tokens=6, seed=4))
    for per in plain + topk:
        assert len(per) in (2, 3) and sorted(s.sample_index for s in per) == list(range(len(per)))
        for s in per:
            assert (
                s.finish_reason in ("stop", "length") and len(s.response_ids) == len(s.logprobs) == len(s.versions) > 0
            )
            assert s.versions == [version] * len(s.response_ids)
            if s.finish_reason == "stop":
                assert s.response_ids[-1] in (5, 9, 11) and not set(s.response_ids[:-1]) & {5, 9, 11}
            else:
                assert len(s.response_ids) == (8 if per in plain else 6)
    ref = rescore(model_dir, _items(plain) + _items(topk), tmp_path, temperature=temperature, top_k=5)
    got = [s for per in plain + topk for s in per]
    for s, r in zip(got[:9], ref[:9]):
        np.testing.assert_allclose(s.logprobs, r["logprobs"], atol=1e-5)
        np.testing.assert_array_equal(s.top_ids, [ids[:3] for ids in r["topk_ids"]])
        np.testing.assert_allclose(s.top_logprobs, [lp[:3] for lp in r["topk_logprobs"]], atol=1e-5)
    for s, r in zip(got[9:], ref[9:]):
        top = np.array(r["topk_logprobs"], np.float64)
        assert all(t in ids for t, ids in zip(s.response_ids, r["topk_ids"]))
        want = np.array(r["logprobs"]) - np.log(np.exp(top).sum(-1))
        np.testing.assert_allclose(s.logprobs, want, atol=1e-5)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_sampling_mask_is_the_support_sampled_from(client, dirs, tmp_path, top_p):
    """return_sampling_mask: each token's support is what top-k 5 (then top-p on the renormalised five) kept, by
    cisjax score's logprobs of the same tokens; the sampled token is in it and q is p renormalised over it."""
    model_dir, _ = dirs
    params = SamplingParams(n=2, temperature=0.8, top_k=5, top_p=top_p, max_new_tokens=6, seed=5)
    got = client.generate(PROMPTS, dataclasses.replace(params, return_sampling_mask=True))
    assert [[s.response_ids for s in per] for per in got] == [
        [s.response_ids for s in per] for per in client.generate(PROMPTS, params)
    ]  # asking for the mask changes no sample
    ref = rescore(model_dir, _items(got), tmp_path, temperature=0.8, top_k=5)
    for s, r in zip((s for per in got for s in per), ref, strict=True):
        ids, counts = s.support
        assert len(counts) == len(s.response_ids) and counts.sum() == len(ids)
        kept = np.split(ids, np.cumsum(counts)[:-1])
        for t, (tok, support) in enumerate(zip(s.response_ids, kept, strict=True)):
            lp5 = np.array(r["topk_logprobs"][t], np.float64)  # the five best, best first
            p5 = np.exp(lp5 - np.logaddexp.reduce(lp5))
            keep = (np.cumsum(p5) - p5) < top_p  # the mass strictly above each token
            assert sorted(support.tolist()) == sorted(np.array(r["topk_ids"][t])[keep].tolist())
            assert tok in support
            np.testing.assert_allclose(s.logprobs[t], r["logprobs"][t] - np.logaddexp.reduce(lp5[keep]), atol=1e-5)
    # greedy and untruncated samples: counts of 0, nothing cut
    plain = client.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=3, return_sampling_mask=True))[0][0]
    assert plain.support[1].tolist() == [0] * len(plain.response_ids) and len(plain.support[0]) == 0


def test_sampling_mask_of_an_unbounded_support_is_refused(client):
    with pytest.raises(RolloutError, match=r"return_sampling_mask with top_p=0.9 needs top_k in \[1, 1024\]"):
        client.generate(PROMPTS[:1], SamplingParams(n=1, top_p=0.9, max_new_tokens=2, return_sampling_mask=True))


def test_seeds_reproduce(client):
    params = SamplingParams(n=4, max_new_tokens=10, seed=123)
    a = client.generate(PROMPTS, params)
    b = client.generate(PROMPTS, params)
    assert [[s.response_ids for s in per] for per in a] == [[s.response_ids for s in per] for per in b]
    assert [[s.logprobs for s in per] for per in a] == [[s.logprobs for s in per] for per in b]
    c = client.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=10, seed=124))
    assert [[s.response_ids for s in per] for per in a] != [[s.response_ids for s in per] for per in c]
    assert len({tuple(s.response_ids) for s in a[0]}) > 1  # the n samples of a prompt differ
    greedy = client.generate(PROMPTS[:1], SamplingParams(n=2, greedy=True, max_new_tokens=6))
    assert greedy[0][0].response_ids == greedy[0][1].response_ids


def test_routing_matches_cisjax(client, dirs):
    """Routed expert ids from Generate and from Score equal cisjax's (XLA fp32) routing of the same tokens at the
    response positions, and the HF model's own routers' top-k at the prompt positions (0 .. P-2)."""
    model_dir, _ = dirs
    samples = client.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=7, seed=11, return_routing=True))
    items = _items(samples)
    scored = client.score(items, routing=True)
    refs = engines.routing(model_dir, items)
    flat = [s for per in samples for s in per]

    def hf_prompt(prompt_ids):  # the HF routers' sorted top-k at positions 0 .. P-2: [P - 1, layers, k]
        return np.transpose(hf_forward(model_dir, np.asarray([prompt_ids]))[1][:, 0, :-1], (1, 0, 2))

    for i, (s, sc, ref) in enumerate(zip(flat, scored, refs)):
        assert ref.shape == (len(s.response_ids), 2, 2)
        engines.assert_routing_matches(s.routing, ref, f"generate {i}")
        engines.assert_routing_matches(sc["routing"], ref, f"score {i}")
        ref_prompt = hf_prompt(s.prompt_ids)
        for where, got in (("generate", s.prompt_routing), ("score", sc["prompt_routing"])):
            assert got.dtype == np.uint8 and got.shape == (len(s.prompt_ids) - 1, 2, 2)  # 8 experts: one byte an id
            engines.assert_routing_matches(got, ref_prompt, f"{where} {i} prompt")
    empty = client.score([([1, 2], [])], routing=True)[0]
    assert empty["routing"].shape == (0, 2, 2)
    engines.assert_routing_matches(empty["prompt_routing"], hf_prompt([1, 2]), "score without a response")


def test_score_matches_cisjax_score(client, dirs, tmp_path):
    model_dir, _ = dirs
    rng = np.random.RandomState(0)
    items = [
        (rng.randint(0, VOCAB, rng.randint(1, 9)).tolist(), rng.randint(0, VOCAB, rng.randint(0, 12)).tolist())
        for _ in range(5)
    ]
    got = client.score(items, temperature=0.7, logprobs=4)
    ref = rescore(model_dir, items, tmp_path, temperature=0.7, top_k=4)
    for g, r, (_, resp) in zip(got, ref, items):
        assert len(g["logprobs"]) == len(resp)
        np.testing.assert_allclose(g["logprobs"], r["logprobs"], atol=1e-5)
        np.testing.assert_array_equal(np.array(g["topk_ids"]).reshape(-1, 4), np.array(r["topk_ids"]).reshape(-1, 4))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompts=[]), "no prompts"),
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(prompts=[[1, VOCAB]]), "outside the vocabulary"),
        (dict(prompts=[[1, -3]]), "outside the vocabulary"),
        (dict(n=0), "n must be"),
        (dict(max_new_tokens=10**9), "max_new_tokens"),
        (dict(max_new_tokens=127), "context length"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(logprobs=10**6), "logprobs"),
    ],
)
def test_malformed_requests_are_invalid_argument(client, bad, message):
    prompts = bad.pop("prompts", PROMPTS)
    params = SamplingParams(**{"max_new_tokens": 4, **bad})
    if prompts:
        with pytest.raises(RolloutError, match=message) as err:
            client.generate(prompts, params)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    else:  # the client sends nothing for no prompts: ask the server directly
        pb = client.pb.rollout_pb2
        with pytest.raises(grpc.RpcError) as err:
            list(
                client.stub.Generate(
                    pb.GenerateRequest(params=pb.SamplingParams(n=1, temperature=1, max_new_tokens=4)),
                    metadata=client.metadata,
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    with pytest.raises(RolloutError, match="outside the vocabulary") as err:
        client.score([([1, 2], [3, 1000])])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # and the server keeps serving
    assert len(client.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2))[0]) == 1


def test_auth(server):
    with RolloutClient(server, retry_s=1) as anon, RolloutClient(server, token="wrong", retry_s=1) as wrong:
        for c in (anon, wrong):
            for call in (
                c.info,
                lambda c=c: c.generate(PROMPTS, SamplingParams(max_new_tokens=2)),
                lambda c=c: c.score([([1], [2])]),
            ):
                with pytest.raises(RolloutError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(RolloutError) as err:
                c.update_weights("x", checksums=False)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert anon.health() == "SERVING"  # probes need no token


def test_non_localhost_bind_needs_token_and_tls(dirs):
    """Refused before the engine loads: no token; a token (from the environment) but no TLS, unless --insecure."""
    argv = [sys.executable, "-m", "cisjax.commands.serve", "--model", str(dirs[0]), "--port", "0", "--host", "0.0.0.0"]
    run = dict(capture_output=True, text=True, timeout=120)
    res = subprocess.run(argv, env=dict(os.environ, CISJAX_ROLLOUT_TOKEN=""), **run)
    assert res.returncode == 2 and "requires a token" in res.stderr, res.stderr
    res = subprocess.run(argv, env=dict(os.environ, CISJAX_ROLLOUT_TOKEN="t0ken"), **run)
    assert res.returncode == 2 and "without TLS" in res.stderr and "--insecure" in res.stderr, res.stderr
    res = subprocess.run([*argv, "--tls-cert", os.path.join(dirs[0], "config.json")], env=os.environ, **run)
    assert res.returncode == 2 and "both --tls-cert and --tls-key" in res.stderr, res.stderr


def test_update_weights(client, dirs, tmp_path):
    import flax.nnx as nnx
    import jax
    from safetensors.numpy import load_file

    from cisjax.models import hf_io

    model_dir, export_root = dirs
    v0 = client.info()["version"]
    model, _, hf = hf_io.load(model_dir, dtype="float32", param_dtype="float32")
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    nnx.update(
        model,
        jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]),
    )
    new_dir = export_root / "step_1"
    hf_io.save(model, new_dir, hf)

    # refused: outside the export root, missing, corrupt manifest, non-increasing version; old weights keep serving
    for path, kw, code in [
        (model_dir, {}, grpc.StatusCode.PERMISSION_DENIED),
        (str(export_root / ".." / "x"), {}, grpc.StatusCode.PERMISSION_DENIED),
        (str(export_root / "nope"), {"checksums": False}, grpc.StatusCode.NOT_FOUND),
        (str(new_dir), {"checksums": {"model.safetensors": "0" * 64}}, grpc.StatusCode.DATA_LOSS),
    ]:
        with pytest.raises(RolloutError, match=".") as err:
            client.update_weights(path, **kw)
        assert err.value.code == code, (path, err.value)
    assert client.info()["version"] == v0

    v1 = client.update_weights(str(new_dir), version=v0 + 10)
    assert v1 == v0 + 10 and client.info()["version"] == v1
    with pytest.raises(RolloutError, match="not above the current version") as err:
        client.update_weights(str(new_dir), version=v1)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    samples = client.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=9))
    assert all(s.versions == [v1] * len(s.response_ids) for per in samples for s in per)
    ref_new = rescore(new_dir, _items(samples), tmp_path)
    ref_old = rescore(model_dir, _items(samples), tmp_path / "..")
    flat = [s for per in samples for s in per]
    for s, r in zip(flat, ref_new):
        np.testing.assert_allclose(s.logprobs, r["logprobs"], atol=1e-5)
    assert max(abs(a - b) for s, r in zip(flat, ref_old) for a, b in zip(s.logprobs, r["logprobs"])) > 1e-3

    # back to the original weights, streamed as tensor chunks (many per tensor)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    v2 = client.update_weights_from_tensors(tensors, chunk_bytes=1000)
    assert v2 == v1 + 1
    items = _items(samples)[:2]
    back = client.score(items)
    for g, r in zip(back, ref_old[:2]):
        np.testing.assert_allclose(g["logprobs"], r["logprobs"], atol=1e-5)
        assert g["version"] == v2
    with pytest.raises(RolloutError, match="lacks") as err:
        client.update_weights_from_tensors(dict(list(tensors.items())[:3]))
    assert client.info()["version"] == v2


def test_client_retries_across_server_restart(dirs, tmp_path):
    """A killed server comes back on its original weights: the client re-sends the weights it had
    loaded (version 1) before retrying, so the samples are those of version 1."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model_dir, _ = dirs
    export_root = tmp_path / "exports"
    changed = export_root / "v1"
    changed.mkdir(parents=True)
    shutil.copy(os.path.join(model_dir, "config.json"), changed / "config.json")
    rng = np.random.default_rng(5)
    save_file(
        {
            k: (v + 0.1 * rng.standard_normal(v.shape)).astype(v.dtype)
            for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()
        },
        str(changed / "model.safetensors"),
    )
    port = _free_port()
    target = f"127.0.0.1:{port}"
    proc = _start(model_dir, port, export_root=export_root)
    _wait(proc, target)
    params = SamplingParams(n=2, max_new_tokens=5, seed=11)
    with RolloutClient(target, retry_s=90) as c:
        original = c.generate(PROMPTS, params)
        assert c.update_weights(str(changed), version=1) == 1
        before = c.generate(PROMPTS, params)
        assert [[s.response_ids for s in per] for per in before] != [[s.response_ids for s in per] for per in original]
        proc.kill()
        proc.wait()
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("samples", c.generate(PROMPTS, params)))
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive()  # pending: retrying against the dead server
        proc = _start(model_dir, port, export_root=export_root)
        try:
            thread.join(90)
            assert not thread.is_alive() and "samples" in result
            after = result["samples"]
            assert [[s.response_ids for s in per] for per in after] == [[s.response_ids for s in per] for per in before]
            assert {s.version for per in after for s in per} == {1}

            # `cisjax generate` against the restarted server: one line per sample, atomically written
            inp, out = tmp_path / "prompts.jsonl", tmp_path / "rollouts.jsonl"
            inp.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
            import argparse

            p = argparse.ArgumentParser()
            generate_add_args(p)
            args = p.parse_args(
                [
                    "--server",
                    target,
                    "--input",
                    str(inp),
                    "--output",
                    str(out),
                    "--n",
                    "2",
                    "--max-new-tokens",
                    "5",
                    "--seed",
                    "11",
                    "--logprobs",
                    "2",
                    "--routing",
                ]
            )
            assert generate_run(args, []) == 0
            lines = [json.loads(x) for x in out.read_text().splitlines()]
            assert len(lines) == 2 * len(PROMPTS)
            assert [x["response_ids"] for x in lines] == [s.response_ids for per in before for s in per]
            assert all(x["version"] == 1 and x["finish_reason"] == "length" and len(x["topk_ids"]) == 5 for x in lines)
            assert all(np.asarray(x["routing"]).shape == (5, 2, 2) for x in lines)
            assert all(np.asarray(x["prompt_routing"]).shape == (len(x["prompt_ids"]) - 1, 2, 2) for x in lines)
        finally:
            assert _stop(proc) == 0


def test_process_boundaries():
    """The server never imports the trainer (nor jax); the client never imports torch/transformers."""
    code = (
        "import sys; import cisjax.rollout.server, cisjax.engines.transformers_backend; "
        "bad = [m for m in sys.modules if m.startswith(('cisjax.train', 'cisjax.rl', 'cisjax.models', 'jax', 'flax'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = (
        "import sys; import cisjax.rollout.client; from cisjax.rollout import protos; protos.load(); "
        "bad = [m for m in sys.modules if m.startswith(('torch', 'transformers', 'vllm'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
