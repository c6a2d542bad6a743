"""The inference engines of a measurement: rollout servers given or started here, and the perturbed copy they serve."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import flax.nnx as nnx

from cisjax import errors
from cisjax.mismatch.spec import MeasureSpec
from cisjax.models import hf_io
from cisjax.rollout import launch
from cisjax.rollout.client import RolloutClient
from cisjax.train import perturb as perturb_lib

log = logging.getLogger(__name__)


class Servers:
    """The rollout servers of the run: given addresses (spec.server, spec.transformers_server, spec.jax_server), or
    children started here on `model_dir` (stopped by close())."""

    def __init__(self, spec: MeasureSpec, model_dir: Path, vocab_size: int):
        self.spec, self.model_dir, self.vocab_size = spec, model_dir, vocab_size
        self.children, self.clients, self.infos = [], {}, {}
        self._export_root = None

    def client(self, backend: str) -> RolloutClient:
        """The client of `backend` (spec.ENGINES), connected (and its server started) on first use; its engine and
        vocabulary checked against the model."""
        if backend in self.clients:
            return self.clients[backend]
        target = self.spec.target(backend)
        client = self._connect(target) if target else self._start(backend)
        info = client.info()
        where = target or "the child server"
        if info["engine"] and backend not in info["engine"].lower():
            raise errors.UserError(f"{where} runs the {info['engine']!r} engine, expected {backend}")
        if self.spec.exact and backend == "jax" and (info["engine"], info["dtype"]) != ("jax-exact", self.spec.dtype):
            raise errors.UserError(
                f"--exact: {where} runs the {info['engine']!r} engine in {info['dtype']}, expected the exact sampler "
                f"in {self.spec.dtype} (cisjax serve --backend jax --exact --dtype {self.spec.dtype})"
            )
        if info["vocab_size"] != self.vocab_size:
            raise errors.UserError(
                f"{where} serves a model with vocab_size {info['vocab_size']} ({info['model']}), but --model "
                f"{self.model_dir} has {self.vocab_size}: not the same model"
            )
        self.clients[backend], self.infos[backend] = client, info
        return client

    def _connect(self, target: str) -> RolloutClient:
        client = RolloutClient(target, token=self.spec.token, tls=self.spec.tls)
        client.wait_ready(self.spec.startup_s)
        return client

    def _start(self, backend: str) -> RolloutClient:
        if self._export_root is None:
            self._export_root = tempfile.mkdtemp(prefix="cisjax-measure-")  # no weight updates: an empty root
        server = launch.ChildServer(
            backend=backend,
            model_dir=str(self.model_dir),
            export_root=self._export_root,
            dtype=self.spec.engine_dtype,
            log_path=self.spec.out / "servers" / f"{backend}.log",
            startup_s=self.spec.startup_s,
            restart=True,
            extra_args=("--exact",) if self.spec.exact and backend == "jax" else (),
        )
        self.children.append(server)
        client = RolloutClient(server.target)
        server.wait_ready(client)
        return client

    def close(self):
        for c in self.clients.values():
            c.close()
        for s in self.children:
            s.stop()
        self.children = []
        if self._export_root:
            os.rmdir(self._export_root)
            self._export_root = None


def perturbed_copy(model_dir: Path, root: Path, *, kind: str, scale: float, seed: int) -> tuple[Path, dict]:
    """--perturb: `model_dir` loaded by cisjax, perturbed (cisjax.train.perturb) and saved in its own dtype as
    root/v000000, the model directory the engines start on; with the settings and the relative rms change."""
    model, _, hf = hf_io.load(model_dir)
    graphdef, params = nnx.split(model)
    kw = dict(kind=kind, scale=scale, seed=seed)
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    path, rel = perturb_lib.export_copy(graphdef, params, hf, root, **kw, dtype=dtype, source="measure")
    info = dict(**kw, rel_rms=rel)
    log.info("--perturb: the engines serve %s (relative rms change %.3g)", path, rel)
    return path, info
