"""What a plan compiles: the architecture's config.json, the mesh, and the train batch's shape at its largest."""

from __future__ import annotations

import json
import os
from pathlib import Path

from cisjax import errors, sharding
from cisjax.engines.jax.engine import bucket
from cisjax.models.padding import round_up


def read_architecture(cfg, hf_config: str | None = None, num_layers: int = 0) -> tuple[dict, str]:
    """(config.json dict, where it came from): --hf-config, else model.hf_config, else <model.path>/config.json."""
    source = hf_config or cfg.model.hf_config or (os.path.join(cfg.model.path, "config.json") if cfg.model.path else "")
    if not source:
        raise errors.UserError(
            "no architecture: pass --hf-config FILE, or set model.hf_config or model.path in the config"
        )
    path = Path(source)
    if not path.is_file():
        raise errors.MissingInput(f"architecture config not found: {path}")
    hf = json.loads(path.read_text())
    if num_layers:
        if not 0 < num_layers <= int(hf["num_hidden_layers"]):
            raise errors.UserError(f"--num-layers {num_layers}: the model has {hf['num_hidden_layers']} layers")
        hf["num_hidden_layers"] = num_layers
    return hf, str(path)


def mesh_shape(cfg, text: str) -> dict:
    """The config's mesh section with --mesh axis=size,... on top."""
    return {**{k: int(v) for k, v in cfg.mesh.to_dict().items()}, **sharding.parse_mesh(text)}


def step_shape(cfg, rows_multiple: int, rows: int = 0, seq_len: int = 0) -> dict:
    """One optimizer update's batch the loop builds for this config at its largest: M micro-batches of `rows` rows of
    `seq_len` tokens (cisjax.train.batching.build_batch's rounding; a rollout batch is train.updates_per_batch such
    mini-batches)."""
    m = int(cfg.train.micro_batches)
    samples = int(cfg.data.prompts_per_step) * int(cfg.rollout.group_size)
    per_micro_batch = -(-samples // (m * int(cfg.train.updates_per_batch)))  # ceil
    rows = rows or round_up(per_micro_batch, rows_multiple)
    if rows % rows_multiple:
        raise errors.UserError(f"--rows {rows}: must be a multiple of the mesh's batch shards ({rows_multiple})")
    if not seq_len:
        if int(cfg.data.max_prompt_tokens) <= 0:
            raise errors.UserError(
                "data.max_prompt_tokens=0 (no limit) leaves the row length open: set it, or pass --seq-len"
            )
        longest = int(cfg.data.max_prompt_tokens) + int(cfg.rollout.max_new_tokens) - 1
        multiple = int(cfg.train.length_multiple)
        seq_len = round_up(longest, multiple)
    return dict(micro_batches=m, rows=rows, seq_len=seq_len, rows_multiple=rows_multiple, samples_per_step=samples)


def sampler_shape(cfg, prompt_bucket: int = 16, new_bucket: int = 16) -> dict:
    """The JAX sampler's bucket for one step's rollouts: every prompt of the step in one call (data.prompts_per_step),
    rollout.group_size samples each, the prompt length and new tokens rounded up as the sampler rounds them
    (cisjax.engines.jax.engine.bucket: powers of two, at least 16)."""
    if int(cfg.data.max_prompt_tokens) <= 0:
        raise errors.UserError("data.max_prompt_tokens=0 (no limit) leaves the sampler's prompt length open: set it")
    prompt_len, new = (
        bucket(int(cfg.data.max_prompt_tokens), prompt_bucket),
        bucket(int(cfg.rollout.max_new_tokens), new_bucket),
    )
    return dict(
        batch=bucket(int(cfg.data.prompts_per_step), 1),
        prompt_len=prompt_len,
        n=int(cfg.rollout.group_size),
        new_tokens=new,
        slots=prompt_len + new,
    )
