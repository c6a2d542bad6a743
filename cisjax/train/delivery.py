"""How a publish reaches the rollout servers: a disk export, a tensor stream, or a delta with the full set as fallback."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax

from cisjax import export as export_lib
from cisjax.models import hf_io
from cisjax.rollout import client as client_lib
from cisjax.rollout import delta as delta_lib

log = logging.getLogger(__name__)

__all__ = ["Sent", "Target", "send_disk", "send_stream", "send_colocated", "DeltaSender"]


@dataclass(frozen=True)
class Target:
    """Where and how a publisher's weights go (process 0 talks to `client`; the others pass None)."""

    client: object  # a RolloutClient or RolloutFleet
    hf_config: dict
    dtype: str | None  # the published dtype (None = the params' own)
    mode: str  # disk | stream
    root: Path | None  # disk: the export root
    server_dir: str | None  # disk: the export root as the server sees it
    keep: int  # disk: versions kept
    is_writer: bool  # process 0

    @property
    def fleet(self) -> bool:
        return hasattr(self.client, "update_weights_each")

    def server_path(self, path: Path) -> str:
        return str(Path(self.server_dir) / path.name) if self.server_dir else str(path)


@dataclass
class Sent:
    path: Path | None  # disk: the directory the servers loaded (a delta export when they all took the delta)
    nbytes: int  # bytes of tensor data sent to one server (a delta's, or the full set's when none took it)
    export_s: float  # producing the tensors (and, for a delta, digest + diff), writing the export
    served: int | None  # the version the server reports (process 0)
    error: BaseException | None  # process 0's failure, else None
    changed_fraction: float | None = None  # delta publishing: elements whose published bits changed
    full_sends: int | None = None  # delta publishing: servers sent the full set (first publish, refusals)


class _TimedTensors:
    """A Mapping-like view of HFTensors for RolloutClient.update_weights_from_tensors: `items()` yields the
    tensors lazily (one on the host at a time), times their production, and
    `drain()` produces whatever the consumer left (multi-process: every process must take part in
    every gather, also when process 0's stream broke off)."""

    def __init__(self, tensors: hf_io.HFTensors):
        self.tensors = tensors
        self._it = iter(tensors.items())
        self._lock = threading.Lock()  # gRPC pulls on its own thread; drain() on the caller's
        self.produce_s = 0.0
        self.started = False

    def keys(self):
        return self.tensors.keys()

    def __len__(self):
        return len(self.tensors)

    def items(self):
        if self.started:
            raise RuntimeError("the tensor stream can be iterated once")
        self.started = True
        return self._generate()

    def _generate(self):
        while True:
            t0 = time.perf_counter()
            with self._lock:
                try:
                    name, arr = next(self._it)
                except StopIteration:
                    return
                finally:
                    self.produce_s += time.perf_counter() - t0
            yield name, arr

    def drain(self):
        with self._lock:
            for _ in self._it:
                pass


def send_disk(t: Target, model, version: int, more: dict) -> Sent:
    """Export as root/vNNNNNN (collective), then UpdateWeights from it."""
    t0 = time.perf_counter()
    path = _export(t, model, version)
    export_s = time.perf_counter() - t0
    nbytes = hf_io.HFTensors(model, t.hf_config, t.dtype).nbytes
    served, error = None, None
    if t.is_writer:
        try:
            served = _send_directory(t, t.client, path, version, more)
        except Exception as e:
            error = e
    return Sent(path, nbytes, export_s, served, error)


def _export(t: Target, model, version: int) -> Path:
    """root/vNNNNNN in the published dtype (collective; atomic, manifest, LATEST, the newest t.keep kept)."""
    return export_lib.export(
        model, t.hf_config, t.root, version, dtype=t.dtype, keep=t.keep, metadata={"source": "publish"}
    )


def _send_directory(t: Target, client, path: Path, version: int, more: dict, **kw) -> int:
    manifest = export_lib.read_manifest(path)
    checksums = {n: f["sha256"] for n, f in manifest["files"].items()}
    return client.update_weights(t.server_path(path), version=version, checksums=checksums, **more, **kw)


def send_stream(t: Target, model, version: int, more: dict) -> Sent:
    """The HF tensors streamed to the server, produced lazily (export_s: the seconds producing them)."""
    stream = _TimedTensors(hf_io.HFTensors(model, t.hf_config, t.dtype))
    served, error = None, None
    try:
        if t.is_writer:
            try:
                served = t.client.update_weights_from_tensors(stream, version=version, **more)
            except Exception as e:
                error = e
    finally:
        if jax.process_count() > 1:
            stream.drain()
    return Sent(None, stream.tensors.nbytes, stream.produce_s, served, error)


def send_colocated(t: Target, engine, model, version: int, *, export: bool = False) -> Sent:
    """The params swapped into the trainer's own engine (cisjax.engines.jax.colocated.Colocated.publish): nothing sent (0
    bytes); the cast and copy onto the engine's shardings count as the reload. `export`: also written as
    root/vNNNNNN (the run's last step: the trained model as an HF directory, LATEST)."""
    t0 = time.perf_counter()
    path = _export(t, model, version) if export else None
    export_s = time.perf_counter() - t0
    served, error = None, None
    try:
        served = engine.publish(model[1], version)
    except Exception as e:
        error = e
    return Sent(path, 0, export_s, served, error)


class DeltaSender:
    """publish.delta: the published set kept on process 0's host between publishes; each publish sends the Delta
    from the version last published (cisjax.rollout.delta: changed elements, or whole tensors where cheaper) with
    the digest of the new set, as a delta export (disk) or a delta stream. A server that refuses it (it restarted,
    missed a version, or the digest differs: ABORTED) is sent the full set, which it keeps as its next base; so is
    every server on the first publish and when `full`. Costs one host copy of the published set (two during a
    publish) on process 0, and one on each server."""

    def __init__(self, target: Target):
        self.t = target
        self.sent: tuple[int, dict] | None = None  # (version, {HF name: ndarray}) the servers were last sent

    def send(self, model, version: int, more: dict, *, full: bool = False) -> Sent:
        t0 = time.perf_counter()
        tensors = {}
        for name, arr in hf_io.HFTensors(model, self.t.hf_config, self.t.dtype).items():  # collective gathers
            if self.t.is_writer:
                tensors[name] = arr
        if not self.t.is_writer:
            return Sent(None, 0, time.perf_counter() - t0, None, None)
        try:
            return self._send(tensors, version, more, full, t0)
        except Exception as e:
            self.sent = None  # the servers may hold either set: the next publish sends the whole
            return Sent(None, 0, time.perf_counter() - t0, None, e)

    def _send(self, tensors: dict, version: int, more: dict, full: bool, t0: float) -> Sent:
        t = self.t
        delta = None
        if self.sent is not None and not full:  # the digest travels with a delta only: whole sends need none
            try:
                digest = delta_lib.digest(tensors)
                delta = delta_lib.diff(self.sent[1], tensors, base_version=self.sent[0], digest_of_new=digest)
            except delta_lib.DeltaError as err:
                log.warning("publishing version %d whole: %s", version, err)
        delta_path = None
        if delta is not None and t.mode == "disk":
            delta_path = export_lib.export_delta(delta, t.root, version, keep=t.keep, metadata={"source": "publish"})
        export_s = time.perf_counter() - t0
        full_nbytes = sum(a.nbytes for a in tensors.values())
        lock, full_path, counts = threading.Lock(), [], {"delta": 0, "full": 0}

        def whole(client) -> int:
            if t.mode == "stream":
                return client.update_weights_from_tensors(tensors, version=version, retain_base=True)
            with lock:  # written once, for the first server that needs it
                if not full_path:
                    full_path.append(
                        export_lib.export_tensors(
                            tensors, t.hf_config, t.root, version, keep=t.keep, metadata={"source": "publish"}
                        )
                    )
            return _send_directory(t, client, full_path[0], version, {}, retain_base=True)

        def one(client) -> int:
            if delta is not None:
                try:
                    if t.mode == "stream":
                        got = client.update_weights_from_delta(delta, version=version)
                    else:
                        got = _send_directory(t, client, delta_path, version, {})
                    with lock:
                        counts["delta"] += 1
                    return got
                except client_lib.RolloutError as err:
                    if not client_lib.delta_refused(err):
                        raise
                    log.warning("%s refused the delta of version %d; sending the full set: %s", client, version, err)
            got = whole(client)
            with lock:
                counts["full"] += 1
            return got

        if t.fleet:
            served = t.client.update_weights_each(one, version=version, **more)
        else:
            served = one(t.client)
        self.sent = (version, tensors)
        took_delta = counts["delta"] > 0
        return Sent(
            delta_path if took_delta and not counts["full"] else (full_path[0] if full_path else None),
            delta.nbytes if took_delta else full_nbytes,
            export_s,
            served,
            None,
            delta.changed_fraction if delta is not None else None,
            counts["full"],
        )
