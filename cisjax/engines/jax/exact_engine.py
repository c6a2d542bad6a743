"""The JAX sampler in rollout.exact mode: samples through cisjax.models.exact's decode, so each token's q is the train
step's p bit for bit; the same generate_many -> SampleResults as engine.Engine."""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
from collections.abc import Sequence

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import runtime, sharding
from cisjax.engines.jax.engine import STOP_SLOTS, Request, bucket
from cisjax.engines.jax.sampling import key_data
from cisjax.models import exact, exact_head
from cisjax.rollout.backend import SampleResult, sample_seed
from cisjax.rollout.params import SamplingParams

CHECK_EVERY = 8  # decode steps between two looks at whether every row has ended (each look synchronises)

log = logging.getLogger(__name__)


class ExactEngine:
    """Generates with exact.exact_step on the model `graphdef` + `params` (the trainer's: its compute dtype, its fp32
    master weights). Prompts sit at slot 0 (slot = position, as the trainer's rows) and are fed one position per step
    through the same program as the responses; every row samples once its prompt is in. A call's rows share one
    temperature (requests of other temperatures run apart); greedy rows take the argmax. `params` may be swapped
    whole between calls. Attributes as Engine's where the Backend reads them (params, graphdef, version, rules,
    phases, device_kind, compiled)."""

    def __init__(self, graphdef, params, *, max_len: int, mesh=None, rules=sharding.DEFAULT_TABLE):
        self.graphdef, self.params = graphdef, params
        self.max_len = max_len
        self.mesh, self.rules = mesh, (rules if mesh is not None else None)
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.device_kind = device.device_kind
        self.version = 0
        self._programs: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.phases: dict = {}

    @property
    def compiled(self) -> int:
        return len(self._programs)

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """ValueError naming what this engine cannot take."""
        if not prompt:
            raise ValueError("an empty prompt")
        if len(prompt) + params.max_new_tokens > self.max_len:
            raise ValueError(f"prompt + max_new_tokens = {len(prompt) + params.max_new_tokens} > {self.max_len}")
        if len(params.stop_token_ids) > STOP_SLOTS:
            raise ValueError(f"{len(params.stop_token_ids)} stop token ids: at most {STOP_SLOTS}")
        if params.logprobs or params.return_routing:
            raise ValueError("the exact sampler returns neither top logprobs nor routing")

    def generate(self, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int], params: SamplingParams):
        return self.generate_many([Request(list(p), i, params) for p, i in zip(prompts, prompt_ids)])

    def generate_many(self, requests: Sequence[Request]):
        """Per request, its params.n samples as SampleResults (q: the exact path's logprob of each token under the
        distribution it was drawn from; the support where the request truncates)."""
        for r in requests:
            self.check(r.prompt, r.params)
        out: list = [None] * len(requests)
        groups: dict = {}
        for i, r in enumerate(requests):  # one temperature per program (a static of the exact head)
            groups.setdefault(1.0 if r.params.greedy else float(r.params.temperature), []).append(i)
        for temperature, idx in groups.items():
            for i, samples in zip(idx, self._generate([requests[i] for i in idx], temperature)):
                out[i] = samples
        return out

    def _program(self, rows: int, total: int, slots: int, new: int, temperature: float, support: bool):
        key = ("exact", rows, total, slots, new, temperature, support)
        with self._lock:
            if key not in self._programs:
                fn = functools.partial(_advance, self.graphdef, self.mesh, self.rules, temperature, support)
                self._programs[key] = jax.jit(fn, donate_argnums=(1, 2))
                log.info("compiling exact sampler program %d: %s", len(self._programs), key[1:])
            return self._programs[key]

    def _generate(self, requests: list, temperature: float) -> list:
        rows = [(r, j) for r in requests for j in range(r.params.n)]
        plen = max(len(r.prompt) for r in requests)
        new = bucket(max(r.params.max_new_tokens for r in requests), 16)
        total = plen + new
        slots = -(-bucket(total, exact.BLOCK) // exact.BLOCK) * exact.BLOCK
        width = bucket(len(rows), exact.TILE)
        support = any(r.params.return_sampling_mask and r.params.truncates for r in requests)
        version, params = self.version, self.params
        model = nnx.merge(self.graphdef, params)
        state = {k: jnp.asarray(a) for k, a in _initial(rows, width, total, new).items()}
        state["keep"] = jnp.ones((width, new, model.cfg.vocab_size) if support else (width, 1, 1), bool)
        cache = exact.init_cache(model, width, slots)
        advance = self._program(width, total, slots, new, temperature, support)
        for s in range(total - 1):
            cache, state = advance(params, cache, state, jnp.int32(s))
            if (s + 1) % CHECK_EVERY == 0 and bool(jnp.all(state["done"])):
                break
        host = jax.tree.map(np.asarray, state)
        return _results(requests, host, version, support)


def _initial(rows: list, width: int, total: int, new: int) -> dict:
    """The decode's starting state of `rows` (request, sample index) padded to `width` rows (padding rows start done)."""
    feed = np.zeros((width, total), np.int32)
    per = dict(
        plen=np.ones(width, np.int32),
        max_new=np.zeros(width, np.int32),
        top_k=np.zeros(width, np.int32),
        top_p=np.ones(width, np.float32),
        greedy=np.zeros(width, bool),
        stop=np.full((width, STOP_SLOTS), -1, np.int32),
        keys=np.zeros((width, 2), np.uint32),
        done=np.ones(width, bool),
    )
    for i, (r, j) in enumerate(rows):
        q = r.params
        feed[i, : len(r.prompt)] = r.prompt
        per["plen"][i], per["max_new"][i], per["done"][i] = len(r.prompt), q.max_new_tokens, False
        per["top_k"][i], per["top_p"][i], per["greedy"][i] = q.top_k, q.top_p, q.greedy
        per["stop"][i, : len(q.stop_token_ids)] = sorted(q.stop_token_ids)
        seed = q.seed if q.seed is not None else secrets.randbits(62)
        per["keys"][i] = key_data(sample_seed(seed, r.prompt_id, j))
    return dict(
        per,
        feed=feed,
        tokens=np.zeros((width, new), np.int32),
        q=np.zeros((width, new), np.float32),
        lengths=np.zeros(width, np.int32),
        stopped=np.zeros(width, bool),
    )


def _advance(graphdef, mesh, rules, temperature: float, support: bool, params, cache, state: dict, s):
    """One decode step of every row: position s fed (its prompt token, or the token it sampled), the next token drawn
    where a row samples (response index s + 1 - plen, below its max_new and not ended), its q and support kept."""
    with sharding.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
        model = nnx.merge(graphdef, params)
        with runtime.matmul_precision(model.cfg.dtype):
            r = state["feed"].shape[0]
            fed = state["feed"][:, s]
            pos = jnp.full((r,), s, jnp.int32)
            z, lse, cache = exact.exact_step(
                model, cache, fed, pos, temperature=temperature, moe_impl=exact.MOE_IMPL, block=exact.BLOCK
            )
            keep, has = exact_head.sampling_support(z, state["top_k"], state["top_p"])
            draw = lambda k, zr: jax.random.categorical(jax.random.fold_in(jax.random.wrap_key_data(k), s), zr)  # noqa: E731
            tok = jax.vmap(draw)(state["keys"], jnp.where(keep, z, -jnp.inf)).astype(jnp.int32)
            tok = jnp.where(state["greedy"], jnp.argmax(z, axis=-1).astype(jnp.int32), tok)
            q = exact.logprob(z, lse, tok, keep, has)
    j = s + 1 - state["plen"]
    on = (j >= 0) & (j < state["max_new"]) & ~state["done"]
    jj = jnp.clip(j, 0, state["tokens"].shape[1] - 1)
    ar = jnp.arange(r)
    st = dict(state)
    put = lambda a, x: a.at[ar, jj].set(jnp.where(on.reshape(-1, *[1] * (x.ndim - 1)), x, a[ar, jj]))  # noqa: E731
    st["tokens"], st["q"] = put(state["tokens"], tok), put(state["q"], q)
    if support:
        st["keep"] = put(state["keep"], keep)
    nxt = jnp.minimum(s + 1, state["feed"].shape[1] - 1)
    st["feed"] = state["feed"].at[:, nxt].set(jnp.where(on, tok, state["feed"][:, nxt]))
    stop = on & jnp.any(tok[:, None] == state["stop"], axis=-1)
    st["lengths"] = jnp.where(on, j + 1, state["lengths"])
    st["stopped"] = state["stopped"] | stop
    st["done"] = state["done"] | stop | (on & (j + 1 >= state["max_new"]))
    return cache, st


def _results(requests: list, host: dict, version: int, support: bool) -> list:
    """Per request, its samples as SampleResults from the decode's final state (host arrays)."""
    out, i = [], 0
    for r in requests:
        samples = []
        for j in range(r.params.n):
            m = int(host["lengths"][i])
            s = SampleResult(
                sample_index=j,
                token_ids=host["tokens"][i, :m].tolist(),
                logprobs=host["q"][i, :m].astype(np.float64).tolist(),
                finish_reason="stop" if host["stopped"][i] else "length",
                versions=[version] * m,
            )
            if r.params.return_sampling_mask:
                s.support = _support(host["keep"][i, :m] if support else None, m, r.params)
            samples.append(s)
            i += 1
        out.append(samples)
    return out


def _support(keep_MxV, m: int, params: SamplingParams) -> tuple[list, list]:
    """(kept ids, a count per token) of a sample's m tokens; counts of 0 where the request does not truncate."""
    if not params.truncates or keep_MxV is None:
        return [], [0] * m
    ids = [np.flatnonzero(keep_MxV[t]).tolist() for t in range(m)]
    return [i for row in ids for i in row], [len(row) for row in ids]
