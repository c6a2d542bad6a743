"""The rollout service of a run or an evaluation: running server(s), or `cisjax serve` children restarted."""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path

from cisjax import errors
from cisjax.rollout import client as client_lib
from cisjax.rollout import launch, placement
from cisjax.rollout.fleet import RolloutFleet

log = logging.getLogger(__name__)


class EmbeddedServer(launch.ChildServer):
    """The trainer's rollout server child (launch.ChildServer) on 127.0.0.1, its output in `log_path`, restarted by a
    watchdog when it exits unexpectedly; the client's retries reconnect and re-send the current weights."""

    def __init__(self, *, export_root, **child):
        """launch.ChildServer's keyword arguments (backend, model_dir, dtype, log_path, env, port, startup_s, grace_s,
        extra_args); the export root is required (where the trainer publishes)."""
        super().__init__(export_root=export_root, restart=True, **child)


class EmbeddedServers:
    """Several EmbeddedServer children (a fleet's replicas), stopped together."""

    def __init__(self, servers: list[EmbeddedServer]):
        self.servers = servers

    def stop(self, timeout_s: float | None = None) -> int:
        """Stop them all (in parallel: each waits its own grace); the first non-zero exit code, else 0."""
        with futures.ThreadPoolExecutor(max_workers=len(self.servers)) as ex:
            codes = list(ex.map(lambda s: s.stop(timeout_s), self.servers))
        return next((c for c in codes if c), 0)

    def kill(self) -> None:
        for s in self.servers:
            s.kill()


def parse_servers(server: str) -> list[str]:
    """`rollout.server` ("" or HOST:PORT[,HOST:PORT...]) as a list of targets; UserError naming a malformed or
    repeated one."""
    if not isinstance(server, str):
        raise errors.UserError("HOST:PORT or a comma-separated list of them")
    targets = [t.strip() for t in server.split(",")] if server.strip() else []
    for t in targets:
        host, _, port = t.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise errors.UserError(f"{t!r} is not HOST:PORT")
    if len(set(targets)) != len(targets):
        raise errors.UserError("a server is listed twice (its replica would get twice the work)")
    return targets


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
    tls=None,
    timeout_s: float = 3600.0,
    retry_s: float = 900.0,
    startup_s: float = 900.0,
    replicas: int = 1,
    replica_cpus: str = "",
    replica_gpus: str = "",
):
    """(embedded server(s) or None, a client waiting until they serve): `server` HOST:PORT of a running one
    (`cisjax serve`), several as HOST:PORT,HOST:PORT,..., or "" for `replicas` children on `model_dir` (their exports
    confined to `export_root`, their output in `log_path`, `log_path` with the replica's index before the suffix when
    there are several; on vLLM-CPU `kv_cache_gib` is VLLM_CPU_KVCACHE_SPACE, 0 = the environment's; each on its own
    cores or GPUs, cisjax.rollout.placement.plan of `replica_cpus` / `replica_gpus`). One server: a
    RolloutClient and an EmbeddedServer; several: a cisjax.rollout.fleet.RolloutFleet and EmbeddedServers. `cisjax
    train` and `cisjax eval` both get their engine here. `token` and `tls` (a cisjax.rollout.tls.ClientTLS) are for
    running servers; children bind 127.0.0.1 in plain text."""
    targets = parse_servers(server)
    if targets and replicas > 1:
        raise errors.UserError(f"rollout.server={server!r} and rollout.replicas={replicas}: set one of them")
    if targets:
        return None, _running(targets, token=token, tls=tls, timeout_s=timeout_s, retry_s=retry_s, startup_s=startup_s)
    places = placement.plan(replicas, cpus=replica_cpus, gpus=replica_gpus, backend=backend)
    Path(export_root).mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)} if kv_cache_gib else {}
    children = _spawn(
        places,
        backend=backend,
        model_dir=model_dir,
        export_root=export_root,
        dtype=dtype,
        log_path=Path(log_path),
        env=env,
        startup_s=startup_s,
    )
    clients: list[client_lib.RolloutClient] = []
    try:
        for child in children:
            clients.append(client_lib.RolloutClient(child.target, timeout_s=timeout_s, retry_s=retry_s))
            child.wait_ready(clients[-1])
    except BaseException:
        for c in clients:
            c.close()
        EmbeddedServers(children).stop()
        raise
    if replicas == 1:
        return children[0], clients[0]
    fleet = RolloutFleet(
        clients,
        retry_s=retry_s,
        restarts=[lambda c=c: c.restarts for c in children],
        restart=[c.kill for c in children],  # the watchdog starts it again
    )
    return EmbeddedServers(children), fleet


def _running(targets: list[str], *, token: str | None, tls, timeout_s: float, retry_s: float, startup_s: float):
    """A client of running servers (a RolloutClient for one, a RolloutFleet for several), once they serve."""
    if len(targets) == 1:
        client = client_lib.RolloutClient(targets[0], token=token, tls=tls, timeout_s=timeout_s, retry_s=retry_s)
        client.wait_ready(startup_s)
        return client
    fleet = RolloutFleet.connect(targets, token=token, tls=tls, timeout_s=timeout_s, retry_s=retry_s)
    try:
        fleet.wait_ready(startup_s)
    except BaseException:
        fleet.close()
        raise
    return fleet


def _spawn(places: list, *, log_path: Path, env: dict, **server) -> list[EmbeddedServer]:
    """An EmbeddedServer per placement, all spawned before any is waited for (their engines load together); with
    several, each logs to `log_path` with its index before the suffix."""
    children: list[EmbeddedServer] = []
    try:
        for i, place in enumerate(places):
            if place != placement.Placement():
                log.info("rollout replica %d: %s", i, place.describe())
            children.append(
                EmbeddedServer(
                    **server,
                    log_path=log_path
                    if len(places) == 1
                    else log_path.with_name(f"{log_path.stem}{i}{log_path.suffix}"),
                    env={**env, **place.env()},
                    extra_args=place.args(server["backend"]),
                )
            )
    except BaseException:
        if children:
            EmbeddedServers(children).stop()
        raise
    return children
