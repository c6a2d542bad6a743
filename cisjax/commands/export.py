"""`cisjax export`: a train checkpoint's weights as a versioned HF directory for the rollout server."""

from __future__ import annotations

import argparse
import sys

from cisjax import errors
from cisjax import export as export_lib
from cisjax.models import hf_io
from cisjax.train import checkpoint


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="train checkpoint directory (cisjax.train.checkpoint)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest committed)")
    p.add_argument(
        "--model", required=True, help="the run's Hugging Face model directory (config.json: the architecture)"
    )
    p.add_argument("--out", required=True, help="export root: versions go to OUT/vNNNNNN, OUT/LATEST names the newest")
    p.add_argument(
        "--version",
        type=int,
        default=None,
        help="export version (default: the checkpoint's step, the number of optimizer steps its weights have taken)",
    )
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16", help="dtype of the exported tensors"
    )
    p.add_argument("--keep", type=int, default=2, help="version directories to keep under OUT (0 = all)")
    p.add_argument(
        "--max-shard-bytes", type=int, default=4 << 30, help="split the safetensors into files of at most this size"
    )


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Restore a checkpoint's params onto one device (hf_io for the model's structure) and export them."""
    if overrides:
        raise errors.UserError(f"cisjax export takes no --config overrides (got {overrides})")
    hf = hf_io.read_hf_config(args.model)
    graphdef, abstract = hf_io.abstract_model(hf, hf_io.model_config(hf))
    params, info = checkpoint.restore_params(args.checkpoint, abstract, step=args.step)
    version = info["step"] if args.version is None else args.version
    path = export_lib.export(
        (graphdef, params),
        hf,
        args.out,
        version,
        dtype=args.dtype,
        keep=args.keep,
        max_shard_bytes=args.max_shard_bytes,
        metadata={"source": "checkpoint", **info},
    )
    print(
        f"{path}  (checkpoint step {info['step']}, policy version {info['policy_version']}, "
        f"{info['data_position']} prompts seen)",
        file=sys.stderr,
    )
    print(path)
    return 0
