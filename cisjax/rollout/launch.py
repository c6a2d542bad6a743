"""Child rollout servers: `python -m cisjax.commands.serve` on a free loopback port, started, waited for, stopped."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from cisjax.rollout import client as client_lib
from cisjax.rollout import engine_env

log = logging.getLogger(__name__)

__all__ = ["free_port", "PortLease", "server_env", "start", "wait_serving", "stop", "ChildServer"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS's pick; another process may take it before it is bound again: a server
    child that starts for seconds holds a PortLease instead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortLease:
    """A port on `host` held for a server child while it starts (and restarts): bound here with SO_REUSEPORT, not
    listening, so no other process's bind or outgoing connection gets the port, while the child's gRPC server, which
    binds with SO_REUSEPORT (cisjax.rollout.server.build_server), can. Without SO_REUSEPORT (not Linux) it holds
    nothing: `free_port`'s pick."""

    def __init__(self, host: str = "127.0.0.1"):
        self._sock = None
        if not hasattr(socket, "SO_REUSEPORT"):
            self.port = free_port(host)
            return
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def server_env(backend: str, env: Mapping | None = None) -> dict:
    """The child's environment: this process's, the vLLM defaults where unset (cisjax.rollout.engine_env; for the JAX
    engine, no preallocation of GPU memory), no
    CISJAX_ROLLOUT_TOKEN (a child binds localhost: a token meant for a remote server is not its), then `env`."""
    out = dict(os.environ)
    if backend == "vllm":
        for key, value in engine_env.defaults().items():
            out.setdefault(key, value)
    if backend == "jax":  # beside a trainer on the same GPU: take memory as needed, not XLA's default 75% up front
        out.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out["CISJAX_ROLLOUT_TOKEN"] = ""
    out.update({k: str(v) for k, v in (env or {}).items()})
    return out


def start(
    backend: str,
    model_dir,
    *,
    port: int,
    dtype: str,
    host: str = "127.0.0.1",
    export_root=None,
    token: str | None = None,
    grace_s: float = 5.0,
    env: Mapping | None = None,
    stdout=None,
    text: bool = False,
    own_session: bool = False,
    extra_args: tuple = (),
) -> subprocess.Popen:
    """Spawn `python -m cisjax.commands.serve` (output to `stdout`, an open file or subprocess.PIPE). `own_session`: in its
    own session (out of the terminal's Ctrl-C; stop it with `stop(group=True)`) and stopping when this process exits."""
    cmd = [
        sys.executable,
        "-m",
        "cisjax.commands.serve",
        "--backend",
        backend,
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--host",
        host,
        "--dtype",
        dtype,
        "--grace",
        f"{grace_s:g}",
    ]
    if export_root is not None:
        cmd += ["--export-root", str(export_root)]
    if token:  # in the environment, not on the command line (which other local users can read)
        env = {**(env or {}), "CISJAX_ROLLOUT_TOKEN": token}
    if own_session:
        cmd += ["--exit-with-parent"]  # a SIGKILLed parent leaves no server behind
    cmd += list(extra_args)
    log.info("starting rollout server: %s", " ".join(cmd))
    return subprocess.Popen(
        cmd,
        env=server_env(backend, env),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=text,
        start_new_session=own_session,
    )


def wait_serving(
    client,
    timeout_s: float,
    *,
    failed: Callable[[], str | None] = lambda: None,
    tail: Callable[[], str] = lambda: "",
    poll_s: float = 0.25,
) -> None:
    """Until `client.health()` says SERVING. RuntimeError holding `tail()` (the server's last output) as soon as
    `failed()` gives a reason (the child exited), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.health() == "SERVING":
                return
        except Exception:  # noqa: BLE001  (not up yet)
            pass
        if (reason := failed()) is not None:
            raise RuntimeError(f"rollout server {reason}:\n{tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout server not serving after {timeout_s:.0f}s:\n{tail()}")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0, *, group: bool = False) -> int:
    """SIGTERM (graceful shutdown; its whole process group with `group`), SIGKILL after `timeout_s`; the exit code."""
    if proc.poll() is None:
        send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
        send(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()
    return proc.returncode


class ChildServer:
    """A rollout server child on 127.0.0.1 in its own session, its output appended to `log_path`. With `restart`, a
    watchdog restarts it when it exits unexpectedly (a client's retries reconnect). `stop()` shuts it down gracefully
    (SIGTERM, then SIGKILL after `grace_s` + 30 s)."""

    def __init__(
        self,
        *,
        backend: str,
        model_dir,
        dtype: str,
        log_path,
        export_root=None,
        env: Mapping | None = None,
        port: int = 0,
        startup_s: float = 600.0,
        grace_s: float = 10.0,
        extra_args: tuple = (),
        restart: bool = False,
        client_tls=None,
    ):
        self.client_tls = client_tls  # a cisjax.rollout.tls.ClientTLS when extra_args make it serve TLS
        self._lease = None if port else PortLease()  # held until stop(): restarts bind the same port
        self.port = port or self._lease.port
        self.target = f"127.0.0.1:{self.port}"
        self._start = dict(
            backend=backend,
            model_dir=model_dir,
            port=self.port,
            dtype=dtype,
            export_root=export_root,
            grace_s=grace_s,
            env=env,
            own_session=True,
            extra_args=tuple(extra_args),
        )
        self.log_path = Path(log_path)
        self.startup_s, self.grace_s = startup_s, grace_s
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        try:
            self.proc = self._spawn()
        except BaseException:
            self._release()
            raise
        self._watchdog = None
        if restart:
            self._watchdog = threading.Thread(target=self._watch, name="rollout-server-watchdog", daemon=True)
            self._watchdog.start()

    def _spawn(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:  # the child holds its own descriptor
            return start(**self._start, stdout=out)

    def wait_ready(self, client=None) -> None:
        """Until the server answers health checks as SERVING (through `client`, else a client of its own); its log
        tail in the error if it exits (keeps exiting, with `restart`) or times out."""

        def failed():
            if self._watchdog is None:
                code = self.proc.poll()
                return None if code is None else f"exited with {code} before serving"
            return "keeps exiting" if self.restarts > 3 else None

        if client is not None:
            return wait_serving(client, self.startup_s, failed=failed, tail=self.log_tail, poll_s=0.5)
        with client_lib.RolloutClient(self.target, tls=self.client_tls) as own:
            wait_serving(own, self.startup_s, failed=failed, tail=self.log_tail)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def _watch(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                code = self.proc.poll()
                if code is not None and not self._stopping.is_set():
                    self.restarts += 1
                    log.warning("rollout server exited with %s; restarting it (restart %d)", code, self.restarts)
                    self.proc = self._spawn()
            self._stopping.wait(1.0)

    def kill(self) -> None:
        """SIGKILL the server (tests of recovery; with `restart` the watchdog starts it again)."""
        with self._lock:
            self.proc.kill()

    def stop(self, timeout_s: float | None = None) -> int:
        """Graceful stop (SIGKILL after `timeout_s`, default grace_s + 30 s); the exit code."""
        self._stopping.set()
        with self._lock:
            code = stop(self.proc, self.grace_s + 30 if timeout_s is None else timeout_s, group=True)
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        self._release()
        return code

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
