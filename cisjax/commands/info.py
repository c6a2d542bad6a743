"""`cisjax info`: a Hugging Face model directory as cisjax loads it (family, config, parameter counts, MoE layers)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import flax.nnx as nnx

from cisjax import errors
from cisjax.models import hf_io


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Family, parsed config, parameter counts and routing layout, without loading weights."""
    if overrides:
        raise errors.UserError(f"cisjax info takes no --config overrides (got {overrides})")
    hf = hf_io.read_hf_config(args.model)
    cfg = hf_io.model_config(hf)
    _, abstract = hf_io.abstract_model(hf, cfg)
    sizes = [math.prod(v.shape) for _, v in nnx.to_flat_state(abstract)]
    files = hf_io.SafetensorsDir(args.model)
    print(f"architecture: {hf['architectures'][0]}  ({hf_io.FAMILIES[hf['architectures'][0]]})")
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        print(f"  {field.name} = {value.dtype.name if hasattr(value, 'dtype') else value}")
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    print(f"parameters: {sum(sizes):,} in {len(sizes)} arrays; checkpoint tensors: {len(files.names())}")
    print(f"MoE layers ({len(moe)}): {moe}")
    return 0
