"""The export-directory manifest (manifest.json: format, version, size and sha256 of every file), written and verified."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

# Imported by the JAX-free rollout server and client: standard library only.

__all__ = [
    "FORMAT",
    "NAME",
    "ManifestError",
    "sha256_file",
    "write",
    "read",
    "recorded_checksums",
    "check_sizes",
    "verify",
]

FORMAT = "cisjax-export/1"
NAME = "manifest.json"  # written last into an export directory, before its atomic rename
CHUNK = 8 << 20


class ManifestError(ValueError):
    """A manifest that is missing, unreadable or not of FORMAT, or files that disagree with it: names the file."""


def sha256_file(path: str | os.PathLike, *, fsync: bool = False) -> tuple[str, int]:
    """(hex sha256, size in bytes) of a file, read in chunks; `fsync`: also flush it to disk (one pass for both)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
        return h.hexdigest(), f.tell()


def write(directory: str | os.PathLike, fields: Mapping, *, digests: Mapping | None = None, heartbeat=None) -> dict:
    """Hash (unless already hashed: `digests`, file name -> sha256, of files written and fsynced) and fsync every
    file of `directory`, then write its manifest (fsynced): {"format": FORMAT, **fields, "files": {name: {size,
    sha256}}}. `heartbeat()` runs after each file hashed here. Returns the manifest; the caller fsyncs the directory."""
    directory = Path(directory)
    files = {}
    for file in sorted(directory.iterdir()):
        if not file.is_file() or file.is_symlink():
            raise ManifestError(f"{file}: not a regular file in an export")
        if digests and file.name in digests:
            files[file.name] = {"size": file.stat().st_size, "sha256": digests[file.name]}
            continue
        digest, size = sha256_file(file, fsync=True)
        files[file.name] = {"size": size, "sha256": digest}
        if heartbeat is not None:
            heartbeat()
    manifest = {"format": FORMAT, **fields, "files": files}
    with open(directory / NAME, "w") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read(directory: str | os.PathLike) -> dict:
    """The manifest of an export directory, checked for form (not against the files: see `verify`)."""
    directory = Path(directory)
    file = directory / NAME
    if not directory.is_dir():
        raise ManifestError(f"{directory}: no such export directory")
    if not file.is_file():
        raise ManifestError(f"{directory}: not a complete export (no {NAME})")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"{file}: unreadable manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(
            f"{file}: not a {FORMAT} manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and {"size", "sha256"} <= v.keys() for v in files.values()
    ):
        raise ManifestError(f"{file}: malformed 'files' table")
    return manifest


def recorded_checksums(directory: str | os.PathLike) -> dict | None:
    """{file name: sha256} as the manifest recorded them at write time, or None for a directory without a readable one."""
    try:
        return {name: entry["sha256"] for name, entry in read(directory)["files"].items()}
    except ManifestError:
        return None


def check_sizes(directory: str | os.PathLike) -> None:
    """Cheap completeness check (no hashing): every file the manifest lists is there with its recorded size. A
    directory without a manifest passes (a plain HF directory)."""
    directory = Path(directory)
    if not (directory / NAME).is_file():
        return
    files = read(directory)["files"]
    for name, entry in sorted(files.items()):
        f = directory / name
        if not f.is_file() or f.stat().st_size != entry["size"]:
            raise ManifestError(
                f"{directory.name}: {name} is missing or not the {entry['size']} bytes its {NAME} lists (incomplete export)"
            )


def verify(directory: str | os.PathLike) -> dict:
    """Check an export directory against its manifest: the same set of files, each of the recorded size and sha256
    (every byte is read). Returns the manifest; raises ManifestError naming the first file that is missing,
    unexpected, truncated or different."""
    directory = Path(directory)
    manifest = read(directory)
    want = manifest["files"]
    have = {p.name for p in directory.iterdir() if p.name != NAME}
    if missing := sorted(want.keys() - have):
        raise ManifestError(
            f"{directory}: file {missing[0]} is missing (listed in {NAME}){f'; also {missing[1:]}' if len(missing) > 1 else ''}"
        )
    if extra := sorted(have - want.keys()):
        raise ManifestError(
            f"{directory}: unexpected file {extra[0]} (not in {NAME}){f'; also {extra[1:]}' if len(extra) > 1 else ''}"
        )
    for name in sorted(want):
        file = directory / name
        size = file.stat().st_size
        if size != want[name]["size"]:
            raise ManifestError(
                f"{file}: size {size} bytes, the manifest says {want[name]['size']} (truncated or rewritten)"
            )
        digest, _ = sha256_file(file)
        if digest != want[name]["sha256"]:
            raise ManifestError(
                f"{file}: sha256 {digest} differs from the manifest's {want[name]['sha256']} (corrupted)"
            )
    return manifest
