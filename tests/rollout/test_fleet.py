"""RolloutFleet: dispatch (least-loaded, groups whole) and faults with fake replicas; a replica killed and restarted on
two fake-engine servers; then on the real vLLM engine."""

import os
import threading

import grpc
import numpy as np
import pytest

from cisjax import errors
from cisjax.rollout.client import RolloutError, Sample
from cisjax.rollout.fleet import RolloutFleet
from cisjax.rollout.params import SamplingParams


class FakeReplica:
    """A RolloutClient stand-in: samples are a function of (seed, prompt id, sample index) alone, as on the servers;
    `down` makes every call fail UNAVAILABLE; `gate` (an Event) holds generate calls until set."""

    def __init__(self, name):
        self.target, self.timeout_s, self.retry_s, self.batch_size = name, 10.0, 5.0, 64
        self.version, self.down, self.gate = 0, False, None
        self.calls = []  # (wire ids, params.n) of each generate call
        self.updates = []

    def _check(self):
        if self.down:
            raise RolloutError(f"{self.target} down", grpc.StatusCode.UNAVAILABLE)

    def generate(self, prompts, params, *, ids):
        if self.gate is not None:
            self.gate.wait(10)
        self._check()
        self.calls.append((list(ids), params.n))
        return [
            [
                Sample(k, j, p, [params.seed, i, j, self.version], [-0.5] * 4, "length", [self.version] * 4)
                for j in range(params.n)
            ]
            for k, (i, p) in enumerate(zip(ids, prompts))
        ]

    def health(self, service=""):
        if self.down:
            raise grpc.RpcError()
        return "SERVING"

    def info(self):
        self._check()
        return {"version": self.version, "engine": "fake"}

    def update_weights(self, path, *, version=0, checksums=True):
        self._check()
        if "bad" in path:
            raise RolloutError(f"{self.target}: reload failed", grpc.StatusCode.FAILED_PRECONDITION)
        self.updates.append((path, version))
        self.version = version
        return version

    def close(self):
        pass


def _fleet(n=2, **kw):
    reps = [FakeReplica(f"r{i}") for i in range(n)]
    return RolloutFleet(reps, **kw), reps


def test_least_loaded_groups_whole_and_in_order():
    fleet, (a, b) = _fleet()
    # one long prompt, then short ones: the long one fills replica 0, the short ones go to replica 1 until it matches
    prompts = [[1] * 400] + [[2] * 10 for _ in range(6)]
    params = SamplingParams(n=4, max_new_tokens=10, seed=7)
    out = fleet.generate(prompts, params)
    assert [s.prompt_index for per in out for s in per] == [i for i in range(7) for _ in range(4)]
    assert [[s.response_ids[:3] for s in per] for per in out] == [[[7, i, j] for j in range(4)] for i in range(7)]
    sent_a = sorted(i for ids, _ in a.calls for i in ids)
    sent_b = sorted(i for ids, _ in b.calls for i in ids)
    assert sent_a == [0] and sent_b == [1, 2, 3, 4, 5, 6]  # cost 440 vs 6 x 50 = 300
    assert all(n == 4 for _, n in a.calls + b.calls)  # each prompt's 4 samples in one request: groups never split
    m = fleet.metrics()
    assert m["rollout/replica0/in_flight"] == m["rollout/replica1/in_flight"] == 0
    assert m["rollout/replica1/tokens_per_s"] > 0


def test_least_loaded_counts_other_calls_in_flight():
    fleet, (a, b) = _fleet()
    a.gate = threading.Event()  # the first call's prompt is held on replica 0
    first = threading.Thread(target=fleet.generate, args=([[1] * 50], SamplingParams(n=1, max_new_tokens=50)))
    first.start()
    while not fleet.metrics()["rollout/replica0/in_flight"]:
        pass
    out = fleet.generate([[3] * 5, [4] * 5], SamplingParams(n=1, max_new_tokens=5))
    assert [ids for ids, _ in b.calls] == [[0, 1]]  # both to the idle replica
    a.gate.set()
    first.join()
    assert len(out) == 2


def test_dead_replica_work_resent_and_it_rejoins_on_current_weights():
    fleet, (a, b) = _fleet(probe_s=0.0)
    assert fleet.update_weights("/exports/v1", version=1, checksums={}) == 1
    assert a.updates == b.updates == [("/exports/v1", 1)]
    a.down = True
    params = SamplingParams(n=2, max_new_tokens=4, seed=3)
    out = fleet.generate([[i] for i in range(6)], params)
    assert [[s.response_ids for s in per] for per in out] == [[[3, i, j, 1] for j in range(2)] for i in range(6)]
    assert not a.calls and sorted(i for ids, _ in b.calls for i in ids) == list(range(6))
    m = fleet.metrics()
    assert m["rollout/replica0/in_rotation"] == 0 and m["rollout/replica0/failures"] == 1
    # an update while it is down reaches the other one; it comes back on version 0 (restarted) and is sent version 2
    assert fleet.update_weights("/exports/v2", version=2, checksums={}) == 2
    a.down, a.version = False, 0
    b.calls.clear()
    fleet.generate([[i] for i in range(6)], params)
    assert a.updates[-1] == ("/exports/v2", 2) and a.calls and b.calls
    m = fleet.metrics()
    assert m["rollout/replica0/in_rotation"] == 1 and m["rollout/replica0/rejoins"] == 1
    assert m["rollout/replica0/version"] == m["rollout/replica1/version"] == 2


def test_replica_restarted_unnoticed_on_old_weights_is_not_used():
    fleet, (a, b) = _fleet(probe_s=0.0)
    fleet.update_weights("/exports/v1", version=1, checksums={})
    a.version = 0  # it restarted between two calls, on its initial weights: its samples say so
    out = fleet.generate([[i] for i in range(4)], SamplingParams(n=2, max_new_tokens=4, seed=3))
    assert all(s.versions == [1] * 4 for per in out for s in per)
    assert sorted(i for ids, _ in b.calls for i in ids) == [0, 1, 2, 3]
    assert fleet.metrics()["rollout/replica0/in_rotation"] == 0
    fleet.generate([[1]], SamplingParams(max_new_tokens=4))  # the next call sends it version 1, then it rejoins
    assert a.updates[-1] == ("/exports/v1", 1) and fleet.metrics()["rollout/replica0/in_rotation"] == 1


def test_update_with_every_replica_down_waits_for_one_and_sends_it():
    fleet, (a, b) = _fleet(retry_s=60, probe_s=0.0)
    a.down = b.down = True
    timer = threading.Timer(0.5, lambda: setattr(a, "down", False))
    timer.start()
    assert fleet.update_weights("/exports/v3", version=3, checksums={}) == 3
    assert a.updates == [("/exports/v3", 3)] and not b.updates
    m = fleet.metrics()
    assert (m["rollout/replica0/in_rotation"], m["rollout/replica1/in_rotation"]) == (1, 0)


def test_update_refused_by_every_replica_is_raised_and_changes_nothing():
    fleet, (a, b) = _fleet()
    fleet.update_weights("/exports/v1", version=1, checksums={})
    with pytest.raises(RolloutError, match="reload failed"):
        fleet.update_weights("/exports/bad", version=2, checksums={})
    assert fleet.expected_version == 1 and fleet.metrics()["rollout/replica0/in_rotation"] == 1


def test_checked_update_quarantines_a_failing_replica_until_a_check_passes():
    fleet, (a, b) = _fleet()
    seen = []

    def check(bad):
        def run(client):
            seen.append((client.target, [r.probation for r in fleet.replicas]))
            return client.target not in bad, client.target, f"{client.target} is off"

        return run

    fleet.update_weights("/exports/v1", version=1, checksums={}, check=check({"r1"}))
    assert sorted(seen) == [("r0", [True, True]), ("r1", [True, True])]  # no new work while any is checked
    assert fleet.last_checks == {0: (True, "r0", "r0 is off"), 1: (False, "r1", "r1 is off")}
    m = fleet.metrics()
    assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/check_failures"]) == (0, 1)
    assert m["rollout/replica1/version"] == 1  # it holds the version, and still gets no work
    fleet.generate([[i] for i in range(4)], SamplingParams(max_new_tokens=2))
    assert not b.calls and sorted(i for ids, _ in a.calls for i in ids) == [0, 1, 2, 3]
    fleet.update_weights("/exports/v2", version=2, checksums={})  # unchecked: it stays out
    assert fleet.metrics()["rollout/replica1/in_rotation"] == 0
    fleet.update_weights("/exports/v3", version=3, checksums={}, check=check(set()))  # passes: back
    m = fleet.metrics()
    assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/rejoins"]) == (1, 1)
    assert [r.probation for r in fleet.replicas] == [False, False]


def test_replica_failing_its_check_is_restarted_then_sent_and_checked_before_it_rejoins():
    restarted = []
    reps = [FakeReplica("r0"), FakeReplica("r1")]

    def restart():  # it comes back on its initial weights
        restarted.append(1)
        reps[1].version = 0

    fleet = RolloutFleet(reps, restart=[None, restart], probe_s=0.0)
    bad = {"r1"}

    def check(c):
        return c.target not in bad, None, f"{c.target} is off"

    fleet.update_weights("/exports/v1", version=1, checksums={}, check=check)
    assert restarted == [1] and fleet.metrics()["rollout/replica1/in_rotation"] == 0
    bad.clear()  # the fresh engine is right: the next call sends it version 1 and checks it
    fleet.generate([[1]], SamplingParams(max_new_tokens=2))
    m = fleet.metrics()
    assert reps[1].updates[-1] == ("/exports/v1", 1) and fleet.last_checks[1][0]
    assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/rejoins"], m["rollout/replica1/version"]) == (
        1,
        1,
        1,
    )
    assert restarted == [1]


def test_all_down_waits_then_fails_after_retry_s():
    fleet, reps = _fleet(retry_s=0.5, probe_s=0.0)
    for r in reps:
        r.down = True
    with pytest.raises(RolloutError, match="no rollout replica serving"):
        fleet.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_all_down_resumes_when_one_returns():
    fleet, (a, b) = _fleet(retry_s=60, probe_s=0.0)
    a.down = b.down = True
    timer = threading.Timer(0.5, lambda: setattr(b, "down", False))
    timer.start()
    out = fleet.generate([[1, 2], [3]], SamplingParams(max_new_tokens=2, seed=1))
    assert [per[0].response_ids[:3] for per in out] == [[1, 0, 0], [1, 1, 0]]


def test_streamed_update_reaches_every_replica_once_read():
    class Streaming(FakeReplica):
        def update_weights_from_tensors(self, tensors, *, version=0, chunk_bytes=0):
            self.got = {k: v.copy() for k, v in tensors.items()}
            self.version = version
            return version

    reps = [Streaming("r0"), Streaming("r1"), Streaming("r2")]
    fleet = RolloutFleet(reps)
    reads = []

    class Once:
        def items(self):
            reads.append(1)
            return ((f"t{i}", np.full(3, i, np.float32)) for i in range(10))

    assert fleet.update_weights_from_tensors(Once(), version=5) == 5
    assert reads == [1] and fleet.expected_version == 5
    for r in reps:
        assert sorted(r.got) == sorted(f"t{i}" for i in range(10)) and r.got["t7"].tolist() == [7, 7, 7]


PROMPTS = [[1, 2, 3, 4], [50, 7], [96, 0, 33, 12, 5, 8], [40, 41], [7, 7, 7], [13, 80, 2, 61], [22], [64, 3, 90]]
STOPS = [5, 9, 11]  # samples end at different lengths: a stream is mid-way when its first sample arrives


# ----------------------------------------------------------------------------- the fake engine, two replicas


@pytest.fixture(scope="module")
def fake_embedded(tmp_path_factory):
    """Two embedded replicas of the fake engine (service.connect with replicas=2, as `cisjax train` starts them, their
    watchdogs on) and the RolloutFleet over them; the model dir and the export root."""
    from cisjax.rollout import service
    from tests.support.servers import fake_model_dir

    root = tmp_path_factory.mktemp("fake_fleet")
    model_dir = fake_model_dir(root / "model", vocab_size=97, max_len=2048)
    servers, fleet = service.connect(
        "",
        replicas=2,
        model_dir=model_dir,
        export_root=root / "exports",
        log_path=root / "rollout_server.log",
        backend="fake",
        timeout_s=30,
        retry_s=30,
        startup_s=30,
        replica_cpus="none",
    )
    yield servers, fleet, model_dir, root / "exports"
    fleet.close()
    assert servers.stop() == 0


def _kill_on_first_sample(monkeypatch, fleet, replica: int, victim) -> threading.Event:
    """kill -9 `victim` as the first sample of its replica's next Generate stream arrives: the rest is lost mid-way.
    The event is set once it was killed."""
    stub = fleet.replicas[replica].client.stub
    first, Generate = threading.Event(), stub.Generate

    def killing(request, **kw):
        for response in Generate(request, **kw):
            if not first.is_set():
                first.set()
                victim.kill()
            yield response

    monkeypatch.setattr(stub, "Generate", killing)
    return first


def test_fake_replica_killed_mid_stream_work_resent_then_restarted_and_rejoins(fake_embedded, monkeypatch):
    """The fleet restart on real server processes, fast: replica 1 is killed (kill -9) as its first sample arrives;
    its prompts are resent to replica 0 and the call returns what one server gives. Its watchdog restarts it on
    version 0; the fleet's next call sends it the current version (a directory) before any work, and it serves
    again."""
    import shutil

    servers, fleet, model_dir, exports = fake_embedded
    victim = servers.servers[1]
    v = fleet.expected_version + 1
    path = shutil.copytree(model_dir, exports / f"v{v:06d}")
    assert fleet.update_weights(str(path), version=v) == v  # a directory: what a restarted replica is sent
    restarts = victim.restarts
    before = fleet.metrics()
    # 8 x 2,000 tokens a prompt (the victim's share about 64,000 tokens, ~1.3 s on the fake engine): its stream is
    # mid-way at its first sample even where the client reads that late (under a loaded CI, 400-token samples were
    # all sent before the client read the first, and no failure came)
    params = SamplingParams(n=8, max_new_tokens=2000, seed=5)
    killed = _kill_on_first_sample(monkeypatch, fleet, 1, victim)
    got = fleet.generate(PROMPTS, params)
    assert killed.is_set()
    m = fleet.metrics()
    assert m["rollout/replica1/failures"] == before["rollout/replica1/failures"] + 1
    assert m["rollout/replica1/in_rotation"] == 0
    with _one(servers.servers[0].target) as single:
        ref = single.generate(PROMPTS, params)
    for what in ("response_ids", "logprobs", "versions", "sample_index", "prompt_index", "finish_reason"):
        assert _flat(got, what) == _flat(ref, what), what
    assert all(s.versions == [v] * 2000 for per in got for s in per)

    victim.wait_ready()  # the watchdog started it again: on the model's own weights
    with _one(victim.target) as c:
        assert c.info()["version"] == 0
    calls = _recorded(monkeypatch, fleet)
    monkeypatch.setattr(fleet, "probe_s", 0.0)  # probed at this call (not a second after the last probe: a run's pace)
    again = fleet.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=6))
    with _one(victim.target) as c:
        assert c.info()["version"] == v
    assert calls[1], "the restarted replica got no work"
    assert all(s.versions == [v] * len(s.response_ids) for per in again for s in per)
    m = fleet.metrics()
    assert victim.restarts == restarts + 1 and m["rollout/replica1/restarts"] == restarts + 1
    assert m["rollout/replica1/rejoins"] == before["rollout/replica1/rejoins"] + 1
    assert m["rollout/replica1/in_rotation"] == 1 and m["rollout/replica1/version"] == v


# ----------------------------------------------------------------------------- the real vLLM engine, two replicas


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_hf_dir):
    """Two embedded vLLM replicas (service.connect with replicas=2, as `cisjax train` starts them, fp32) and the
    RolloutFleet over them; the model dir and the export root."""

    if os.environ.get("CISJAX_SKIP_VLLM") == "1":
        pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine")
    from cisjax.rollout import service
    from tests.support.hf import VLLM_QWEN2_MOE

    model_dir = tiny_hf_dir("qwen2_moe", **VLLM_QWEN2_MOE)
    root = tmp_path_factory.mktemp("fleet")
    servers, fleet = service.connect(
        "",
        replicas=2,
        model_dir=model_dir,
        export_root=root / "exports",
        log_path=root / "rollout_server.log",
        backend="vllm",
        dtype="float32",
        timeout_s=300,
        retry_s=300,
        startup_s=300,
        replica_cpus="" if len(os.sched_getaffinity(0)) >= 2 else "none",  # a core each (automatic) where there are two
    )
    yield servers, fleet, model_dir, root / "exports"
    fleet.close()
    assert servers.stop() == 0


def _cores(pid: int) -> set:
    """The cores every thread of process `pid` may run on (the union over /proc/PID/task/*/status)."""
    from pathlib import Path

    from cisjax.rollout import placement

    out = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that exited meanwhile
            continue
        line = next(ln for ln in text.splitlines() if ln.startswith("Cpus_allowed_list:"))
        out |= set(placement.parse_ids(line.split(":", 1)[1].strip()))
    return out


@pytest.mark.slow
def test_embedded_replicas_are_pinned_to_disjoint_cores(embedded):
    """Automatic placement: each replica's process (the engine's threads and all) on its own core, and serving."""

    from cisjax.rollout import placement

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the replicas are not pinned")
    servers, fleet, _, _ = embedded
    want = [set(p.cpus) for p in placement.plan(2, backend="vllm")]
    got = [_cores(s.proc.pid) for s in servers.servers]
    assert got == want and not got[0] & got[1], (got, want)
    for s, cores in zip(servers.servers, want):
        assert f"pinned to cores {placement.format_ids(cores)}" in s.log_path.read_text()
    out = fleet.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert len(out) == len(PROMPTS) and all(len(per) == 2 for per in out)


def _recorded(monkeypatch, fleet) -> list[list]:
    """The wire ids of every generate call, per replica."""
    calls = [[] for _ in fleet.replicas]
    for r in fleet.replicas:

        def rec(prompts, params, *, ids, orig=r.client.generate, log=calls[r.index]):
            log.append((list(ids), params.n))
            return orig(prompts, params, ids=ids)

        monkeypatch.setattr(r.client, "generate", rec)
    return calls


def _one(target):
    from cisjax.rollout.client import RolloutClient

    return RolloutClient(target, retry_s=10)


def _flat(samples, what):
    return [[getattr(s, what) for s in per] for per in samples]


def _max_diff(a, b) -> float:
    """max |a - b| over two [prompt][sample][token](...) nests of floats of the same shape."""
    out = 0.0
    for per_a, per_b in zip(a, b, strict=True):
        for x, y in zip(per_a, per_b, strict=True):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            assert x.shape == y.shape
            out = max(out, float(np.max(np.abs(x - y), initial=0.0)))
    return out


@pytest.mark.slow
def test_fleet_equals_one_server(embedded, monkeypatch):
    servers, fleet, _, _ = embedded
    calls = _recorded(monkeypatch, fleet)
    params = SamplingParams(n=3, max_new_tokens=24, seed=11, logprobs=2, stop_token_ids=STOPS)
    got = fleet.generate(PROMPTS, params)
    with _one(servers.servers[0].target) as single:
        ref = single.generate(PROMPTS, params)
    for what in ("response_ids", "top_ids", "versions", "finish_reason", "prompt_index", "sample_index"):
        assert _flat(got, what) == _flat(ref, what), what
    # the same tokens; logprobs to an fp32 ulp: a server's own numerics shift that much with its batch's make-up
    # (the fleet sends each replica half the prompts; measured: 2.4e-7 on one top-2 logprob of 24 samples)
    for what in ("logprobs", "top_logprobs"):
        diff = _max_diff(_flat(got, what), _flat(ref, what))
        assert diff <= 1e-6, (what, diff)
    # both replicas served, every prompt once, each prompt's n samples in one request (groups whole)
    placed = [sorted(i for ids, _ in per for i in ids) for per in calls]
    assert all(placed) and sorted(placed[0] + placed[1]) == list(range(len(PROMPTS)))
    assert all(n == 3 for per in calls for _, n in per)
    m = fleet.metrics()
    assert m["rollout/replica0/tokens_per_s"] > 0 and m["rollout/replica1/tokens_per_s"] > 0


@pytest.mark.slow
def test_running_servers_as_a_list(embedded):
    """rollout.server=HOST:PORT,HOST:PORT (running servers, here the embedded ones): a fleet, no child started."""
    from cisjax.rollout import service
    from cisjax.rollout.fleet import RolloutFleet

    servers, fleet, _, _ = embedded
    listed = ",".join(s.target for s in servers.servers)
    child, other = service.connect(listed, model_dir="", export_root="", log_path="", startup_s=60, retry_s=10)
    try:
        assert child is None and isinstance(other, RolloutFleet) and other.target == listed
        params = SamplingParams(n=2, max_new_tokens=8, seed=2, stop_token_ids=STOPS)
        assert _flat(other.generate(PROMPTS, params), "response_ids") == _flat(
            fleet.generate(PROMPTS, params), "response_ids"
        )
    finally:
        other.close()
    with pytest.raises(errors.UserError, match="is not HOST:PORT"):
        service.connect(listed + ",nohost", model_dir="", export_root="", log_path="")


@pytest.mark.slow
def test_update_weights_reaches_every_replica(embedded):
    import shutil

    from safetensors.numpy import load_file

    servers, fleet, model_dir, exports = embedded
    params = SamplingParams(n=2, max_new_tokens=16, seed=4, stop_token_ids=STOPS)
    before = fleet.generate(PROMPTS, params)
    v = fleet.expected_version + 1
    path = shutil.copytree(model_dir, exports / f"v{v:06d}")  # the same weights under a new version
    assert fleet.update_weights(str(path), version=v) == v
    versions = []
    for s in servers.servers:
        with _one(s.target) as c:
            versions.append(c.info()["version"])
    assert versions == [v, v] and fleet.info()["version"] == v
    # streamed: the tensors read once, every replica gets them all
    tensors = load_file(str(path / "model.safetensors"))
    assert fleet.update_weights_from_tensors(tensors, version=v + 1, chunk_bytes=4000) == v + 1
    for s in servers.servers:
        with _one(s.target) as c:
            assert c.info()["version"] == v + 1
    after = fleet.generate(PROMPTS, params)  # reloaded engines == the first ones (same weights)
    assert _flat(after, "response_ids") == _flat(before, "response_ids")
    assert _max_diff(_flat(after, "logprobs"), _flat(before, "logprobs")) <= 1e-6
    assert all(s.versions == [v + 1] * len(s.response_ids) for per in after for s in per)


@pytest.mark.slow
def test_killed_replica_work_resent_and_it_rejoins_on_current_weights(embedded, monkeypatch):
    import shutil

    servers, fleet, model_dir, exports = embedded
    victim = servers.servers[1]
    v = fleet.expected_version + 1
    path = shutil.copytree(model_dir, exports / f"v{v:06d}")
    assert fleet.update_weights(str(path), version=v) == v  # a directory: what a restarted replica is sent
    restarts = victim.restarts

    # kill -9 the replica as its first sample arrives: the rest of its stream is lost mid-way
    stub = fleet.replicas[1].client.stub
    first = threading.Event()

    def killing(request, **kw):
        for response in Generate(request, **kw):
            if not first.is_set():
                first.set()
                victim.kill()
            yield response

    Generate = stub.Generate
    monkeypatch.setattr(stub, "Generate", killing)
    params = SamplingParams(n=4, max_new_tokens=100, seed=5, stop_token_ids=STOPS)
    prompts = PROMPTS * 2
    got = fleet.generate(prompts, params)
    assert first.is_set()
    m = fleet.metrics()
    assert m["rollout/replica1/failures"] == 1 and m["rollout/replica1/in_rotation"] == 0
    with _one(servers.servers[0].target) as single:
        ref = single.generate(prompts, params)
    for what in ("response_ids", "versions", "sample_index", "prompt_index"):
        assert _flat(got, what) == _flat(ref, what), what
    assert _max_diff(_flat(got, "logprobs"), _flat(ref, "logprobs")) <= 1e-6

    # the watchdog restarts it on the model's own weights (version 0); the fleet's next call sends it version v first
    victim.wait_ready()
    with _one(victim.target) as c:
        assert c.info()["version"] == 0
    calls = _recorded(monkeypatch, fleet)
    again = fleet.generate(prompts, params)
    with _one(victim.target) as c:
        assert c.info()["version"] == v
    assert calls[1], "the restarted replica got no work"
    assert all(s.versions == [v] * len(s.response_ids) for per in again for s in per)
    assert _flat(again, "response_ids") == _flat(ref, "response_ids")
    m = fleet.metrics()
    assert victim.restarts == restarts + 1
    assert m["rollout/replica1/restarts"] == restarts + 1 and m["rollout/replica1/rejoins"] == 1
    assert m["rollout/replica1/in_rotation"] == 1 and m["rollout/replica1/version"] == v


@pytest.fixture(scope="module")
def trainer(tiny_hf_dir):
    """The publisher's trainer side (tests.train.publishing.load_trainer) on the embedded replicas' model."""
    from tests.support import publishing
    from tests.support.hf import VLLM_QWEN2_MOE

    return publishing.load_trainer(tiny_hf_dir("qwen2_moe", **VLLM_QWEN2_MOE))


def _wait_restarted(server, restarts: int, timeout_s: float = 60.0) -> None:
    """Until the watchdog has started `server` again (its restarts past `restarts`) and it serves."""
    import time

    deadline = time.monotonic() + timeout_s
    while server.restarts <= restarts:
        assert time.monotonic() < deadline, f"{server.target} was not restarted"
        time.sleep(0.2)
    server.wait_ready()


@pytest.mark.slow
def test_replica_failing_its_canary_is_excluded_reported_restarted_and_rejoins(embedded, trainer, monkeypatch):
    """Issue 16's acceptance on the real engine: the publisher streams changed params to the fleet while replica 1's
    reload misses the change (the old tensors under the new version). Its canary fails: the publish stands on replica
    0 and reports replica 1; replica 1 is quarantined (out of rotation, a check failure) and, being embedded, restarted
    (RolloutFleet._run_check): it comes back on its initial weights and, the last update having been streamed (nothing
    to re-send), stays out: no generate call reaches it. The next, honest publish reaches it, its canary passes and it
    rejoins."""
    from tests.support.publishing import changed, old_tensors, publisher, stale_of

    servers, fleet, _, exports = embedded
    victim, stale_replica = servers.servers[1], fleet.replicas[1].client
    before = fleet.metrics()
    restarts = victim.restarts
    pub = publisher(trainer, fleet, exports, mode="stream")
    v = fleet.expected_version + 1
    honest = stale_replica.update_weights_from_tensors
    monkeypatch.setattr(stale_replica, "update_weights_from_tensors", stale_of(stale_replica, old_tensors(trainer)))
    rep = pub.publish(changed(trainer["params"], 11), v)

    # the publish stands on replica 0; replica 1's failure is reported
    assert rep.version == v and rep.canary is not None and rep.canary.ok
    assert rep.failed_replicas == (1,) and rep.metrics()["publish/canary_failed_replicas"] == 1
    assert fleet.last_checks[0][0] and not fleet.last_checks[1][0] and "mean_abs" in fleet.last_checks[1][2]
    m = fleet.metrics()
    assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/check_failures"]) == (
        0,
        before["rollout/replica1/check_failures"] + 1,
    )
    assert (m["rollout/replica0/in_rotation"], m["rollout/replica0/version"]) == (1, v)
    assert fleet.info()["version"] == v  # from replica 0, the one in rotation
    assert m["rollout/replica0/check_failures"] == before["rollout/replica0/check_failures"]
    assert fleet.replicas[1].quarantined and not fleet.replicas[0].quarantined

    # embedded: the failed replica was restarted (killed; the watchdog starts it on the model's own weights)
    _wait_restarted(victim, restarts)
    assert fleet.metrics()["rollout/replica1/restarts"] == restarts + 1
    with _one(victim.target) as c:
        assert c.info()["version"] == 0
    # serving again, but quarantined on version 0 after a streamed update: it gets no work (replica 0 serves all)
    calls = _recorded(monkeypatch, fleet)
    params = SamplingParams(n=2, max_new_tokens=8, seed=6, stop_token_ids=STOPS)
    out = fleet.generate(PROMPTS, params)
    assert not calls[1] and sorted(i for ids, _ in calls[0] for i in ids) == list(range(len(PROMPTS)))
    assert all(s.versions == [v] * len(s.response_ids) for per in out for s in per)
    m = fleet.metrics()
    assert (
        m["rollout/replica1/in_rotation"] == 0 and m["rollout/replica1/rejoins"] == before["rollout/replica1/rejoins"]
    )

    # an honest publish reaches it (out of rotation but serving), its canary passes and it rejoins
    monkeypatch.setattr(stale_replica, "update_weights_from_tensors", honest)
    rep = pub.publish(changed(trainer["params"], 12), v + 1)
    assert rep.canary.ok and rep.failed_replicas == () and rep.metrics()["publish/canary_failed_replicas"] == 0
    assert fleet.last_checks[0][0] and fleet.last_checks[1][0]
    m = fleet.metrics()
    assert (m["rollout/replica1/in_rotation"], m["rollout/replica1/rejoins"]) == (
        1,
        before["rollout/replica1/rejoins"] + 1,
    )
    assert m["rollout/replica0/in_rotation"] == 1
    assert m["rollout/replica0/version"] == m["rollout/replica1/version"] == v + 1
    assert victim.restarts == restarts + 1  # a passing check restarts nothing
    assert not fleet.replicas[1].quarantined
    for s in servers.servers:
        with _one(s.target) as c:
            assert c.info()["version"] == v + 1
    calls[0].clear()
    out = fleet.generate(PROMPTS, params)  # both serve again, on v + 1
    assert calls[0] and calls[1]
    assert all(s.versions == [v + 1] * len(s.response_ids) for per in out for s in per)


@pytest.mark.slow
def test_delta_publishing_a_killed_replica_gets_the_full_set(embedded, trainer):
    """publish.delta on the real engine: the first publish sends both replicas the whole set, a small step only its
    changed elements; replica 1 killed (its watchdog restarts it on the initial weights) keeps no base, refuses the
    next delta and is sent the full set: its canary passes and it scores exactly as replica 0."""
    from cisjax.models import hf_io
    from tests.support.publishing import changed, publisher

    servers, fleet, _, exports = embedded
    victim = servers.servers[1]
    pub = publisher(trainer, fleet, exports, mode="stream", delta=True)
    v = fleet.expected_version + 1
    p = changed(trainer["params"], 21)
    rep = pub.publish(p, v)
    assert rep.full_sends == 2 and rep.canary.ok and rep.failed_replicas == ()
    full = hf_io.HFTensors((trainer["graphdef"], p), trainer["hf"], "bfloat16").nbytes
    p = changed(p, 22, scale=2e-5)
    rep = pub.publish(p, v + 1)
    assert rep.full_sends == 0 and rep.bytes < 0.2 * full and rep.canary.ok and rep.failed_replicas == ()

    restarts = victim.restarts
    victim.kill()
    _wait_restarted(victim, restarts)
    with _one(victim.target) as c:
        assert c.info()["version"] == 0
    p = changed(p, 23, scale=2e-5)
    rep = pub.publish(p, v + 2)
    assert rep.full_sends == 1 and rep.canary.ok and rep.failed_replicas == ()
    assert fleet.last_checks[0][0] and fleet.last_checks[1][0]
    scores = []
    for s in servers.servers:
        with _one(s.target) as c:
            assert c.info()["version"] == v + 2
            scores.append([r["logprobs"] for r in c.score(pub.sequences)])
    assert _max_diff(scores[0], scores[1]) <= 1e-6
