"""Rollout-server subprocesses for the benches: `python -m cisjax.rollout.server` on a free loopback port,
its output in a log file, started, waited for until serving, stopped gracefully."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cisjax.rollout import engine_env as engine_env_lib


def engine_env(kv_cache_gib: float | None = None) -> dict:
    """The vLLM environment both sides of a bench run with: this process's values, else the backend's defaults
    (cisjax.rollout.engine_env)."""
    env = {k: os.environ.get(k, v) for k, v in engine_env_lib.defaults().items()}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A rollout server subprocess on 127.0.0.1 (no token). Waits until it serves unless `wait=False` (then call
    `wait()`, e.g. after other start-up work done meanwhile). `start_s`: from spawn to SERVING."""

    def __init__(self, backend: str, model_dir, *, dtype: str, log_path, export_root=None, env: dict | None = None,
                 timeout_s: float = 600.0, wait: bool = True):
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "cisjax.rollout.server", "--backend", backend, "--model", str(model_dir), "--port", str(self.port),
               "--host", "127.0.0.1", "--dtype", dtype, "--grace", "5"]
        if export_root is not None:
            cmd += ["--export-root", str(export_root)]
        full_env = dict(os.environ, CISJAX_ROLLOUT_TOKEN="", **(env or {}))
        self._log = open(self.log_path, "w")
        self._t0 = time.monotonic()
        self.timeout_s = timeout_s
        self.start_s = None
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the server's health check says SERVING; RuntimeError with its log's tail if it exits or times out (the
        process is stopped then)."""
        try:
            self._wait(self._t0 + self.timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - self._t0

    def _wait(self, deadline: float) -> None:
        import grpc

        from cisjax.rollout.client import RolloutClient

        with RolloutClient(self.target) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"rollout server exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
                try:
                    if client.health() == "SERVING":
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout server not serving after {self.timeout_s:.0f}s:\n{self.log_tail()}")
                time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful), SIGKILL after `timeout_s`; the exit code."""
        if self._log.closed:
            return self.proc.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
