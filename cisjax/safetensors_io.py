"""Safetensors files with numpy: a model directory read through memory maps, files written tensor by tensor with their sha256."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from cisjax.errors import CheckpointError

# Imported by the JAX-free rollout server: numpy and ml_dtypes only.

__all__ = ["ST_DTYPES", "ST_NAMES", "SafetensorsDir", "write_file", "plan_files", "INDEX"]

INDEX = "model.safetensors.index.json"

ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),  # a weight delta's element indices
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class SafetensorsDir(Mapping):
    """Lazy, memory-mapped view of the safetensors files of a model directory (single or sharded):
    a Mapping of HF name -> memmapped ndarray (nothing read until used).

    Reads the documented format (8-byte header length, JSON header, raw little-endian data)
    with numpy memmaps: the safetensors numpy API has no bfloat16, and slices must be read
    without loading whole files.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors files")
        self.entries: dict[str, tuple[str, dict, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            path = self.dir / name
            if not path.is_file():
                raise CheckpointError(f"{model_dir}: index names missing file {name}")
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for tensor, info in header.items():
                if tensor in self.entries:
                    raise CheckpointError(
                        f"{model_dir}: tensor {tensor!r} is in both {self.entries[tensor][0]} and {name}"
                    )
                self.entries[tensor] = (name, info, 8 + n)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise KeyError(name)
        return self.array(name)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def array(self, name: str) -> np.ndarray:
        """A memmapped (not yet read) view of one tensor."""
        file, info, offset = self.entries[name]
        if info["dtype"] not in ST_DTYPES:
            raise CheckpointError(f"tensor {name!r}: unsupported dtype {info['dtype']}")
        if file not in self._maps:
            self._maps[file] = np.memmap(self.dir / file, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        raw = self._maps[file][offset + start : offset + end]
        return raw.view(ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def write_file(path: Path, items: list[tuple[str, tuple, np.dtype]], produce, digests: dict | None = None) -> None:
    """Write one safetensors file, streaming tensors one by one (`produce(name)` -> ndarray). With
    `digests`, also its sha256 (as digests[file name]), hashed on a thread while the next tensor is
    produced and written (hashlib releases the GIL), instead of a second pass over the file."""
    hasher = hashlib.sha256() if digests is not None else None
    pool = ThreadPoolExecutor(max_workers=1) if hasher is not None else None  # one thread: updates stay in order
    pending = []
    header, offset = {}, 0
    for name, shape, dtype in items:
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data aligned to 8 bytes

    def write(f, data) -> None:
        f.write(data)
        if hasher is not None:
            pending.append(pool.submit(hasher.update, data))

    try:
        with open(path, "wb") as f:
            write(f, len(blob).to_bytes(8, "little"))
            write(f, blob)
            for name, shape, dtype in items:
                arr = np.ascontiguousarray(produce(name), dtype=dtype)
                if arr.shape != tuple(shape):
                    raise AssertionError(f"{name}: produced shape {arr.shape}, planned {shape}")
                write(
                    f, memoryview(arr.reshape(-1).view(np.uint8))
                )  # the array's own bytes, no copy (bf16 has no buffer format)
            f.flush()
            os.fsync(f.fileno())
        for fut in pending:
            fut.result()
        if hasher is not None:
            digests[path.name] = hasher.hexdigest()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


def plan_files(specs, max_shard_bytes: int) -> list[tuple[str, list[tuple[str, tuple, np.dtype]]]]:
    """[(file name, [(tensor name, shape, dtype), ...]), ...]: `specs` ((name, shape, dtype) in order) cut into
    files of at most `max_shard_bytes` (a larger tensor alone in its file), named as transformers names them:
    model.safetensors when one file, else model-0000k-of-0000n.safetensors (with an INDEX, see `write_index`)."""
    shards, current, size = [], [], 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, tuple(shape), np.dtype(dtype)))
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        return [("model.safetensors", shards[0])]
    return [(f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", s) for k, s in enumerate(shards)]


def write_index(out: Path, files) -> None:
    """The INDEX of sharded files (`plan_files`' result): nothing when there is one file."""
    if len(files) < 2:
        return
    total = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for _, items in files for _, shape, dtype in items)
    weight_map = {name: fname for fname, items in files for name, _, _ in items}
    (Path(out) / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
