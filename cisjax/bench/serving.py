"""Rollout-server subprocesses for the benches (cisjax.rollout.launch's, timed from spawn to serving) and the engine
environment both sides of a bench run with."""

from __future__ import annotations

import os
import time

from cisjax.rollout import engine_env as engine_env_lib
from cisjax.rollout import launch


def engine_env(kv_cache_gib: float | None = None) -> dict:
    """The vLLM environment both sides of a bench run with: this process's values, else the backend's defaults
    (cisjax.rollout.engine_env)."""
    env = {k: os.environ.get(k, v) for k, v in engine_env_lib.defaults().items()}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    return env


class Server(launch.ChildServer):
    """A rollout server subprocess on 127.0.0.1 (no token; launch.ChildServer's keyword arguments: dtype, log_path,
    export_root, env, extra_args). Waits until it serves unless `wait=False` (then call `wait()`, e.g. after other
    start-up work done meanwhile). `start_s`: from spawn to SERVING."""

    def __init__(self, backend: str, model_dir, *, timeout_s: float = 600.0, wait: bool = True, **child):
        self._t0 = time.monotonic()
        super().__init__(backend=backend, model_dir=model_dir, startup_s=timeout_s, grace_s=5.0, **child)
        self.timeout_s = timeout_s
        self.start_s = None
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the server's health check says SERVING; RuntimeError with its log's tail if it exits or times out (the
        process is stopped then)."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - self._t0

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful), SIGKILL after `timeout_s`; the exit code."""
        return super().stop(timeout_s)


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid`, all threads (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def print_logs(servers: dict[str, Server]) -> None:
    """Each server's log tail, headed '--- <name> server log (tail):' (a bench that failed prints them)."""
    for name, server in servers.items():
        print(f"--- {name} server log (tail):\n{server.log_tail()}", flush=True)
