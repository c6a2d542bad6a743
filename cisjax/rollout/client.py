"""Rollout client used by the trainer, the evaluation and `cisjax generate`: batches, deadlines, retries across restarts."""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

import grpc

from cisjax.rollout import manifest as manifest_lib
from cisjax.rollout import protos, weights
from cisjax.rollout.params import SamplingParams
from cisjax.rollout.samples import RolloutError, Sample, decode_routing, from_message
from cisjax.rollout.tls import LOCALHOST, ClientTLS

log = logging.getLogger("cisjax.rollout.client")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
_CHANNEL_OPTIONS = [
    # reconnect quickly after a server restart instead of gRPC's default backoff (up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
]


def sampling_message(rp, params: SamplingParams):
    """`params` as rollout.proto's SamplingParams message (rp: the generated rollout_pb2); the server's
    backend.check_params reads it back into the same record."""
    p = rp.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=sorted(params.stop_token_ids),
        greedy=params.greedy,
        logprobs=params.logprobs,
        return_routing=params.return_routing,
        return_sampling_mask=params.return_sampling_mask,
    )
    if params.seed is not None:
        p.seed = params.seed
    return p


class RolloutClient:
    """Calls a rollout server, from any number of threads. Generate/Score/Info/UpdateWeights retry on UNAVAILABLE
    with exponential backoff for up to `retry_s` seconds (reopening the channel, so a restarted server is picked up;
    a call cancelled because another thread's retry replaced the channel is retried too); a
    broken Generate stream is resumed with only the prompts still missing (their ids keep the
    seeded samples identical). Every prompt gets exactly n samples or a RolloutError is raised."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: ClientTLS | None = None,
        timeout_s: float = 600.0,
        retry_s: float = 120.0,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        batch_size: int = 64,
    ):
        self.target = target
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls
        self._credentials = tls.credentials() if tls is not None else None  # bad files fail here, once
        host = target.rpartition(":")[0].strip("[]")
        if token and tls is None and host not in LOCALHOST:
            log.warning("sending the rollout token to %s in clear text (no TLS: rollout.tls_ca / --tls-ca)", target)
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.batch_size = batch_size
        self.pb = protos.load()
        # The trainer calls from two threads (the rollout producer's Generate, the publisher's UpdateWeights): the
        # channel is replaced under this lock, and only by the call whose channel failed.
        self._lock = threading.Lock()
        self._channel = None
        self._open()
        # The weights the server should hold: after a reconnect to a server that reports an older
        # version (it restarted), `restore_weights()` re-sends them before the call is retried.
        # Set by update_weights (re-sends the directory); a caller that streams tensors sets its own.
        self.expected_version = 0
        self.restore_weights = None
        self._reconnected = False

    def _open(self):
        old = self._channel
        if self._credentials is not None:
            options = _CHANNEL_OPTIONS + self.tls.options()
            self._channel = grpc.secure_channel(self.target, self._credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self.stub = self.pb.rollout_pb2_grpc.RolloutStub(self._channel)
        self.health_stub = self.pb.health_pb2_grpc.HealthStub(self._channel)
        if old is not None:  # closed after the new one is in place: a call it cancels sees it replaced
            old.close()

    def _reopen(self, used) -> None:
        """Replace the channel `used` after a failed call on it, unless another thread already has."""
        with self._lock:
            if self._channel is used:
                self._open()
            self._reconnected = True

    def close(self):
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ retry
    def _retrying(self, what: str, attempt):
        """Run attempt() until it succeeds, raising RolloutError on a non-retryable error or when
        `retry_s` has passed. attempt() may keep partial progress between calls."""
        start, delay, tries = time.monotonic(), self.backoff_s, 0
        while True:
            tries += 1
            used = self._channel
            try:
                if self._reconnected:
                    self._restore()
                return attempt()
            except grpc.RpcError as err:
                code = err.code()
                # CANCELLED on a channel that is no longer the client's: another thread's retry replaced it mid-call
                with self._lock:  # a replacement in progress finishes first
                    replaced = code == grpc.StatusCode.CANCELLED and self._channel not in (used, None)
                if code not in _RETRYABLE and not replaced:
                    raise RolloutError(f"{what} on {self.target} failed: {code.name}: {err.details()}", code) from None
                if time.monotonic() - start + delay > self.retry_s:
                    raise RolloutError(
                        f"{what} on {self.target}: still {code.name} after {tries} tries in {time.monotonic() - start:.0f}s: "
                        f"{err.details()}{self._transport_hint()}",
                        code,
                    ) from None
                log.warning("%s: %s (%s), retrying in %.2fs", what, code.name, err.details(), delay)
                time.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self.max_backoff_s)
                self._reopen(used)

    def _transport_hint(self) -> str:
        """What this client's transport is, for an unreachable server's error: a plain client to a TLS server (or the
        reverse, or a certificate the CA did not sign) reads as UNAVAILABLE too."""
        if self.tls is None:
            return " (this client speaks plain text: a TLS server needs --tls-ca / rollout.tls_ca)"
        return f" (this client speaks TLS, trusting {self.tls.ca}: a plain-text server, or a certificate that CA did not sign, fails so)"

    def _restore(self) -> None:
        """After a reconnect: re-send the expected weights to a server that lost them (restarted)."""
        self._reconnected = False  # the re-send below is itself a retried call: it must not restore again
        try:
            version = self._served()
            if version < self.expected_version:
                if self.restore_weights is None:
                    raise RolloutError(
                        f"{self.target} restarted and serves version {version}, but version {self.expected_version} "
                        "was sent by streaming and cannot be re-sent by the client"
                    )
                log.warning(
                    "server %s restarted (version %d < %d): re-sending the weights",
                    self.target,
                    version,
                    self.expected_version,
                )
                try:
                    self.restore_weights()
                except RolloutError as err:  # another thread's call restored it first: the server holds it now
                    if err.code != grpc.StatusCode.FAILED_PRECONDITION or self._served() < self.expected_version:
                        raise
        except grpc.RpcError:
            self._reconnected = True  # still down: restore on the next try
            raise

    def _served(self) -> int:
        return self.stub.Info(self.pb.rollout_pb2.InfoRequest(), timeout=self.timeout_s, metadata=self.metadata).version

    # ------------------------------------------------------------------ calls
    def info(self) -> dict:
        r = self._retrying(
            "Info",
            lambda: self.stub.Info(self.pb.rollout_pb2.InfoRequest(), timeout=self.timeout_s, metadata=self.metadata),
        )
        return {
            "engine": r.engine,
            "model": r.model,
            "dtype": r.dtype,
            "version": r.version,
            "architecture": r.architecture,
            "vocab_size": r.vocab_size,
            "max_model_len": r.max_model_len,
            # the JAX sampler's prefill and decode apart (cisjax.engines.jax.engine.Engine.phases), None for the others
            "phases": _fields(r.phases) if r.HasField("phases") else None,
        }

    def health(self, service: str = "") -> str:
        """SERVING / NOT_SERVING / ... (no retries: a probe)."""
        hp = self.pb.health_pb2
        r = self.health_stub.Check(hp.HealthCheckRequest(service=service), timeout=min(self.timeout_s, 10.0))
        return hp.HealthCheckResponse.ServingStatus.Name(r.status)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline, last = time.monotonic() + timeout_s, ""
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except grpc.RpcError as err:
                last = f": {err.code().name}: {err.details()}{self._transport_hint()}"
            if time.monotonic() > deadline:
                raise RolloutError(f"rollout server {self.target} not serving after {timeout_s:.0f}s{last}")
            time.sleep(0.2)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, *, ids: list[int] | None = None
    ) -> list[list[Sample]]:
        """n samples per prompt, as [prompt][sample], whatever order the server streams them in. `ids`: the prompts'
        ids on the wire (default their positions), which the server mixes into the per-sample seeds: a caller that
        sends part of a batch (a RolloutFleet) passes the positions in the whole batch so that the samples do not
        depend on the split. Sample.prompt_index is the position in `prompts` either way."""
        params = params or SamplingParams()
        wire = list(range(len(prompts))) if ids is None else [int(i) for i in ids]
        if len(wire) != len(prompts) or len(set(wire)) != len(wire):
            raise ValueError(f"generate: {len(wire)} ids for {len(prompts)} prompts, or repeated ids")
        position = {w: i for i, w in enumerate(wire)}
        rp = self.pb.rollout_pb2
        p = sampling_message(rp, params)
        results: dict[int, dict[int, Sample]] = {i: {} for i in range(len(prompts))}
        for lo in range(0, len(prompts), self.batch_size):
            batch = list(range(lo, min(lo + self.batch_size, len(prompts))))

            sent = []

            def attempt(batch=batch, sent=sent):
                # the first attempt sends the whole batch (the server validates it); retries only what is missing
                missing = [i for i in batch if len(results[i]) < params.n] if sent else batch
                sent.append(len(missing))
                if not missing:
                    return
                req = rp.GenerateRequest(
                    prompts=[rp.Prompt(token_ids=prompts[i], id=wire[i]) for i in missing], params=p
                )
                for resp in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
                    s = resp.sample
                    i = position.get(s.prompt_id, -1)
                    if i not in results:
                        raise RolloutError(f"server returned a sample for unknown prompt id {s.prompt_id}")
                    results[i][s.sample_index] = from_message(s, i, prompts[i])

            self._retrying("Generate", attempt)
            short = [i for i in batch if len(results[i]) != params.n]
            if short:
                raise RolloutError(
                    f"Generate: {len(short)} prompts did not get {params.n} samples (e.g. prompt {short[0]}: {len(results[short[0]])})"
                )
        return [[results[i][j] for j in range(params.n)] for i in range(len(prompts))]

    def score(
        self,
        items: list[tuple[list[int], list[int]]],
        *,
        temperature: float = 1.0,
        logprobs: int = 0,
        routing: bool = False,
    ) -> list[dict]:
        """Server-side prefill logprobs of the response tokens: [{"logprobs", "version", ...}] in input order;
        with `routing`, also the routed expert ids (rollout.proto Routing) as Sample has them: "routing" [R, MoE
        layers, k] of the response tokens' passes and "prompt_routing" [P - 1, MoE layers, k]."""
        rp = self.pb.rollout_pb2
        out: dict[int, dict] = {}

        def attempt():
            todo = [i for i in range(len(items)) if i not in out]
            if not todo:
                return
            req = rp.ScoreRequest(
                sequences=[rp.Sequence(prompt_ids=items[i][0], response_ids=items[i][1]) for i in todo],
                temperature=temperature,
                logprobs=logprobs,
                return_routing=routing,
            )
            for r in self.stub.Score(req, timeout=self.timeout_s, metadata=self.metadata):
                rec = {"logprobs": list(r.logprobs), "version": r.version}
                if logprobs:
                    rec["topk_ids"] = [list(t.token_ids) for t in r.top_logprobs]
                    rec["topk_logprobs"] = [list(t.logprobs) for t in r.top_logprobs]
                i = todo[r.index]
                if routing:  # the prompt's rows apart from the response's, as a Sample's properties give them
                    rows = decode_routing(r.routing, len(items[i][0]), len(items[i][1]))
                    p = len(items[i][0]) - 1
                    rec["prompt_routing"], rec["routing"] = rows[:p], rows[p:]
                out[i] = rec

        self._retrying("Score", attempt)
        if len(out) != len(items):
            raise RolloutError(f"Score: got {len(out)} of {len(items)} sequences")
        return [out[i] for i in range(len(items))]

    def update_weights(
        self, path: str, *, version: int = 0, checksums: bool | dict = True, retain_base: bool = False
    ) -> int:
        """Tell the server to load an exported directory (a path under its --export-root, as the
        server sees it): a full export, or a delta export over the version it serves (refused with ABORTED,
        `delta_refused`, when it does not hold that version's set). checksums: True = sha256 of every file under
        `path` as this process sees it (same filesystem) — those recorded in its manifest.json when it is a `cisjax
        export` — a dict = given manifest, False = none. `retain_base`: the server keeps the set as the base of
        later deltas. Retried on UNAVAILABLE (a directory can be sent again). Returns the new version."""
        rp = self.pb.rollout_pb2
        manifest = (
            (manifest_lib.recorded_checksums(path) or sha256_manifest(path)) if checksums is True else (checksums or {})
        )

        def send(version=version):
            req = rp.UpdateWeightsRequest(
                version=version,
                directory=rp.WeightsDirectory(path=str(path), sha256=manifest),
                retain_base=retain_base,
            )
            tries = []

            def attempt():
                tries.append(1)
                try:
                    return self.stub.UpdateWeights(iter([req]), timeout=self.timeout_s, metadata=self.metadata).version
                except grpc.RpcError as err:
                    # a retry after a lost answer finds the update done: the server already serves `version`
                    if (
                        len(tries) > 1
                        and version
                        and err.code() == grpc.StatusCode.FAILED_PRECONDITION
                        and self.info()["version"] == version
                    ):
                        return version
                    raise

            try:  # retried across a server restart, like the other calls (a directory can be sent again)
                return self._retrying("UpdateWeights", attempt)
            except grpc.RpcError as err:
                raise RolloutError(
                    f"UpdateWeights on {self.target} failed: {err.code().name}: {err.details()}", err.code()
                ) from None

        new = send()
        self.expected_version, self.restore_weights = new, lambda: send(new)
        return new

    def update_weights_from_tensors(
        self, tensors: dict, *, version: int = 0, chunk_bytes: int = 1 << 20, retain_base: bool = False
    ) -> int:
        """Stream HF-named numpy tensors (the full checkpoint) in chunks below gRPC's message limit. `retain_base`:
        the server keeps the set as the base of later deltas."""
        rp = self.pb.rollout_pb2
        parts = ((name, weights.WHOLE, arr) for name, arr in tensors.items())
        first = rp.UpdateWeightsRequest(version=version, retain_base=retain_base)
        new = self._update(weights.chunk_messages(rp, first, parts, chunk_bytes))
        self.expected_version, self.restore_weights = new, None  # the caller may set restore_weights
        return new

    def update_weights_from_delta(self, delta, *, version: int = 0, chunk_bytes: int = 1 << 20) -> int:
        """Stream a cisjax.rollout.delta.Delta over the version the server serves (its tensors whole, or the indices
        and values of their changed elements). The server applies it to the set it kept, checks the digest and swaps;
        RolloutError with code ABORTED (`delta_refused`) when it does not hold delta.base_version's set or the
        digest differs: nothing was swapped, send the full set."""
        rp = self.pb.rollout_pb2
        parts = [(name, weights.WHOLE, arr) for name, arr in delta.dense.items()]
        for name, (idx, values) in delta.sparse.items():
            parts += [(name, weights.INDICES, idx), (name, weights.VALUES, values)]
        first = rp.UpdateWeightsRequest(
            version=version, delta=rp.WeightsDelta(base_version=delta.base_version, digest=delta.digest)
        )
        new = self._update(weights.chunk_messages(rp, first, iter(parts), chunk_bytes))
        self.expected_version, self.restore_weights = new, None
        return new

    def weights_updated(self, version: int) -> None:
        """The server took `version` another way than through this client (a colocated engine's in-memory swap)."""
        self.expected_version, self.restore_weights = int(version), None

    def _update(self, requests) -> int:
        try:
            return self.stub.UpdateWeights(requests, timeout=self.timeout_s, metadata=self.metadata).version
        except grpc.RpcError as err:
            raise RolloutError(
                f"UpdateWeights on {self.target} failed: {err.code().name}: {err.details()}", err.code()
            ) from None


def _fields(message) -> dict:
    """A message's fields by name, zeros included (proto3 omits them from ListFields)."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


DELTA_REFUSED = grpc.StatusCode.ABORTED  # the server does not hold a delta's base, or the result's digest differs


def delta_refused(err: BaseException) -> bool:
    """Whether `err` is a server's refusal of a delta (the sender then sends the full set)."""
    return isinstance(err, RolloutError) and err.code == DELTA_REFUSED


def sha256_manifest(path: str | Path) -> dict:
    """{relative path: sha256} of every file under `path` (a directory without a manifest)."""
    root = Path(path)
    return {str(f.relative_to(root)): manifest_lib.sha256_file(f)[0] for f in sorted(root.rglob("*")) if f.is_file()}
