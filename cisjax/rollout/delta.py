"""Weight deltas: the elements of a published set that changed since a base version, their application, the set's digest."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cisjax import safetensors_io
from cisjax.rollout import manifest as manifest_lib

# Imported by the JAX-free rollout server: numpy only.
#
# What a delta is. The publisher holds the set it last published (HF name -> ndarray in the published dtype) as
# version b; the new set N of version v differs from it where an element's *bits* differ (a bf16 value that did not
# cross a rounding boundary this step is unchanged, however the fp32 master weight moved). Per tensor the delta holds
# the cheaper of
#   sparse: the flat indices i (uint32, int64 past 2^32 elements) where bits(N)[i] != bits(B)[i], and N's values there;
#   dense:  the whole tensor N (when m * (index + value bytes) >= n * value bytes);
# and nothing for a tensor without a changed element. Applying it to B gives N exactly; `digest(N)` travels with the
# delta and the receiver checks it on the result before it serves anything.

__all__ = ["Delta", "DeltaError", "diff", "apply", "digest", "write_dir", "read_dir", "is_delta_dir", "FILE", "KIND"]

FILE = "delta.safetensors"  # a delta export's one data file: "<name>" dense, "<name>@indices" + "<name>@values" sparse
KIND = "delta"  # manifest.json "kind" of a delta export (full exports carry none)
_INDICES, _VALUES = "@indices", "@values"


class DeltaError(ValueError):
    """A delta that does not fit its base (an unknown tensor, another shape or dtype, an index out of range) or is
    malformed: names the tensor."""


@dataclass(frozen=True)
class Delta:
    base_version: int  # the version whose set this applies to
    digest: str  # digest() of the complete result
    dense: dict = field(default_factory=dict)  # name -> ndarray: tensors sent whole
    sparse: dict = field(default_factory=dict)  # name -> (flat indices [m], values [m]): the changed elements
    elements: int = 0  # elements of the complete set
    changed: int = 0  # elements whose bits changed

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the delta carries (indices and values)."""
        return sum(a.nbytes for a in self.dense.values()) + sum(i.nbytes + v.nbytes for i, v in self.sparse.values())

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of the same width, flat (bit equality: -0.0 != 0.0, NaN == NaN)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.dtype(f"u{a.dtype.itemsize}"))


def diff(base: Mapping, new: Mapping, *, base_version: int, digest_of_new: str) -> Delta:
    """The Delta taking `base` (version `base_version`) to `new`, tensor by tensor. Both must hold the same names,
    each of one shape and dtype in both (DeltaError otherwise: such a change is a new model, sent whole)."""
    if set(base) != set(new):
        extra, missing = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        raise DeltaError(f"the tensor sets differ (new: {extra[:3]}, gone: {missing[:3]}): send the full set")
    for name, n in new.items():
        b = base[name]
        if b.shape != n.shape or b.dtype != n.dtype:
            raise DeltaError(
                f"tensor {name!r}: {b.dtype}{list(b.shape)} -> {n.dtype}{list(n.shape)}: send the full set"
            )

    def one(name):  # numpy releases the GIL: tensors compared on a thread pool
        n = new[name]
        idx = np.flatnonzero(_bits(base[name]) != _bits(n))
        if not idx.size:
            return name, 0, None, None
        idx = idx.astype(np.uint32 if n.size <= 1 << 32 else np.int64)
        if idx.size * (idx.itemsize + n.itemsize) >= n.nbytes:
            return name, idx.size, np.ascontiguousarray(n), None
        return name, idx.size, None, (idx, np.ascontiguousarray(n).reshape(-1)[idx])

    dense, sparse, changed = {}, {}, 0
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, count, whole, part in pool.map(one, list(new)):
            changed += int(count)
            if whole is not None:
                dense[name] = whole
            elif part is not None:
                sparse[name] = part
    elements = sum(int(n.size) for n in new.values())
    return Delta(int(base_version), digest_of_new, dense, sparse, elements, changed)


def apply(base: Mapping, delta: Delta) -> dict:
    """The complete set `delta` leads to from `base`: a new dict; changed tensors are copies, the others `base`'s own
    arrays (never written). DeltaError when the delta does not fit `base`."""
    out = dict(base)
    for name, arr in delta.dense.items():
        b = _known(base, name)
        if arr.shape != b.shape or arr.dtype != b.dtype:
            raise DeltaError(
                f"tensor {name!r}: the delta sends {arr.dtype}{list(arr.shape)}, the base holds "
                f"{b.dtype}{list(b.shape)}"
            )
        out[name] = arr
    for name, (idx, values) in delta.sparse.items():
        b = _known(base, name)
        if idx.ndim != 1 or values.shape != idx.shape or not np.issubdtype(idx.dtype, np.integer):
            raise DeltaError(f"tensor {name!r}: {idx.size} indices ({idx.dtype}) for {values.size} values")
        if values.dtype != b.dtype:
            raise DeltaError(f"tensor {name!r}: values in {values.dtype}, the base holds {b.dtype}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= b.size):
            raise DeltaError(f"tensor {name!r}: an index outside its {b.size} elements")
        patched = np.array(b, copy=True)
        patched.reshape(-1)[idx] = values
        out[name] = patched
    return out


def _known(base: Mapping, name: str) -> np.ndarray:
    if name not in base:
        raise DeltaError(f"tensor {name!r} is not in the base set")
    return base[name]


def digest(tensors: Mapping) -> str:
    """sha256 over the set: per tensor in name order, its name, dtype, shape and the sha256 of its bytes (hashed on
    a thread pool: hashlib releases the GIL). Equal for equal sets, whatever the order or memory layout."""
    names = sorted(tensors)

    def one(name):
        return hashlib.sha256(memoryview(_bits(tensors[name]).view(np.uint8))).hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        per = list(pool.map(one, names))
    h = hashlib.sha256()
    for name, d in zip(names, per):
        a = tensors[name]
        h.update(f"{name}\t{np.dtype(a.dtype).name}\t{list(a.shape)}\t{d}\n".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- on disk


def write_dir(delta: Delta, directory: Path, digests: dict | None = None) -> dict:
    """The delta's tensors as `directory`/FILE (dense under their names, sparse as "<name>@indices" and
    "<name>@values"); returns the manifest fields that name it (kind, base_version, digest, elements, changed). The
    caller writes the manifest and commits the directory."""
    tensors = dict(delta.dense)
    for name, (idx, values) in delta.sparse.items():
        tensors[name + _INDICES], tensors[name + _VALUES] = idx, values
    if not tensors:  # nothing changed: an empty file still names the version
        tensors["@empty"] = np.zeros((0,), np.uint32)
    items = [(name, a.shape, a.dtype) for name, a in tensors.items()]
    safetensors_io.write_file(Path(directory) / FILE, items, tensors.__getitem__, digests)
    return {
        "kind": KIND,
        "base_version": delta.base_version,
        "digest": delta.digest,
        "elements": delta.elements,
        "changed": delta.changed,
    }


def is_delta_dir(directory: Path) -> bool:
    """Whether `directory` is a delta export (its manifest says kind: delta)."""
    try:
        return manifest_lib.read(directory).get("kind") == KIND
    except manifest_lib.ManifestError:
        return False


def read_dir(directory: Path) -> Delta:
    """The Delta of a delta export (its manifest and FILE, read into memory: the export may be pruned while the
    result serves). DeltaError if malformed."""
    m = manifest_lib.read(directory)
    try:
        files = safetensors_io.SafetensorsDir(directory)
    except Exception as err:
        raise DeltaError(f"{Path(directory).name}: {err}") from None
    dense, sparse = {}, {}
    for key in files.names():
        if key == "@empty":
            continue
        if key.endswith(_INDICES):
            name = key[: -len(_INDICES)]
            if name + _VALUES not in files:
                raise DeltaError(f"{Path(directory).name}: {name!r} has indices but no values")
            sparse[name] = (np.array(files.array(key)), np.array(files.array(name + _VALUES)))
        elif not key.endswith(_VALUES):
            dense[key] = np.array(files.array(key))
        elif key[: -len(_VALUES)] + _INDICES not in files:
            raise DeltaError(f"{Path(directory).name}: {key!r} without its indices")
    return Delta(
        int(m["base_version"]), str(m["digest"]), dense, sparse, int(m.get("elements", 0)), int(m.get("changed", 0))
    )
