"""`cisjax train`: the RL loop of a config file, with a checkpoint on the first SIGINT/SIGTERM (abort on the second)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

import jax

from cisjax import config as config_lib
from cisjax import console
from cisjax.commands import remote
from cisjax.train import loop

log = logging.getLogger("cisjax.train")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        help="config file returning a ConfigDict, or a config's name (qwen15_moe_a27b: configs/qwen15_moe_a27b.py)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint of the run (same data order and versions)",
    )


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    console.setup()
    cfg = config_lib.load(args.config, overrides or [])
    if config_lib.secret_overrides(overrides or []):
        log.warning(remote.TOKEN_ON_COMMAND_LINE.replace("--token", "--config.rollout.token"))
    _init_distributed()
    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():
            raise KeyboardInterrupt
        log.warning("signal %d: finishing the current step, then a checkpoint (again to abort)", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    last = loop.train(cfg, resume=args.resume, stop_event=stop)
    print(json.dumps({k: last[k] for k in ("reward_mean", "accuracy", "time/step_s") if k in last}))
    return 0


def _init_distributed() -> None:
    """Multi-host runs opt in with CISJAX_DISTRIBUTED=1 (launchers/tpu_pod.sh sets it): jax.distributed.initialize()
    before anything touches a device, its arguments auto-detected (TPU VM metadata, SLURM, Open MPI;
    JAX_COORDINATOR_ADDRESS is read too). Off by default: a single-host run needs no coordinator."""
    if os.environ.get("CISJAX_DISTRIBUTED", "0") in ("", "0"):
        return
    jax.distributed.initialize()
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
