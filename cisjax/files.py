"""Atomic file writes: a temp file in the same directory, fsynced, renamed into place (never a half-written output)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike):
    """A text file handle; on a clean exit the file is fsynced and replaces `path`, on an exception it is removed.
    The parent directory is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_jsonl_atomic(path: str | os.PathLike, records, keys) -> None:
    """One JSON line per record (its `keys`, those it has), written atomically."""
    with atomic_open(path) as f:
        for rec in records:
            f.write(json.dumps({k: rec[k] for k in keys if k in rec}) + "\n")
