"""The GPU check's loop section: the demo's warm-up, `cisjax train` with the colocated JAX sampler (plain and
rollout.exact), and launchers/gpu_local.sh with the transformers engine as a server on the same GPU; each a
subprocess, read back from its metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# full: the demo's own recipe on a GPU (800 warm-up steps, 64 RL steps; the learning verdict compares the last
# WINDOW steps' reward with the first WINDOW's); small: every path end to end on a CPU in a minute or two.
SIZES = {
    "full": dict(
        warmup_steps=800,
        heldout=512,
        eval_size=256,
        steps=64,
        local_steps=4,
        exact_steps=8,
        window=16,
        prompts=32,
        group=8,
    ),
    "small": dict(
        warmup_steps=8, heldout=64, eval_size=0, steps=4, local_steps=4, exact_steps=3, window=2, prompts=4, group=4
    ),
}
# gpu_local.sh's engine dtype: bf16 as the demo serves it; float32 on a CPU's toy run (torch's CPU bf16 is slow)
ENGINE_DTYPE = {"full": "bfloat16", "small": "float32"}
STOP_S = 15.0  # a stage past its deadline: seconds between TERM (the launcher stops its servers) and KILL, within
# the check's grace (gpu_check.GRACE_S) after the part's deadline
# The learning verdict: the mean reward of the last WINDOW steps at least this much above the first WINDOW's. The
# demo's colocated runs on a CPU (docs/results.md) went 0.29 -> 0.70 over 32-step windows of 128 steps; this
# section's own 64 steps on a CPU (tests/fixtures/gpu_check/loop_colocated_cpu.jsonl) 0.167 -> 0.463 over 16-step
# windows, with step-to-step spread of about 0.05: a gain of 0.10 is well outside noise and well inside learning.
MARGIN = 0.10
# Each process's share of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION; gpu_local.sh's GPU_MEM and TRAIN_MEM):
# the two colocated runs and gpu_local.sh's two processes run at once (on an H200 on 2026-11-30 each run, alone,
# peaked at 1.1 GiB: the demo's model is small), the warm-up before them alone.
MEM_SHARES = dict(prepare="0.93", colocated="0.22", exact="0.22", gpu_local_server="0.22", gpu_local_trainer="0.22")
# rollout.exact's run: the colocated sampler computing each token's logprob as the train step does, bit for bit
# (train/exact_frac 1 at every step, every correction weight 1); fed one position per step, no staleness
EXACT_ARGS = ("--config.rollout.exact=True", "--config.rollout.max_staleness=0", "--config.eval.sets=")
# Phases read from metrics.jsonl (time/<phase>_s): the rollout side's generation, what the trainer waited for it,
# the update, the publish (swap or export + reload, and the canary), the in-loop evaluation, the whole step.
PHASES = ("generate", "rollout_wait", "train", "publish", "eval", "step")


def learning(rewards: list[float], window: int, margin: float = MARGIN) -> dict:
    """The mean reward of the first and last `window` steps and whether the last beat the first by `margin` (None:
    fewer than 2 x window steps, no verdict)."""
    if len(rewards) < 2 * window:
        return dict(first=None, last=None, gain=None, met=None, window=window, margin=margin)
    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
    return dict(first=first, last=last, gain=last - first, met=last - first >= margin, window=window, margin=margin)


def summarize(rows: list[dict], window: int) -> dict:
    """A run's figures from its metrics.jsonl rows: steps, rewards, the learning verdict, each phase's median seconds
    (over the steps after the first, which compiles) and the first step's, the canary's worst reading, peak device
    memory."""
    out = dict(steps=len(rows), rewards=[r.get("reward_mean") for r in rows])
    out["learning"] = learning([float(x) for x in out["rewards"] if x is not None], window)
    phases = {}
    for phase in PHASES:
        vals = [r[f"time/{phase}_s"] for r in rows if r.get(f"time/{phase}_s") is not None]
        if vals:
            later = vals[1:] or vals
            phases[phase] = dict(first_s=vals[0], median_s=statistics.median(later), total_s=sum(vals), n=len(vals))
    out["phases"] = phases
    canary = [r["publish/canary_mean_abs"] for r in rows if r.get("publish/canary_mean_abs") is not None]
    out["canary"] = dict(checked=len(canary), mean_abs_max=max(canary) if canary else None)
    peaks = [r["device/peak_gib"] for r in rows if r.get("device/peak_gib") is not None]
    out["peak_gib"] = max(peaks) if peaks else None
    evals = {k: v for r in rows for k, v in r.items() if k.startswith("eval/") and k.endswith("/accuracy")}
    out["eval"] = evals
    # the fraction of response tokens whose sampler logprob q equals the step's p bit for bit, per step
    out["exact_frac"] = [r.get("train/exact_frac") for r in rows]
    logk = [r["train/abs_logk_max"] for r in rows if r.get("train/abs_logk_max") is not None]
    out["abs_logk_max"] = max(logk) if logk else None
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """`cmd` started from the repository's root in a session of its own, its output to `log`."""
    fh = open(log, "w")  # closed by _wait
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, text=True
    )
    return dict(proc=proc, fh=fh, log=log, cmd=cmd, t0=time.time())


def _wait(started: dict, deadline: float) -> dict:
    """How a started command ended, its whole session killed at `deadline`."""
    proc, cmd, log = started["proc"], started["cmd"], started["log"]
    try:
        proc.wait(timeout=max(deadline - time.time(), 1.0))
        status = "ok" if proc.returncode == 0 else f"failed (exit code {proc.returncode})"
    except subprocess.TimeoutExpired:
        # TERM first: gpu_local.sh's trap stops its servers (their own sessions), which a KILL would leave running
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        status = "timed out"
    started["fh"].close()
    out = dict(status=status, seconds=time.time() - started["t0"])
    out["command"] = " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
    if status != "ok":
        out["log_tail"] = log.read_text(errors="replace")[-3000:]
    return out


def _run(cmd: list[str], log: Path, deadline: float, env: dict | None = None) -> dict:
    """`cmd` from the repository's root, its output to `log`, killed (its whole session) at `deadline`: how it ended."""
    return _wait(_start(cmd, log, env), deadline)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _train_args(init: Path, run_dir: Path, steps: int, spec: dict) -> list[str]:
    """`cisjax train`'s arguments shared by both runs: the demo config on the warm-up's model and RL problems, for
    `steps` steps of the spec's prompts and group size, evaluated in the loop on the test problems."""
    return [
        "--config",
        "configs/demo_cpu.py",
        f"--config.model.path={init / 'model'}",
        f"--config.data.source={init / 'data' / 'rl.jsonl'}",
        f"--config.data.prompts_per_step={spec['prompts']}",
        f"--config.rollout.group_size={spec['group']}",
        f"--config.run.dir={run_dir}",
        f"--config.run.steps={steps}",
        "--config.run.print_every=8",
        "--config.eval.sets=gsm8k",
        f"--config.eval.data=gsm8k={init / 'data' / 'test.jsonl'}",
        f"--config.eval.every={max(steps // 2, 1)}",
        "--config.eval.limit=64",
        "--config.eval.max_new_tokens=64",
        "--config.checkpoint.every=0",
    ]


def run(size: str, deadline: float, save, work_dir: str) -> dict:
    """prepare, then the colocated train, the colocated train in exact mode and gpu_local.sh (transformers server) at
    once, each recorded as it ends; a stage that would start past `deadline` is skipped, saying so. `work_dir` holds
    the runs (the warm-up model, metrics, logs). The three runs share the GPU (MEM_SHARES): their learning verdict,
    exact fractions and end-to-end checks are theirs alone, their phase seconds are measured beside each other."""
    spec = SIZES[size]
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    init = work / "init"
    concurrent = ["colocated", "exact", "gpu_local"]
    out: dict = dict(size=size, spec=spec, stages={}, concurrent=concurrent, mem_shares=MEM_SHARES)
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=MEM_SHARES["prepare"], PYTHONUNBUFFERED="1")
    py = [sys.executable, "-m", "cisjax"]

    def late(name) -> bool:
        if time.time() + 5.0 <= deadline:
            return False
        out["stages"][name] = dict(status="skipped", reason=f"time box: {deadline - time.time():.0f} s left")
        save(out)
        return True

    prep = [*py, "demo", "prepare", "--out", str(init), "--warmup-steps", str(spec["warmup_steps"])]
    prep += ["--heldout", str(spec["heldout"]), "--eval-size", str(spec["eval_size"])]
    if late("prepare"):
        return out
    out["stages"]["prepare"] = _run(prep, work / "prepare.log", deadline, env)
    save(out)
    if out["stages"]["prepare"]["status"] != "ok":
        return out
    warm = json.loads((init / "warmup.json").read_text()) if (init / "warmup.json").is_file() else {}
    out["stages"]["prepare"]["warmup"] = {k: v for k, v in warm.items() if not isinstance(v, (list, dict))}
    if any(late(name) for name in concurrent):
        return out

    dirs = dict(colocated=work / "colocated", exact=work / "exact", gpu_local=work / "local")
    started = {}
    for name, steps, extra in (("colocated", spec["steps"], ()), ("exact", spec["exact_steps"], EXACT_ARGS)):
        cmd = [*py, "train", *_train_args(init, dirs[name], steps, spec)]
        cmd += ["--config.rollout.backend=jax", "--config.rollout.colocated=True", *extra]
        started[name] = _start(cmd, work / f"{name}.log", dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION=MEM_SHARES[name]))

    launcher_env = dict(
        env,
        CONFIG="configs/demo_cpu.py",
        BACKEND="transformers",
        DTYPE=ENGINE_DTYPE[size],
        MODEL=str(init / "model"),
        RUN=str(dirs["gpu_local"]),
        PORT=str(_free_port()),
        STARTUP_S="300",
        PYTHON=sys.executable,
        GPU_MEM=MEM_SHARES["gpu_local_server"],
        TRAIN_MEM=MEM_SHARES["gpu_local_trainer"],
    )
    launcher_env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION")  # the launcher splits the GPU between the two (TRAIN_MEM)
    args = _train_args(init, dirs["gpu_local"], spec["local_steps"], spec)[2:] + ["--config.eval.sets="]
    started["gpu_local"] = _start(["bash", "launchers/gpu_local.sh", *args], work / "gpu_local.log", launcher_env)

    for name in concurrent:
        out["stages"][name] = _wait(started[name], deadline)
        out["stages"][name]["run"] = summarize(_rows(dirs[name] / "metrics.jsonl"), spec["window"])
        save(out)
    log = work / "gpu_local.log"
    split = (
        [line for line in log.read_text(errors="replace").splitlines() if " shared" in line] if log.is_file() else []
    )
    out["stages"]["gpu_local"]["memory_split"] = split[-1] if split else None
    save(out)
    return out
