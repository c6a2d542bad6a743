"""The rollout service end to end on the fake engine (fast tier): a `cisjax serve --backend fake` subprocess with a
token, its health, Generate and Score as the engine computes them, refusals, weight updates (a directory, a stream)
and their versions, a client that re-sends its weights across a restart, and a graceful stop."""

import shutil
import threading
import time

import grpc
import numpy as np
import pytest

from cisjax.engines import fake
from cisjax.rollout.client import RolloutClient, RolloutError
from cisjax.rollout.params import SamplingParams
from tests.support import servers

VOCAB, MAX_LEN = 97, 64
TOKEN = "s3cret-test-token"
PROMPTS = [[1, 2, 3, 4], [50, 7], [96, 0, 33, 12, 5, 8]]
WEIGHTS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_server")
    model_dir = servers.fake_model_dir(root / "model", VOCAB, MAX_LEN, tensors=WEIGHTS)
    (root / "exports").mkdir()
    return model_dir, root / "exports"


def _serve(model_dir, export_root, port, **kw):
    proc = servers.start("fake", model_dir, port, export_root=export_root, **kw)
    servers.wait_serving(proc, f"127.0.0.1:{port}", timeout=60.0, poll=0.05)
    return proc


@pytest.fixture(scope="module")
def server(dirs):
    port = servers.free_port()
    proc = _serve(*dirs, port, token=TOKEN)
    yield f"127.0.0.1:{port}"
    assert servers.stop(proc) == 0  # SIGTERM: drained, exit 0


@pytest.fixture
def client(server):
    with RolloutClient(server, token=TOKEN, retry_s=10) as c:
        yield c


def _flat(samples, what):
    return [[getattr(s, what) for s in per] for per in samples]


def test_health_info_generate_and_score_are_the_engines(client, dirs):
    assert client.health() == "SERVING"
    info = client.info()
    assert (info["engine"], info["vocab_size"], info["max_model_len"]) == ("fake", VOCAB, MAX_LEN)
    version = info["version"]
    params = SamplingParams(n=3, max_new_tokens=8, seed=5, stop_token_ids=[5, 9, 11], logprobs=2)
    got = client.generate(PROMPTS, params)
    # what the engine gives in this process for the same request (prompt ids: their positions)
    engine = fake.Backend(dirs[0])
    want = [engine.generate(p, i, params) for i, p in enumerate(PROMPTS)]
    assert _flat(got, "response_ids") == [[s.token_ids for s in per] for per in want]
    f32 = lambda x: np.asarray(x, np.float32).tolist()  # noqa: E731  (float on the wire)
    assert _flat(got, "logprobs") == [[f32(s.logprobs) for s in per] for per in want]
    assert _flat(got, "top_ids") == [[s.top_ids for s in per] for per in want]
    assert _flat(got, "finish_reason") == [[s.finish_reason for s in per] for per in want]
    for i, per in enumerate(got):
        assert [s.sample_index for s in per] == [0, 1, 2] and all(s.prompt_index == i for s in per)
        for s in per:
            assert s.versions == [version] * len(s.response_ids) and len(s.response_ids) > 0
            assert all(lp < 0 and np.isfinite(lp) for lp in s.logprobs)
    scored = client.score([(s.prompt_ids, s.response_ids) for per in got for s in per])
    for s, r in zip((s for per in got for s in per), scored, strict=True):
        assert r["logprobs"] == s.logprobs
        assert r["version"] == version


@pytest.mark.parametrize(
    "bad, message, code",
    [
        (dict(prompts=[[1, VOCAB]]), "outside the vocabulary", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(n=0), "n must be", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(max_new_tokens=MAX_LEN - 3), "context length", grpc.StatusCode.INVALID_ARGUMENT),
        (dict(return_routing=True), "does not return routing", grpc.StatusCode.UNIMPLEMENTED),
        (dict(top_p=0.9, return_sampling_mask=True), "needs top_k", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_refusals_and_the_server_keeps_serving(client, bad, message, code):
    prompts = bad.pop("prompts", PROMPTS)
    with pytest.raises(RolloutError, match=message) as err:
        client.generate(prompts, SamplingParams(**{"max_new_tokens": 4, **bad}))
    assert err.value.code == code
    assert len(client.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=2))[0]) == 2


def test_auth(server):
    with RolloutClient(server, retry_s=1) as anon, RolloutClient(server, token="wrong", retry_s=1) as wrong:
        for c in (anon, wrong):
            for call in (c.info, lambda c=c: c.generate(PROMPTS, SamplingParams(max_new_tokens=2))):
                with pytest.raises(RolloutError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert anon.health() == "SERVING"  # probes need no token


def test_weight_updates_and_versions(client, dirs):
    model_dir, export_root = dirs
    v0 = client.info()["version"]
    new_dir = shutil.copytree(model_dir, export_root / "v_next")
    # refused, the version kept: outside the export root, missing, a corrupt checksum
    for path, kw, code in [
        (model_dir, {}, grpc.StatusCode.PERMISSION_DENIED),
        (str(export_root / "nope"), {"checksums": False}, grpc.StatusCode.NOT_FOUND),
        (str(new_dir), {"checksums": {"model.safetensors": "0" * 64}}, grpc.StatusCode.DATA_LOSS),
    ]:
        with pytest.raises(RolloutError) as err:
            client.update_weights(path, **kw)
        assert err.value.code == code, (path, err.value)
    assert client.info()["version"] == v0
    v1 = client.update_weights(str(new_dir), version=v0 + 10)
    assert v1 == v0 + 10 and client.info()["version"] == v1
    with pytest.raises(RolloutError, match="not above the current version") as err:
        client.update_weights(str(new_dir), version=v1)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    samples = client.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=9))
    assert all(s.versions == [v1] * 6 for per in samples for s in per)
    # streamed: every tensor of the checkpoint, in many chunks; an incomplete stream is refused
    assert client.update_weights_from_tensors(WEIGHTS, chunk_bytes=8) == v1 + 1
    with pytest.raises(RolloutError, match="lacks 1 tensors"):
        client.update_weights_from_tensors({"w": WEIGHTS["w"]})
    assert client.info()["version"] == v1 + 1
    assert [r["version"] for r in client.score([(PROMPTS[0], [1, 2])])] == [v1 + 1]


def test_client_resends_its_weights_to_a_restarted_server(dirs, tmp_path):
    """A killed server comes back on version 0: the client's pending call waits for it, re-sends the directory it had
    loaded (version 1), then generates: every token says version 1."""
    model_dir, export_root = dirs
    v1 = shutil.copytree(model_dir, export_root / "v000001")
    port = servers.free_port()
    target = f"127.0.0.1:{port}"
    proc = _serve(model_dir, export_root, port)
    params = SamplingParams(n=2, max_new_tokens=5, seed=11)
    try:
        with RolloutClient(target, retry_s=30) as c:
            assert c.update_weights(str(v1), version=1) == 1
            before = c.generate(PROMPTS, params)
            proc.kill()
            proc.wait()
            result = {}
            thread = threading.Thread(target=lambda: result.setdefault("samples", c.generate(PROMPTS, params)))
            thread.start()
            time.sleep(0.5)
            assert thread.is_alive()  # pending: retrying against the dead server
            proc = _serve(model_dir, export_root, port)
            thread.join(30)
            assert not thread.is_alive() and "samples" in result
            after = result["samples"]
            assert _flat(after, "response_ids") == _flat(before, "response_ids")
            assert {v for per in after for s in per for v in s.versions} == {1}
            assert c.info()["version"] == 1
    finally:
        assert servers.stop(proc) == 0
