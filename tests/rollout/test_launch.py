"""cisjax.rollout.launch: a child server's port held from the parent's pick until the child binds it, and released."""

import errno
import socket
import types

import pytest

from cisjax.rollout import launch
from cisjax.rollout import server as server_lib
from cisjax.rollout.client import RolloutClient

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="leases hold ports with SO_REUSEPORT")


def _plain_bind(port: int) -> OSError | None:
    """What binding `port` without SO_REUSEPORT gets (another process's listener, an outgoing connection's pick)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            return err
    return None


def test_a_leased_port_is_refused_to_others_until_released():
    lease = launch.PortLease()
    err = _plain_bind(lease.port)
    assert err is not None and err.errno == errno.EADDRINUSE
    lease.close()
    assert _plain_bind(lease.port) is None
    lease.close()  # twice: no error


def test_the_rollout_server_binds_a_leased_port_and_serves_on_it():
    """build_server's socket joins the lease's (SO_REUSEPORT) and gets the connections: the lease does not listen."""
    backend = types.SimpleNamespace(config_json={})  # what the services read when built; health needs no engine
    with launch.PortLease() as lease:
        server, _health, bound = server_lib.build_server(
            backend, host="127.0.0.1", port=lease.port, token=None, export_root=None
        )
        try:
            assert bound == lease.port
            with RolloutClient(f"127.0.0.1:{lease.port}", timeout_s=10.0) as client:
                assert client.health() == "SERVING"
        finally:
            server.stop(0)


def test_a_child_server_holds_its_port_until_stopped(tmp_path):
    """A child that fails to start (no such model) still leaves its port held until stop(), then free."""
    child = launch.ChildServer(
        backend="transformers",
        model_dir=tmp_path / "missing",
        dtype="float32",
        log_path=tmp_path / "server.log",
        startup_s=120.0,
    )
    try:
        assert child.target == f"127.0.0.1:{child.port}"
        assert _plain_bind(child.port) is not None
        with pytest.raises(RuntimeError, match="exited with"):
            child.wait_ready()
        assert _plain_bind(child.port) is not None  # exited, but the port stays this server's
    finally:
        child.stop()
    assert _plain_bind(child.port) is None
