"""The weights an UpdateWeights brings: an export directory's checks, a tensor stream's assembly and its staging on disk."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
from safetensors import safe_open

from cisjax import safetensors_io
from cisjax.rollout import delta as delta_lib
from cisjax.rollout import manifest as manifest_lib
from cisjax.rollout.backend import RequestError

# safetensors dtype names a tensor chunk may carry -> numpy dtypes
ST_DTYPES = {"F32": np.dtype("float32"), "F16": np.dtype("float16"), "BF16": np.dtype(ml_dtypes.bfloat16)}


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


def check_same_model(path: Path, config_json: dict) -> None:
    """RequestError unless `path` holds an HF config of the served model's architecture and shape."""
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
                f"{path.name}: config.json {key}={new_cfg.get(key)!r} differs from the served model's "
                f"{config_json.get(key)!r}"
            )


def checkpoint_tensor_names(folder) -> set:
    """Names of the tensors in a directory's *.safetensors files."""
    names = set()
    for fn in Path(folder).glob("*.safetensors"):
        with safe_open(str(fn), "np") as f:
            names.update(f.keys())
    return names


WHOLE, INDICES, VALUES = 0, 1, 2  # rollout.proto TensorPart
INDEX_DTYPES = {"U32": np.dtype(np.uint32), "I64": np.dtype(np.int64)}  # a delta's INDICES parts


_WIRE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32", "int64": "I64"}


def chunk_messages(rp, first, parts, chunk_bytes: int):
    """UpdateWeightsRequests carrying `parts` ((name, TensorPart, ndarray), ...) in chunks of at most `chunk_bytes`;
    the first message is `first` (version and flags) with the first chunk."""
    for name, part, arr in parts:
        allowed = ("uint32", "int64") if part == INDICES else ("float32", "float16", "bfloat16")
        if arr.dtype.name not in allowed:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} not one of {allowed}")
        data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        for off in range(0, max(len(data), 1), chunk_bytes):
            chunk = rp.TensorChunk(
                name=name,
                dtype=_WIRE_NAMES[arr.dtype.name],
                shape=list(arr.shape),
                offset=off,
                data=bytes(data[off : off + chunk_bytes]),
                part=part,
            )
            if first is not None:
                first.chunk.CopyFrom(chunk)
                yield first
                first = None
            else:
                yield rp.UpdateWeightsRequest(chunk=chunk)
    if first is not None:  # a delta that changes nothing: one message, no tensor
        yield first


def parts_from_chunks(chunks) -> dict:
    """The TensorChunk messages of a tensor stream (in any order) as {(HF name, part): ndarray}; RequestError when
    a chunk falls outside its tensor, a dtype is unknown, or a tensor is not received whole."""
    buffers: dict = {}  # (name, part) -> (dtype, shape, bytes, [bytes received])
    for c in chunks:
        key = (c.name, int(c.part))
        if key not in buffers:
            known = INDEX_DTYPES if c.part == INDICES else ST_DTYPES
            if c.dtype not in known:
                raise RequestError(f"tensor {c.name!r}: dtype {c.dtype!r} not one of {sorted(known)}")
            nbytes = int(np.prod(c.shape, dtype=np.int64)) * known[c.dtype].itemsize
            buffers[key] = (known[c.dtype], tuple(c.shape), bytearray(nbytes), [0])
        dtype, shape, buf, filled = buffers[key]
        if c.offset < 0 or c.offset + len(c.data) > len(buf):
            raise RequestError(
                f"tensor {c.name!r}: chunk [{c.offset}, {c.offset + len(c.data)}) outside its {len(buf)} bytes"
            )
        buf[c.offset : c.offset + len(c.data)] = c.data
        filled[0] += len(c.data)
    parts = {}
    for (name, part), (dtype, shape, buf, filled) in buffers.items():
        if filled[0] != len(buf):
            raise RequestError(f"tensor {name!r}: received {filled[0]} of {len(buf)} bytes")
        parts[(name, part)] = np.frombuffer(bytes(buf), dtype=dtype).reshape(shape)
    return parts


def tensors_from_chunks(chunks) -> dict:
    """A full tensor stream as {HF name: ndarray} (parts_from_chunks; every tensor WHOLE)."""
    parts = parts_from_chunks(chunks)
    if any(part != WHOLE for _, part in parts):
        raise RequestError("a full tensor stream carries whole tensors only (indices and values belong to a delta)")
    return {name: arr for (name, _), arr in parts.items()}


def delta_from_chunks(chunks, base_version: int, digest: str) -> delta_lib.Delta:
    """A delta stream as a Delta: WHOLE parts dense, INDICES + VALUES pairs sparse (RequestError on a lone half)."""
    parts = parts_from_chunks(chunks)
    dense = {name: arr for (name, part), arr in parts.items() if part == WHOLE}
    sparse = {}
    for (name, part), arr in parts.items():
        if part == INDICES:
            if (name, VALUES) not in parts:
                raise RequestError(f"delta tensor {name!r}: indices without values")
            sparse[name] = (arr, parts[(name, VALUES)])
        elif part == VALUES and (name, INDICES) not in parts:
            raise RequestError(f"delta tensor {name!r}: values without indices")
    return delta_lib.Delta(int(base_version), digest, dense, sparse)


def read_tensors(path: Path) -> dict:
    """Every tensor of an HF directory, read into memory ({name: ndarray}; the files may be pruned after)."""
    files = safetensors_io.SafetensorsDir(path)
    return {name: np.array(files.array(name)) for name in files.names()}


def write_weights_dir(tensors: dict, config_json: dict, served_model_dir) -> Path:
    """Streamed tensors (name -> ndarray) as a temporary HF directory (config.json + one safetensors
    file) that a backend can reload from; the caller owns (and removes) it. RequestError if the
    stream lacks tensors of the served checkpoint."""
    import safetensors.torch  # lazy: torch
    import torch  # lazy: torch

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


def load_through_directory(backend, tensors: dict, version: int) -> None:
    """A backend's load_tensors by way of its load_directory: the tensors written as a temporary HF directory
    (write_weights_dir), loaded from there as `version`, the directory removed after."""
    tmp = write_weights_dir(tensors, backend.config_json, backend.model)
    try:
        backend.load_directory(tmp, version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Base:
    """The set a server keeps on its host (version, {HF name: ndarray}) so that a delta over it can be applied: kept
    only when the full update that brought it asked (retain_base), replaced by each delta's result, dropped by a
    full update that did not ask. Used under the servicer's update lock."""

    def __init__(self):
        self.version, self.tensors = None, None

    def keep(self, version: int, tensors: dict | None) -> None:
        self.version, self.tensors = (version, tensors) if tensors is not None else (None, None)

    def apply(self, delta: delta_lib.Delta, serving: int) -> dict:
        """The complete set `delta` leads to, its digest checked; RequestError (ABORTED: the sender falls back to
        the full set) when this server does not hold the delta's base or the result differs. Nothing is changed."""
        if self.tensors is None:
            raise RequestError(
                f"a delta over version {delta.base_version}, but this server keeps no base set (it started or "
                f"restarted since, or its last full update did not ask to keep one): send the full set",
                grpc.StatusCode.ABORTED,
            )
        if delta.base_version != self.version or serving != self.version:
            raise RequestError(
                f"a delta over version {delta.base_version}, but this server serves version {serving} and keeps "
                f"the set of version {self.version}: send the full set",
                grpc.StatusCode.ABORTED,
            )
        try:
            tensors = delta_lib.apply(self.tensors, delta)
        except delta_lib.DeltaError as err:
            raise RequestError(
                f"the delta does not fit version {self.version}: {err}", grpc.StatusCode.ABORTED
            ) from None
        got = delta_lib.digest(tensors)
        if got != delta.digest:
            raise RequestError(
                f"the delta over version {self.version} gives a set of digest {got[:16]}..., the sender's is "
                f"{delta.digest[:16]}...: nothing swapped, send the full set",
                grpc.StatusCode.ABORTED,
            )
        return tensors
