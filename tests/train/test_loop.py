"""`cisjax train` end to end on the demo's path, shortened: a tiny MoE, the real vLLM engine as an embedded
child server, rewards from math-verify, CIS, publish + canary every step, metrics, dumps, checkpoints, resume."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

if os.environ.get("CISJAX_SKIP_VLLM") == "1":
    pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine", allow_module_level=True)
import vllm  # noqa: E402,F401  (a broken or missing install must fail the suite, not skip it)

from cisjax import config as config_lib  # noqa: E402
from cisjax.rollout import engine_env
from cisjax.train import loop  # noqa: E402
from tests.support import processes, runs  # noqa: E402

# `cisjax train` on the real vLLM engine: `slow` (not in the fast tier, make test-fast), test by test; the config check
# starts nothing and stays in it.

REPO = str(processes.REPO)


def _cfg(prepared, run_dir, **overrides):
    base = [
        f"--config.model.path={prepared / 'model'}",
        f"--config.data.source={prepared / 'data' / 'heldout.jsonl'}",
        f"--config.run.dir={run_dir}",
        "--config.run.progress=off",
        "--config.data.prompts_per_step=8",
        "--config.rollout.group_size=4",
        "--config.rollout.max_new_tokens=12",
        "--config.rollout.dtype=float32",
        "--config.publish.dtype=float32",
        "--config.rollout.max_staleness=1",
        "--config.rollout.seed=3",
        "--config.checkpoint.every=2",
        "--config.run.dump_every=2",
        "--config.run.tensorboard=true",
        "--config.publish.canary.num_sequences=2",
        "--config.publish.canary.response_len=8",
        "--config.reward.workers=1",
    ]
    base += [f"--config.{k}={v}" for k, v in overrides.items()]
    return config_lib.load(os.path.join(REPO, "configs", "demo_cpu.py"), base)


@pytest.fixture(scope="module", autouse=True)
def shared_compiles(jax_cache):
    """The module's runs share their compiled programs through the session's persistent cache, as runs of `cisjax
    train` in the subprocess tests do (processes.subprocess_env): a resumed run, and a run with the same shapes,
    compile nothing again. Off again after the module: the rest of the suite compiles as before."""
    before = {
        k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    compilation_cache.set_cache_dir(str(jax_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    compilation_cache.reset_cache()
    yield
    for k, v in before.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def vllm_env(monkeypatch):
    for k, v in engine_env.defaults().items():  # the engine's defaults, whatever the caller's environment says
        monkeypatch.setenv(k, v)


_metrics = runs.metrics


def _checkpoint_counters(prepared, run_dir) -> dict:
    from cisjax.models import hf_io
    from cisjax.train import checkpoint as checkpoint_lib

    hf = hf_io.read_hf_config(prepared / "model")
    _, abstract = hf_io.abstract_model(hf, hf_io.model_config(hf))
    _, info = checkpoint_lib.restore_params(run_dir / "checkpoints", abstract)
    return {k: info[k] for k in ("step", "policy_version", "data_position")}


def _eval_cfg(prepared):
    """The in-loop eval (cisjax.evaluation.in_loop): greedy, 4 held-out problems as a GSM8K-format set, every 2 steps."""
    return {
        "eval.sets": "gsm8k",
        "eval.data": f"gsm8k={prepared / 'data' / 'heldout.jsonl'}",
        "eval.every": 2,
        "eval.limit": 4,
        "eval.max_new_tokens": 12,
    }


def _check_evals(run_dir, rows, steps):
    """The eval lines: at `steps`, each of the version just published, its samples all of that version."""
    evals = {r["step"]: r for r in rows if "eval/gsm8k/accuracy" in r}
    assert sorted(evals) == steps
    for s, r in evals.items():
        assert r["eval/version"] == s + 1 == r["publish/version"]
        assert r["eval/gsm8k/count"] == 4 and r["time/eval_s"] > 0 and r["eval/average"] == r["eval/gsm8k/accuracy"]
        out = run_dir / "eval" / f"v{s + 1:06d}"
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 4 and {x["version"] for x in samples} == {s + 1}
        assert r["eval/gsm8k/accuracy"] == sum(x["correct"] for x in samples) / 4
        assert r["eval/gsm8k/answered"] == sum(x["rule"] != "none" for x in samples) / 4
        results = json.loads((out / "results.json").read_text())
        assert results["sampling"]["greedy"] and (out / "report.md").is_file()
        # the publish's export (a full one, or a delta: publish.delta), not the start
        assert results["model"] in [str(run_dir / "exports" / f"{k}{s + 1:06d}") for k in "vd"]
    # TensorBoard has the eval scalars too
    events = b"".join(f.read_bytes() for f in (run_dir / "tb").rglob("*tfevents*"))
    assert b"eval/gsm8k/accuracy" in events


@pytest.mark.slow
def test_train_runs_resumes_and_logs(prepared, tmp_path):
    """Three steps, the metrics, dumps, TensorBoard, exports, checkpoints and in-loop evals, then a resumed fourth;
    two optimizer updates per rollout batch (train.updates_per_batch=2) after one proximal rescoring pass (auto:
    rescore; the other runs of this module take one update and p_prox from the step). Weights published as deltas
    (publish.delta): the first and the last step whole (the last a complete export under LATEST), the middle one only
    its changed elements; the resumed run's fresh server gets the whole set."""
    run_dir = tmp_path / "run"
    over = {"train.updates_per_batch": 2, "publish.delta": True, **_eval_cfg(prepared)}
    last = loop.train(_cfg(prepared, run_dir, **{"run.steps": 3, **over}))
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["rollout/samples"] == 32
        assert r["rollout/staleness_max"] <= 1  # the bound holds
        assert r["publish/version"] == r["step"] + 1
        assert r["publish/canary_mean_abs"] < 1e-3  # fp32 engine and trainer on the same weights
        for k in (
            "time/generate_s",
            "time/reward_s",
            "time/rescore_s",
            "time/train_s",
            "time/publish_s",
            "tokens_per_s",
            "train/grad_norm",
            "train/acted_frac",
            "train/k3",
            "entropy",
        ):
            assert k in r and r[k] is not None, k
    assert rows[0]["rollout/staleness_max"] == 0 and rows[1]["rollout/staleness_mean"] >= 0
    assert last["reward_mean"] == rows[-1]["reward_mean"]
    # token dumps every 2 steps with the fields of operators.md
    dump = np.load(run_dir / "dumps" / "step_0000002.npz")
    for k in ("logp_infer", "logp_prox", "rollout_version", "current_version", "loss_mask", "weight", "acted"):
        assert k in dump.files
    assert dump["logp_prox"].shape == dump["logp_infer"].shape  # both mini-batches' p_prox
    assert len(dump["logp_infer"]) > 0 and np.all(dump["current_version"] == 2) and np.all(dump["rollout_version"] >= 1)
    assert np.all(dump["logp_infer"] <= 0) and np.all(dump["logp_prox"] <= 0)
    assert (run_dir / "tb").is_dir() and any((run_dir / "tb").iterdir())
    assert (run_dir / "exports" / "LATEST").read_text().strip() == "v000003"
    assert [r["publish/full_sends"] for r in rows] == [1, 0, 1]
    # (fp32 publishes: a step with rewards moves nearly every value; one without (all rewards 0, no gradient) moves
    # none, and its delta is a message without tensors)
    assert 0 <= rows[1]["publish/changed_fraction"] <= 1 and rows[1]["publish/bytes"] <= rows[0]["publish/bytes"]
    assert (run_dir / "exports" / "d000002" / "delta.safetensors").is_file()
    # the train state's counters advance with the loop and are in the checkpoint (what cisjax export reports)
    assert [r["data/position"] for r in rows] == [8, 16, 24]
    # (step: optimizer updates, two per rollout batch; the checkpoint is named after the rollout batches)
    assert _checkpoint_counters(prepared, run_dir) == {"step": 6, "policy_version": 3, "data_position": 24}
    # in-loop eval: after step 1 (eval.every=2) and the final weights after step 2
    _check_evals(run_dir, rows, [1, 2])

    # resume: continue to step 4 from the last checkpoint (the state after step 3), same data order and versions
    loop.train(_cfg(prepared, run_dir, **{"run.steps": 4, **over}), resume=True)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["publish/version"] == 4 and rows[3]["data/position"] == 32
    assert rows[3]["publish/full_sends"] == 1
    assert _checkpoint_counters(prepared, run_dir) == {"step": 8, "policy_version": 4, "data_position": 32}
    _check_evals(run_dir, rows, [1, 2, 3])


@pytest.mark.slow
def test_routing_replay_through_the_loop(prepared, tmp_path):
    """cis+replay: the real vLLM engine returns the routing of every position (prompt and response), the rescoring
    and the update replay it. With the engine in fp32 it chose what the fp32 trainer's routers choose at almost every
    (position, layer) -- replayed ids that were not the engine's (misaligned, or another sample's) would flip most."""
    run_dir = tmp_path / "run"
    loop.train(_cfg(prepared, run_dir, **{"run.steps": 2, "routing.replay": "rollout", "run.dump_every": 1}))
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["replay/flip_pair_frac"] <= r["replay/flip_token_frac"] <= 1.0
        assert r["replay/flip_pair_frac"] < 0.05, r
        assert np.isfinite(r["train/loss"]) and r["skipped_steps"] == 0
    dump = np.load(run_dir / "dumps" / "step_0000001.npz")
    assert dump["routing_flips"].shape == dump["logp_infer"].shape
    assert dump["routing_flips_per_layer"].shape == (2,)  # the demo model's two MoE layers
    assert 0 <= dump["routing_flips"].min() and dump["routing_flips"].max() <= 2


@pytest.mark.slow
def test_perturbed_and_lagged_engine(prepared, tmp_path):
    """rollout.perturb=int4 and rollout.lag=1 on the fp32 engine: every publish (version 0 included) sends the int4
    copy, which the tight canary checks against the engine (so the engine serves exactly the copy, not the params);
    the exported matrices lie on the int4 grid; the engine trails by one version (staleness exactly 1 after step 0)
    and the last step publishes the final weights as they are (the canary passes against the unperturbed params:
    the run's final export and evaluation are the trained model). With train.proximal=step: no rescoring pass, the
    dumps' p_prox from the step's own forward."""
    from safetensors.numpy import load_file

    run_dir = tmp_path / "run"
    over = {"run.steps": 3, "rollout.perturb": "int4", "rollout.lag": 1, "publish.canary.mean_abs": 1e-3}
    over["train.proximal"] = "step"
    loop.train(_cfg(prepared, run_dir, **{**over, "publish.canary.max_abs": 1e-2, "checkpoint.every": 0}))
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("time/rescore_s" not in r and r["time/train_s"] > 0 and r["train/acted_frac"] >= 0 for r in rows)
    dump = np.load(run_dir / "dumps" / "step_0000002.npz")  # p_prox from the step, q from the int4 engine
    assert len(dump["logp_prox"]) > 0 and np.all(dump["logp_prox"] <= 0) and np.all(np.isfinite(dump["logp_prox"]))
    assert np.abs(dump["logp_prox"] - dump["logp_infer"]).max() > 1e-3  # the perturbed engine's q is not p
    start = load_file(str(run_dir / "engine_start" / "v000000" / "model.safetensors"))  # version 0: perturbed too
    w0 = start["model.layers.0.self_attn.q_proj.weight"].astype(np.float64)
    np.testing.assert_allclose(w0 / (np.abs(w0).max() / 7), np.round(w0 / (np.abs(w0).max() / 7)), atol=1e-4)
    assert "publish/version" not in rows[0]  # version 1 held back
    assert [r["publish/version"] for r in rows[1:]] == [1.0, 3.0]
    assert 0.05 < rows[1]["publish/perturb_rel_rms"] < 0.3  # int4 on Gaussian-like matrices: ~0.1-0.2
    assert "publish/perturb_rel_rms" not in rows[2]  # the last publish: the trainer's own weights
    for r in rows[1:]:
        assert r["publish/canary_mean_abs"] < 1e-3
    on_grid = []
    for v in (1, 3):
        tensors = load_file(str(run_dir / "exports" / f"v{v:06d}" / "model.safetensors"))
        w = tensors["model.layers.0.self_attn.q_proj.weight"].astype(np.float64)
        steps = w / (np.abs(w).max() / 7)
        on_grid.append(float(np.abs(steps - np.round(steps)).max()))
    assert on_grid[0] < 1e-4 and on_grid[1] > 0.1, on_grid


def _train_killing_a_server(cfg, run_dir, which: int) -> list:
    """loop.train(cfg) while embedded server number `which` is killed (-9) once the first step is logged; the
    embedded servers the run started, in order."""
    from cisjax.rollout import service

    servers = []
    real = service.EmbeddedServer

    class Spy(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            servers.append(self)

    def killer():
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
            time.sleep(0.2)
        servers[which].kill()

    service.EmbeddedServer = Spy
    try:
        threading.Thread(target=killer, daemon=True).start()
        loop.train(cfg)
    finally:
        service.EmbeddedServer = real
    return servers


@pytest.mark.slow
def test_server_killed_mid_run_is_recovered(prepared, tmp_path):
    """The embedded server dies during the run: the watchdog restarts it, the client reconnects and re-sends
    the current weights, and the run completes every step."""
    run_dir = tmp_path / "run"
    servers = _train_killing_a_server(_cfg(prepared, run_dir, **{"run.steps": 3, "rollout.retry_s": 300}), run_dir, 0)
    assert servers and servers[0].restarts >= 1
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2]


@pytest.mark.slow
def test_fleet_of_two_replicas_one_killed_mid_run(prepared, tmp_path):
    """rollout.replicas=2: both embedded engines generate; one is killed (-9) after the first step. The run completes
    every step with continuous versions, its work goes to the other, and no replica in rotation ever holds an older
    version than the one just published (the per-replica metrics of every step say so)."""
    run_dir = tmp_path / "run"
    cfg = _cfg(prepared, run_dir, **{"run.steps": 4, "rollout.replicas": 2, "rollout.retry_s": 300})
    servers = _train_killing_a_server(cfg, run_dir, 1)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["publish/version"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["rollout/replica0/tokens_per_s"] > 0 and rows[0]["rollout/replica1/tokens_per_s"] > 0
    assert len(servers) == 2 and servers[1].restarts >= 1 and servers[0].restarts == 0
    assert rows[-1]["rollout/replica1/failures"] >= 1 and rows[-1]["rollout/replica0/failures"] == 0
    for r in rows:
        assert r["publish/canary_failed_replicas"] == 0  # every replica that took the weights was canaried
        for i in (0, 1):
            assert r[f"rollout/replica{i}/check_failures"] == 0
            if r[f"rollout/replica{i}/in_rotation"]:
                assert r[f"rollout/replica{i}/version"] == r["publish/version"], (r["step"], i)
    assert (run_dir / "rollout_server0.log").is_file() and (run_dir / "rollout_server1.log").is_file()


def test_bad_config_field_is_named():
    with pytest.raises(Exception, match="rollout.group_sizee|group_sizee"):
        config_lib.load(os.path.join(REPO, "configs", "demo_cpu.py"), ["--config.rollout.group_sizee=3"])


@pytest.mark.slow
def test_more_steps_than_the_data_give_is_named_before_any_step(prepared, tmp_path):
    run_dir = tmp_path / "run"
    # about 64 held-out problems, 8 per step, one epoch: 8 steps
    cfg = _cfg(prepared, run_dir, **{"run.steps": 9, "data.epochs": 1, "rollout.backend": "transformers"})
    with pytest.raises(ValueError, match=r"run.steps=9, but the data give 8 steps .*data.epochs"):
        loop.train(cfg)
    assert _metrics(run_dir) == []
