"""`cisjax plan`: the train step compiled for a TPU slice or GPU set on this host: memory, fit, FLOPs."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# Set before JAX starts (the imports below bring it in). plan never runs anything: its devices are the compiler's
# deviceless ones, so it uses no local accelerator (a TPU VM's chips stay free for a running job), and libtpu gets the
# host settings it asks for on a machine without a TPU instead of printing warnings about them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# libtpu locks a machine-wide file so that one process owns the TPU; compiling owns nothing, and several plans (or a
# plan beside a job on a TPU VM) may run at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from cisjax import config as config_lib  # noqa: E402
from cisjax import errors  # noqa: E402
from cisjax.plan import hardware, report  # noqa: E402
from cisjax.plan.planner import DEFAULT_PROGRAMS, PROGRAM_NAMES, SEARCHES, plan  # noqa: E402


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=config_lib.FLAG_HELP)
    p.add_argument("--topology", required=True, help=f"the target: {hardware.NAMES_HELP}")
    p.add_argument(
        "--mesh",
        default="",
        help="mesh axes, e.g. fsdp=8,expert=1 (default: the config's mesh section; "
        "one size may be -1 = the rest of the chips)",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        help="the architecture's config.json (default: model.hf_config, else "
        "<model.path>/config.json); no weights are read",
    )
    p.add_argument("--num-layers", type=int, default=0, help="compile a cut of the model: its first N layers (0 = all)")
    p.add_argument(
        "--rows",
        type=int,
        default=0,
        help="rows per micro-batch (default: data.prompts_per_step x "
        "rollout.group_size / train.micro_batches, rounded up to the mesh's batch shards)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="padded tokens per row (default: data.max_prompt_tokens + "
        "rollout.max_new_tokens - 1, rounded up to train.length_multiple)",
    )
    p.add_argument(
        "--search",
        choices=list(SEARCHES),
        default=None,
        help="rows: also find the largest rows per micro-batch whose train step fits in HBM (a compile per probe); "
        "options: when the train step does not fit, the smallest set of memory options that makes it fit (bf16 "
        "moments, the moments offloaded to host memory, bf16 master weights, full remat; a whole plan per set tried)",
    )
    p.add_argument("--max-rows", type=int, default=4096, help="--search rows: stop growing at this many rows")
    p.add_argument(
        "--programs",
        default=",".join(DEFAULT_PROGRAMS),
        help=f"which of the loop's programs to compile (comma-separated from {','.join(PROGRAM_NAMES)}; default "
        f"{','.join(DEFAULT_PROGRAMS)}); sampler: the JAX sampler's program for one step's rollouts "
        "(data.prompts_per_step prompts x rollout.group_size samples) on the same mesh, and its KV cache",
    )
    p.add_argument(
        "--no-layer-costs", action="store_true", help="skip the per-layer-kind programs (no FLOP table, no roofline)"
    )
    p.add_argument("--json", default=None, help="also write the whole report as JSON to this file")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Load the config, compile its programs for --topology, print the report (and write it as JSON)."""
    cfg = config_lib.load(args.config, overrides or [])
    programs = [p for p in args.programs.split(",") if p]
    unknown = sorted(set(programs) - set(PROGRAM_NAMES))
    if unknown:
        raise errors.UserError(f"--programs: unknown {unknown}; from {list(PROGRAM_NAMES)}")
    doc = plan(
        cfg,
        target_name=args.topology,
        mesh_text=args.mesh,
        hf_config=args.hf_config,
        num_layers=args.num_layers,
        rows=args.rows,
        seq_len=args.seq_len,
        programs=programs,
        layer_costs=not args.no_layer_costs,
        search=args.search,
        max_rows=args.max_rows,
        log=report.console_log,
    )
    report.print_report(doc)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
    return 0
