"""The trainer's weight publisher (cisjax.train.publish) against real rollout-server subprocesses: disk and stream
publishes pass the canary; a corrupted export, an engine left on stale weights and a stale version fail it."""

import os
import re

import numpy as np
import pytest

from cisjax import export as export_lib
from cisjax.models import hf_io
from cisjax.rollout import launch
from cisjax.rollout.client import RolloutClient
from cisjax.train.publish import CanaryError, Publisher
from tests.support import publishing, servers
from tests.support.hf import VLLM_QWEN2_MOE, tiny_hf_config
from tests.support.publishing import changed, old_tensors, publish_cfg, publisher, stale_of
from tests.support.runs import spec_of

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): rollout servers on both engines

# The vLLM CPU test model of tests/rollout/test_rollout_vllm.py (hidden and MoE sizes multiples of 32).
TINY = tiny_hf_config("qwen2_moe", **VLLM_QWEN2_MOE)
EXPERTS_DOWN = "model.layers.*.mlp.experts.*.down_proj.weight"


class _Server:
    def __init__(self, backend, model_dir, export_root, env, timeout):
        port = servers.free_port()
        self.proc = servers.start(backend, model_dir, port, export_root=export_root, env=env)
        self.target = f"127.0.0.1:{port}"
        servers.wait_serving(self.proc, self.target, timeout=timeout, poll=0.5)

    def stop(self):
        return servers.stop(self.proc, timeout=60)


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir):
    return tiny_hf_dir("qwen2_moe", **VLLM_QWEN2_MOE)


@pytest.fixture(scope="module")
def tf_server(model_dir, tmp_path_factory):
    """(target, export root) of a transformers-backend server."""
    root = tmp_path_factory.mktemp("tf_exports")
    s = _Server("transformers", model_dir, root, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    yield s.target, root
    assert s.stop() == 0


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    if os.environ.get("CISJAX_SKIP_VLLM") == "1":
        pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine")
    root = tmp_path_factory.mktemp("vllm_exports")
    s = _Server("vllm", model_dir, root, env=None, timeout=300)  # launch sets the vLLM environment
    yield s.target, root
    assert s.stop() == 0


@pytest.fixture(scope="module")
def trainer(model_dir):
    """publishing.load_trainer: the default config with a small canary, the tiny model on a 2-device fsdp mesh."""
    return publishing.load_trainer(model_dir)


def _next_version(client):
    return client.info()["version"] + 1


def test_publish_disk_then_stream_transformers(tf_server, trainer):
    target, root = tf_server
    with RolloutClient(target, retry_s=10) as client:
        pub = publisher(trainer, client, root, mode="disk")
        params = changed(trainer["params"], 1)
        v = _next_version(client)
        rep = pub.publish(params, v)
        assert rep.version == v == client.info()["version"]
        assert rep.canary is not None and rep.canary.ok and rep.canary.tokens == 3 * 12
        assert rep.canary.mean_abs < pub.bounds["mean_abs"] and rep.bytes > 0 and rep.export_s > 0 and rep.canary_s > 0
        export_lib.verify(rep.path)
        assert export_lib.latest(pub.root) == (v, pub.root / export_lib.version_name(v))
        # The engine now serves different weights: its logprobs moved by far more than the bound, so a canary
        # against the old params (an engine that missed the update) would fail.
        before = pub.trainer_logprobs(trainer["params"])
        scored = [s["logprobs"] for s in client.score(pub.sequences)]
        assert np.mean(np.abs(np.subtract(before, scored))) > 2 * pub.bounds["mean_abs"]

        stream = publisher(trainer, client, root, mode="stream")
        params = changed(params, 2)
        rep = stream.publish(params, v + 1)
        assert rep.version == v + 1 == client.info()["version"] and rep.path is None
        assert (
            rep.canary.ok
            and rep.bytes == hf_io.HFTensors((trainer["graphdef"], params), trainer["hf"], "bfloat16").nbytes
        )
        assert set(rep.metrics()) >= {
            "publish/export_s",
            "publish/reload_s",
            "publish/canary_s",
            "publish/bytes",
            "publish/canary_mean_abs",
        }


def test_corrupted_export_fails_and_names_the_family(tf_server, trainer, monkeypatch):
    """An export whose routed experts' down_proj are shifted by one expert (every layer): the canary fails and the
    report names that family first, with the files read back."""
    n = TINY["num_experts"]
    original = hf_io._write_shard
    params = changed(trainer["params"], 3)
    right = dict(hf_io.iter_tensors((trainer["graphdef"], params), trainer["hf"], "bfloat16"))

    def write(path, items, produce, *rest):
        arrays = {name: produce(name) for name, _, _ in items}  # one small shard: the whole model
        for name in list(arrays):
            m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", name)
            if m:
                layer, e = m.groups()
                arrays[name] = right[f"model.layers.{layer}.mlp.experts.{(int(e) + 1) % n}.down_proj.weight"]
        return original(path, items, lambda name: arrays[name], *rest)

    target, root = tf_server
    with RolloutClient(target, retry_s=10) as client:
        pub = publisher(trainer, client, root, mode="disk")
        monkeypatch.setattr(hf_io, "_write_shard", write)
        v = _next_version(client)
        with pytest.raises(CanaryError) as err:
            pub.publish(params, v)
    text = str(err.value)
    assert "weight canary FAILED" in text and "mean_abs" in text
    assert err.value.report is not None and not err.value.report.ok
    assert err.value.families[0].family == EXPERTS_DOWN and err.value.families[0].relative > 0.5
    assert all(f.max_abs == 0 for f in err.value.families[1:])  # nothing else differs
    listed = text.split("worst first):\n", 1)[1].splitlines()
    assert listed[0].startswith(f"  {EXPERTS_DOWN} [{TINY['num_hidden_layers'] * n} tensors]: relative")
    assert len([ln for ln in listed if ln.startswith("  model.")]) == 1


class _StaleClient:
    """A client whose stream update sends the OLD params under the new version: the engine misses the change."""

    def __init__(self, client, old):
        self.client, self.old = client, old

    def update_weights_from_tensors(self, tensors, *, version):
        for _ in tensors.items():  # the publisher's stream is consumed, not sent
            pass
        return self.client.update_weights_from_tensors(self.old, version=version)

    def score(self, *args, **kwargs):
        return self.client.score(*args, **kwargs)


def test_engine_on_stale_weights_fails_the_canary(tf_server, trainer):
    target, root = tf_server
    with RolloutClient(target, retry_s=10) as client:
        old = old_tensors(trainer)
        pub = publisher(trainer, _StaleClient(client, old), root, mode="stream")
        v = _next_version(client)
        with pytest.raises(CanaryError, match=r"(?s)weight canary FAILED.*stream mode: no files"):
            pub.publish(changed(trainer["params"], 4), v)
        assert client.info()["version"] == v


def test_canary_every_and_off(tf_server, trainer):
    target, root = tf_server
    with RolloutClient(target, retry_s=10) as client:
        every2 = publisher(trainer, client, root, mode="stream")
        every2.every = 2
        v = _next_version(client)
        params = changed(trainer["params"], 5)
        assert every2.publish(params, v).canary is not None  # the first publish is always checked
        assert every2.publish(params, v + 1).canary is None
        cfg = publish_cfg(trainer, mode="stream")
        cfg.publish.canary.every = 0
        off = Publisher(
            trainer["graphdef"],
            trainer["hf"],
            spec_of(cfg).publish,
            client,
            trainer["mesh"],
            trainer["rules"],
            root=root,
        )
        rep = off.publish(params, v + 2)
        assert rep.canary is None and rep.canary_s == 0 and client.info()["version"] == v + 2


@pytest.fixture(scope="module")
def tf_server2(model_dir, tf_server):
    """A second transformers-backend server on the same export root: with tf_server, a fleet of two."""
    s = _Server("transformers", model_dir, tf_server[1], env={"OMP_NUM_THREADS": "1"}, timeout=300)
    yield s.target
    assert s.stop() == 0


def test_fleet_replica_failing_its_canary_is_quarantined(tf_server, tf_server2, trainer, monkeypatch):
    """A fleet of two: one replica's reload misses the change (the old params under the new version). Its canary
    fails, it is out of rotation and the publish stands on the other; once it reloads right, it passes and rejoins.
    Both failing is a CanaryError naming each replica."""
    from cisjax.rollout.fleet import RolloutFleet

    target, root = tf_server
    fleet = RolloutFleet([RolloutClient(target), RolloutClient(tf_server2)])
    try:
        old = old_tensors(trainer)
        stale_replica = fleet.replicas[1].client
        honest = stale_replica.update_weights_from_tensors
        pub = publisher(trainer, fleet, root, mode="stream")
        v = max(r.client.info()["version"] for r in fleet.replicas) + 1
        monkeypatch.setattr(stale_replica, "update_weights_from_tensors", stale_of(stale_replica, old))
        rep = pub.publish(changed(trainer["params"], 8), v)
        assert rep.canary.ok and rep.failed_replicas == (1,) and rep.metrics()["publish/canary_failed_replicas"] == 1
        assert not fleet.last_checks[1][0] and "mean_abs" in fleet.last_checks[1][2]
        m = fleet.metrics()
        assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/check_failures"]) == (0, 1)
        assert m["rollout/replica0/in_rotation"] == 1 and fleet.info()["version"] == v

        monkeypatch.setattr(stale_replica, "update_weights_from_tensors", honest)
        rep = pub.publish(changed(trainer["params"], 9), v + 1)
        assert rep.canary.ok and rep.failed_replicas == ()
        m = fleet.metrics()
        assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/rejoins"]) == (1, 1)

        for c in (stale_replica, fleet.replicas[0].client):  # both miss the change
            monkeypatch.setattr(c, "update_weights_from_tensors", stale_of(c, old))
        with pytest.raises(CanaryError, match=r"(?s)every rollout replica failed.*replica 0: .*replica 1: "):
            pub.publish(changed(trainer["params"], 10), v + 2)
    finally:
        fleet.close()


def _published(trainer, params) -> dict:
    """The HF tensors of `params` as published (bf16)."""
    return {n: np.asarray(a) for n, a in hf_io.iter_tensors((trainer["graphdef"], params), trainer["hf"], "bfloat16")}


def _scores(client, pub):
    return [s["logprobs"] for s in client.score(pub.sequences)]


@pytest.mark.parametrize("mode", ["stream", "disk"])
def test_delta_publishes_send_only_what_changed(tf_server, trainer, mode):
    """publish.delta: the first publish sends the whole set (the server keeps it as its base); after a small step
    only the changed bf16 elements travel (a few % of the bytes, counted here from the tensors), and the server then
    serves exactly what a full publish of the same params gives."""
    target, root = tf_server
    with RolloutClient(target, retry_s=10) as client:
        pub = publisher(trainer, client, root, mode=mode, delta=True)
        p1, v = changed(trainer["params"], 31), _next_version(client)
        rep = pub.publish(p1, v)
        full = hf_io.HFTensors((trainer["graphdef"], p1), trainer["hf"], "bfloat16").nbytes
        assert rep.full_sends == 1 and rep.changed_fraction is None and rep.bytes == full and rep.canary.ok
        under_p1 = _scores(client, pub)

        p2 = changed(p1, 32, scale=2e-5)
        old, new = _published(trainer, p1), _published(trainer, p2)
        moved = sum(int(np.sum(old[k] != new[k])) for k in new)
        total = sum(a.size for a in new.values())
        assert 0 < moved < 0.05 * total
        rep = pub.publish(p2, v + 1)
        assert rep.version == v + 1 == client.info()["version"] and rep.canary.ok
        assert rep.full_sends == 0 and rep.changed_fraction == moved / total and 0 < rep.bytes < 0.2 * full
        assert rep.metrics()["publish/full_sends"] == 0 and rep.metrics()["publish/changed_fraction"] > 0
        if mode == "disk":
            assert rep.path.endswith(export_lib.delta_name(v + 1)) and export_lib.latest(pub.root)[0] == v
        under_delta = _scores(client, pub)
        assert under_delta != under_p1  # the delta reached the engine

        whole = publisher(trainer, client, root, mode="stream").publish(p2, v + 2)
        assert whole.full_sends is None and _scores(client, pub) == under_delta  # bit-identical weights


def test_a_refused_delta_is_followed_by_the_full_set(tf_server, trainer, monkeypatch, caplog):
    """The server refuses a delta (ABORTED, the reason said, nothing swapped) when it keeps no base, when its base is
    another version, and when the result's digest differs from the sender's (a changed element lost on the way): each
    time the publisher sends the full set next, and the engine serves the new params."""
    from cisjax.rollout import delta as delta_lib

    target, root = tf_server
    with RolloutClient(target, retry_s=10) as client:
        pub = publisher(trainer, client, root, mode="stream", delta=True)
        p, v = changed(trainer["params"], 41), _next_version(client)
        assert pub.publish(p, v).full_sends == 1
        steps = [
            # another full update without retain_base: the server keeps no base
            ("keeps no base set", lambda v: client.update_weights_from_tensors(_published(trainer, p), version=v)),
            # another full update kept as the base: the publisher's delta is over an older version
            (
                "serves version",
                lambda v: client.update_weights_from_tensors(_published(trainer, p), version=v, retain_base=True),
            ),
        ]
        for k, (reason, meddle) in enumerate(steps):
            v += 2
            meddle(v - 1)
            p = changed(p, 42 + k, scale=2e-5)
            caplog.clear()
            with caplog.at_level("WARNING", logger="cisjax.train.delivery"):
                rep = pub.publish(p, v)
            assert rep.full_sends == 1 and rep.canary.ok and client.info()["version"] == v
            assert reason in caplog.text and "sending the full set" in caplog.text

        honest = delta_lib.diff

        def lossy(*args, **kw):  # one changed element dropped: the server's result is not the sender's set
            d = honest(*args, **kw)
            name = next(iter(d.sparse))
            d.sparse[name] = tuple(x[1:] for x in d.sparse[name])
            return d

        monkeypatch.setattr(delta_lib, "diff", lossy)
        v += 1
        p = changed(p, 49, scale=2e-5)
        with caplog.at_level("WARNING", logger="cisjax.train.delivery"):
            rep = pub.publish(p, v)
        assert "nothing swapped" in caplog.text and rep.full_sends == 1 and rep.canary.ok
        monkeypatch.setattr(delta_lib, "diff", honest)
        assert pub.publish(changed(p, 50, scale=2e-5), v + 1).full_sends == 0  # the full set is the new base


def test_publish_vllm_fp32(vllm_server, trainer):
    """The real engine (fp32 on CPU): a disk publish and a stream publish both pass the default bounds."""
    target, root = vllm_server
    with RolloutClient(target, retry_s=10) as client:
        assert client.info()["engine"] == "vllm"
        v = _next_version(client)
        params = changed(trainer["params"], 6)
        disk = publisher(trainer, client, root, mode="disk")
        rep = disk.publish(params, v)
        assert rep.canary.ok and client.info()["version"] == v
        before = [s["logprobs"] for s in client.score(disk.sequences)]
        params = changed(params, 7)
        rep = publisher(trainer, client, root, mode="stream").publish(params, v + 1)
        assert rep.canary.ok and client.info()["version"] == v + 1
        after = [s["logprobs"] for s in client.score(disk.sequences)]
        assert np.mean(np.abs(np.subtract(before, after))) > 2 * rep.canary.mean_abs_bound  # the reload took effect


def test_two_processes_publish_and_fail_together(model_dir, tmp_path):
    """Two processes x 4 CPU devices, one mesh; process 0 has a fake client: a passing canary, a failing one (CanaryError
    on both, process 0's naming no differing family: the export is faithful), a stream broken off (PublishError on both)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    port = launch.free_port()  # jax.distributed's coordinator
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    repo = Path(__file__).resolve().parents[2]
    procs = []
    for pid in range(2):
        log = open(tmp_path / f"worker{pid}.log", "w")
        cmd = [
            sys.executable,
            "-m",
            "tests.train._publish_worker",
            str(port),
            str(pid),
            str(model_dir),
            str(tmp_path / "exports"),
            str(tmp_path / f"out{pid}.json"),
        ]
        procs.append((subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=240)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(2))
    assert all(proc.returncode == 0 for proc, _ in procs), logs
    out = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert out[0]["right"] == out[1]["right"] and len(out[0]["right"]) == 3
    assert out[0]["pass"] is True and out[1]["pass"] is True
    assert "weight canary FAILED" in out[0]["fail"] and "tensor families identical" in out[0]["fail"]
    assert "export is faithful" in out[0]["fail"]
    assert "failed for version 2 on process 0" in out[1]["fail"]
    assert "ConnectionError: stream broken off" in out[0]["broken_stream"]
    assert "failed on process 0" in out[1]["broken_stream"]
    assert out[0]["stream_pass"] is True and out[1]["stream_pass"] is True
