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


def tensors_from_chunks(chunks) -> dict:
    """The TensorChunk messages of a tensor stream (in any order) as {HF name: ndarray}; RequestError when a chunk
    falls outside its tensor, a dtype is unknown, or a tensor is not received whole."""
    buffers: dict = {}  # name -> (dtype, shape, bytes, [bytes received])
    for c in chunks:
        if c.name not in buffers:
            if c.dtype not in ST_DTYPES:
                raise RequestError(f"tensor {c.name!r}: dtype {c.dtype!r} not one of {sorted(ST_DTYPES)}")
            nbytes = int(np.prod(c.shape, dtype=np.int64)) * ST_DTYPES[c.dtype].itemsize
            buffers[c.name] = (ST_DTYPES[c.dtype], tuple(c.shape), bytearray(nbytes), [0])
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
        tensors[name] = np.frombuffer(bytes(buf), dtype=dtype).reshape(shape)
    return tensors


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
