"""The engine contract of the rollout server: the Backend interface, its records, and the checks a request passes first."""

from __future__ import annotations

import hashlib
import math
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cisjax.rollout.params import SamplingParams

MAX_N = 1024
MAX_NEW_TOKENS = 1 << 16
MAX_TOP_LOGPROBS = 100
MAX_MASK_TOP_K = 1024  # return_sampling_mask of a truncated distribution: top_k bounds the support (ties aside)


class RequestError(ValueError):
    """A request the engine refuses; carries the gRPC status code to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass
class SampleResult:
    """One finished sample, as a backend returns it."""

    sample_index: int
    token_ids: list
    logprobs: list
    finish_reason: str  # "stop" | "length" | "abort"
    versions: list
    top_ids: list | None = None  # [tokens][k]
    top_logprobs: list | None = None
    routing: object = None  # ndarray [tokens, layers, k]: the passes that produced the tokens; or None
    prompt_routing: object = None  # ndarray [prompt positions - 1, layers, k]: the prefill's other positions; or None
    support: tuple | None = None  # return_sampling_mask: (kept ids, a count per token) as rollout.proto SamplingMask
    timing: dict = field(default_factory=dict)


def sample_seed(seed: int, prompt_id: int, sample_index: int) -> int:
    """Per-sample generator seed: independent of batch composition, so a resent prompt samples identically."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Backend:
    """The engine behind the servicer. Implementations: transformers (reference), vllm.

    The servicer calls `submit_generate` / `submit_score` from many threads at once and streams
    each future's result as it completes; `update` (a weight reload) must wait for the work in
    flight and hold back new work until it is done, so that every token of a sample comes from one
    version. This base class gives that by running everything on one worker thread, in order; an
    engine that batches concurrent requests (vllm) overrides the submit/update methods.

    All ids are validated against `vocab_size`/`max_model_len` before a backend sees them.
    Weight updates must be atomic: on failure the old weights and version stay in place."""

    engine = "?"
    model = ""
    dtype = ""
    architecture = ""
    vocab_size = 0
    max_model_len = 0
    version = 0
    supports_routing = False  # can return routed expert ids per token
    routing_unsupported = ""  # why not, when the engine cannot (said in the refusal)
    supports_sampling_mask = False  # can return each token's sampling support (return_sampling_mask)
    sampling_mask_unsupported = "not implemented for this engine"  # why not (said in the refusal)
    config_json: dict = {}  # the model's HF config.json (its expert count sets the width of routing ids)
    phases: dict | None = None  # prefill and decode apart (sampler.engine.PHASE_KEYS) where the engine times them

    # --- what a serial backend implements (called on the one worker thread)
    def generate(self, prompt_ids: list, prompt_id: int, params: SamplingParams):
        """Sample params.n continuations of one prompt; returns a list of SampleResult."""
        raise NotImplementedError

    def score(
        self, prompt_ids: list, response_ids: list, temperature: float, top_k: int, routing: bool = False
    ) -> dict:
        """{"logprobs": [...], "top_ids": [[...]], "top_logprobs": [[...]]} of the response tokens; with `routing`, also
        "routing" (ndarray [R, layers, k], the passes that produced them) and "prompt_routing" ([P - 1, layers, k])."""
        raise NotImplementedError

    def load_directory(self, path: Path, version: int) -> None:
        raise NotImplementedError

    def load_tensors(self, tensors: dict, version: int) -> None:
        """tensors: HF name -> numpy array (the full set of the checkpoint)."""
        raise NotImplementedError

    # --- what the servicer calls
    def submit_generate(self, prompt_ids: list, prompt_id: int, params: SamplingParams) -> futures.Future:
        """Future of the list of SampleResult, each with timing {"started", "finished"} (time.monotonic)."""
        return self._serial().submit(self._timed_generate, prompt_ids, prompt_id, params)

    def submit_score(
        self, prompt_ids: list, response_ids: list, temperature: float, top_k: int, routing: bool
    ) -> futures.Future:
        """Future of score()'s dict plus "version", the weights it was computed with."""
        return self._serial().submit(self._versioned_score, prompt_ids, response_ids, temperature, top_k, routing)

    def update(self, kind: str, source, version: int) -> None:
        """Reload weights ("directory", Path) or ("tensors", dict) as `version`, once the work before it is done."""
        load = self.load_directory if kind == "directory" else self.load_tensors
        self._serial().submit(load, source, version).result()

    def cancel(self, future: futures.Future) -> None:
        """Drop submitted work whose caller went away (best effort)."""
        future.cancel()

    def close(self) -> None:
        pool = self.__dict__.pop("_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _serial(self) -> futures.ThreadPoolExecutor:
        if "_pool" not in self.__dict__:
            self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.engine}-engine")
        return self._pool

    def _timed_generate(self, prompt_ids, prompt_id, params):
        started = time.monotonic()
        samples = self.generate(prompt_ids, prompt_id, params)
        finished = time.monotonic()
        for s in samples:
            s.timing = {"started": started, "finished": finished}
        return samples

    def _versioned_score(self, prompt_ids, response_ids, temperature, top_k, routing):
        return dict(self.score(prompt_ids, response_ids, temperature, top_k, routing), version=self.version)


# ----------------------------------------------------------------------------- request checks


def check_routing(b: Backend) -> None:
    """RequestError (UNIMPLEMENTED, saying why) when the engine cannot return routing."""
    if not b.supports_routing:
        why = f": {b.routing_unsupported}" if b.routing_unsupported else ""
        raise RequestError(f"the {b.engine} backend does not return routing{why}", grpc.StatusCode.UNIMPLEMENTED)


def check_sampling_mask(b: Backend, params: SamplingParams) -> None:
    """RequestError when return_sampling_mask cannot be served: UNIMPLEMENTED by the engine, or a truncated
    distribution whose support top_k does not bound."""
    if not b.supports_sampling_mask:
        raise RequestError(
            f"the {b.engine} backend does not return sampling masks: {b.sampling_mask_unsupported}",
            grpc.StatusCode.UNIMPLEMENTED,
        )
    if params.truncates and not 0 < params.top_k <= MAX_MASK_TOP_K:
        raise RequestError(
            f"return_sampling_mask with top_p={params.top_p:.6g} needs top_k in [1, {MAX_MASK_TOP_K}] to bound each "
            f"token's support (top_p alone may keep the whole vocabulary); got top_k={params.top_k}"
        )


def check_params(p, vocab_size: int) -> SamplingParams:
    """A request's SamplingParams message as the record SamplingParams; RequestError when a field is out of range."""
    if p.n <= 0 or p.n > MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {p.n}")
    if not math.isfinite(p.temperature) or (not p.greedy and p.temperature <= 0):
        raise RequestError(f"temperature must be > 0 (or set greedy), got {p.temperature}")
    top_p = p.top_p or 1.0
    if not (0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise RequestError(f"top_k must be >= 0 (0 = disabled), got {p.top_k}")
    if p.max_new_tokens <= 0 or p.max_new_tokens > MAX_NEW_TOKENS:
        raise RequestError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {p.max_new_tokens}")
    if not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs (top-k to return) must be in [0, {MAX_TOP_LOGPROBS}], got {p.logprobs}")
    bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return SamplingParams(
        n=p.n,
        temperature=float(p.temperature) if not p.greedy else 1.0,
        top_p=float(top_p),
        top_k=int(p.top_k),
        max_new_tokens=int(p.max_new_tokens),
        stop_token_ids=frozenset(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        greedy=bool(p.greedy),
        logprobs=int(p.logprobs),
        return_routing=bool(p.return_routing),
        return_sampling_mask=bool(p.return_sampling_mask),
    )


def check_ids(ids, what: str, vocab_size: int, *, allow_empty: bool = False) -> list:
    ids = list(ids)
    if not ids and not allow_empty:
        raise RequestError(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def check_generate(request, b: Backend) -> tuple[SamplingParams, list[list[int]]]:
    """A GenerateRequest as (SamplingParams, the prompts' token ids); RequestError naming what the engine `b` cannot take."""
    if not request.prompts:
        raise RequestError("no prompts in the request")
    params = check_params(request.params, b.vocab_size)
    if params.return_routing:
        check_routing(b)
    if params.return_sampling_mask:
        check_sampling_mask(b, params)
    prompts = [check_ids(p.token_ids, f"prompt {i}", b.vocab_size) for i, p in enumerate(request.prompts)]
    for i, ids in enumerate(prompts):
        if len(ids) + params.max_new_tokens > b.max_model_len:
            raise RequestError(
                f"prompt {i}: {len(ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the model's context "
                f"length {b.max_model_len}"
            )
    return params, prompts


def check_score(request, b: Backend) -> tuple[float, list[tuple[list[int], list[int]]]]:
    """A ScoreRequest as (temperature, [(prompt ids, response ids)]); RequestError naming what `b` cannot take."""
    if not request.sequences:
        raise RequestError("no sequences in the request")
    temperature = request.temperature or 1.0
    if not math.isfinite(temperature) or temperature <= 0:
        raise RequestError(f"temperature must be > 0, got {request.temperature}")
    if not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}")
    if request.return_routing:
        check_routing(b)
    seqs = []
    for i, s in enumerate(request.sequences):
        p = check_ids(s.prompt_ids, f"sequence {i} prompt_ids", b.vocab_size)
        r = check_ids(s.response_ids, f"sequence {i} response_ids", b.vocab_size, allow_empty=True)
        if len(p) + len(r) > b.max_model_len:
            raise RequestError(
                f"sequence {i}: {len(p) + len(r)} tokens exceed the model's context length {b.max_model_len}"
            )
        seqs.append((p, r))
    return temperature, seqs
