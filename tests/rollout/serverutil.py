"""Rollout-server subprocesses for tests: a free port, start, wait until serving, graceful stop."""

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc

from cisjax.rollout.client import RolloutClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(backend, model_dir, port, *, export_root=None, token=None, host="127.0.0.1", env=None, dtype="float32"):
    """`python -m cisjax.rollout.server` (engine dtype fp32 unless told) with a 5 s shutdown grace, output captured."""
    cmd = [sys.executable, "-m", "cisjax.rollout.server", "--backend", backend, "--model", str(model_dir),
           "--port", str(port), "--host", host, "--dtype", dtype, "--grace", "5"]
    if export_root:
        cmd += ["--export-root", str(export_root)]
    if token:
        cmd += ["--token", token]
    env = dict(os.environ, CISJAX_ROLLOUT_TOKEN="", **(env or {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # drain the output continuously: a full pipe would block the server (it logs every reload)
    proc.output = collections.deque(maxlen=2000)
    threading.Thread(target=lambda: proc.output.extend(proc.stdout), daemon=True).start()
    return proc


def output(proc) -> str:
    """The last lines the server printed."""
    time.sleep(0.2)  # let the reader catch up with a process that just exited
    return "".join(proc.output)


def wait_serving(proc, target, timeout: float, poll: float = 0.2) -> None:
    """Until the health check says SERVING; the server's output in the error if it exits or times out."""
    client = RolloutClient(target)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{output(proc)}")
        try:
            if client.health() == "SERVING":
                client.close()
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not serving after {timeout}s:\n{output(proc)}")
        time.sleep(poll)


def stop(proc, timeout: float = 30) -> int:
    """SIGTERM (graceful shutdown), SIGKILL after `timeout`; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
