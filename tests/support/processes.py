"""Processes a test starts and watches: the trainer's environment and command, a command in its own session, the tree of
processes it starts, bounded waits that show the log's tail when they fail."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def tail(path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except (OSError, TypeError):
        return "(no log)"
