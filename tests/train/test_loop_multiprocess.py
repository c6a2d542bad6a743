"""`cisjax train` under jax.distributed: two processes x 2 CPU devices (gloo) train as one process does on the same
4-device mesh (same losses, gradients and weights), with one writer of exports and metrics, and resume from a checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cisjax import export as export_lib
from cisjax.rollout.launch import free_port
from cisjax.train.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420
STEPS = 4  # the two-process run is stopped after 3 (a checkpoint) and resumed for the 4th

pytestmark = pytest.mark.slow


class _Run:
    """The worker processes of one `train` call (one per jax process), their logs under `tmp`."""

    def __init__(self, tmp: Path, name: str, processes: int, prepared: Path, run_dir: Path, steps: int, mode: str):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # 2 CI cores shared by up to 3 trainers and 2 servers
        self.name, self.procs, self.logs, self.outs = name, [], [], []
        for pid in range(processes):
            self.outs.append(tmp / f"{name}.p{pid}.json")
            self.logs.append(tmp / f"{name}.p{pid}.log")
            cmd = [
                sys.executable,
                "-m",
                "tests.train._loop_worker",
                str(port),
                str(pid),
                str(processes),
                str(4 // processes),
                str(prepared),
                str(run_dir),
                str(steps),
                mode,
                str(self.outs[-1]),
            ]
            with open(self.logs[-1], "w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))

    def done(self) -> bool:
        """True once every process exited 0; fails as soon as one exits otherwise (the others would wait in a collective)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            self.kill()
            pytest.fail(f"{self.name}: exit codes {codes}\n{self.tails()}")
        return all(c == 0 for c in codes)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p, out in zip(self.procs, self.outs):  # rollout servers a failed worker may have left behind
            servers = Path(f"{out}.servers")
            if p.returncode == 0 or not servers.exists():
                continue
            for pid in servers.read_text().split():
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def tails(self) -> str:
        def tail(log: Path) -> str:
            lines = log.read_text(errors="replace").splitlines()[-400:]
            lines = [line for line in lines if " absl " not in line]  # orbax's chatter
            return "\n".join(lines)[-4000:]

        return "\n".join(f"--- {log.name}\n{tail(log)}" for log in self.logs)

    def results(self) -> list[dict]:
        return [json.loads(out.read_text()) for out in self.outs]


def _wait(runs, deadline):
    while not all([r.done() for r in runs]):  # every run polled: a failure anywhere ends the wait
        if time.monotonic() > deadline:
            for r in runs:
                r.kill()
            pytest.fail("timed out\n" + "\n".join(r.tails() for r in runs))
        time.sleep(0.5)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(export_dir: Path) -> dict:
    from safetensors.numpy import load_file

    return {k: v for f in sorted(export_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_two_processes_train_as_one(prepared, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    deadline = time.monotonic() + TIMEOUT_S
    runs = []
    try:
        # the reference (1 process x 4 devices, straight through) runs beside the two-process run
        runs.append(_Run(tmp_path, "one", 1, prepared, one, STEPS, "fresh"))
        # a stop before step 3 that only process 1 sees: both leave after step 2 and checkpoint the state of step 3
        runs.append(_Run(tmp_path, "two", 2, prepared, two, STEPS, "stop@3"))
        _wait(runs[1:], deadline)
        runs.append(_Run(tmp_path, "two_resumed", 2, prepared, two, STEPS, "resume"))
        _wait(runs, deadline)
    finally:
        for r in runs:
            r.kill()
    (ref,), stopped, resumed = (r.results() for r in runs)

    # only process 0 started the rollout server and talked to it (once per invocation)
    assert ref["made"] == {"clients": 1, "servers": 1}
    for res, version in ((stopped, 3), (resumed, 4)):
        assert [r["made"] for r in res] == [{"clients": 1, "servers": 1}, {"clients": 0, "servers": 0}]
        # every process returns the step's metrics (the rollout metrics broadcast from process 0)
        lead, other = (r["last"] for r in res)
        assert lead["publish/version"] == other["publish/version"] == version
        for k in ("train/loss", "train/grad_norm", "reward/mean", "rollout/tokens", "rollout/response_len_max"):
            assert other[k] == lead[k], k
        assert "time/generate_s" in lead and "time/generate_s" not in other

    # one metrics line per step (process 0 alone writes), the same numbers as the one-process run
    rows_one, rows_two = _metrics(one), _metrics(two)
    assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two] == list(range(STEPS))
    for a, b in zip(rows_one, rows_two):
        # the same samples: the batch is the same
        for k in ("rollout/tokens", "rollout/response_len", "reward/mean", "rollout/staleness_max", "publish/version"):
            assert a[k] == b[k], (a["step"], k)
        assert a["train/grad_norm"] > 0
        for k in ("train/loss", "train/grad_norm", "train/entropy"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=f"step {a['step']} {k}")
        # a mean of |log p - log q| (about 6e-4 here) of logprobs up to about 10 in magnitude: the two programs (4
        # devices in one process, 2 x 2) may round a logprob an fp32 unit apart (up to 9.5e-7 at 8), not more
        np.testing.assert_allclose(b["train/abs_logk_mean"], a["train/abs_logk_mean"], rtol=0, atol=2e-6)
    for k in ("train/loss", "train/grad_norm"):
        print(f"{k} (1 process, 2 processes):", [(a[k], b[k]) for a, b in zip(rows_one, rows_two)])

    # the proximal logprobs of the dumped steps agree too
    for step in (0, 3):
        d1, d2 = (np.load(d / "dumps" / f"step_{step:07d}.npz") for d in (one, two))
        np.testing.assert_array_equal(d1["position"], d2["position"])
        np.testing.assert_allclose(d2["logp_prox"], d1["logp_prox"], atol=1e-5, rtol=0)

    # one set of exports (process 0 writes; keep = 2), complete, with the same weights after the last step
    for d in (one, two):
        assert sorted(p.name for p in (d / "exports").iterdir()) == ["LATEST", "v000003", "v000004"]
        assert (d / "exports" / "LATEST").read_text().strip() == "v000004"
        for v in ("v000003", "v000004"):
            export_lib.verify(d / "exports" / v)
    w1, w2 = _weights(one / "exports" / "v000004"), _weights(two / "exports" / "v000004")
    assert sorted(w1) == sorted(w2)
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6, err_msg=k)

    # the checkpoints, saved by both processes together: the stop's (step 3) and, after resuming from it, step 4's
    ckpt = Checkpointer(two / "checkpoints", read_only=True)
    try:
        assert ckpt.all_steps() == [3, 4]
        for step in (3, 4):
            meta = ckpt.metadata(step)
            assert meta["version"] == step and meta["data_state"] is not None  # process 0's data position
    finally:
        ckpt.close()
