"""`cisjax serve`: the rollout gRPC server (validation, auth, health, shutdown) over a pluggable engine Backend."""

from __future__ import annotations

import argparse
import hmac
import logging
import math
import os
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from cisjax import console, errors
from cisjax.rollout import manifest as manifest_lib
from cisjax.rollout import protos

log = logging.getLogger("cisjax.serve")

LOCALHOST = {"127.0.0.1", "localhost", "::1", "[::1]"}
MAX_N = 1024
MAX_NEW_TOKENS = 1 << 16
MAX_TOP_LOGPROBS = 100
DEVICES = ("auto", "cpu", "cuda", "tpu")
BACKENDS = {  # name -> module defining Backend, imported only when chosen (the server runs without vllm installed)
    "transformers": "cisjax.rollout.transformers_backend",
    "vllm": "cisjax.rollout.vllm_backend",
}


class RequestError(ValueError):
    """A request the engine refuses; carries the gRPC status code to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass
class Params:
    """Validated sampling parameters (engine-neutral)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: frozenset
    seed: int | None
    greedy: bool
    logprobs: int
    return_routing: bool


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
    timing: dict = field(default_factory=dict)


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
    config_json: dict = {}  # the model's HF config.json (its expert count sets the width of routing ids)

    # --- what a serial backend implements (called on the one worker thread)
    def generate(self, prompt_ids: list, prompt_id: int, params: Params):
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
    def submit_generate(self, prompt_ids: list, prompt_id: int, params: Params) -> futures.Future:
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


# ----------------------------------------------------------------------------- validation


def _no_routing(b: Backend) -> str:
    return f"the {b.engine} backend does not return routing" + (
        f": {b.routing_unsupported}" if b.routing_unsupported else ""
    )


def check_params(p, vocab_size: int) -> Params:
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
    return Params(
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
    )


def check_ids(ids, what: str, vocab_size: int, *, allow_empty: bool = False) -> list:
    ids = list(ids)
    if not ids and not allow_empty:
        raise RequestError(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def confined(path: str, export_root: Path | None) -> Path:
    """The resolved `path` if it lies under `export_root` (symlinks resolved), else a RequestError."""
    if export_root is None:
        raise RequestError(
            "this server was started without --export-root: weight updates from a directory are disabled",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    if not path:
        raise RequestError("weights directory path is empty")
    real = Path(os.path.realpath(export_root / path if not os.path.isabs(path) else path))
    if real != export_root and export_root not in real.parents:
        raise RequestError(
            f"weights path {path!r} is outside the server's export root", grpc.StatusCode.PERMISSION_DENIED
        )
    if not real.is_dir():
        raise RequestError(f"weights path {path!r} is not a directory", grpc.StatusCode.NOT_FOUND)
    return real


def check_export(root: Path) -> None:
    """Refuse what is not a complete export: a writer's temp directory (`.tmp-*`, in progress or
    abandoned by a killed writer) and a directory whose manifest.json disagrees with its files (by
    size here; every byte when the caller sends checksums). A plain HF directory without a manifest
    is accepted."""
    if root.name.startswith(".tmp-"):
        raise RequestError(
            f"{root.name} is an export being written (or abandoned by a killed writer), not a complete export",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    try:
        manifest_lib.check_sizes(root)
    except manifest_lib.ManifestError as err:
        raise RequestError(str(err), grpc.StatusCode.DATA_LOSS) from None


def check_manifest(root: Path, sha256: dict) -> None:
    """Every file `sha256` names (file name -> hex digest, as the client sends them) lies in `root` and has that digest."""
    for name, digest in sha256.items():
        f = Path(os.path.realpath(root / name))
        if root not in f.parents:
            raise RequestError(f"checksum manifest names {name!r}, outside the weights directory")
        if not f.is_file():
            raise RequestError(f"checksum manifest names {name!r}, which is missing", grpc.StatusCode.NOT_FOUND)
        if manifest_lib.sha256_file(f)[0] != digest.lower():
            raise RequestError(
                f"checksum mismatch for {name!r}: the export is incomplete or corrupt", grpc.StatusCode.DATA_LOSS
            )


# ----------------------------------------------------------------------------- routing

# Config keys of the routed expert count: Qwen2/3-MoE, DeepSeek-V2/V3, Mixtral.
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def routing_id_bytes(config_json: dict) -> int:
    """Bytes per expert id in a Routing message: 1 when the model has <= 256 routed experts, else 2. From the config,
    not from the ids, so that every message of a server has one width (2 when the config names no count)."""
    for cfg in (config_json, config_json.get("text_config") or {}):
        for key in _EXPERT_COUNT_KEYS:
            if cfg.get(key):
                return 1 if int(cfg[key]) <= 256 else 2
    return 2


def encode_routing(pb, prompt_rows, response_rows, id_bytes: int):
    """A Routing message of a sequence's prompt rows [P - 1, layers, k] then response rows [R, layers, k]."""
    ids = np.concatenate([np.asarray(prompt_rows), np.asarray(response_rows)])
    if ids.ndim != 3:
        raise ValueError(f"routing of shape {ids.shape}, expected [positions, layers, k]")
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << (8 * id_bytes)):
        raise ValueError(f"routed expert ids in [{ids.min()}, {ids.max()}] do not fit {id_bytes}-byte ids")
    return pb.Routing(
        num_layers=ids.shape[1],
        k=ids.shape[2],
        expert_ids=ids.astype(f"<u{id_bytes}").tobytes(),
        id_bytes=id_bytes,
        prompt_positions=len(prompt_rows),
    )


# ----------------------------------------------------------------------------- servicer


_FINISH = {"stop": 1, "length": 2, "abort": 3}
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def check_same_model(path: Path, config_json: dict) -> None:
    """RequestError unless `path` holds an HF config of the served model's architecture and shape."""
    import json

    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise RequestError(
            f"{path.name}: no config.json (expected an HF directory written by cisjax export)",
            grpc.StatusCode.NOT_FOUND,
        )
    new_cfg = json.loads(cfg_path.read_text())
    for key in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
        if new_cfg.get(key) != config_json.get(key):
            raise RequestError(
                f"{path.name}: config.json {key}={new_cfg.get(key)!r} differs from the served model's {config_json.get(key)!r}"
            )


def checkpoint_tensor_names(folder) -> set:
    """Names of the tensors in a directory's *.safetensors files."""
    from safetensors import safe_open

    names = set()
    for fn in Path(folder).glob("*.safetensors"):
        with safe_open(str(fn), "np") as f:
            names.update(f.keys())
    return names


def write_weights_dir(tensors: dict, config_json: dict, served_model_dir) -> Path:
    """Streamed tensors (name -> ndarray) as a temporary HF directory (config.json + one safetensors
    file) that a backend can reload from; the caller owns (and removes) it. RequestError if the
    stream lacks tensors of the served checkpoint."""
    import json
    import shutil
    import tempfile

    import numpy as np
    import safetensors.torch
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="cisjax-weights-"))
    try:
        (tmp / "config.json").write_text(json.dumps(config_json))
        as_torch = {}
        for name, arr in tensors.items():
            if arr.dtype.name == "bfloat16":  # torch has no numpy bfloat16: go through the bits
                as_torch[name] = torch.from_numpy(arr.view(np.uint16).copy()).view(torch.bfloat16)
            else:
                as_torch[name] = torch.from_numpy(np.ascontiguousarray(arr).copy())
        safetensors.torch.save_file(as_torch, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        missing = sorted(checkpoint_tensor_names(served_model_dir) - checkpoint_tensor_names(tmp))
        if missing:
            raise RequestError(f"tensor stream lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
        return tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _abort(context, err: RequestError):
    context.abort(err.code, str(err))


class RolloutServicer:
    def __init__(self, backend: Backend, export_root: Path | None):
        self.pb = protos.load().rollout_pb2
        self.backend = backend
        self.export_root = Path(os.path.realpath(export_root)) if export_root else None
        self.update_lock = threading.Lock()  # one weight update at a time (version check + reload)
        self.id_bytes = routing_id_bytes(backend.config_json)

    # Generate ---------------------------------------------------------------
    def Generate(self, request, context):
        arrived = time.monotonic()
        b = self.backend
        try:
            if not request.prompts:
                raise RequestError("no prompts in the request")
            params = check_params(request.params, b.vocab_size)
            if params.return_routing and not b.supports_routing:
                raise RequestError(_no_routing(b), grpc.StatusCode.UNIMPLEMENTED)
            prompts = [check_ids(p.token_ids, f"prompt {i}", b.vocab_size) for i, p in enumerate(request.prompts)]
            for i, ids in enumerate(prompts):
                if len(ids) + params.max_new_tokens > b.max_model_len:
                    raise RequestError(
                        f"prompt {i}: {len(ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the model's context length {b.max_model_len}"
                    )
        except RequestError as err:
            _abort(context, err)
        # every prompt goes to the engine at once (it batches them with other calls' work); samples
        # stream back as each prompt finishes
        pending = {
            b.submit_generate(ids, prompt.id, params): (i, prompt.id)
            for i, (ids, prompt) in enumerate(zip(prompts, request.prompts))
        }
        for fut, (i, prompt_id) in _as_completed(pending, context, b):
            samples = _result(context, "generate", fut)
            for s in samples:
                out = self.pb.Sample(
                    prompt_index=i,
                    prompt_id=prompt_id,
                    sample_index=s.sample_index,
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    finish_reason=_FINISH[s.finish_reason],
                    versions=s.versions,
                    timing=self.pb.Timing(
                        queue_s=max(0.0, s.timing["started"] - arrived),
                        generate_s=s.timing["finished"] - s.timing["started"],
                    ),
                )
                if s.top_ids is not None:
                    out.top_logprobs.extend(
                        self.pb.TopLogprobs(token_ids=a, logprobs=b_) for a, b_ in zip(s.top_ids, s.top_logprobs)
                    )
                if s.routing is not None:
                    out.routing.CopyFrom(self._routing(context, s.prompt_routing, s.routing))
                yield self.pb.GenerateResponse(sample=out)

    def _routing(self, context, prompt_rows, response_rows):
        try:
            return encode_routing(self.pb, prompt_rows, response_rows, self.id_bytes)
        except ValueError as err:  # an engine's capture gone wrong: this call fails, not the server
            context.abort(grpc.StatusCode.INTERNAL, f"engine routing: {err}")

    # Score ------------------------------------------------------------------
    def Score(self, request, context):
        b = self.backend
        try:
            if not request.sequences:
                raise RequestError("no sequences in the request")
            temperature = request.temperature or 1.0
            if not math.isfinite(temperature) or temperature <= 0:
                raise RequestError(f"temperature must be > 0, got {request.temperature}")
            if not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}")
            if request.return_routing and not b.supports_routing:
                raise RequestError(_no_routing(b), grpc.StatusCode.UNIMPLEMENTED)
            seqs = []
            for i, s in enumerate(request.sequences):
                p = check_ids(s.prompt_ids, f"sequence {i} prompt_ids", b.vocab_size)
                r = check_ids(s.response_ids, f"sequence {i} response_ids", b.vocab_size, allow_empty=True)
                if len(p) + len(r) > b.max_model_len:
                    raise RequestError(
                        f"sequence {i}: {len(p) + len(r)} tokens exceed the model's context length {b.max_model_len}"
                    )
                seqs.append((p, r))
        except RequestError as err:
            _abort(context, err)
        pending = {
            b.submit_score(p, r, temperature, request.logprobs, request.return_routing): i
            for i, (p, r) in enumerate(seqs)
        }
        for fut, i in _as_completed(pending, context, b):
            res = _result(context, "score", fut)
            out = self.pb.ScoreResponse(index=i, logprobs=res["logprobs"], version=res["version"])
            if request.logprobs:
                out.top_logprobs.extend(
                    self.pb.TopLogprobs(token_ids=a, logprobs=c) for a, c in zip(res["top_ids"], res["top_logprobs"])
                )
            if request.return_routing:
                out.routing.CopyFrom(self._routing(context, res["prompt_routing"], res["routing"]))
            yield out

    # UpdateWeights ----------------------------------------------------------
    def UpdateWeights(self, request_iterator, context):
        import numpy as np

        t0 = time.monotonic()
        try:
            first = next(request_iterator, None)
            if first is None:
                raise RequestError("empty UpdateWeights stream")
            version = first.version
            kind = first.WhichOneof("source")
            if kind == "directory":
                if next(request_iterator, None) is not None:
                    raise RequestError("an UpdateWeights from a directory is a single message")
                path = confined(first.directory.path, self.export_root)
                check_export(path)
                check_manifest(path, dict(first.directory.sha256))
                source = ("directory", path)
            elif kind == "chunk":
                buffers: dict = {}
                for msg in _chain(first, request_iterator):
                    if msg.WhichOneof("source") != "chunk":
                        raise RequestError("a tensor stream must contain only chunks")
                    c = msg.chunk
                    if c.name not in buffers:
                        if c.dtype not in _ST_DTYPES:
                            raise RequestError(f"tensor {c.name!r}: dtype {c.dtype!r} not one of {sorted(_ST_DTYPES)}")
                        nbytes = int(np.prod(c.shape, dtype=np.int64)) * np.dtype(_np_dtype(c.dtype)).itemsize
                        buffers[c.name] = (c.dtype, tuple(c.shape), bytearray(nbytes), [0])
                    dtype, shape, buf, filled = buffers[c.name]
                    if c.offset < 0 or c.offset + len(c.data) > len(buf):
                        raise RequestError(
                            f"tensor {c.name!r}: chunk [{c.offset}, {c.offset + len(c.data)}) outside its {len(buf)} bytes"
                        )
                    buf[c.offset : c.offset + len(c.data)] = c.data
                    filled[0] += len(c.data)
                tensors = {}
                for name, (dtype, shape, buf, filled) in buffers.items():
                    if filled[0] != len(buf):
                        raise RequestError(f"tensor {name!r}: received {filled[0]} of {len(buf)} bytes")
                    tensors[name] = np.frombuffer(bytes(buf), dtype=_np_dtype(dtype)).reshape(shape)
                source = ("tensors", tensors)
            else:
                raise RequestError("UpdateWeights needs a directory or tensor chunks")
            with self.update_lock:
                current = self.backend.version
                new = version or current + 1
                if new <= current:
                    raise RequestError(
                        f"version {new} is not above the current version {current}", grpc.StatusCode.FAILED_PRECONDITION
                    )
                try:
                    self.backend.update(source[0], source[1], new)
                except RequestError:
                    raise
                except Exception as err:  # the backend keeps its old weights
                    log.exception("weight reload failed")
                    raise RequestError(
                        f"reload failed, still serving version {current}: {type(err).__name__}: {err}",
                        grpc.StatusCode.FAILED_PRECONDITION,
                    ) from err
                log.info("weights version %d -> %d", current, self.backend.version)
        except RequestError as err:
            _abort(context, err)
        return self.pb.UpdateWeightsResponse(version=self.backend.version, reload_s=time.monotonic() - t0)

    def Info(self, request, context):
        b = self.backend
        return self.pb.InfoResponse(
            engine=b.engine,
            model=b.model,
            dtype=b.dtype,
            version=b.version,
            architecture=b.architecture,
            vocab_size=b.vocab_size,
            max_model_len=b.max_model_len,
        )


def _as_completed(pending: dict, context, backend: Backend):
    """(future, tag) pairs of `pending` as they complete; when the caller goes away (cancel,
    deadline), the rest is cancelled in the backend and the stream ends."""
    waiting = set(pending)
    try:
        while waiting:
            done, waiting = futures.wait(waiting, timeout=0.5, return_when=futures.FIRST_COMPLETED)
            for fut in done:
                yield fut, pending[fut]
            if not context.is_active():
                return
    finally:
        for fut in waiting:
            backend.cancel(fut)


def _result(context, what, fut: futures.Future):
    """A backend future's result; its failure ends this RPC with a clear status, never the server."""
    try:
        return fut.result()
    except RequestError as err:
        _abort(context, err)
    except futures.CancelledError:
        context.abort(grpc.StatusCode.CANCELLED, f"engine {what} was cancelled")
    except Exception as err:
        log.exception("engine %s failed", what)
        context.abort(grpc.StatusCode.INTERNAL, f"engine {what} failed: {type(err).__name__}: {err}")


def _chain(first, rest):
    yield first
    yield from rest


def _np_dtype(st: str):
    if st == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _ST_DTYPES[st]


class HealthServicer:
    """grpc.health.v1.Health: "" and "cisjax.rollout.v1.Rollout" report the server's status."""

    SERVICES = ("", "cisjax.rollout.v1.Rollout")

    def __init__(self):
        self.pb = protos.load().health_pb2
        self.status = self.pb.HealthCheckResponse.SERVING
        self.changed = threading.Condition()

    def set(self, status) -> None:
        with self.changed:
            self.status = status
            self.changed.notify_all()

    def Check(self, request, context):
        if request.service not in self.SERVICES:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return self.pb.HealthCheckResponse(status=self.status)

    def Watch(self, request, context):
        last = None
        while context.is_active():
            status = self.status if request.service in self.SERVICES else self.pb.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield self.pb.HealthCheckResponse(status=status)
                last = status
            with self.changed:
                self.changed.wait(timeout=1.0)


class TokenAuth(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health checks."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>' metadata")

        self.deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self.deny_stream = grpc.unary_stream_rpc_method_handler(deny)
        self.deny_client_stream = grpc.stream_unary_rpc_method_handler(lambda it, ctx: deny(None, ctx))

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self.expected):
            return continuation(details)
        if details.method.endswith("/Generate") or details.method.endswith("/Score"):
            return self.deny_stream
        if details.method.endswith("/UpdateWeights"):
            return self.deny_client_stream
        return self.deny_unary


# ----------------------------------------------------------------------------- server


def build_server(
    backend: Backend, *, host: str, port: int, token: str | None, export_root: str | None, workers: int = 64
):
    """(grpc server started on host:port, health servicer, bound port)."""
    if host not in LOCALHOST and not token:
        raise errors.UserError(f"refusing to bind {host}: binding a non-localhost address requires --token")
    pb = protos.load()
    interceptors = [TokenAuth(token)] if token else []
    # each call in flight holds a thread while its work sits in the engine's batch: `workers` bounds
    # the calls served at once (more wait in gRPC's queue)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors)
    pb.rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(backend, export_root), server)
    health = HealthServicer()
    pb.health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as err:
        raise errors.UserError(f"cannot bind {address}: {err}") from None
    if not bound:
        raise errors.UserError(f"cannot bind {address} (port in use?)")
    server.start()
    return server, health, bound


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="transformers",
        help="inference engine (default transformers, the torch reference)",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0 = any free port, printed)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; anything else requires --token)"
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="engine dtype (default bfloat16)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("CISJAX_ROLLOUT_TOKEN"),
        help="require 'authorization: Bearer TOKEN' (default $CISJAX_ROLLOUT_TOKEN)",
    )
    p.add_argument(
        "--export-root",
        default=None,
        help="UpdateWeights may only load directories under this one (unset: directory updates disabled)",
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get to finish on SIGTERM/SIGINT")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (as on SIGTERM) when the process that started this one exits, even SIGKILLed: what "
        "`cisjax train` asks of its embedded server, which runs in its own session",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="vllm: context length (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="vllm: GPUs the engine shards the model over (default 1)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.0,
        help="vllm on GPU: fraction of GPU memory for weights + KV cache (default: vLLM's)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="vllm: the platform the engine must run on: cpu (vLLM's CPU build), cuda, tpu (vllm-tpu, the tpu-inference "
        "backend; untested); auto = what vLLM detects (default auto)",
    )
    p.add_argument(
        "--cpus",
        default="",
        help="hold the server (engine threads included) to these cores, e.g. 0-3 or 0,2 (default: unrestricted); "
        "`cisjax train` pins its embedded replicas this way (rollout.replica_cpus)",
    )


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    import importlib

    console.setup()
    if overrides:
        raise errors.UserError(f"cisjax serve takes no --config overrides: {overrides}")
    if args.host not in LOCALHOST and not args.token:
        raise errors.UserError(f"refusing to bind {args.host}: binding a non-localhost address requires --token")
    if args.export_root and not Path(args.export_root).is_dir():
        raise errors.MissingInput(f"--export-root {args.export_root} is not a directory")
    if args.cpus:  # before the engine's libraries start their thread pools
        from cisjax.rollout import placement

        placement.pin(placement.parse_ids(args.cpus, "--cpus"))
        log.info("pinned to cores %s", args.cpus)
    options = {}
    if args.backend == "vllm":
        options = dict(
            max_model_len=args.max_model_len or None,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization or None,
            device=args.device,
        )
        if args.device == "cpu":  # vLLM picks its platform when imported
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    elif args.tensor_parallel_size != 1 or args.gpu_memory_utilization or args.max_model_len or args.device != "auto":
        raise errors.UserError(
            "--max-model-len, --tensor-parallel-size, --gpu-memory-utilization and --device are vllm options"
        )
    backend = importlib.import_module(BACKENDS[args.backend]).Backend(args.model, dtype=args.dtype, **options)
    server, health, port = build_server(
        backend, host=args.host, port=args.port, token=args.token, export_root=args.export_root
    )
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: draining (grace %.0fs)", signum, args.grace)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.exit_with_parent:
        parent = os.getppid()

        def watch_parent():
            # an exiting process's children are re-parented at once (before it is reaped): a new ppid means it is gone
            while not stop.wait(1.0):
                if os.getppid() != parent:
                    log.warning("parent process %d exited: stopping", parent)
                    stop.set()

        threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    print(
        f"cisjax serve: {backend.engine} engine, {args.model} ({args.dtype}), listening on {args.host}:{port}",
        flush=True,
    )
    stop.wait()
    health.set(protos.load().health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=args.grace).wait()
    backend.close()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m cisjax.rollout.server ...`: the server without the cisjax CLI (imports nothing of the trainer)."""
    p = argparse.ArgumentParser(prog="cisjax serve", description="rollout gRPC server")
    add_args(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except errors.UserError as err:  # declared user errors only: anything else shows its traceback
        print(f"cisjax serve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # run the module's imported copy: the backends import cisjax.rollout.server, and its classes
    # (RequestError above all) must be the ones the servicer catches, not this __main__ module's twins
    from cisjax.rollout import server as _server

    sys.exit(_server.main())
