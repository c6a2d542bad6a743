"""gRPC stubs of rollout.proto/health.proto, generated with grpc_tools.protoc on first use into a cache dir keyed by their hash."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from functools import cache
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import google.protobuf

try:
    from grpc_tools import protoc
except ImportError:  # said by _generate, when the stubs must be generated
    protoc = None

# How the stubs come to be: no generated code is committed. On first use, load() runs
# grpc_tools.protoc (grpcio-tools, a pinned dependency) on rollout.proto and health.proto into
# <cache>/protos/<key>/cisjax_rollout_pb/, where <key> hashes the .proto sources and the protobuf
# and grpcio-tools versions, so an edited proto or an upgraded protobuf regenerates by itself and an
# editable install never sees stale stubs. Generation writes a temp dir and renames it (concurrent
# first imports are safe); an unwritable cache falls back to the system temp dir. The health proto
# is the standard grpc.health.v1 one (grpcio-health-checking is not a dependency); do not import
# grpc_health in the same process, its descriptors would clash with these.

_HERE = Path(__file__).resolve().parent
_PROTOS = ("rollout.proto", "health.proto")
# Generated modules live in this package inside the cache dir, so the generated imports
# (`from cisjax_rollout_pb import rollout_pb2`) resolve without touching the cisjax package.
_PKG = "cisjax_rollout_pb"


def cache_root() -> Path:
    """$CISJAX_CACHE_DIR, else $XDG_CACHE_HOME/cisjax, else ~/.cache/cisjax."""
    if os.environ.get("CISJAX_CACHE_DIR"):
        return Path(os.environ["CISJAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cisjax"


def _key() -> str:
    h = hashlib.sha256()
    for name in _PROTOS:
        h.update(name.encode() + b"\0" + (_HERE / name).read_bytes())
    h.update(google.protobuf.__version__.encode())
    try:
        h.update(metadata.version("grpcio-tools").encode())
    except metadata.PackageNotFoundError:  # grpcio-tools missing: reported by _generate when it is needed
        pass
    return h.hexdigest()[:16]


def _generate(dest: Path) -> None:
    if protoc is None:
        raise RuntimeError(
            "cisjax.rollout needs grpcio-tools to generate its gRPC stubs on first use "
            "(pip install grpcio-tools, pinned in pyproject.toml)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        src = tmp / "src" / _PKG
        src.mkdir(parents=True)
        out = tmp / "out"
        (out / _PKG).mkdir(parents=True)
        for name in _PROTOS:
            shutil.copy(_HERE / name, src / name)
        include = str(Path(protoc.__file__).parent / "_proto")
        args = ["protoc", f"-I{tmp / 'src'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
        code = protoc.main(args + [f"{_PKG}/{name}" for name in _PROTOS])
        if code != 0:
            raise RuntimeError(f"grpc_tools.protoc failed (exit {code}) on {', '.join(_PROTOS)}")
        (out / _PKG / "__init__.py").write_text('"""Generated from cisjax/rollout/*.proto; do not edit."""\n')
        try:
            os.rename(out, dest)  # atomic: concurrent first imports race harmlessly
        except OSError:
            if not (dest / _PKG / "rollout_pb2.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@cache
def load() -> SimpleNamespace:
    """(rollout_pb2, rollout_pb2_grpc, health_pb2, health_pb2_grpc), generating them if needed."""
    key = _key()
    dest = None
    for root in (cache_root(), Path(tempfile.gettempdir()) / f"cisjax-{os.getuid()}"):
        dest = root / "protos" / key
        if (dest / _PKG / "rollout_pb2_grpc.py").is_file():
            break
        try:
            _generate(dest)
            break
        except PermissionError:
            continue  # unwritable cache: fall back to the temp dir
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    mods = {
        n: importlib.import_module(f"{_PKG}.{n}")
        for n in ("rollout_pb2", "rollout_pb2_grpc", "health_pb2", "health_pb2_grpc")
    }
    return SimpleNamespace(**mods)
