"""The JAX sampler as a rollout Backend (`cisjax serve --backend jax`): cisjax's own models behind the same protocol."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import threading
import time
from concurrent import futures
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import runtime, sharding
from cisjax.engines.jax.engine import Engine, Request, bucket
from cisjax.engines.jax.exact_engine import ExactEngine
from cisjax.errors import CheckpointError
from cisjax.models import hf_io
from cisjax.rollout import backend as backend_lib
from cisjax.rollout import weights
from cisjax.rollout.backend import RequestError
from cisjax.rollout.params import SamplingParams

MAX_BATCH = 64  # prompts in one program: the requests waiting beyond it run in the next

log = logging.getLogger(__name__)


class Backend(backend_lib.Backend):
    """Generates with cisjax.engines.jax.engine, scores with the model's forward; weights and compute in `dtype`, the
    routers in fp32 (as the trainer's). One engine thread takes the work in arrival order: the Generate requests
    waiting together (those of one call, and of calls in flight at once) run as one batch per n; a Score or a weight
    update runs alone at its place in the order, so an update waits for the work before it and holds back the work
    after it (every token of a sample comes from one version).

    `mesh` (with its resolved logical `rules`, default sharding.DEFAULT_TABLE): the weights, the activations and the
    KV cache sharded over it as the trainer shards them (a serving mesh; the trainer's own in colocated mode).
    `runtime`: hf_io.load's model options (the trainer's moe_impl, moe_tile, router_dtype, ...); dtype and param_dtype
    are always `dtype`, except with `exact` (rollout.exact): then the runtime's own (the trainer's compute dtype and
    fp32 master weights) and the samples come from exact_engine.ExactEngine, q bit for bit the train step's p."""

    engine = "jax"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        mesh=None,
        rules: sharding.FrozenRules = sharding.DEFAULT_TABLE,
        runtime: dict | None = None,
        exact: bool = False,
    ):
        self.model = str(model_dir)
        self.dtype = dtype
        self.mesh, self.rules = mesh, rules
        self.exact = exact
        if exact:  # Info names it: a client (cisjax mismatch measure --exact) can tell the exact sampler from the plain
            self.engine = "jax-exact"
        dropped = ("remat",) if exact else ("dtype", "param_dtype", "remat")
        self.runtime = {k: v for k, v in (runtime or {}).items() if k not in dropped}
        self.config_json = json.loads((Path(model_dir) / "config.json").read_text())
        model, cfg = self._open(model_dir)
        self.architecture = (self.config_json.get("architectures") or [type(model).__name__])[0]
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(cfg.max_position_embeddings)
        self.supports_routing = bool(model.moe_layers) and not exact
        self.routing_unsupported = (
            "" if self.supports_routing else ("exact mode" if exact else "the model has no MoE layer")
        )
        self.supports_sampling_mask = True
        self.version = 0
        engine = ExactEngine if exact else Engine
        self.sampler = engine(*nnx.split(model), max_len=self.max_model_len, mesh=mesh, rules=rules)
        self._cast = _cast_program(self.sampler.params)
        if mesh is not None:
            log.info("weights, activations and KV cache sharded over the mesh %s", dict(mesh.shape))
        self.score_shapes: set[tuple[int, int]] = set()  # (length bucket, top_n): one compiled Score program each
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="jax-engine", daemon=True)
        self._thread.start()

    @property
    def phases(self) -> dict:
        return dict(self.sampler.phases, device_kind=self.sampler.device_kind)

    def _open(self, model_dir):
        """The model at `model_dir` (CheckpointError naming a missing or misshapen tensor: nothing is swapped)."""
        dtypes = {} if self.exact else dict(dtype=self.dtype, param_dtype=self.dtype)
        model, cfg, _ = hf_io.load(model_dir, mesh=self.mesh, rules=self.rules, **dtypes, **self.runtime)
        return model, cfg

    # ------------------------------------------------------------------ the engine thread
    def submit_generate(self, prompt_ids, prompt_id, params: SamplingParams) -> futures.Future:
        fut: futures.Future = futures.Future()
        self._queue.put(("generate", Request(list(prompt_ids), prompt_id, params), fut))
        return fut

    def submit_score(self, prompt_ids, response_ids, temperature, top_k, routing) -> futures.Future:
        fut: futures.Future = futures.Future()
        call = functools.partial(self._versioned_score, prompt_ids, response_ids, temperature, top_k, routing)
        self._queue.put(("call", call, fut))
        return fut

    def update(self, kind: str, source, version: int) -> None:
        fut: futures.Future = futures.Future()
        load = self.load_directory if kind == "directory" else self.load_tensors
        self._queue.put(("call", functools.partial(load, source, version), fut))
        fut.result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _work(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:  # everything waiting now: the prompts of one call arrive together
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batch: list = []
            for item in items:
                if item is None:
                    self._generate(batch)
                    return
                kind, work, fut = item
                if kind == "generate":
                    batch.append((work, fut))
                    continue
                self._generate(batch)
                batch = []
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(work())
                    except BaseException as err:  # noqa: BLE001  (handed to the caller)
                        fut.set_exception(err)
            self._generate(batch)

    def _generate(self, batch: list) -> None:
        """Run waiting Generate requests: one program per n (MAX_BATCH prompts at most), in arrival order."""
        live = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
        for n in dict.fromkeys(r.params.n for r, _ in live):
            same = [(r, f) for r, f in live if r.params.n == n]
            for i in range(0, len(same), MAX_BATCH):
                part = same[i : i + MAX_BATCH]
                started = time.monotonic()
                try:
                    results = self.sampler.generate_many([r for r, _ in part])
                except BaseException as err:  # noqa: BLE001  (handed to the callers)
                    for _, f in part:
                        f.set_exception(err)
                    continue
                finished = time.monotonic()
                for (_, f), samples in zip(part, results):
                    for s in samples:
                        s.timing = {"started": started, "finished": finished}
                    f.set_result(samples)

    # ------------------------------------------------------------------ generate / score
    def generate(self, prompt_ids, prompt_id, params: SamplingParams):
        return self.sampler.generate([list(prompt_ids)], [prompt_id], params)[0]

    def score(self, prompt_ids, response_ids, temperature, top_k, routing=False):
        seq = list(prompt_ids) + list(response_ids)
        p, n = len(prompt_ids), len(seq)
        length = bucket(n, 16)
        tokens_1xL = np.zeros((1, length), np.int32)
        tokens_1xL[0, :n] = seq
        targets_L = np.zeros((length,), np.int32)
        targets_L[: n - 1] = seq[1:]  # position i predicts token i + 1
        top_n = min(int(top_k), self.vocab_size)
        if (length, top_n) not in self.score_shapes:
            self.score_shapes.add((length, top_n))
            log.info("compiling score program %d: length %d, top_logprobs %d", len(self.score_shapes), length, top_n)
        rules = self.sampler.rules  # frozen: a cache key (None without a mesh)
        lp_L, top_v, top_i, ids = _score_program(self.sampler.graphdef, top_n, self.mesh, rules)(
            self.sampler.params, jnp.asarray(tokens_1xL), jnp.int32(n), jnp.float32(temperature), jnp.asarray(targets_L)
        )
        rows = slice(p - 1, n - 1)  # the positions whose next token is a response token
        out = {"logprobs": np.asarray(lp_L)[rows].astype(np.float64).tolist()}
        if top_n:
            out["top_ids"], out["top_logprobs"] = np.asarray(top_i)[rows].tolist(), np.asarray(top_v)[rows].tolist()
        if routing:
            ids_LxXxK = np.moveaxis(np.asarray(ids)[:, 0], 0, 1)  # [X, L, k] -> [L, X, k]
            out["prompt_routing"], out["routing"] = ids_LxXxK[: p - 1], ids_LxXxK[rows]
        return out

    # ------------------------------------------------------------------ weights
    def load_directory(self, path: Path, version: int) -> None:
        weights.check_same_model(Path(path), self.config_json)
        try:
            model, _ = self._open(path)
        except CheckpointError as err:
            raise RequestError(f"{Path(path).name}: {err}") from None
        graphdef, params = nnx.split(model)
        if jax.tree.structure(params) != jax.tree.structure(self.sampler.params):
            raise RequestError(f"{Path(path).name}: not the served model's parameters")
        self.sampler.params = params  # swapped whole, after a complete load; the compiled programs stay
        self.sampler.version = self.version = version

    def load_tensors(self, tensors: dict, version: int) -> None:
        weights.load_through_directory(self, tensors, version)

    def set_params(self, params, version: int) -> None:
        """Colocated: serve the trainer's `params` (an nnx.State of the same model) as `version`, once the work before
        it is done: cast to this engine's dtypes and copied onto its shardings (the trainer's step donates its own
        buffers; a mesh of its own is a resharding). ValueError naming a parameter that does not fit; nothing is
        swapped then."""
        mine, theirs = _by_path(self.sampler.params), _by_path(params)
        if mine.keys() != theirs.keys():
            missing, extra = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
            raise ValueError(f"not the served model's parameters: missing {missing[:3]}, unknown {extra[:3]}")
        for path, x in theirs.items():
            if tuple(x.shape) != tuple(mine[path].shape):
                raise ValueError(f"{path}: shape {tuple(x.shape)}, the served model has {tuple(mine[path].shape)}")
        # dispatched here; the swap waits for the work queued before it
        copied = self._cast([theirs[path] for path in mine])
        fut: futures.Future = futures.Future()
        self._queue.put(("call", functools.partial(self._swap, copied, version), fut))
        fut.result()

    def _swap(self, params, version: int) -> None:
        self.sampler.params = params
        self.sampler.version = self.version = version


def _by_path(params) -> dict:
    return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _cast_program(like):
    """Jitted: `like`'s leaves' counterparts, in its order -> a state like `like` (its structure, dtypes and
    shardings) holding copies of them (`jnp.copy`: never the input's buffer, even where nothing changes)."""
    leaves, treedef = jax.tree.flatten(like)
    dtypes = [x.dtype for x in leaves]

    def cast(flat):
        return jax.tree.unflatten(treedef, [jnp.copy(x.astype(d)) for x, d in zip(flat, dtypes)])

    return jax.jit(cast, out_shardings=jax.tree.unflatten(treedef, [x.sharding for x in leaves]))


@functools.cache
def _score_program(graphdef, top_n: int, mesh=None, rules=None):
    """Jitted (params, tokens [1, L], length, temperature, targets [L]) -> (logprob of each target [L], the top_n
    logprobs and ids per position, the routers' expert ids [X, 1, L, k] or None): the forward over the sequence
    (right-padded past `length`), log-softmax of logits / temperature in fp32."""

    def run(params, tokens_1xL, length, temperature, targets_L):
        with sharding.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
            model = nnx.merge(graphdef, params)
            with runtime.matmul_precision(model.cfg.dtype):  # fp32 on a GPU: no TF32
                segments_1xL = (jnp.arange(tokens_1xL.shape[1]) < length).astype(jnp.int32)[None]
                out = model(tokens_1xL, None, segments_1xL)
                lp_LxV = jax.nn.log_softmax(model.logits(out.hidden_BxLxD)[0] / temperature, axis=-1)
        lp_L = jnp.take_along_axis(lp_LxV, targets_L[:, None], axis=-1)[:, 0]
        top_v, top_i = jax.lax.top_k(lp_LxV, top_n) if top_n else (None, None)
        return lp_L, top_v, top_i, out.expert_ids_XxBxLxK

    return jax.jit(run)
