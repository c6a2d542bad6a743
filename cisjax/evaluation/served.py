"""The served model against the local one: the same vocabulary, and the export version the local directory records."""

from __future__ import annotations

import json
from pathlib import Path

from cisjax import errors


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
