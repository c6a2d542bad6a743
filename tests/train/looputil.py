"""Shared set-up of the `cisjax train` tests: the demo's data and model, metrics, the trainer as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo_cpu.py"


def prepare(out) -> Path:
    """The demo's task and tiny MoE, not warmed up (fast): 64 held-out problems in `out/data`, the model in `out/model`."""
    from cisjax import demo

    out = Path(out)
    assert demo.prepare(out, seed=0, warmup_steps=0, heldout=64, eval_size=0, log=lambda *_: None) == 0
    return out


def metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_reward(text: str, reference: str) -> float:
    """A reward fn for the pool that math-verify judges 1.0 whatever the (untrained) model wrote: the reference
    against itself. A run scored with it has reward_mean 1 on every step unless the pool lost a score."""
    from cisjax.answers import verify

    return verify(f"\\boxed{{{reference}}}", reference)


def parity_reward(text: str, reference: str) -> float:
    """A reward fn that varies within a group whatever the (untrained) model wrote: 1.0 for a text of even length.
    A run scored with it updates its params at every step (GRPO's advantages are not all zero)."""
    return float(len(text) % 2 == 0)


def subprocess_env(cache_dir) -> dict:
    """The trainer's environment: one CPU device (not the suite's 8 fake ones: faster compiles), and a persistent
    compilation cache (the session's, tests/conftest.py's `jax_cache`: a resumed run, or another test's run of the
    same shapes, compiles nothing again)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=str(REPO),
    )
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def cisjax_command() -> list[str]:
    """The venv's `cisjax` entry point (what a user types), else the same main through the interpreter."""
    script = Path(sys.executable).with_name("cisjax")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from cisjax.cli import main; sys.exit(main())"]


def start(argv: list[str], log_path, env: dict) -> subprocess.Popen:
    """Start a command in its own session (a process group, as a shell job is: Ctrl-C can go to the whole group)."""
    log = open(log_path, "ab")
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class Tree:
    """The descendants of a process, remembered as they are seen (psutil.Process objects: pid + create time, so a
    recycled pid is not mistaken for one of them)."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.seen: dict[int, psutil.Process] = {}
        self.cmdlines: dict[int, str] = {}

    def poll(self) -> None:
        import psutil

        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for c in children:
            known = self.seen.get(c.pid)
            if known is not None and known.create_time() != c.create_time():
                continue  # a recycled pid: not ours
            try:
                # read again at every poll: a child seen between its fork and its exec shows its parent's command line
                # (an exited one reads empty: its last one stays)
                cmdline = " ".join(c.cmdline())
            except psutil.Error:
                continue
            if cmdline or c.pid not in self.cmdlines:
                self.cmdlines[c.pid] = cmdline
            self.seen.setdefault(c.pid, c)

    def matching(self, text: str) -> list:
        return [p for pid, p in self.seen.items() if text in self.cmdlines[pid]]

    def direct(self, text: str) -> list:
        """Live direct children whose command line contains `text`."""
        import psutil

        out = []
        try:
            children = self.root.children()
        except psutil.NoSuchProcess:
            return out
        for c in children:
            try:
                if text in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE:
                    out.append(c)
            except psutil.Error:
                pass
        return out

    def alive(self) -> list:
        import psutil

        out = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out


def wait_for(
    proc: subprocess.Popen, condition, *, timeout_s: float, tree: Tree | None = None, what: str = "", log_path=None
):
    """Poll `condition()` until it is true; fails (with the log's tail) if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if tree is not None:
            tree.poll()
        value = condition()
        if value:
            return value
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (
                f"exited with {proc.returncode}"
                if proc.returncode is not None
                else f"still running after {timeout_s:.0f} s"
            )
            raise AssertionError(f"waiting for {what}: the trainer {why}; its log ends:\n{tail(log_path)}")
        time.sleep(0.2)


def wait_children(
    proc: subprocess.Popen,
    tree: Tree,
    text: str,
    *,
    count: int = 1,
    direct: bool = False,
    timeout_s: float = 60,
    log_path=None,
) -> list:
    """The trainer's descendants (`direct`: live direct children) whose command line contains `text`, once there are
    `count` of them (bounded wait): one read of the tree can miss a child that is being started, or see it between
    its fork and its exec with its parent's command line."""
    found = lambda: tree.direct(text) if direct else tree.matching(text)  # noqa: E731
    wait_for(
        proc,
        lambda: len(found()) >= count,
        timeout_s=timeout_s,
        tree=tree,
        what=f"{count} process(es) running {text!r} among the trainer's {'children' if direct else 'descendants'}",
        log_path=log_path,
    )
    return found()


def start_until_first_step(
    argv: list[str], run_dir, log_path, env: dict, timeout_s: float = 300
) -> tuple[subprocess.Popen, Tree]:
    """start(argv) and wait until the run's metrics.jsonl has a step: (the process, its Tree); the process group is
    killed when the wait fails."""
    import signal

    proc = start(argv, log_path, env)
    tree = Tree(proc.pid)
    try:
        wait_for(
            proc, lambda: metrics(run_dir), timeout_s=timeout_s, tree=tree, what="the first step", log_path=log_path
        )
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, tree


def tail(path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except (OSError, TypeError):
        return "(no log)"


def main(argv: list[str]) -> int:
    """`python -m tests.train.looputil train ARGS`: `cisjax ARGS` with the reward pool scoring with
    reference_reward (the rest of the loop unchanged)."""
    from cisjax import cli
    from cisjax.rl import rewards

    class Pool(rewards.RewardPool):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("fn", f"{__spec__.name}:reference_reward")
            super().__init__(*args, **kwargs)

    rewards.RewardPool = Pool
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
