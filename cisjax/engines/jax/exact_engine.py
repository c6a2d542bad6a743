"""The JAX sampler in rollout.exact mode: samples through cisjax.models.exact's decode, so each token's q is the train
step's p bit for bit; the same generate_many -> SampleResults as engine.Engine."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
from collections.abc import Sequence

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import exact_rows, sharding
from cisjax.engines.jax.engine import STOP_SLOTS, Request, bucket, check_request
from cisjax.engines.jax.sampling import draw, key_data, sampling_logprobs
from cisjax.models import cast_inputs, exact
from cisjax.rollout.backend import SampleResult, sample_seed
from cisjax.rollout.params import SamplingParams

CHECK_EVERY = 8  # decode steps between two looks at whether every row has ended (each look synchronises)

log = logging.getLogger(__name__)


class ExactEngine:
    """Generates with cisjax.models.exact on the model `graphdef` + `params` (the trainer's: its compute dtype, its
    fp32 master weights). Prompts sit at slot 0 (slot = position, as the trainer's rows); each distinct prompt goes
    through exact_prefill once, its cache rows copied to its n samples, then every row decodes a token per step
    (exact_step at its own position): the same per-token programs as the train step's. A call's rows share one
    temperature (requests of other temperatures run apart); greedy rows take the argmax. `params` may be swapped
    whole between calls. Attributes as Engine's where the Backend reads them (params, graphdef, version, rules,
    phases, device_kind, compiled)."""

    def __init__(self, graphdef, params, *, max_len: int, mesh=None, rules=sharding.DEFAULT_TABLE):
        self.graphdef, self.params = graphdef, params
        self.max_len = max_len
        self.mesh, self.rules = mesh, (rules if mesh is not None else None)
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.device_kind = device.device_kind
        # on a CPU the programs take the layers' weights sliced out of their stacks once per call (_split_layers);
        # elsewhere they slice them (a second copy of the weights would cost a TPU or GPU its memory)
        self._split = device.platform == "cpu"
        self._split_fn, self._layer_graphdefs = None, ()
        self._casts: dict = {}
        self.cast_weights = 0  # the weights the last new program pair takes cast once per call (_cast)
        self.version = 0
        self._programs: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.phases: dict = {}

    @property
    def compiled(self) -> int:
        return len(self._programs)

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """ValueError naming what this engine cannot take (engine.check_request's, and neither top logprobs nor routing)."""
        check_request(prompt, params, self.max_len)
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

    def _program(self, key: tuple, fn, donate: tuple):
        """The program `key` (fn jitted at its first use)."""
        with self._lock:
            if key not in self._programs:
                self._programs[key] = jax.jit(fn, donate_argnums=donate)
                log.info("compiling exact sampler program %d: %s %s", len(self._programs), key[0], key[1:])
            return self._programs[key]

    def _generate(self, requests: list, temperature: float) -> list:
        rows = [(i, r, j) for i, r in enumerate(requests) for j in range(r.params.n)]
        p = bucket(max(len(r.prompt) for r in requests), 16)
        new = bucket(max(r.params.max_new_tokens for r in requests), 16)
        slots = -(-(p + new) // exact.BLOCK) * exact.BLOCK
        # on a mesh the prompts and rows split over its batch axes (exact_rows), each device's rows whole tiles
        shards = exact_rows.shards(self.mesh, self.rules)
        b, width = bucket(len(requests), shards), bucket(len(rows), exact.TILE * shards)
        support = any(r.params.return_sampling_mask and r.params.truncates for r in requests)
        tokens_BxP, plen_B = np.zeros((b, p), np.int32), np.ones(b, np.int32)
        for i, r in enumerate(requests):
            tokens_BxP[i, : len(r.prompt)], plen_B[i] = r.prompt, len(r.prompt)
        version, params = self.version, self.params
        state = {k: jnp.asarray(a) for k, a in _initial(rows, width, new).items()}
        cfg = nnx.merge(self.graphdef, params).cfg
        v = cfg.vocab_size
        state["keep"] = jnp.ones((width, new, v) if support else (width, 1, 1), bool)
        layers = self._split_layers(params)
        on = (self.graphdef, self._layer_graphdefs, self.mesh, self.rules, temperature, support)
        keys = (
            ("prefill", b, p, slots, width, new, temperature, support),
            ("decode", width, slots, new, temperature, support),
        )
        fns = (functools.partial(_prefill, *on, slots), functools.partial(_decode, *on))
        prefill, decode = self._program(keys[0], fns[0], (4,)), self._program(keys[1], fns[1], (2, 3))
        args = (jnp.asarray(tokens_BxP), jnp.asarray(plen_B))
        params, layers = self._cast(keys, fns, jnp.dtype(cfg.dtype), params, layers, args, state)
        cache, state = prefill(params, layers, *args, state)
        for t in range(1, new):
            if t % CHECK_EVERY == 0 and bool(jnp.all(state["done"])):
                break
            cache, state = decode(params, layers, cache, state, jnp.int32(t))
        host = jax.tree.map(np.asarray, state)
        return _results(requests, host, version, support)

    def _cast(self, keys: tuple, fns: tuple, dtype, params, layers, args: tuple, state: dict):
        """On a CPU in a 16-bit compute dtype: (params, layers) with the weights that both programs only ever cast to
        it cast once per call (cast_inputs.only_cast, from the programs' jaxprs: the same values go in; each decode
        step cast the fp32 master weights again, the head's [256, 8,192] alone 3.7 ms a step on the benches' model)."""
        if layers is None or dtype.itemsize != 2:
            return params, layers
        if keys not in self._casts:
            n = len(jax.tree.leaves((params, layers)))
            prefill, decode = fns
            pre = cast_inputs.only_cast(jax.make_jaxpr(prefill)(params, layers, *args, state), dtype)[:n]
            cache, after = jax.eval_shape(prefill, params, layers, *args, state)
            t = jax.ShapeDtypeStruct((), jnp.int32)
            dec = cast_inputs.only_cast(jax.make_jaxpr(decode)(params, layers, cache, after, t), dtype)[:n]
            mask = [a and b for a, b in zip(pre, dec)]

            def cast(tree):
                leaves, treedef = jax.tree.flatten(tree)
                return jax.tree.unflatten(treedef, [x.astype(dtype) if m else x for x, m in zip(leaves, mask)])

            self._casts[keys] = jax.jit(cast)
            self.cast_weights = sum(mask)
            log.info("exact sampler: %d of %d weights cast once per call", sum(mask), n)
        return self._casts[keys]((params, layers))

    def _split_layers(self, params):
        """On a CPU, the states of exact.layers(model) (each layer's weights sliced out of its stack: one copy per
        call, where each decode step's program copied them all: a fifth of its time on the benches' fp32 model); else
        None (the programs slice them)."""
        if not self._split:
            return None
        if self._split_fn is None:
            graphdefs = []

            def states(params):
                with exact_rows.trace(self.mesh, self.rules):
                    out = [nnx.split(layer) for layer in exact.layers(nnx.merge(self.graphdef, params))]
                graphdefs[:] = [g for g, _ in out]
                return [st for _, st in out]

            self._split_fn = jax.jit(states)
            jax.eval_shape(self._split_fn, params)
            self._layer_graphdefs = tuple(graphdefs)
        return self._split_fn(params)


def _initial(rows: list, width: int, new: int) -> dict:
    """The decode's starting state of `rows` (prompt index, request, sample index) padded to `width` rows (padding
    rows start done, on prompt 0)."""
    per = dict(
        prompt=np.zeros(width, np.int32),
        plen=np.ones(width, np.int32),
        max_new=np.zeros(width, np.int32),
        top_k=np.zeros(width, np.int32),
        top_p=np.ones(width, np.float32),
        greedy=np.zeros(width, bool),
        stop=np.full((width, STOP_SLOTS), -1, np.int32),
        keys=np.zeros((width, 2), np.uint32),
        done=np.ones(width, bool),
    )
    for row, (i, r, j) in enumerate(rows):
        q = r.params
        per["prompt"][row], per["plen"][row], per["max_new"][row] = i, len(r.prompt), q.max_new_tokens
        per["done"][row] = q.max_new_tokens <= 0
        per["top_k"][row], per["top_p"][row], per["greedy"][row] = q.top_k, q.top_p, q.greedy
        per["stop"][row, : len(q.stop_token_ids)] = sorted(q.stop_token_ids)
        seed = q.seed if q.seed is not None else secrets.randbits(62)
        per["keys"][row] = key_data(sample_seed(seed, r.prompt_id, j))
    return dict(
        per,
        tokens=np.zeros((width, new), np.int32),
        q=np.zeros((width, new), np.float32),
        lengths=np.zeros(width, np.int32),
        stopped=np.zeros(width, bool),
    )


def _prefill(
    graphdef, layer_graphdefs, mesh, rules, temperature, support, slots, params, layers, tokens_BxP, plen_B, state
):
    """The prompts through exact.exact_prefill (each once; on a mesh each device its own prompts), their cache rows
    and next-token logits taken by every sample row of theirs, and every row's first token drawn (each device its
    own rows)."""

    def prefill(w, tokens_BxP, plen_B):
        kw = dict(slots=slots, temperature=temperature, moe_impl=exact.moe_impl(w.model), block=exact.BLOCK)
        return exact.exact_prefill(w.model, tokens_BxP, plen_B, layers_=w.layers, **kw)

    z, lse, cache = exact_rows.apply(
        prefill, graphdef, layer_graphdefs, mesh, rules, params, layers, (tokens_BxP, plen_B)
    )
    rows = state["prompt"]
    cache, z, lse = exact_rows.split_rows(
        (
            [tuple(jnp.take(c, rows, axis=0) for c in arrays) for arrays in cache],
            *(jnp.take(a, rows, axis=0) for a in (z, lse)),
        ),
        mesh,
        rules,
    )
    return cache, exact_rows.apply_rows(lambda st, z, lse: _draw(st, z, lse, 0, support), mesh, rules, (state, z, lse))


def _decode(graphdef, layer_graphdefs, mesh, rules, temperature, support, params, layers, cache, state, t):
    """Decode step t of every row (on a mesh each device its own rows): its token t - 1 fed at position plen + t - 1,
    its token t drawn."""

    def step(w, cache, state, t):
        pos_R = state["plen"] + t - 1
        kw = dict(temperature=temperature, moe_impl=exact.moe_impl(w.model), block=exact.BLOCK, layers_=w.layers)
        z, lse, cache = exact.exact_step(w.model, cache, state["tokens"][:, t - 1], pos_R, **kw)
        return cache, _draw(state, z, lse, t, support)

    return exact_rows.apply(step, graphdef, layer_graphdefs, mesh, rules, params, layers, (cache, state), (t,))


def _draw(state: dict, z_RxV, lse_R, t, support: bool) -> dict:
    """Response token t of every row that still samples, from z (logits / temperature) truncated by its top-k / top-p
    (greedy rows: the argmax), its q = exact.logprob (the trainer's formula and tile), its support kept."""
    lp_RxV, keep, has = sampling_support(z_RxV, state["top_k"], state["top_p"])
    keys_R = jax.vmap(jax.random.fold_in, in_axes=(0, None))(jax.random.wrap_key_data(state["keys"]), t)
    # the plain engine's draw (two Gumbel-max draws of ~sqrt(V) each; greedy rows: the first argmax of z, as the
    # truncation and the temperature-1 log-softmax keep the order)
    tok = draw(keys_R, jnp.where(state["greedy"][:, None], z_RxV, lp_RxV), state["greedy"])
    q = exact.logprob(z_RxV, lse_R, tok, keep, has)
    on = (t < state["max_new"]) & ~state["done"]
    st = dict(state)
    put = lambda a, x: a.at[:, t].set(jnp.where(on.reshape(-1, *[1] * (x.ndim - 1)), x, a[:, t]))  # noqa: E731
    st["tokens"], st["q"] = put(state["tokens"], tok), put(state["q"], q)
    if support:
        st["keep"] = put(state["keep"], keep)
    stop = on & jnp.any(tok[:, None] == state["stop"], axis=-1)
    st["lengths"] = jnp.where(on, t + 1, state["lengths"])
    st["stopped"] = state["stopped"] | stop
    st["done"] = state["done"] | stop | (on & (t + 1 >= state["max_new"]))
    return st


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


def sampling_support(z_TxV, top_k_T, top_p_T):
    """The sampler's truncation of z (already divided by the temperature): (its log-probabilities [T, V] fp32 with
    -inf outside the support, keep [T, V] bool, has [T] bool), with the
    JAX engine's definition (sampling.sampling_logprobs: top-k with ties kept, then top-p); has where a row truncates
    (top_k > 0 or top_p < 1, even where that keeps every token: a truncating row's support always reaches the trainer,
    whose p subtracts its log mass where it has one)."""
    ones_T = jnp.ones(z_TxV.shape[:1], jnp.float32)
    lp_TxV = sampling_logprobs(z_TxV, ones_T, top_k_T, top_p_T, jnp.zeros(z_TxV.shape[:1], bool))
    has_T = (top_k_T > 0) | (top_p_T < 1.0)  # the engine's SamplingParams.truncates: it then sends the support
    return lp_TxV, (lp_TxV > -jnp.inf) | ~has_T[:, None], has_T


def sample(
    model,
    prompts: list,
    max_new: int,
    key,
    *,
    slots: int,
    temperature: float = 1.0,
    top_k=None,
    top_p=None,
    moe_impl: str = "gather",
    block: int | None = None,
):
    """The exact decode's reference loop (the tests'; ExactEngine is the served one): max_new tokens per prompt of the
    CausalLM `model` (rows = prompts; prompts fed one position per step, so
    a row's prompt and response go through the same program). top_k / top_p: per prompt (0 / 1.0: no truncation).
    Returns (tokens [R, max_new], q [R, max_new], keep [R, max_new, V]): q the logprob of each sampled token under the
    distribution it was drawn from (renormalised over its support where the row truncates), by the trainer's formula
    on the same logits row; keep each step's support (all True on rows that do not truncate)."""
    r = len(prompts)
    plen = [len(p) for p in prompts]
    total = max(plen) + max_new
    if total > slots:
        raise ValueError(f"{total} positions > slots={slots}")
    feed = jnp.zeros((r, total), jnp.int32)
    for i, p in enumerate(prompts):
        feed = feed.at[i, : len(p)].set(jnp.asarray(p, jnp.int32))
    plen_R = jnp.asarray(plen, jnp.int32)
    top_k_R = jnp.asarray(top_k if top_k is not None else [0] * r, jnp.int32)
    top_p_R = jnp.asarray(top_p if top_p is not None else [1.0] * r, jnp.float32)
    step = jax.jit(functools.partial(exact.exact_step, temperature=temperature, moe_impl=moe_impl, block=block))

    @jax.jit
    def draw(z, lse, k):
        _, keep, has = sampling_support(z, top_k_R, top_p_R)
        tok = jax.random.categorical(k, jnp.where(keep, z, -jnp.inf), axis=-1).astype(jnp.int32)
        return tok, exact.logprob(z, lse, tok, keep, has), keep

    cache = exact.init_cache(model, r, slots)
    v = model.cfg.vocab_size
    out_tok = jnp.zeros((r, max_new), jnp.int32)
    out_q = jnp.zeros((r, max_new), jnp.float32)
    out_keep = jnp.ones((r, max_new, v), bool)
    ar = jnp.arange(r)
    # row i feeds its prompt then its samples: at step s its position is s; it samples at positions >= plen - 1
    for s in range(total - 1):
        z, lse, cache = step(model, cache, feed[:, s], jnp.full((r,), s, jnp.int32))
        key, sub = jax.random.split(key)
        drawn, qv, keep = draw(z, lse, sub)
        j = s + 1 - plen_R  # the response index this step samples (< 0: still in the prompt)
        sampling = (j >= 0) & (j < max_new)
        feed = feed.at[:, s + 1].set(jnp.where(sampling, drawn, feed[:, s + 1]))
        jj = jnp.clip(j, 0, max_new - 1)
        out_tok = out_tok.at[ar, jj].set(jnp.where(sampling, drawn, out_tok[ar, jj]))
        out_q = out_q.at[ar, jj].set(jnp.where(sampling, qv, out_q[ar, jj]))
        out_keep = out_keep.at[ar, jj].set(jnp.where(sampling[:, None], keep, out_keep[ar, jj]))
    return out_tok, out_q, out_keep


def abstract_programs(graphdef, params, mesh, rules, *, batch: int, prompt_len: int, n: int, new_tokens: int):
    """ExactEngine's two programs of one bucket on abstract inputs, as _generate builds them (temperature 1, no
    support kept), for compiling without running (cisjax plan): ((prefill, its args), (decode step, its args)).
    `batch` prompts of `prompt_len` tokens (buckets), n samples each, `new_tokens` new tokens."""
    slots = -(-(prompt_len + new_tokens) // exact.BLOCK) * exact.BLOCK
    shards = exact_rows.shards(mesh, rules)
    if batch % shards:
        raise ValueError(f"batch={batch} prompts: not a multiple of the mesh's {shards} row shards")
    width = bucket(batch * n, exact.TILE * shards)
    state = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in _initial([], width, new_tokens).items()}
    state["keep"] = jax.ShapeDtypeStruct((width, 1, 1), jnp.bool_)
    on = (graphdef, (), mesh, rules, 1.0, False)  # the layers sliced in the programs (a TPU's or GPU's engine)
    prefill = jax.jit(functools.partial(_prefill, *on, slots), donate_argnums=(4,))
    args = (
        params,
        None,
        jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    cache, state_after = jax.eval_shape(prefill, *args, state)
    decode = jax.jit(functools.partial(_decode, *on), donate_argnums=(2, 3))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return (prefill, (*args, state)), (decode, (params, None, cache, state_after, scalar))
