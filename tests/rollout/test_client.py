"""RolloutClient shared by threads: a call on a replaced channel is retried; concurrent restores of one server agree."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from cisjax.rollout import protos
from cisjax.rollout.client import RolloutClient, RolloutError
from tests.support import servers


class SlowInfo(protos.load().rollout_pb2_grpc.RolloutServicer):
    """A rollout servicer whose Info answers after `delay_s` (the others: UNIMPLEMENTED; the tests call only Info)."""

    def __init__(self, pb, delay_s: float):
        self.pb, self.delay_s, self.calls = pb, delay_s, 0

    def Info(self, request, context):
        self.calls += 1
        time.sleep(self.delay_s)
        return self.pb.rollout_pb2.InfoResponse(engine="slow", version=7)


@pytest.fixture
def slow_server():
    pb = protos.load()
    port = servers.free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 1)])
    servicer = SlowInfo(pb, delay_s=1.0)
    pb.rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def _info_in_thread(client):
    box = {}

    def run():
        try:
            box["info"] = client.info()
        except Exception as err:  # the test reads it
            box["error"] = err

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_a_call_whose_channel_another_thread_replaced_is_retried(slow_server):
    target, servicer = slow_server
    with RolloutClient(target, retry_s=30.0, backoff_s=0.05) as client:
        t, box = _info_in_thread(client)
        while servicer.calls == 0:  # the call is in flight on the first channel
            time.sleep(0.01)
        client._reopen(client._channel)  # what another thread's retry does after its own call failed
        t.join(timeout=30)
    assert "error" not in box, box.get("error")
    assert box["info"]["version"] == 7 and servicer.calls >= 2  # answered by the retry on the new channel


def test_a_stale_failure_does_not_replace_the_new_channel(slow_server):
    target, _ = slow_server
    with RolloutClient(target) as client:
        old = client._channel
        client._reopen(old)
        new = client._channel
        client._reopen(old)  # a second thread failing on the same old channel: the new one stays
        assert new is not old and client._channel is new


def test_a_call_on_a_closed_client_is_not_retried(slow_server):
    target, servicer = slow_server
    client = RolloutClient(target, retry_s=30.0, backoff_s=0.05)
    t, box = _info_in_thread(client)
    while servicer.calls == 0:
        time.sleep(0.01)
    client.close()
    t.join(timeout=30)
    assert isinstance(box.get("error"), RolloutError) and "CANCELLED" in str(box["error"])


class Restarted(protos.load().rollout_pb2_grpc.RolloutServicer):
    """A server that restarted (serves version 0) and loads a weights directory per UpdateWeights, refusing a version
    not above the one it serves (FAILED_PRECONDITION, as the real server does). Its first `hold` Info calls wait for
    each other: every caller has read the old version before any re-send lands."""

    def __init__(self, pb, hold: int):
        self.pb, self.version, self.updates = pb, 0, []
        self._barrier = threading.Barrier(hold) if hold else None
        self._held, self._lock = hold, threading.Lock()

    def Info(self, request, context):
        with self._lock:
            wait, self._held = self._held > 0, self._held - 1
            version = self.version
        if wait:
            self._barrier.wait(timeout=20)
        return self.pb.rollout_pb2.InfoResponse(engine="restarted", version=version)

    def UpdateWeights(self, request_iterator, context):
        version = next(iter(request_iterator)).version
        with self._lock:
            self.updates.append(version)
            if version <= self.version:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"version {version} is not above the current {self.version}"
                )
            self.version = version
        return self.pb.rollout_pb2.UpdateWeightsResponse(version=version)


@pytest.fixture
def restarted():
    def start(hold: int):
        pb = protos.load()
        port = servers.free_port()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        servicer = Restarted(pb, hold)
        pb.rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        started.append(server)
        return f"127.0.0.1:{port}", servicer

    started = []
    yield start
    for server in started:
        server.stop(0)


def _in_threads(fn, n: int) -> list:
    """fn() in n threads at once: what each raised (None when it returned)."""
    errors = [None] * n

    def run(i):
        try:
            fn()
        except Exception as err:  # the test reads it
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def test_two_threads_restoring_one_restarted_server_both_succeed(restarted, tmp_path):
    """The trainer's two threads (rollouts, publishing) both reconnect to a restarted server and both read that it lost
    the weights: both re-send them, the server takes the first and refuses the second (not above what it serves now).
    The refused re-send is done, not a failure: the server holds the expected version."""
    target, server = restarted(hold=2)
    with RolloutClient(target, retry_s=10.0, backoff_s=0.05) as client:
        client.expected_version = 3
        client.restore_weights = lambda: client.update_weights(str(tmp_path), version=3, checksums=False)
        errors = _in_threads(client._restore, 2)
    assert errors == [None, None], errors
    assert server.updates == [3, 3] and server.version == 3  # the interleaving happened: two re-sends, one taken


def test_a_refused_restore_that_left_the_server_behind_fails(restarted, tmp_path):
    """A re-send refused while the server still serves a version below the expected one is a failure, not taken for
    another thread's restore."""
    target, server = restarted(hold=0)
    with RolloutClient(target, retry_s=10.0, backoff_s=0.05) as client:
        client.expected_version = 3
        client.restore_weights = lambda: client.update_weights(str(tmp_path), version=2, checksums=False)
        server.version = 2  # refuses version 2 (not above 2) and stays below the expected 3
        with pytest.raises(RolloutError, match="FAILED_PRECONDITION"):
            client._restore()
    assert server.updates == [2] and server.version == 2
