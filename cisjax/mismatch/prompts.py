"""The prompts a measurement samples from (token ids, text or problem rows) and the stop tokens of its model."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cisjax import data, errors, tokenizer

log = logging.getLogger(__name__)

PROMPT_FORMATS = """prompts (--prompts, jsonl): {"prompt_ids": [...]} lines are used as they are; {"prompt": "text"} lines are
encoded as they are (no chat template); any other row is a problem of --kind (default dapo_math_17k, e.g. the
DAPO-Math-17k rows), formatted as the trainer formats them (the tokenizer's chat template and the training instruction)."""


def stop_ids(model_dir) -> list[int]:
    """The model's stop tokens (none without a tokenizer: the responses run to max_new_tokens)."""
    try:
        return list(data.PromptFormatter(model_dir, chat_template=False).stop_token_ids)
    except Exception as err:  # noqa: BLE001  (no tokenizer: the responses run to --max-new-tokens)
        log.warning("no stop tokens (%s)", err)
        return []


def _token_ids(path: Path, rows) -> list[list[int]]:
    """{"prompt_ids": [...]} rows, checked."""
    out = []
    for i, r in enumerate(rows):
        ids = r.get("prompt_ids") if isinstance(r, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise errors.UserError(f"{path}: prompt {i + 1}: 'prompt_ids' must be a non-empty list of token ids")
        out.append(ids)
    return out


def _texts(path: Path, rows, model_dir) -> list[list[int]]:
    """{"prompt": "text"} rows, encoded as they are."""
    tok = tokenizer.load(model_dir)
    texts = [r.get("prompt") if isinstance(r, dict) else None for r in rows]
    bad = [i + 1 for i, t in enumerate(texts) if not isinstance(t, str) or not t]
    if bad:
        raise errors.UserError(f"{path}: prompt(s) {bad[:5]}: 'prompt' must be a non-empty string")
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def read_prompts(path, model_dir, *, kind: str, num: int, seed: int) -> list[list[int]]:
    """Prompt token ids from `path` (PROMPT_FORMATS), a seeded sample of `num` of them when num > 0."""
    path = Path(path)
    if not path.is_file():
        raise errors.MissingInput(f"--prompts {path}: no such file")
    rows = data.read_jsonl(str(path))
    if not rows:
        raise errors.UserError(f"{path}: no prompts")
    if num > 0 and num < len(rows):
        pick = np.sort(np.random.default_rng(seed).choice(len(rows), num, replace=False))
        rows = [rows[i] for i in pick]
    first = rows[0] if isinstance(rows[0], dict) else {}
    if "prompt_ids" in first:
        return _token_ids(path, rows)
    if isinstance(first.get("prompt"), str):
        return _texts(path, rows, model_dir)
    problems = data.problems_from_rows(rows, kind=kind, where=str(path))
    return data.PromptFormatter(model_dir, instruction=data.TRAIN_INSTRUCTION).encode_batch(problems)
