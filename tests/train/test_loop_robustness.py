"""`cisjax train` as a user runs it, interrupted. On the fake engine (no model: the fast tier): Ctrl-C (the step
finished, its checkpoint, exit 0, no orphan server) and a SIGKILLed trainer (its server follows). On the transformers
engine (slow): Ctrl-C then --resume, a second Ctrl-C, reward workers killed mid-run. (vLLM: test_loop.py.)"""

import os
import signal
import sys
import time

import pytest

from cisjax.rl.rewards import RewardPool
from tests.support import processes, runs

# The `cisjax train` subprocesses on the transformers engine are `slow` (not in the fast tier, make test-fast), test by
# test; those on the fake engine and the reward pool's own shutdown test are in it.

STEPS = 6  # the run stops early (Ctrl-C) and a resumed run finishes them (a step: about a second here)
EXIT_S = 60.0  # from Ctrl-C to exit: the step in flight, the checkpoint, the server's drain
# The fake engine (its samples need no model; its logprobs are not the model's: no canary). Its steps take a few
# hundredths of a second, so the run is long (1000 steps of 100 epochs of the data): it is still running when signalled.
FAKE = {"rollout.backend": "fake", "publish.canary.every": 0, "run.steps": 1000, "data.epochs": 100}


@pytest.fixture(scope="module")
def env(jax_cache):
    return processes.subprocess_env(jax_cache)


def _overrides(prepared, run_dir, **extra):
    kw = {
        "model.path": prepared / "model",
        "data.source": prepared / "data" / "heldout.jsonl",
        "run.dir": run_dir,
        "run.steps": STEPS,
        "run.progress": "off",
        "run.tensorboard": "false",
        "run.dump_every": 0,
        "data.prompts_per_step": 4,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 8,
        "rollout.backend": "transformers",
        "rollout.dtype": "float32",
        "publish.dtype": "float32",
        "rollout.max_staleness": 1,
        "rollout.seed": 3,
        "publish.canary.num_sequences": 2,
        "publish.canary.response_len": 8,
        "reward.workers": 1,
        "checkpoint.every": 0,
    }  # no periodic checkpoint: the one found after Ctrl-C is the one Ctrl-C wrote
    kw.update(extra)
    return [f"--config.{k}={v}" for k, v in kw.items()]


def _train(prepared, run_dir, *extra, **overrides):
    return [
        *processes.cisjax_command(),
        "train",
        "--config",
        str(runs.DEMO_CONFIG),
        *_overrides(prepared, run_dir, **overrides),
        *extra,
    ]


def _exit_code(proc, timeout_s, log_path, tree):
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        tree.poll()  # the processes it starts until the end (replaced workers, a restarted server)
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the trainer did not exit within {timeout_s:.0f} s; its log ends:\n{processes.tail(log_path)}")
        time.sleep(0.2)
    return proc.returncode


def _assert_no_orphans(tree, log_path):
    """Every process the trainer started (the rollout server, reward workers, multiprocessing's tracker) is gone."""
    deadline = time.monotonic() + 10.0
    while (left := tree.alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:  # (after a failure, not left behind either)
        p.kill()
    assert not left, (
        f"still running after the trainer exited: {[(p.pid, tree.cmdlines[p.pid]) for p in left]}\n{processes.tail(log_path)}"
    )


def _assert_checkpoint_of_last_step(run_dir) -> int:
    """The run's metrics end early, one row per finished step, and its one checkpoint holds the state after the last
    (state.step = steps done, the weights version published after it): the number of steps done."""
    from cisjax.train.checkpoint import Checkpointer

    rows = runs.metrics(run_dir)
    done = len(rows)
    assert done and [r["step"] for r in rows] == list(range(done)), [r["step"] for r in rows]
    ckpt = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        assert ckpt.all_steps() == [done], (ckpt.all_steps(), done)
        assert ckpt.metadata(done)["version"] == done
    finally:
        ckpt.close()
    return done


def test_ctrl_c_on_the_fake_engine_finishes_the_step_checkpoints_and_stops_the_server(prepared, env, tmp_path):
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    argv = _train(prepared, run_dir, **FAKE)
    proc, tree = runs.start_until_first_step(argv, run_dir, log_path, env)
    try:
        servers = processes.wait_children(proc, tree, "cisjax.commands.serve", log_path=log_path)
        assert len(servers) == 1 and "--backend fake" in tree.cmdlines[servers[0].pid], tree.cmdlines
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the trainer's process group
        code = _exit_code(proc, EXIT_S, log_path, tree)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    assert code == 0, processes.tail(log_path)  # the documented exit: the run stopped, not failed
    assert "finishing the current step" in log and "stop requested" in log, processes.tail(log_path)
    _assert_no_orphans(tree, log_path)
    assert _assert_checkpoint_of_last_step(run_dir) < FAKE["run.steps"]
    assert "fake engine" in (run_dir / "rollout_server.log").read_text(errors="replace")


@pytest.mark.slow
def test_ctrl_c_checkpoints_stops_the_server_and_resumes(prepared, env, tmp_path):
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    t_start = time.monotonic()
    proc, tree = runs.start_until_first_step(_train(prepared, run_dir), run_dir, log_path, env)
    try:
        t_first = time.monotonic() - t_start
        servers = processes.wait_children(proc, tree, "cisjax.commands.serve", log_path=log_path)
        assert len(servers) == 1, tree.cmdlines
        # what a terminal's Ctrl-C does: SIGINT to the foreground process group (the trainer and its reward
        # workers; the server runs in its own session and is stopped by the trainer)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        code = _exit_code(proc, EXIT_S, log_path, tree)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    assert code == 0, processes.tail(log_path)
    assert "finishing the current step" in log
    _assert_no_orphans(tree, log_path)
    rows = runs.metrics(run_dir)
    done = len(rows)
    assert [r["step"] for r in rows] == list(range(done)) and done < STEPS, "the run should have stopped early"
    t_exit = time.monotonic() - t0

    # the checkpoint holds the state after the last finished step (state.step = steps done)
    from cisjax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir / "checkpoints", read_only=True)
    assert ckpt.all_steps() == [done], ckpt.all_steps()
    assert ckpt.metadata(done)["version"] == done
    ckpt.close()

    # --resume: from there to STEPS, step numbers and weight versions continuous
    t0 = time.monotonic()
    proc = processes.start(_train(prepared, run_dir, "--resume"), log_path, env)
    tree = processes.Tree(proc.pid)
    try:
        processes.wait_for(
            proc,
            lambda: tree.matching("cisjax.commands.serve"),
            timeout_s=120,
            tree=tree,
            what="the resumed run's server",
            log_path=log_path,
        )
        code = _exit_code(proc, 300, log_path, tree)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, processes.tail(log_path)
    print(
        f"first step after {t_first:.0f} s, Ctrl-C after {done} steps, exit {t_exit:.1f} s later; resumed run {time.monotonic() - t0:.0f} s"
    )
    _assert_no_orphans(tree, log_path)
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["publish/version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)


@pytest.mark.slow
def test_second_ctrl_c_aborts(prepared, env, tmp_path):
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # synchronous steps of 64-token samples: the trainer waits for each batch, so the second press lands in the run
    # (with 0.5 s steps it landed once after the run had finished its step, checkpoint and shutdown: exit 0)
    slow = {"rollout.max_new_tokens": 64, "rollout.max_staleness": 0}
    proc, tree = runs.start_until_first_step(_train(prepared, run_dir, **slow), run_dir, log_path, env)
    try:
        processes.wait_children(proc, tree, "cisjax.commands.serve", log_path=log_path)
        os.killpg(proc.pid, signal.SIGINT)
        # a user presses again after seeing the first one taken; two signals that land while the main thread is in one
        # C call (XLA, a gRPC wait) coalesce into one Python handler call, so sending blind could be one press
        processes.wait_for(
            proc,
            lambda: "finishing the current step" in log_path.read_text(errors="replace"),
            timeout_s=60,
            tree=tree,
            what="the first Ctrl-C taken",
            log_path=log_path,
        )
        os.killpg(proc.pid, signal.SIGINT)
        code = _exit_code(proc, EXIT_S, log_path, tree)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # KeyboardInterrupt: Python ends by SIGINT (-2), or 1 if a handler turned it into an error
    assert code in (-signal.SIGINT, 1, 130), (code, processes.tail(log_path))
    assert "KeyboardInterrupt" in log_path.read_text(errors="replace")
    _assert_no_orphans(tree, log_path)


def test_sigkilled_trainer_leaves_no_server(prepared, env, tmp_path):
    """No handler runs on SIGKILL (the OOM killer, `kill -9`): the embedded server, in its own session, notices that
    its parent is gone (--exit-with-parent) and stops; the reward workers see their pipes close. On the fake engine:
    what stops is the server, whatever its engine."""
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    proc, tree = runs.start_until_first_step(_train(prepared, run_dir, **FAKE), run_dir, log_path, env)
    try:
        servers = processes.wait_children(proc, tree, "cisjax.commands.serve", log_path=log_path)
        assert len(servers) == 1 and "--exit-with-parent" in tree.cmdlines[servers[0].pid], tree.cmdlines
        proc.kill()  # the trainer alone, not its process group
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0  # 1 s to notice, then the server's drain (--grace 10 s) and engine close
    while servers[0].is_running() and servers[0].status() != "zombie" and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in tree.alive()]
    for p in left:
        p.kill()
    assert not left, f"alive after the trainer was SIGKILLed: {[tree.cmdlines[p.pid] for p in left]}"
    assert "parent process" in (run_dir / "rollout_server.log").read_text(errors="replace")


@pytest.mark.slow
def test_killed_reward_workers_are_replaced_and_no_score_is_lost(prepared, env, tmp_path):
    """SIGKILL every math-verify worker after the first step: the pool replaces them, re-runs what they held, and
    every step of the run is scored (reference_reward: 1.0 for each sample unless a score was lost). The run samples
    with top-k 8 and top-p 0.9 (truncated), corrected by mask replay: the engine returns each token's support, the
    trainer renormalises p over it, so k stays at 1 (fp32 engine and trainer), where p over the whole vocabulary
    would put log k at the support's log mass."""
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    steps, workers = 6, 2
    argv = [
        sys.executable,
        "-m",
        "tests.support.runs",
        "train",
        "--config",
        str(runs.DEMO_CONFIG),
        *_overrides(prepared, run_dir, **{"run.steps": steps, "reward.workers": workers, "checkpoint.every": 0}),
        "--config.rollout.top_k=8",
        "--config.rollout.top_p=0.9",
    ]
    proc, tree = runs.start_until_first_step(argv, run_dir, log_path, env)
    try:
        # the pool's spawned workers (the resource tracker is not spawn_main)
        killed = processes.wait_children(proc, tree, "spawn_main", count=workers, direct=True, log_path=log_path)
        assert len(killed) == workers, tree.cmdlines
        for p in killed:
            p.kill()
        code = _exit_code(proc, 300, log_path, tree)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, processes.tail(log_path)
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["reward_mean"] == 1.0 for r in rows), [r["reward_mean"] for r in rows]
    assert max(r["train/abs_logk_max"] for r in rows) < 1e-3, [r["train/abs_logk_max"] for r in rows]
    last = rows[-1]
    assert (
        last["reward/pool_restarts"] >= workers
        and last["reward/pool_crashed"] == 0
        and last["reward/pool_timed_out"] == 0
    ), last
    replacements = set(tree.matching("spawn_main")) - set(killed)
    assert replacements, tree.cmdlines  # new workers were started (and are gone with the trainer)
    _assert_no_orphans(tree, log_path)


def test_pool_closed_during_a_call_starts_no_workers():
    """The trainer's shutdown closes the pool while the rollout thread may be scoring: that call ends, and the
    workers close() killed are not replaced."""
    import threading

    import psutil

    def workers():
        pids = set()
        for c in psutil.Process().children():
            try:  # a child of an earlier pool may exit (or be a zombie) while it is being looked at
                if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                    pids.add(c.pid)
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                pass
        return pids

    before = workers()  # other tests' pools in this process
    pool = RewardPool(workers=2, timeout_s=30.0, fn="tests.rl.test_rewards:scripted")
    result = {}

    def call():
        try:
            result["scores"] = pool.score(["slow:5:\\boxed{1}"] * 4, ["1"] * 4)
        except RuntimeError as err:
            result["error"] = str(err)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)
    pool.close()
    t.join(10)
    assert not t.is_alive() and "closed" in result.get("error", ""), result
    time.sleep(0.5)
    assert not workers() - before
