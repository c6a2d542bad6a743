"""Versioned, crash-safe weight exports for the rollout server (atomic HF directories + sha256 manifest + LATEST) and `cisjax export`."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import flax.nnx as nnx
import jax

import cisjax
from cisjax import distributed, errors
from cisjax.errors import CheckpointError
from cisjax.models import hf_io
from cisjax.rollout import delta as delta_lib
from cisjax.rollout import manifest as manifest_lib

log = logging.getLogger(__name__)

__all__ = [
    "ExportError",
    "export",
    "export_tensors",
    "export_delta",
    "read_manifest",
    "verify",
    "latest",
    "versions",
    "deltas",
    "version_name",
    "delta_name",
]

# Layout of an export root:
#   root/v000012/            one complete export: config.json, model*.safetensors[, index], manifest.json
#   root/d000013/            a delta export (publish.delta): delta.safetensors + manifest.json (kind, base_version,
#                            digest); applied by a server over the set it holds; never announced by LATEST
#   root/LATEST              the name of the newest announced version directory ("v000012\n")
#   root/.tmp-*              a version (or LATEST) being written; renamed into place only when complete
#   root/.del-*              a pruned version being deleted (renamed away first: no half-deleted vNNNNNN)
FORMAT = manifest_lib.FORMAT
MANIFEST = manifest_lib.NAME
LATEST = "LATEST"
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
STALE_AFTER_S = 900.0  # a .tmp-* not written to for this long is a crashed writer's, wherever it ran
_VERSION_RE = re.compile(r"v(\d{6,})")
_DELTA_RE = re.compile(r"d(\d{6,})")
# .tmp-<what>-<random>-<pid>@<host>: the pid and host let a later writer on the same host see a dead writer at once
_TMP_RE = re.compile(r"\.tmp-(?P<what>[^-]+)-(?P<rand>[0-9a-f]+)-(?P<pid>\d+)@(?P<host>.+)")


class ExportError(CheckpointError):
    """An export that cannot be written, or a directory that is not a complete, intact export: names the path and file."""


# ----------------------------------------------------------------------------- naming


def version_name(version: int) -> str:
    """The directory name of a version: zero-padded so that names sort like numbers (up to 999999)."""
    return f"v{int(version):06d}"


def delta_name(version: int) -> str:
    """The directory name of a delta export of a version."""
    return f"d{int(version):06d}"


def versions(root: str | os.PathLike, *, pattern: re.Pattern = _VERSION_RE) -> dict[int, Path]:
    """Every version directory under root by version number, ascending (complete ones: only those
    appear under a version name, by an atomic rename)."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for p in root.iterdir():
        m = pattern.fullmatch(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def deltas(root: str | os.PathLike) -> dict[int, Path]:
    """Every delta export under root by version number, ascending."""
    return versions(root, pattern=_DELTA_RE)


def _pointer(root: Path) -> str | None:
    try:
        text = (root / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text if _VERSION_RE.fullmatch(text) else None


# ----------------------------------------------------------------------------- reading


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of an export directory (not checked against the files: see `verify`)."""
    try:
        return manifest_lib.read(path)
    except manifest_lib.ManifestError as e:
        raise ExportError(str(e)) from None


def verify(path: str | os.PathLike) -> dict:
    """Check an export directory against its manifest: the same set of files, each of the recorded
    size and sha256 (every byte is read), and its version that of the directory's name. Returns the
    manifest; raises ExportError naming the first file that is missing, unexpected, truncated or different."""
    path = Path(path)
    manifest = read_manifest(path)
    m = _VERSION_RE.fullmatch(path.name)
    if m and int(m.group(1)) != manifest.get("version"):
        raise ExportError(
            f"{path}: manifest says version {manifest.get('version')}, the directory name {int(m.group(1))}"
        )
    try:
        return manifest_lib.verify(path)
    except manifest_lib.ManifestError as e:
        raise ExportError(str(e)) from None


def latest(root: str | os.PathLike) -> tuple[int, Path] | None:
    """(version, directory) of the newest announced export, or None when there is none.

    LATEST is the commit point: it names a version only after that directory is complete and on
    disk. When LATEST is missing or names a directory that is gone (removed by hand), the newest
    version directory holding a manifest is used. A version directory newer than LATEST (a writer
    that died between its rename and the LATEST update) is complete but not announced; the next
    export supersedes it. Cheap (no hashing): call `verify` on the result before loading it.
    """
    root = Path(root)
    name = _pointer(root)
    if name is not None and (root / name / MANIFEST).is_file():
        return int(name[1:]), root / name
    if name is not None:
        log.warning("%s: LATEST names %s, which is not a complete export; using the newest complete one", root, name)
    complete = [(v, p) for v, p in versions(root).items() if (p / MANIFEST).is_file()]
    return complete[-1] if complete else None


# ----------------------------------------------------------------------------- writing


def export(
    model,
    hf_config: Mapping,
    root: str | os.PathLike,
    version: int,
    *,
    dtype: str | None = "bfloat16",
    max_shard_bytes: int = 4 << 30,
    keep: int = 2,
    metadata: Mapping | None = None,
    stale_after_s: float = STALE_AFTER_S,
) -> Path:
    """Export the weights as `root/vNNNNNN` (an HF directory transformers/vLLM/SGLang load, plus
    manifest.json), atomically, then point `root/LATEST` at it and prune. Returns the directory.

    `model` is an nnx model or a (graphdef, params) pair (e.g. a TrainState's params with the
    graphdef from train.state.create). `dtype` (bfloat16 | float32 | float16 | None = the params'
    own) is what the files hold. `version` must exceed every version under root (ExportError).

    Order, so that no reader ever sees a partial export and a crash loses nothing but the
    export in flight: (1) stale `.tmp-*` of crashed writers are removed; (2) the files (hf_io.save)
    and the manifest (size + sha256 of every file) go into `root/.tmp-vNNNNNN-...`, every file and
    the directory fsynced; (3) it is renamed to `root/vNNNNNN` and root fsynced; (4) LATEST is
    replaced atomically (temp file, fsync, os.replace, fsync root); (5) version directories beyond
    the newest `keep` (0 = keep all) are deleted, never the new one. On an error before (3) the tmp
    directory is removed and root is as it was.

    Multi-process: every process must call this (hf_io.save's gathers are collective); only
    process 0 touches the filesystem; all return once process 0 has committed (or all raise).
    """
    version = _check_int(version, "version", 0)
    keep = _check_int(keep, "keep", 0)
    if isinstance(model, tuple):
        if len(model) != 2:
            raise TypeError("model must be an nnx model or a (graphdef, params) pair")
        model = nnx.merge(*model)
    root = Path(root)
    name = version_name(version)
    final = root / name
    writer = jax.process_index() == 0

    tmp = None
    error = None
    if writer:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root, stale_after_s)
            newest = _newest_version(root)
            if newest is not None and version <= newest:
                raise ExportError(
                    f"{root}: version {version} is not newer than the existing {version_name(newest)} (versions must increase)"
                )
            tmp = root / _tmp_name(name)
            tmp.mkdir()
        except Exception as e:
            error = e
    _agree(error, "prepare")

    try:
        digests: dict = {}  # sha256 of the weight files, computed while they were written
        hf_io.save(
            model,
            tmp if writer else final,
            dict(hf_config),
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            digests=digests,
        )
        if writer:
            write_manifest(tmp, version, metadata, digests)
            _commit(tmp, final)
    except BaseException as e:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not writer or isinstance(e, (KeyboardInterrupt, SystemExit)) or jax.process_count() == 1:
            raise
        error = e
    if writer and error is None:
        try:
            _point_latest(root, name)
        except Exception as e:  # the directory is complete, only not announced: kept, the next export supersedes it
            error = e
    _agree(error, "commit")
    if writer:
        _prune(root, keep, protect={name})
    log.debug("exported version %d to %s", version, final)
    return final


def export_tensors(
    tensors: Mapping,
    hf_config: Mapping,
    root: str | os.PathLike,
    version: int,
    *,
    max_shard_bytes: int = 4 << 30,
    keep: int = 2,
    metadata: Mapping | None = None,
    stale_after_s: float = STALE_AFTER_S,
) -> Path:
    """`export` of HF tensors already on this host (name -> ndarray in one dtype, e.g. a publisher's host copy):
    the same directory, manifest, LATEST and pruning, written by the calling process alone (no collectives)."""

    def write(tmp: Path, digests: dict) -> dict:
        hf_io.save_tensors(tensors, tmp, hf_config, max_shard_bytes=max_shard_bytes, digests=digests)
        return {}

    return _export_local(Path(root), version, version_name(version), write, _VERSION_RE, keep, metadata, stale_after_s)


def export_delta(
    delta,
    root: str | os.PathLike,
    version: int,
    *,
    keep: int = 2,
    metadata: Mapping | None = None,
    stale_after_s: float = STALE_AFTER_S,
) -> Path:
    """A cisjax.rollout.delta.Delta as `root/dNNNNNN` (delta.safetensors + a manifest naming its kind, base version
    and the digest of the set it leads to), atomically as `export` writes; never announced by LATEST (it is not a
    model directory: a server applies it over the set it holds). Delta exports beyond the newest `keep` are
    pruned. Written by the calling process alone."""

    def write(tmp: Path, digests: dict) -> dict:
        return delta_lib.write_dir(delta, tmp, digests)

    return _export_local(Path(root), version, delta_name(version), write, _DELTA_RE, keep, metadata, stale_after_s)


def _export_local(root: Path, version: int, name: str, write, pattern, keep, metadata, stale_after_s) -> Path:
    """One process's atomic version directory: `write(tmp, digests) -> extra manifest fields` into a .tmp-*
    directory, the manifest, the rename; LATEST moved for full exports; older ones of the same kind pruned."""
    version, keep = _check_int(version, "version", 0), _check_int(keep, "keep", 0)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root, stale_after_s)
    newest = _newest_version(root) if pattern is _VERSION_RE else max(versions(root, pattern=pattern), default=None)
    if newest is not None and version <= newest:
        what = version_name(newest) if pattern is _VERSION_RE else delta_name(newest)
        raise ExportError(f"{root}: version {version} is not newer than the existing {what} (versions must increase)")
    tmp = root / _tmp_name(name)
    tmp.mkdir()
    try:
        digests: dict = {}
        fields = write(tmp, digests)
        write_manifest(tmp, version, metadata, digests, fields)
        _commit(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if pattern is _VERSION_RE:
        _point_latest(root, name)
    _prune(root, keep, protect={name}, pattern=pattern)
    return root / name


def _check_int(value, what: str, minimum: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise errors.UserError(f"{what}={value!r}: want an integer >= {minimum}")
    return int(value)


def _agree(error: BaseException | None, stage: str) -> None:
    """Raise `error` on process 0 and a matching error on the others (collective: every process calls it at the
    same point)."""
    if distributed.agree(int(error is not None)) and error is None:
        raise ExportError(f"export failed on process 0 ({stage}); see its log")
    if error is not None:
        raise error


def _newest_version(root: Path) -> int | None:
    """The highest version under root: of any version directory, and of LATEST."""
    found = list(versions(root))
    name = _pointer(root)
    if name is not None:
        found.append(int(name[1:]))
    return max(found) if found else None


def _tmp_name(what: str) -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    return f"{TMP_PREFIX}{what}-{secrets.token_hex(4)}-{os.getpid()}@{host}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(
    tmp: Path, version: int, metadata: Mapping | None, digests: Mapping | None = None, extra: Mapping | None = None
) -> dict:
    """Hash (unless hashed while written: `digests`) and fsync every file hf_io.save wrote, write
    manifest.json (fsynced; `extra` fields added), fsync the directory."""
    config = json.loads((tmp / "config.json").read_text()) if (tmp / "config.json").is_file() else {}
    now = time.time()
    fields = {
        **dict(extra or {}),
        "version": version,
        "cisjax_version": cisjax.__version__,
        "dtype": config.get("dtype"),
        "architecture": (config.get("architectures") or [None])[0],
        "created_unix": now,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "metadata": json.loads(json.dumps(dict(metadata or {}), default=str)),
    }
    try:
        # heartbeat: a long hashing pass is not mistaken for a crashed writer
        manifest = manifest_lib.write(tmp, fields, digests=digests, heartbeat=lambda: os.utime(tmp))
    except manifest_lib.ManifestError as e:
        raise ExportError(str(e)) from None
    _fsync_path(tmp)
    return manifest


def _write_file(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, final: Path) -> None:
    """The atomic step: the complete tmp directory becomes the version directory."""
    if final.exists():  # a concurrent writer of the same version (a rename would replace an empty dir)
        raise ExportError(f"{final}: already exists (another writer?)")
    os.rename(tmp, final)
    _fsync_path(final.parent)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / _tmp_name(LATEST)
    try:
        _write_file(tmp, name + "\n")
        os.replace(tmp, root / LATEST)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_path(root)


def _remove_stale(root: Path, stale_after_s: float) -> None:
    """Delete `.del-*` (pruned versions half deleted) and the `.tmp-*` of writers that are gone: a
    dead pid on this host, or nothing written for `stale_after_s` (a live writer keeps touching its files)."""
    now = time.time()
    for p in root.iterdir():
        if p.name.startswith(DEL_PREFIX):
            _remove(p)
        elif p.name.startswith(TMP_PREFIX) and _is_stale(p, now, stale_after_s):
            log.warning("%s: removing the partial export of a writer that is gone", p)
            _remove(p)


def _is_stale(path: Path, now: float, stale_after_s: float) -> bool:
    m = _TMP_RE.fullmatch(path.name)
    if (
        m
        and m.group("host") == re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())
        and not _alive(int(m.group("pid")))
    ):
        return True
    try:
        newest = max([path.stat().st_mtime] + ([q.stat().st_mtime for q in path.iterdir()] if path.is_dir() else []))
    except FileNotFoundError:  # finished or removed meanwhile
        return False
    return now - newest > stale_after_s


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prune(root: Path, keep: int, protect: set[str], pattern: re.Pattern = _VERSION_RE) -> None:
    """Delete version directories beyond the newest `keep` (never those in `protect` nor the one
    LATEST names). Each is renamed to `.del-*` first, so a reader never finds a half-deleted version.
    Failures are logged, not raised: the export itself is complete."""
    if keep <= 0:
        return
    protect = protect | {_pointer(root)}
    old = list(versions(root, pattern=pattern).items())[:-keep]
    for _, path in old:
        if path.name in protect:
            continue
        trash = root / f"{DEL_PREFIX}{path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(path, trash)
            shutil.rmtree(trash)
        except OSError as e:
            log.warning("%s: could not prune: %s", path, e)
