"""The embedded rollout server: `cisjax.rollout.server` as a child process of the trainer, restarted if it dies."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedServer:
    """A rollout server child on 127.0.0.1 (its output in `log_path`). A watchdog restarts it when it
    exits unexpectedly; the client's retries reconnect and re-send the current weights. `stop()`
    shuts it down gracefully (SIGTERM, then SIGKILL after `grace_s`)."""

    def __init__(self, *, backend: str, model_dir: str, export_root: str, dtype: str, log_path, env: dict | None = None,
                 port: int = 0, startup_s: float = 600.0, grace_s: float = 10.0, extra_args: tuple = ()):
        self.port = port or free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "cisjax.rollout.server", "--backend", backend, "--model", str(model_dir),
                    "--port", str(self.port), "--dtype", dtype, "--export-root", str(export_root), "--grace", str(grace_s),
                    "--exit-with-parent", *extra_args]  # a SIGKILLed trainer leaves no server behind
        # the server must not pick up a token meant for a remote server: it binds localhost only
        self.env = dict(os.environ, CISJAX_ROLLOUT_TOKEN="", **(env or {}))
        self.log_path = Path(log_path)
        self.startup_s, self.grace_s = startup_s, grace_s
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.proc = self._spawn()
        self._watchdog = threading.Thread(target=self._watch, name="rollout-server-watchdog", daemon=True)
        self._watchdog.start()

    def _spawn(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")
        log.info("starting rollout server: %s", " ".join(self.cmd))
        return subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, client) -> None:
        """Until the server answers health checks as SERVING; its log tail in the error if it exits or times out."""
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None and not self._stopping.is_set():
                time.sleep(0.5)  # the watchdog may be restarting it
            try:
                if client.health() == "SERVING":
                    return
            except Exception:  # noqa: BLE001  (not up yet)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout server not serving after {self.startup_s:.0f}s; its log ends:\n{self.log_tail()}")
            if self.restarts > 3:
                raise RuntimeError(f"rollout server keeps exiting; its log ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

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
        """SIGKILL the server (tests of recovery): the watchdog restarts it."""
        with self._lock:
            self.proc.kill()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(self.grace_s + 30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        self._watchdog.join(timeout=5)


def connect(server: str, *, model_dir, export_root, log_path, backend: str = "vllm", dtype: str = "bfloat16",
            kv_cache_gib: float = 0, token: str | None = None, timeout_s: float = 3600.0, retry_s: float = 900.0,
            startup_s: float = 900.0):
    """(embedded server or None, a RolloutClient waiting until it serves): `server` HOST:PORT of a running one
    (`cisjax serve`), or "" for a child on `model_dir` (its exports confined to `export_root`, its output in
    `log_path`; on vLLM-CPU `kv_cache_gib` is VLLM_CPU_KVCACHE_SPACE, 0 = the environment's). `cisjax train` and
    `cisjax eval` both get their engine here."""
    from cisjax.rollout.client import RolloutClient

    if server:
        client = RolloutClient(server, token=token, timeout_s=timeout_s, retry_s=retry_s)
        client.wait_ready(startup_s)
        return None, client
    Path(export_root).mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)} if kv_cache_gib else {}
    child = EmbeddedServer(backend=backend, model_dir=str(model_dir), export_root=str(export_root), dtype=dtype, log_path=log_path,
                           env=env, startup_s=startup_s)
    try:
        client = RolloutClient(child.target, timeout_s=timeout_s, retry_s=retry_s)
        child.wait_ready(client)
    except BaseException:
        child.stop()
        raise
    return child, client
