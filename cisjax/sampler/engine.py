"""The JAX sampler's host side: requests padded into a shape bucket, one compiled program per bucket (prefill, expand
to n samples, decode), and the results as the rollout backends return them."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cisjax import sharding
from cisjax.rollout.backend import Params, SampleResult, sample_seed
from cisjax.sampler import programs
from cisjax.sampler.sampling import key_data

STOP_SLOTS = programs.STOP_SLOTS
BUCKET_KEYS = ("batch", "prompt_len", "n", "new_tokens", "top_logprobs", "support")

# Engine.phases: what the engine ran, its prefill and decode programs apart
# (decode_row_steps: rows x steps of each call, summed: a row that has ended still takes its slot until the loop ends)
PHASE_KEYS = (
    "prefill_tokens",
    "prefill_s",
    "decode_tokens",
    "decode_steps",
    "decode_rows",
    "decode_row_steps",
    "decode_s",
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Bucket:
    prefill: object  # jitted (params, tokens_BxP, valid_BxP) -> Prefilled
    decode: object  # jitted (params, cache, Prefilled, Rows) -> (Decoded, cache), the cache donated
    ran: bool = False  # its first call (the compile) is behind it


class Request(NamedTuple):
    prompt: list  # token ids
    prompt_id: int  # mixed into the per-sample seeds (cisjax.rollout.backend.sample_seed)
    params: Params


def bucket(n: int, smallest: int) -> int:
    """The shape a size compiles at: the next power of two, at least `smallest`."""
    size = smallest
    while size < n:
        size *= 2
    return size


class Engine:
    """Generates with a cisjax CausalLM (graphdef + params, e.g. hf_io.load's): a batch of requests (each its own
    sampling parameters; one n) has its size, prompt length and new-token count rounded up to buckets (prompt_bucket,
    new_bucket: the smallest sizes), so a run compiles one program per bucket it meets (`compiled` counts them).
    `params` may be swapped whole between calls (same structure): the compiled programs stay. With a `mesh` (and its
    logical `rules`), the programs lay the activations and the KV cache out as the trainer does (params sharded as
    hf_io.load places them on that mesh) and the batch bucket is a multiple of the batch shards."""

    def __init__(
        self,
        graphdef,
        params,
        *,
        max_len: int,
        prompt_bucket: int = 16,
        new_bucket: int = 16,
        mesh=None,
        rules=None,
    ):
        self.graphdef, self.params = graphdef, params
        self.max_len = max_len
        self.prompt_bucket, self.new_bucket = prompt_bucket, new_bucket
        self.mesh, self.rules = mesh, (sharding.rules_from_config(rules) if mesh is not None else None)
        self.batch_multiple = sharding.axis_multiple(mesh, self.rules, "batch") if mesh is not None else 1
        self._programs: dict[tuple, _Bucket] = {}
        self._lock = threading.Lock()
        self._phases = dict.fromkeys(PHASE_KEYS, 0)
        self._phases.update(prefill_s=0.0, decode_s=0.0)
        self.version = 0

    @property
    def compiled(self) -> int:
        return len(self._programs)

    @property
    def phases(self) -> dict:
        """What the engine has run since it started, its two programs apart (compiles not counted): prompt tokens
        prefilled and their seconds; tokens generated, decode steps, rows and row-steps, and their seconds."""
        with self._lock:
            return dict(self._phases)

    def _program(self, b: int, p: int, n: int, max_new: int, top_n: int, mask_n: int):
        """The bucket's (prefill, decode) programs, jitted (programs.split_fns); the decode takes the prefill's
        cache donated (written in place)."""
        key = (b, p, n, max_new, top_n, mask_n)
        with self._lock:
            if key not in self._programs:
                pre, dec = programs.split_fns(
                    self.graphdef, n=n, max_new=max_new, top_n=top_n, mask_n=mask_n, mesh=self.mesh, rules=self.rules
                )
                self._programs[key] = _Bucket(jax.jit(pre), jax.jit(dec, donate_argnums=1))  # the cache donated
                log.info("compiling sampler program %d: %s", len(self._programs), dict(zip(BUCKET_KEYS, key)))
            return self._programs[key]

    def _run(self, bucket: _Bucket, params, tokens_BxP, valid_BxP, rows: programs.Rows, prompt_tokens: int):
        """(Decoded, the prompt's routing ids) as host arrays, prefill and decode timed apart into `phases` (a
        bucket's first call, which compiles, is not counted)."""
        t0 = time.perf_counter()
        pre = jax.block_until_ready(bucket.prefill(params, tokens_BxP, valid_BxP))
        prompt_routing = None if pre.prompt_ids_XxBxPxK is None else np.asarray(pre.prompt_ids_XxBxPxK)
        t1 = time.perf_counter()
        out, _ = bucket.decode(params, pre.cache, pre._replace(cache=None), rows)
        out = jax.tree.map(np.asarray, out)
        t2 = time.perf_counter()
        with self._lock:
            if bucket.ran:
                ph = self._phases
                ph["prefill_tokens"] += prompt_tokens
                ph["prefill_s"] += t1 - t0
                ph["decode_tokens"] += int(out.lengths_B.sum())
                ph["decode_steps"] += int(out.steps)
                ph["decode_rows"] += int(out.lengths_B.shape[0])
                ph["decode_row_steps"] += int(out.lengths_B.shape[0]) * int(out.steps)
                ph["decode_s"] += t2 - t1
            bucket.ran = True
        return out, prompt_routing

    def check(self, prompt: Sequence[int], params: Params) -> None:
        """ValueError naming what this engine cannot take (the server checks requests first; a library caller may not)."""
        if not prompt:
            raise ValueError("an empty prompt")
        if len(prompt) + params.max_new_tokens > self.max_len:
            raise ValueError(f"prompt + max_new_tokens = {len(prompt) + params.max_new_tokens} > {self.max_len}")
        if len(params.stop_token_ids) > STOP_SLOTS:
            raise ValueError(f"{len(params.stop_token_ids)} stop token ids: at most {STOP_SLOTS}")

    def generate(self, prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int], params: Params):
        """Per prompt, its params.n samples as SampleResults (the logprobs of the distribution sampled from)."""
        return self.generate_many([Request(list(p), i, params) for p, i in zip(prompts, prompt_ids)])

    def generate_many(self, requests: Sequence[Request]):
        """Requests with the same n in one program, each row with its own sampling parameters, stop tokens and
        length: per request, its n samples as SampleResults."""
        ns = {r.params.n for r in requests}
        if len(ns) != 1:
            raise ValueError(f"one n per batch of requests, got {sorted(ns)}")
        for r in requests:
            self.check(r.prompt, r.params)
        n = ns.pop()
        p = bucket(max(len(r.prompt) for r in requests), self.prompt_bucket)
        b = -(-bucket(len(requests), 1) // self.batch_multiple) * self.batch_multiple
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
        out, prompt_routing = self._run(
            self._program(b, p, n, new, top_n, mask_n),
            params_now,
            jnp.asarray(tokens_BxP),
            jnp.asarray(valid_BxP),
            rows,
            sum(len(r.prompt) for r in requests),
        )
        return [self._samples(out, prompt_routing, i * n, n, p, r, version) for i, r in enumerate(requests)]

    @staticmethod
    def _samples(out: programs.Decoded, prompt_routing, first: int, n: int, p: int, r: Request, version: int):
        samples = []
        top = r.params.logprobs
        for j in range(n):
            i = first + j
            m = int(out.lengths_B[i])
            s = SampleResult(
                sample_index=j,
                token_ids=out.tokens_BxN[i, :m].tolist(),
                logprobs=out.logprobs_BxN[i, :m].tolist(),
                finish_reason="stop" if out.stopped_B[i] else "length",
                versions=[version] * m,
                top_ids=out.top_ids_BxNxT[i, :m, :top].tolist() if top else None,
                top_logprobs=out.top_logprobs_BxNxT[i, :m, :top].tolist() if top else None,
            )
            if r.params.return_sampling_mask:
                s.support = Engine._support(out, i, m, r.params)
            if r.params.return_routing and out.routing_BxNxXxK is not None:
                s.routing = out.routing_BxNxXxK[i, :m]
                # [X, B*n, P, k] -> the real prompt's positions but its last: [len - 1, X, k]
                s.prompt_routing = np.moveaxis(prompt_routing[:, i, p - len(r.prompt) : p - 1], 0, 1)
            samples.append(s)
        return samples

    @staticmethod
    def _support(out: programs.Decoded, i: int, m: int, params: Params) -> tuple[list, list]:
        """(kept ids, a count per token) of row i's m tokens: counts of 0 when the distribution was not cut."""
        if not params.truncates:
            return [], [0] * m
        counts = out.support_counts_BxN[i, :m]
        wide = int(counts.max(initial=0))
        if wide > out.support_ids_BxNxS.shape[-1]:  # ties at the k-th value kept more than top_k tokens
            raise ValueError(
                f"a sampling support of {wide} tokens exceeds the top_k={params.top_k} bound (ties at the k-th value)"
            )
        ids = [tok for t in range(m) for tok in out.support_ids_BxNxS[i, t, : counts[t]].tolist()]
        return ids, counts.tolist()
