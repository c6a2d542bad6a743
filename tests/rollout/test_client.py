"""RolloutClient shared by threads: a call whose channel another thread's retry replaced is retried, not failed."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from cisjax.rollout import protos
from cisjax.rollout.client import RolloutClient, RolloutError
from tests.rollout import serverutil


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
    port = serverutil.free_port()
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
