"""One process of tests/train/test_loop_multiprocess.py (its arguments: see `main`)."""

import os
import sys

from tests.support import xla_flags


def config(prepared: str, run_dir: str, steps: int):
    """configs/base.py on the demo's model and data, shrunk: the transformers engine (deterministic) in bf16 against the
    fp32 trainer (correction weights other than 1), synchronous seeded rollouts, fp32 exports, a data x fsdp mesh over
    4 devices, a checkpoint every 2 steps. Dumps at steps 0 and 3: a run resumed at step 3 then traces the step after
    the same checks as the first (checkify numbers them per process), so its compilation comes from the cache."""
    from cisjax import config as config_lib

    overrides = {
        "model.path": f"{prepared}/model",
        "data.source": f"{prepared}/data/heldout.jsonl",
        "run.dir": run_dir,
        "run.steps": steps,
        "run.progress": "off",
        "run.tensorboard": "false",
        "run.dump_every": 3,
        "mesh.data": 2,
        "mesh.fsdp": 2,
        "train.precision": "fp32",
        "train.lr": 1e-4,
        "train.length_multiple": 32,
        "data.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 12,
        "rollout.backend": "transformers",
        "rollout.dtype": "bfloat16",
        "rollout.seed": 3,
        "rollout.max_staleness": 0,
        "rollout.startup_s": 120,
        "publish.dtype": "float32",
        "publish.canary.num_sequences": 2,
        "publish.canary.response_len": 8,
        "publish.canary.mean_abs": 0.3,
        "publish.canary.max_abs": 0,
        "checkpoint.every": 2,
        "checkpoint.keep": 2,
        "reward.workers": 1,
        # the untrained model earns no reward: raw (reward - 0.5) * 10 advantages still give every token a gradient
        "advantages.group_norm": "false",
        "advantages.batch_norm": "false",
    }
    return config_lib.load(None, [f"--config.{k}={v}" for k, v in overrides.items()])


class StopOnLastProcess:
    """A stop event that only the last process sees, from step `at` on: a signal that reached one process of several."""

    def __init__(self, at: int):
        self.at, self.checks = at, 0

    def is_set(self) -> bool:
        import jax

        self.checks += 1  # the loop asks once before each step
        return jax.process_index() == jax.process_count() - 1 and self.checks > self.at


def main(
    port: str,
    process_id: str,
    processes: str,
    devices: str,
    prepared: str,
    run_dir: str,
    steps: str,
    mode: str,
    out: str,
) -> int:
    """`train` on PROCESSES processes x DEVICES CPU devices (coordinator on 127.0.0.1:PORT): STEPS steps from scratch
    (mode "fresh"), or ("stop@N") with a stop from step N on seen by the last process only, or continuing from the
    last checkpoint ("resume"); the last metrics and what this process started go to OUT (JSON)."""
    import json
    import logging
    import signal

    import jax

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the loop's cleanup (the rollout server) runs

    logging.basicConfig(level=logging.INFO, format=f"[p{process_id}] %(asctime)s %(name)s %(levelname)s %(message)s")
    # a resumed run compiles the programs of the first one again: a cache shared by the run's invocations
    jax.config.update("jax_compilation_cache_dir", os.path.join(run_dir, "..", f"jax_cache_{processes}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if int(processes) > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=int(processes),
            process_id=int(process_id),
            initialization_timeout=300,
        )
    assert (
        jax.process_count() == int(processes) and jax.device_count() == 4 and jax.local_device_count() == int(devices)
    )

    from cisjax.rollout import client as client_lib
    from cisjax.rollout import service
    from cisjax.train import loop

    # count what this process starts and connects to (only process 0 may talk to the rollout server)
    made = {"clients": 0, "servers": 0}

    class CountedClient(client_lib.RolloutClient):
        def __init__(self, *a, **kw):
            made["clients"] += 1
            super().__init__(*a, **kw)

    class CountedServer(service.EmbeddedServer):
        def __init__(self, *a, **kw):
            made["servers"] += 1
            super().__init__(*a, **kw)

        def _spawn(self):
            proc = super()._spawn()
            with open(out + ".servers", "a") as f:  # the test kills these if this process dies before stopping them
                f.write(f"{proc.pid}\n")
            return proc

    client_lib.RolloutClient, service.EmbeddedServer = CountedClient, CountedServer

    stop = StopOnLastProcess(int(mode.split("@")[1])) if mode.startswith("stop@") else None
    last = loop.train(config(prepared, run_dir, int(steps)), resume=mode == "resume", stop_event=stop)
    with open(out, "w") as f:
        json.dump({"process": jax.process_index(), "made": made, "last": last}, f)
    if int(processes) > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    # DEVICES CPU devices in this process and the suite's compile flags, set before jax is imported
    os.environ["XLA_FLAGS"] = xla_flags.flags(int(sys.argv[4]))
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        code = main(*sys.argv[1:])
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # not jax.distributed's exit barrier, which waits minutes for a peer that failed or is stuck in a collective
    os._exit(code)
