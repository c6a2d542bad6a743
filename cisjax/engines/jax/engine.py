"""The JAX sampler's host side: requests padded into a shape bucket, their prompts prefilled, their samples through
decode rows that free as samples end (the waiting ones enter them), and the results as the rollout backends return
them."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import sharding
from cisjax.engines.jax import costs, programs
from cisjax.engines.jax.sampling import key_data
from cisjax.rollout.backend import SampleResult, sample_seed
from cisjax.rollout.params import SamplingParams

STOP_SLOTS = programs.STOP_SLOTS
# decode steps per call: between two calls, waiting samples enter the rows that ended, and the decode narrows once
# fewer rows are active (a row that ends mid-call idles until the call's end: at most this many steps)
DECODE_STEPS = 16
MAX_ROWS = 256  # rows decoding at once by default: the samples past them wait for a row that ends
MIN_ROWS = 32  # the decode narrows down to this many rows, not below: a narrower one gains little
# The decode's widths (rows) on a CPU: multiples of this, so that it narrows as rows end (a step's work there grows
# with its rows: measured, a decode step of the bench's model took about 10 ms + 0.5 ms per row). On an accelerator
# a step reads the weights whatever its rows, a narrower one saves only its KV reads, and each width is a long
# compile: powers of two there (the decode halves).
CPU_WIDTH_STEP = 16

# Engine.phases: what the engine ran, its prefill and decode programs apart
# (decode_row_steps: rows x steps of each decode call, summed: a row that has ended or waits takes its slot anyway;
# decode_bytes: what those steps must read from memory, summed: sampler.costs.decode_bytes_per_step of each call's
# rows and slots)
PHASE_KEYS = (
    "prefill_tokens",
    "prefill_s",
    "decode_tokens",
    "decode_steps",
    "decode_rows",
    "decode_row_steps",
    "decode_s",
    "decode_bytes",
)

log = logging.getLogger(__name__)


def check_request(prompt: Sequence[int], params: SamplingParams, max_len: int) -> None:
    """ValueError naming what a JAX sampler cannot take: an empty prompt, one too long for max_len with its new
    tokens, more stop ids than STOP_SLOTS."""
    if not prompt:
        raise ValueError("an empty prompt")
    if len(prompt) + params.max_new_tokens > max_len:
        raise ValueError(f"prompt + max_new_tokens = {len(prompt) + params.max_new_tokens} > {max_len}")
    if len(params.stop_token_ids) > STOP_SLOTS:
        raise ValueError(f"{len(params.stop_token_ids)} stop token ids: at most {STOP_SLOTS}")


class Request(NamedTuple):
    prompt: list  # token ids
    prompt_id: int  # mixed into the per-sample seeds (cisjax.rollout.backend.sample_seed)
    params: SamplingParams


def bucket(n: int, smallest: int) -> int:
    """The shape a size compiles at: the next power of two, at least `smallest`."""
    size = smallest
    while size < n:
        size *= 2
    return size


class Engine:
    """Generates with a cisjax CausalLM (graphdef + params, e.g. hf_io.load's): a batch of requests (each its own
    sampling parameters; one n) has its size, prompt length and new-token count rounded up to buckets (prompt_bucket,
    new_bucket: the smallest sizes). Its prompts are prefilled together; then its samples decode in at most
    `max_rows` rows, each row at its own step, `decode_steps` steps per call: a sample that ends frees its row for the
    next waiting one, and once no sample waits, the decode narrows to the active rows (down to `min_rows`) where that
    saves a width step: `width_step` rows (default CPU_WIDTH_STEP on a CPU; 0: powers of two, the decode halves).
    A run compiles a handful of programs per bucket (`compiled` counts them: prefill, a decode per width, the
    samples' entering and the narrowing).
    `params` may be swapped whole between calls (same structure): the compiled programs stay. With a `mesh` (and its
    resolved logical `rules`, default sharding.DEFAULT_TABLE), the programs lay the activations and the KV cache out as
    the trainer does (params sharded as hf_io.load places them on that mesh) and the row counts are multiples of the
    batch shards."""

    def __init__(
        self,
        graphdef,
        params,
        *,
        max_len: int,
        prompt_bucket: int = 16,
        new_bucket: int = 16,
        max_rows: int = MAX_ROWS,
        min_rows: int = MIN_ROWS,
        width_step: int | None = None,
        decode_steps: int = DECODE_STEPS,
        mesh=None,
        rules: sharding.FrozenRules = sharding.DEFAULT_TABLE,
    ):
        self.graphdef, self.params = graphdef, params
        self.max_len = max_len
        self.prompt_bucket, self.new_bucket = prompt_bucket, new_bucket
        self.mesh, self.rules = mesh, (rules if mesh is not None else None)
        self.batch_multiple = sharding.axis_multiple(mesh, self.rules, "batch") if mesh is not None else 1
        if min(max_rows, min_rows, decode_steps) < 1 or (width_step is not None and width_step < 0):
            raise ValueError(
                f"max_rows={max_rows}, min_rows={min_rows}, decode_steps={decode_steps}, width_step={width_step}: "
                "not positive"
            )
        self.decode_steps = decode_steps
        device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.device_kind = device.device_kind
        if width_step is None:
            width_step = CPU_WIDTH_STEP if device.platform == "cpu" else 0
        self.width_step = math.lcm(width_step, self.batch_multiple) if width_step else 0
        self.max_rows, self.min_rows = self._width(max_rows), self._width(min_rows)
        self._programs: dict[tuple, object] = {}
        self._ran: set[tuple] = set()  # programs whose first call (the compile) is behind them
        self._lock = threading.Lock()
        self._phases = dict.fromkeys(PHASE_KEYS, 0)
        self._phases.update(prefill_s=0.0, decode_s=0.0, decode_bytes=0.0)
        self.version = 0
        # what a decode step reads (costs), from the params' shapes: nothing held of the arrays themselves
        self._abstract = nnx.merge(graphdef, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params))
        self._counts = costs.param_counts(self._abstract)
        largest = max(jax.tree.leaves(params), key=lambda a: a.size)  # an expert stack: the weights' dtype
        self._param_bytes = jnp.dtype(largest.dtype).itemsize
        self._step_bytes: dict[tuple[int, int], float] = {}
        with sharding.use_mesh(mesh, self.rules) if mesh is not None else contextlib.nullcontext():
            # each call attends over the slots its rows can reach (_seen), unless the model's decode attention stops
            # at each row's last written slot itself (the GPU's kernel: every slot, one program per width)
            self._phased = self._abstract.decode_needs_phases()

    @property
    def compiled(self) -> int:
        return len(self._programs)

    @property
    def phases(self) -> dict:
        """What the engine has run since it started, its two programs apart (compiles not counted): prompt tokens
        prefilled and their seconds; tokens generated, decode steps, samples decoded, row-steps (rows x steps of each
        decode call) and their seconds (the samples' entering and the narrowing included)."""
        with self._lock:
            return dict(self._phases)

    def step_bytes(self, rows: int, slots: int) -> float:
        """The bytes one decode step of `rows` rows over `slots` cache slots must read (costs.decode_bytes_per_step:
        the weights they touch, at the params' dtype, and their KV cache)."""
        if (rows, slots) not in self._step_bytes:
            step = costs.step_of(self._abstract, self._counts, rows, slots, self._param_bytes)
            self._step_bytes[rows, slots] = step["bytes"]
        return self._step_bytes[rows, slots]

    def _width(self, rows: int) -> int:
        """The decode width (rows) that holds `rows`: a multiple of width_step above it, else (and with no step) a
        power of two; a multiple of the batch shards either way."""
        if self.width_step and rows > self.width_step:
            return -(-rows // self.width_step) * self.width_step
        return self._shards(bucket(rows, 1))

    def _shards(self, rows: int) -> int:
        """`rows` rounded up to a multiple of the batch shards."""
        return -(-rows // self.batch_multiple) * self.batch_multiple

    def _narrowed(self, width: int, active: int) -> int:
        """The width a decode of `width` rows, `active` of them active and no sample waiting, goes on at: the width
        of the active rows (at least min_rows) when that is narrower by a width step (or half, for powers of two)."""
        to = max(self._width(active), self.min_rows)
        return to if to <= width - (self.width_step or width // 2) else width

    def _jit(self, key: tuple, make):
        """The program `key` (jitted by make() at its first use)."""
        with self._lock:
            if key not in self._programs:
                self._programs[key] = make()
                log.info("compiling sampler program %d: %s %s", len(self._programs), key[0], key[1:])
            return self._programs[key]

    def _prefill(self, b: int, p: int):
        return self._jit(
            ("prefill", b, p), lambda: jax.jit(programs.traced(self.graphdef, programs.prefill, *self._on))
        )

    @property
    def _on(self) -> tuple:
        return self.mesh, self.rules

    def _empty(self, r: int, q: int, b: int, p: int, new: int, top_n: int, mask_n: int):
        def make():
            fn = lambda model, prompts: programs.empty(  # noqa: E731
                model, prompts, slots=r, samples=q, max_new=new, top_n=top_n, mask_n=mask_n
            )
            return jax.jit(programs.traced(self.graphdef, fn, *self._on))

        return self._jit(("empty", r, q, b, p, new, top_n, mask_n), make)

    def _enter(self, r: int, q: int, b: int, p: int, new: int):
        make = lambda: jax.jit(programs.traced(self.graphdef, programs.enter, *self._on), donate_argnums=1)  # noqa: E731
        return self._jit(("enter", r, q, b, p, new), make)

    def _decode(self, r: int, q: int, p: int, new: int, top_n: int, mask_n: int, seen: int):
        def make():
            fn = functools.partial(programs.decode, steps=min(self.decode_steps, new), seen=seen)
            return jax.jit(programs.traced(self.graphdef, fn, *self._on), donate_argnums=(1, 2))

        return self._jit(("decode", r, q, p, new, top_n, mask_n, seen), make)

    def _seen(self, p: int, new: int, reach: int) -> int:
        """The slots a decode call attends over when its rows may reach step `reach` (exclusive): P and the first
        of programs.phase_ends(new) at or past it (a handful of decode programs per width); all P + new where the
        model's decode attention needs no bound (CausalLM.decode_needs_phases)."""
        if not self._phased:
            return p + new
        return p + next(e for e in programs.phase_ends(new) if e >= min(reach, new))

    def _keep(self, r: int, to: int, p: int, new: int):
        return self._jit(("narrow", r, to, p, new), lambda: jax.jit(programs.keep))

    def _run(self, params, tokens_BxP, valid_BxP, rows: programs.Rows, samples: list, prompt_tokens: int, **bucket_of):
        """The requests' samples (`samples`: their indices, sample i * n + j being prompt i's j-th; the others are
        padding) through the programs -> (Decoded, the prompts' routing ids) as host arrays, prefill and decode timed
        apart into `phases` (a call that compiles a program is not counted)."""
        n, new, top_n, mask_n = (bucket_of[k] for k in ("n", "new", "top_n", "mask_n"))
        b, p = tokens_BxP.shape
        q = b * n
        used = [("prefill", b, p)]
        t0 = time.perf_counter()
        prompts = jax.block_until_ready(self._prefill(b, p)(params, tokens_BxP, valid_BxP))
        t1 = time.perf_counter()
        prompt_routing = None if prompts.prompt_ids_XxKxBxP is None else np.asarray(prompts.prompt_ids_XxKxBxP)
        r = min(self._width(len(samples)), self.max_rows)
        used.append(("empty", r, q, b, p, new, top_n, mask_n))
        slots, out = self._empty(r, q, b, p, new, top_n, mask_n)(params, prompts)
        waiting = collections.deque(samples)
        active_R = np.zeros(r, bool)
        t_R = np.zeros(r, np.int64)  # an active row's step (each active row has been since it entered)
        steps = row_steps = 0
        read = 0.0  # bytes the decode steps must read
        t2 = time.perf_counter()
        while True:
            free_R = np.flatnonzero(~active_R)[: len(waiting)]
            if len(free_R):  # waiting samples into the free rows
                sample_R = np.full(r, q, np.int32)
                sample_R[free_R] = [waiting.popleft() for _ in free_R]
                prompt_R = np.where(sample_R < q, sample_R // n, -1).astype(np.int32)
                used.append(("enter", r, q, b, p, new))
                enter = self._enter(r, q, b, p, new)
                slots = enter(params, slots, prompts, rows, jnp.asarray(prompt_R), jnp.asarray(sample_R))
                active_R[free_R] = True
                t_R[free_R] = 0
            if not active_R.any():
                break
            to = r if waiting else self._narrowed(r, int(active_R.sum()))
            if to < r:  # the active rows into fewer
                kept = np.concatenate([np.flatnonzero(active_R), np.flatnonzero(~active_R)])[:to]
                used.append(("narrow", r, to, p, new))
                slots = self._keep(r, to, p, new)(slots, jnp.asarray(kept.astype(np.int32)))
                r, active_R, t_R = to, active_R[kept], t_R[kept]
            seen = self._seen(p, new, int(t_R[active_R].max()) + min(self.decode_steps, new))
            used.append(("decode", r, q, p, new, top_n, mask_n, seen))
            slots, out, ran = self._decode(r, q, p, new, top_n, mask_n, seen)(params, slots, out, rows)
            t_R[active_R] += int(ran)
            active_R = np.array(slots.active_R)  # synchronises (a copy: written here)
            steps += int(ran)
            row_steps += r * int(ran)
            read += int(ran) * self.step_bytes(r, seen)
        out = jax.tree.map(np.asarray, out)
        t3 = time.perf_counter()
        with self._lock:
            if self._ran.issuperset(used):  # a call that compiled is not counted
                ph = self._phases
                ph["prefill_tokens"] += prompt_tokens
                ph["prefill_s"] += t1 - t0
                ph["decode_tokens"] += int(out.lengths_B.sum())
                ph["decode_steps"] += steps
                ph["decode_rows"] += len(samples)
                ph["decode_row_steps"] += row_steps
                ph["decode_s"] += t3 - t2
                ph["decode_bytes"] += read
            self._ran.update(used)
        return out, prompt_routing

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """ValueError naming what this engine cannot take (the server checks requests first; a library caller may not)."""
        check_request(prompt, params, self.max_len)

    def generate(self, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int], params: SamplingParams):
        """Per prompt, its params.n samples as SampleResults (the logprobs of the distribution sampled from)."""
        return self.generate_many([Request(list(p), i, params) for p, i in zip(prompts, prompt_ids)])

    def generate_many(self, requests: Sequence[Request]):
        """Requests with the same n in one bucket, each sample with its own sampling parameters, stop tokens and
        length: per request, its n samples as SampleResults."""
        ns = {r.params.n for r in requests}
        if len(ns) != 1:
            raise ValueError(f"one n per batch of requests, got {sorted(ns)}")
        for r in requests:
            self.check(r.prompt, r.params)
        n = ns.pop()
        p = bucket(max(len(r.prompt) for r in requests), self.prompt_bucket)
        b = self._shards(bucket(len(requests), 1))
        new = bucket(max(r.params.max_new_tokens for r in requests), self.new_bucket)
        top_n = max(r.params.logprobs for r in requests)
        # return_sampling_mask of a truncated request: its support lies in the top_k best ids (ties aside)
        mask_n = max(
            (r.params.top_k for r in requests if r.params.return_sampling_mask and r.params.truncates), default=0
        )
        tokens_BxP = np.zeros((b, p), np.int32)
        valid_BxP = np.zeros((b, p), bool)
        per_row = dict(
            prompt_len_B=np.zeros(b, np.int32),
            temperature_B=np.ones(b, np.float32),
            top_k_B=np.zeros(b, np.int32),
            top_p_B=np.ones(b, np.float32),
            greedy_B=np.ones(b, bool),
            max_new_B=np.zeros(b, np.int32),  # padding rows produce nothing
            stop_ids_BxT=np.full((b, STOP_SLOTS), -1, np.int32),
        )
        keys = np.zeros((b * n, 2), np.uint32)
        for i, r in enumerate(requests):
            q = r.params
            tokens_BxP[i, p - len(r.prompt) :] = r.prompt
            valid_BxP[i, p - len(r.prompt) :] = True
            per_row["prompt_len_B"][i] = len(r.prompt)
            per_row["temperature_B"][i] = max(q.temperature, 1e-6)
            per_row["top_k_B"][i], per_row["top_p_B"][i], per_row["greedy_B"][i] = q.top_k, q.top_p, q.greedy
            per_row["max_new_B"][i] = q.max_new_tokens
            stops = sorted(q.stop_token_ids)
            per_row["stop_ids_BxT"][i, : len(stops)] = stops
            seed = q.seed if q.seed is not None else secrets.randbits(62)
            for j in range(n):
                keys[i * n + j] = key_data(sample_seed(seed, r.prompt_id, j))
        rows = programs.Rows(
            **{k: jnp.asarray(np.repeat(v, n, axis=0)) for k, v in per_row.items()}, key_data_Bx2=jnp.asarray(keys)
        )
        version = self.version
        params_now = self.params
        samples = [i * n + j for i in range(len(requests)) for j in range(n)]
        out, prompt_routing = self._run(
            params_now,
            jnp.asarray(tokens_BxP),
            jnp.asarray(valid_BxP),
            rows,
            samples,
            sum(len(r.prompt) for r in requests),
            n=n,
            new=new,
            top_n=top_n,
            mask_n=mask_n,
        )
        return [self._samples(out, prompt_routing, i, n, p, r, version) for i, r in enumerate(requests)]

    @staticmethod
    def _samples(out: programs.Decoded, prompt_routing, prompt: int, n: int, p: int, r: Request, version: int):
        samples = []
        top = r.params.logprobs
        for j in range(n):
            i = prompt * n + j
            m = int(out.lengths_B[i])
            s = SampleResult(
                sample_index=j,
                token_ids=out.tokens_BxN[i, :m].tolist(),
                logprobs=out.logprobs_BxN[i, :m].tolist(),
                finish_reason="stop" if out.stopped_B[i] else "length",
                versions=[version] * m,
                top_ids=out.top_ids_BxTxN[i, :top, :m].T.tolist() if top else None,
                top_logprobs=out.top_logprobs_BxTxN[i, :top, :m].T.tolist() if top else None,
            )
            if r.params.return_sampling_mask:
                s.support = Engine._support(out, i, m, r.params)
            if r.params.return_routing and out.routing_XxKxBxN is not None:
                s.routing = np.moveaxis(out.routing_XxKxBxN[:, :, i, :m], 2, 0)  # [m, X, k]
                # [X, k, B, P] -> the real prompt's positions but its last: [len - 1, X, k]
                s.prompt_routing = np.moveaxis(prompt_routing[:, :, prompt, p - len(r.prompt) : p - 1], 2, 0)
            samples.append(s)
        return samples

    @staticmethod
    def _support(out: programs.Decoded, i: int, m: int, params: SamplingParams) -> tuple[list, list]:
        """(kept ids, a count per token) of sample i's m tokens: counts of 0 when the distribution was not cut."""
        if not params.truncates:
            return [], [0] * m
        counts = out.support_counts_BxN[i, :m]
        wide = int(counts.max(initial=0))
        if wide > out.support_ids_BxSxN.shape[1]:  # ties at the k-th value kept more than top_k tokens
            raise ValueError(
                f"a sampling support of {wide} tokens exceeds the top_k={params.top_k} bound (ties at the k-th value)"
            )
        ids = [tok for t in range(m) for tok in out.support_ids_BxSxN[i, : counts[t], t].tolist()]
        return ids, counts.tolist()
