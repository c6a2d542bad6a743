"""The model evaluated through the rollout service: a client of a running server or of an embedded child, the served
vocabulary checked against the local model's, and the export version the local directory records."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cisjax import errors
from cisjax.rollout import service


@contextlib.contextmanager
def serving(
    server: str,
    *,
    model_dir,
    log_path,
    backend: str,
    dtype: str,
    kv_cache_gib: float,
    token: str | None,
    startup_s: float,
    tls=None,
) -> Iterator:
    """A client of `server` (HOST:PORT, or several: a fleet), or of an embedded server child on `model_dir` (its
    output in `log_path`; its exports confined to a temporary directory: it never loads other weights). On exit the
    client is closed, then the child stopped, then the directory removed."""
    export_root = "" if server else tempfile.mkdtemp(prefix="cisjax-eval-")
    try:
        child, client = service.connect(
            server,
            model_dir=model_dir,
            export_root=export_root,
            log_path=log_path,
            backend=backend,
            dtype=dtype,
            kv_cache_gib=kv_cache_gib,
            token=token,
            tls=tls,
            startup_s=startup_s,
        )
        try:
            yield client
        finally:
            client.close()
            if child is not None:
                child.stop()
    finally:
        if export_root:
            os.rmdir(export_root)


def check_vocabulary(info: dict, model_dir, tokenizer, where: str) -> None:
    """ValueError unless the server's vocabulary is --model's (config.json vocab_size) and holds every token id the
    tokenizer can produce: token ids cross the boundary, so another vocabulary would mean another model."""
    served = int(info["vocab_size"])
    cfg = Path(model_dir) / "config.json"
    if cfg.is_file():
        ours = json.loads(cfg.read_text()).get("vocab_size")
        if ours is not None and int(ours) != served:
            raise errors.UserError(
                f"{where} serves a model with vocab_size {served} ({info.get('model')}), but --model {model_dir} has "
                f"{ours}: not the same model"
            )
    if len(tokenizer) > served:
        raise errors.UserError(
            f"the tokenizer of {model_dir} has {len(tokenizer)} tokens, more than the vocab_size {served} that {where} "
            f"serves ({info.get('model')}): not the same model"
        )


def export_version(model_dir) -> int | None:
    """The version recorded by `cisjax export` in the model directory's manifest.json, None for other directories."""
    try:
        return json.loads((Path(model_dir) / "manifest.json").read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None
