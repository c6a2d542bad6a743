"""The rollout gRPC server (validation, auth, health, shutdown) over a pluggable engine Backend (`cisjax serve`)."""

from __future__ import annotations

import hmac
import importlib
import itertools
import logging
import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from cisjax import errors
from cisjax.rollout import delta as delta_lib
from cisjax.rollout import protos, weights
from cisjax.rollout.backend import Backend, RequestError, check_generate, check_score
from cisjax.rollout.tls import LOCALHOST, ServerTLS

log = logging.getLogger("cisjax.serve")

DEVICES = ("auto", "cpu", "cuda", "tpu")
BACKENDS = {  # name -> module defining Backend, imported only when chosen (the server runs without vllm installed)
    "transformers": "cisjax.engines.transformers_backend",
    "vllm": "cisjax.engines.vllm.backend",
    "jax": "cisjax.engines.jax.backend",
    "fake": "cisjax.engines.fake",  # no model: a setup's and the tests' engine
}


def open_backend(name: str, model_dir: str, *, dtype: str, **options) -> Backend:
    """The engine BACKENDS names, on `model_dir` (the options are the engine's own, e.g. vllm's max_model_len)."""
    return importlib.import_module(BACKENDS[name]).Backend(model_dir, dtype=dtype, **options)


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


def _abort(context, err: RequestError):
    context.abort(err.code, str(err))


def _checked(context, check, request, backend: Backend):
    """check(request, backend) (backend.check_generate, check_score); its RequestError ends the call with its status."""
    try:
        return check(request, backend)
    except RequestError as err:
        _abort(context, err)


class RolloutServicer:
    """rollout.proto's Rollout service over a Backend: requests checked, work handed to the engine, results streamed."""

    def __init__(self, backend: Backend, export_root: Path | None):
        self.pb = protos.load().rollout_pb2
        self.backend = backend
        self.export_root = Path(os.path.realpath(export_root)) if export_root else None
        self.update_lock = threading.Lock()  # one weight update at a time (version check + reload)
        self.base = weights.Base()  # the set deltas apply to (kept when a full update asks)
        self.id_bytes = routing_id_bytes(backend.config_json)

    # Generate ---------------------------------------------------------------
    def Generate(self, request, context):
        arrived = time.monotonic()
        b = self.backend
        params, prompts = _checked(context, check_generate, request, b)
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
                if params.return_sampling_mask:
                    ids, counts = s.support if s.support is not None else ([], [0] * len(s.token_ids))
                    if len(counts) != len(s.token_ids) or sum(counts) != len(ids):
                        context.abort(
                            grpc.StatusCode.INTERNAL,
                            f"engine sampling mask: {len(counts)} counts summing to {sum(counts)} for "
                            f"{len(s.token_ids)} tokens and {len(ids)} ids",
                        )
                    out.sampling_mask.CopyFrom(self.pb.SamplingMask(token_ids=ids, counts=counts))
                yield self.pb.GenerateResponse(sample=out)

    def _routing(self, context, prompt_rows, response_rows):
        try:
            return encode_routing(self.pb, prompt_rows, response_rows, self.id_bytes)
        except ValueError as err:  # an engine's capture gone wrong: this call fails, not the server
            context.abort(grpc.StatusCode.INTERNAL, f"engine routing: {err}")

    # Score ------------------------------------------------------------------
    def Score(self, request, context):
        b = self.backend
        temperature, seqs = _checked(context, check_score, request, b)
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
        t0 = time.monotonic()
        try:
            first = next(request_iterator, None)
            if first is None:
                raise RequestError("empty UpdateWeights stream")
            version, retain = first.version, first.retain_base
            kind = first.WhichOneof("source")
            if kind == "directory":
                if next(request_iterator, None) is not None:
                    raise RequestError("an UpdateWeights from a directory is a single message")
                path = weights.confined(first.directory.path, self.export_root)
                weights.check_export(path)
                weights.check_manifest(path, dict(first.directory.sha256))
                source = ("delta", _read_delta(path)) if delta_lib.is_delta_dir(path) else ("directory", path)
            elif kind == "chunk" or first.HasField("delta"):  # a delta that changes nothing has no chunk
                chunks = _chunks(first, request_iterator) if kind == "chunk" else _chunks(None, request_iterator)
                if first.HasField("delta"):
                    d = first.delta
                    source = ("delta", weights.delta_from_chunks(chunks, d.base_version, d.digest))
                else:
                    source = ("tensors", weights.tensors_from_chunks(chunks))
            else:
                raise RequestError("UpdateWeights needs a directory or tensor chunks")
            with self.update_lock:
                current = self.backend.version
                new = version or current + 1
                if new <= current:
                    raise RequestError(
                        f"version {new} is not above the current version {current}", grpc.StatusCode.FAILED_PRECONDITION
                    )
                if source[0] == "delta":  # applied over the kept set, its digest checked, before anything is swapped
                    source, retain = ("tensors", self.base.apply(source[1], current)), True
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
                self._keep_base(new, source, retain)
                log.info("weights version %d -> %d", current, self.backend.version)
        except RequestError as err:
            _abort(context, err)
        return self.pb.UpdateWeightsResponse(version=self.backend.version, reload_s=time.monotonic() - t0)

    def _keep_base(self, version: int, source, retain: bool) -> None:
        """The set just loaded becomes the base of later deltas when asked (a directory is read into memory: its
        files may be pruned); a base that cannot be read is dropped (the next delta is refused, not misapplied)."""
        kind, payload = source
        tensors = None
        if retain:
            try:
                tensors = weights.read_tensors(payload) if kind == "directory" else payload
            except Exception as err:
                log.warning("could not keep version %d as the base of deltas: %s", version, err)
        self.base.keep(version, tensors)

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
            phases=None if b.phases is None else self.pb.Phases(**b.phases),
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


def _read_delta(path: Path) -> delta_lib.Delta:
    try:
        return delta_lib.read_dir(path)
    except ValueError as err:  # a DeltaError, a ManifestError or an unreadable file
        raise RequestError(f"{path.name}: not a readable delta export: {err}", grpc.StatusCode.DATA_LOSS) from None


def _chunks(first, rest):
    """The TensorChunk of each message of a tensor stream (`first` unless None, then `rest`)."""
    for msg in itertools.chain([first] if first is not None else [], rest):
        if msg.WhichOneof("source") != "chunk":
            raise RequestError("a tensor stream must contain only chunks")
        yield msg.chunk


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


def check_bind(host: str, *, token: str | None, tls: ServerTLS | None, insecure: bool) -> None:
    """UserError unless a bind of `host` is safe: beyond localhost, a bearer token, and TLS unless `insecure` says
    the network may read the token and the weights."""
    if host in LOCALHOST:
        return
    if not token:
        raise errors.UserError(
            f"refusing to bind {host}: binding a non-localhost address requires a token (--token, or "
            "$CISJAX_ROLLOUT_TOKEN)"
        )
    if tls is None and not insecure:
        raise errors.UserError(
            f"refusing to bind {host} without TLS: the bearer token and every weight update would cross the network "
            "in clear text; give --tls-cert and --tls-key (docs/rollout.md makes a CA for a cluster), or --insecure "
            "to accept that"
        )


def build_server(
    backend: Backend,
    *,
    host: str,
    port: int,
    token: str | None,
    export_root: str | None,
    workers: int = 64,
    tls: ServerTLS | None = None,
    insecure: bool = False,
):
    """(grpc server started on host:port, health servicer, bound port); with `tls`, a TLS port (check_bind's rules)."""
    check_bind(host, token=token, tls=tls, insecure=insecure)
    credentials = tls.credentials() if tls is not None else None  # a bad file is reported before anything binds
    if credentials is None and host not in LOCALHOST:
        log.warning("--insecure: serving %s in clear text (the token and the weights can be read on the network)", host)
    pb = protos.load()
    interceptors = [TokenAuth(token)] if token else []
    # each call in flight holds a thread while its work sits in the engine's batch: `workers` bounds
    # the calls served at once (more wait in gRPC's queue)
    # SO_REUSEPORT (gRPC's default on Linux, stated): a parent's launch.PortLease holds the port until this binds it
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 1)],
    )
    pb.rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(backend, export_root), server)
    health = HealthServicer()
    pb.health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as err:
        raise errors.UserError(f"cannot bind {address}: {err}") from None
    if not bound:
        raise errors.UserError(f"cannot bind {address} (port in use?)")
    server.start()
    return server, health, bound


def stop_event(*, exit_with_parent: bool, grace: float) -> threading.Event:
    """An event set on SIGTERM or SIGINT (logged with the `grace` the calls in flight will get) or, with
    `exit_with_parent`, when the process that started this one exits (even SIGKILLed)."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: draining (grace %.0fs)", signum, grace)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if exit_with_parent:
        parent = os.getppid()

        def watch_parent():
            # an exiting process's children are re-parented at once (before it is reaped): a new ppid means it is gone
            while not stop.wait(1.0):
                if os.getppid() != parent:
                    log.warning("parent process %d exited: stopping", parent)
                    stop.set()

        threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    return stop


def shut_down(server, health: HealthServicer, backend: Backend, grace: float) -> None:
    """Health NOT_SERVING, the calls in flight given `grace` seconds to finish, then the engine closed."""
    health.set(health.pb.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=grace).wait()
    backend.close()
    log.info("stopped")
