"""The JAX sampler in the trainer's process (rollout.colocated): a loopback rollout server over an engine on the
trainer's mesh, its weights swapped in memory instead of exported."""

from __future__ import annotations

import logging
import secrets

from cisjax.engines.jax.backend import Backend
from cisjax.rollout import server as server_lib
from cisjax.rollout.client import RolloutClient

log = logging.getLogger(__name__)


class Colocated:
    """cisjax.engines.jax.backend's engine on `mesh` (the trainer's: the weights, activations and KV cache sharded as
    the trainer shards its own), served on a 127.0.0.1 port of this process with a random token, so the run's
    rollouts, canary and in-loop evaluation go through the same protocol, checks and client as with a separate
    server. `publish` swaps the trainer's params in (cast to the engine's dtype, copied: no export, no stream); it
    waits for the work queued before it and holds back the work after it, so every sample comes from one version.
    `exact` (rollout.exact): the engine holds the trainer's master weights and samples on the exact path.
    `stop` / `kill` as an embedded server's."""

    def __init__(
        self,
        model_dir,
        *,
        dtype: str,
        mesh,
        rules,
        runtime: dict | None = None,
        timeout_s: float = 3600.0,
        retry_s: float = 60.0,
        startup_s: float = 60.0,
        exact: bool = False,
    ):
        # what the engine serves the params in: rollout.exact serves the trainer's master weights as they are
        self.dtype = str((runtime or {}).get("param_dtype", "float32")) if exact else dtype
        self.backend = Backend(str(model_dir), dtype=dtype, mesh=mesh, rules=rules, runtime=runtime, exact=exact)
        token = secrets.token_urlsafe(24)  # only this process's client may call it
        try:
            self.server, self.health, port = server_lib.build_server(
                self.backend, host="127.0.0.1", port=0, token=token, export_root=None, workers=16
            )
        except BaseException:
            self.backend.close()
            raise
        self.target = f"127.0.0.1:{port}"
        self.client = RolloutClient(self.target, token=token, timeout_s=timeout_s, retry_s=retry_s)
        self.client.wait_ready(startup_s)
        kind = f"{self.dtype}, exact" if exact else self.dtype
        log.info("colocated JAX sampler (%s) serving in this process on %s", kind, self.target)

    def publish(self, params, version: int) -> int:
        """Serve the trainer's `params` (its nnx.State) as `version`; returns the version the engine now serves.
        ValueError naming a parameter that does not fit the served model (nothing is swapped)."""
        self.backend.set_params(params, version)
        self.client.weights_updated(version)
        return self.backend.version

    def stop(self, timeout_s: float | None = None) -> int:
        """Health NOT_SERVING, the calls in flight given `timeout_s` seconds (default 5), then the engine closed; 0
        (as a child's exit code)."""
        self.client.close()
        server_lib.shut_down(self.server, self.health, self.backend, 5.0 if timeout_s is None else timeout_s)
        return 0

    def kill(self) -> None:
        self.server.stop(grace=0)
        self.backend.close()
