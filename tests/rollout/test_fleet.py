"""RolloutFleet: dispatch (least-loaded, groups whole) and faults with fake replicas; then on the real vLLM engine."""

import threading

import grpc
import numpy as np
import pytest

from cisjax.rollout.client import RolloutError, Sample, SamplingParams
from cisjax.rollout.fleet import RolloutFleet


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
