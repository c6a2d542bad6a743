"""cisjax.bench.gpu_tune: the MoE layer's kernel calls, the routing's group sizes, the sweep in Mosaic GPU's
interpreter (the rule first, each candidate checked against it, refused ones recorded), the choice of the best, its
BLOCKS line, the time box, and the refusal off a Hopper GPU."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import pytest

from cisjax.bench import gpu_check, gpu_parts, gpu_report, gpu_tune
from cisjax.models import moe_hopper
from cisjax.models.moe_hopper import Blocks
from cisjax.models.ragged_ws import Tiles
from tests.models import mgpu_interpret

# one toy layer shape (E, k, F) at hidden 64, 128 tokens: 256 sorted rows in 4 groups
TOY = dict(tokens=128, hidden=64, repeats=1, shapes={"toy": (4, 2, 32)})


def test_calls_of_the_paper_shapes():
    """Qwen1.5-MoE (60, 4, 1408) and Qwen3-30B-A3B (128, 8, 768) give six keys each at hidden 2048; DeepSeek-V2-Lite
    (64, 6, 1408) repeats Qwen1.5's keys and adds none."""
    calls = gpu_tune.calls("full")
    keys = [c.key for c in calls]
    assert keys == [
        "ragged_dot 2048x1408", "ragged_dot 1408x2048", "ragged_dot_t 1408x2048", "ragged_dot_t 2048x1408",
        "transposed 2048x1408", "transposed 1408x2048",
        "ragged_dot 2048x768", "ragged_dot 768x2048", "ragged_dot_t 768x2048", "ragged_dot_t 2048x768",
        "transposed 2048x768", "transposed 768x2048",
    ]  # fmt: skip
    qwen15, qwen3 = calls[0], calls[6]
    assert (qwen15.shape, len(qwen15.sizes), sum(qwen15.sizes), qwen15.rows) == ("qwen15_moe", 60, 32768, 32768)
    assert (qwen3.shape, len(qwen3.sizes), sum(qwen3.sizes), qwen3.rows) == ("qwen3_30b_a3b", 128, 65536, 65536)
    assert qwen15.flops == 2.0 * 32768 * 2048 * 1408


def test_group_sizes_are_a_routing():
    sizes = gpu_tune.group_sizes(1000, 10, 3, seed=0)
    assert len(sizes) == 10 and sum(sizes) == 3000 and max(sizes) <= 1000  # each token in 3 distinct groups
    assert 200 < min(sizes) and max(sizes) < 400  # near balance: 300 each on average
    assert gpu_tune.group_sizes(1000, 10, 3, seed=0) == sizes != gpu_tune.group_sizes(1000, 10, 3, seed=1)
    # rows past the groups pad to whole row blocks
    calls = gpu_tune.calls("small")
    assert all(c.rows % moe_hopper.ROW_ALIGN == 0 and c.rows >= sum(c.sizes) for c in calls)


def test_off_a_hopper_gpu_the_sweep_says_so():
    saved = []
    res = gpu_tune.run("small", time.time() + 60, saved.append)
    assert "compute capability 9.x" in res["skipped"] and "cpu" in res["skipped"] and not saved


def test_sweep_in_the_interpreter(monkeypatch):
    """After the rule per kernel: one configuration of ragged_ws's kernels, then two of JAX's, one the kernel takes
    (it agrees with the rule's output) and one it refuses (no pipeline stage: the kernels need more stages than they
    delay a buffer's release), recorded as an error; the best of JAX's is the fastest agreeing one and a BLOCKS line
    names it when it is not the rule's; ragged_ws's agrees with the rule and is reported beside (best_ws); after the
    rules' round, swiglu_ws's two fused calls, each against the rule's ms of the JAX calls it replaces (gate_up: two
    forward calls of D x F; down_grad: the input-gradient call of D x F)."""
    mgpu_interpret.enable(monkeypatch)
    monkeypatch.setitem(gpu_parts.MOE_LAYER, "small", TOY)
    bad = Blocks(64, 64, 64, 0, 1)
    kernels = ("ragged_dot", "ragged_dot_t", "transposed")
    monkeypatch.setattr(gpu_tune, "CANDIDATES", {k: (Blocks(64, 64, 64, 2, 1), bad) for k in kernels})
    monkeypatch.setattr(gpu_tune, "WS_CANDIDATES", {k: (Tiles(64, 64, 64, 2),) for k in kernels})
    saved = []
    res = gpu_tune.run("small", time.time() + 3600, saved.append)
    assert saved and saved[-1] is res and len(saved) == 4  # saved after each round: the rule, then three candidates
    assert list(res["calls"]) == [c.key for c in gpu_tune.calls("small")] and len(res["calls"]) == 6
    lines = []
    for key, c in res["calls"].items():
        rule, ws, good, refused = c["candidates"]
        assert tuple(rule["blocks"]) == tuple(c["rule"]) and rule["kernels"] == "jax" and ws["kernels"] == "ws"
        assert rule["status"] == "ok" and rule["max_rel_to_rule"] == 0.0 and rule["ms"] > 0 and rule["tflops"] > 0
        assert ws["status"] == "ok" and ws["agrees"] and ws["max_rel_to_rule"] <= gpu_tune.AGREE, (key, ws)
        assert good["status"] == "ok" and good["agrees"] and good["max_rel_to_rule"] <= gpu_tune.AGREE, (key, good)
        assert refused["status"] == "error" and refused["error"], (key, refused)
        best = c["best"]
        assert best["ms"] == min(rule["ms"], good["ms"]) and c["best_ws"]["ms"] == ws["ms"]
        assert best["speedup_over_rule"] == pytest.approx(rule["ms"] / best["ms"])
        if list(best["blocks"]) != list(rule["blocks"]):
            kernel, k, n = c["kernel"], c["k"], c["n"]
            lines.append(f'("{kernel}", {k}, {n}): Blocks(64, 64, 64, 2, 1),  # ')
    assert [line[: len(want)] for line, want in zip(res["table"], lines)] == lines and len(res["table"]) == len(lines)
    assert list(res["fused"]) == ["gate_up 64x64", "down_grad 64x32"]
    rule_ms = {key: c["candidates"][0]["ms"] for key, c in res["calls"].items()}
    for key, want in (
        ("gate_up 64x64", 2 * rule_ms["ragged_dot 64x32"]),
        ("down_grad 64x32", rule_ms["ragged_dot_t 64x32"]),
    ):
        row = res["fused"][key]
        assert row["status"] == "ok" and row["ms"] > 0 and row["jax_ms"] == pytest.approx(want), (key, row)
        assert row["speedup_over_jax"] == pytest.approx(want / row["ms"])
    json.dumps(res)  # the check writes it as JSON


def test_the_best_must_agree_with_the_rule():
    """A faster candidate whose output differs from the rule's is never the best; the rule stays when it is."""
    key = "ragged_dot 2048x1408"
    calls = {
        key: dict(
            kernel="ragged_dot",
            k=2048,
            n=1408,
            rows_in_groups=32768,
            groups=1,
            candidates=[
                dict(blocks=(128, 128, 64, 4, 2), status="ok", ms=0.5, tflops=1.0, agrees=True),
                dict(blocks=(64, 64, 64, 2, 1), status="ok", ms=0.1, tflops=5.0, agrees=False),
                dict(blocks=(128, 256, 64, 3, 2), status="error", error="no"),
                dict(blocks=(128, 128, 64, 4, 1), status="ok", ms=0.4, tflops=1.2, agrees=True),
            ],
        )
    }
    res = dict(device_kind="NVIDIA H200", calls=calls)
    gpu_tune._conclude(res)
    best = calls[key]["best"]
    assert best["blocks"] == (128, 128, 64, 4, 1) and best["speedup_over_rule"] == pytest.approx(1.25)
    assert res["table"] == [
        '("ragged_dot", 2048, 1408): Blocks(128, 128, 64, 4, 1),  # 0.400 ms = 1 TFLOP/s (the rule: 0.500 ms), '
        "32,768 rows in 1 groups, NVIDIA H200"
    ]
    calls[key]["candidates"][3]["agrees"] = False  # the rule is the best left: no line
    gpu_tune._conclude(res)
    assert calls[key]["best"]["blocks"] == (128, 128, 64, 4, 2) and res["table"] == []


def test_past_the_deadline_every_candidate_is_skipped(monkeypatch):
    mgpu_interpret.enable(monkeypatch)
    res = gpu_tune.run("small", time.time() - 1, lambda r: None)
    rows = [r for c in res["calls"].values() for r in c["candidates"]]
    assert rows and all(r["status"] == "skipped" and r["reason"] == "time box" for r in rows)
    assert all(c["best"] is None for c in res["calls"].values()) and res["table"] == []
    assert res["fused"] and all(r == dict(status="skipped", reason="time box") for r in res["fused"].values())


def test_the_check_runs_the_sweep_only_when_asked_and_reports_it(tmp_path, capsys):
    assert "tune" in gpu_check.SECTIONS and "tune" not in gpu_check.DEFAULT_SECTIONS
    out = tmp_path / "check.json"
    assert gpu_check.main(["--out", str(out), "--only", "tune", "--budget-s", "300"]) == 0
    res = json.loads(out.read_text())
    assert set(res["sections"]) == {"tune"} and res["sections"]["tune"]["runs"][0]["status"] == "ok"
    assert "compute capability 9.x" in res["summary"]["tune"]["skipped"]
    assert "tune: skipped" in capsys.readouterr().out


def test_report_shows_a_sweep(capsys):
    tune = dict(
        device_kind="NVIDIA H200",
        calls={
            "ragged_dot 2048x1408": dict(
                rows_in_groups=32768, groups=60, rule=[128, 128, 64, 4, 2],
                candidates=[dict(blocks=[128, 128, 64, 4, 2], status="ok", ms=0.45, tflops=421.0, agrees=True)],
                best=dict(blocks=[128, 128, 64, 4, 2], ms=0.45, tflops=421.0, speedup_over_rule=1.0),
                best_ws=dict(blocks=[128, 128, 64, 3, True], ms=0.36, tflops=526.0, speedup_over_rule=1.25),
            )
        },
        table=[],
        fused={"gate_up 2048x2816": dict(status="ok", ms=0.7, tflops=540.0, jax_ms=0.91, speedup_over_jax=1.3)},
    )  # fmt: skip
    res = dict(size="full", seconds=1.0, budget_s=300, env={}, sections=dict(tune=tune))
    res["summary"] = gpu_report.summary(res)
    assert res["summary"]["tune"]["speedup_over_rule"] == {"ragged_dot 2048x1408": 1.0}
    assert res["summary"]["tune"]["ws_speedup_over_rule"] == {"ragged_dot 2048x1408": 1.25}
    gpu_report.show(res)
    shown = capsys.readouterr().out
    assert "block sweep" in shown and "ragged_dot 2048x1408" in shown and "421" in shown and "1.00" in shown
    assert "526 (1.25x)" in shown
    assert "fused calls" in shown and "gate_up 2048x2816" in shown and "0.910" in shown and "1.30" in shown
    assert res["summary"]["tune"]["fused_speedup_over_jax"] == {"gate_up 2048x2816": 1.3}


def test_agreement_measure_by_hand():
    """max |got - ref| / max |ref| on the device: |[1, 2] - [1, 4]| / 4 = 0.5; an all-zero reference gives max |got|."""
    assert float(gpu_tune._max_rel(jnp.asarray([1.0, 2.0]), jnp.asarray([1.0, 4.0]))) == 0.5
    assert float(gpu_tune._max_rel(jnp.asarray([0.0, -3.0], jnp.bfloat16), jnp.zeros(2, jnp.bfloat16))) == 3.0


def _swept(best_blocks, rule=(128, 128, 64, 4, 2), kernel="ragged_dot", k=2048, n=1408):
    best = None if best_blocks is None else dict(blocks=list(best_blocks), ms=0.4, tflops=1.0, speedup_over_rule=1.1)
    return dict(kernel=kernel, k=k, n=n, rule=list(rule), best=best)


def test_tuned_blocks_are_the_bests_that_differ_from_the_rule(monkeypatch):
    """The entries the sections after the sweep apply: a best that is not the rule's own choice; none where the rule
    won or nothing agreed; applied, moe_hopper.blocks chooses them (for groups of 128 rows or more on average)."""
    res = dict(
        calls={
            "ragged_dot 2048x1408": _swept((64, 128, 64, 4, 2)),
            "transposed 2048x1408": _swept((128, 128, 64, 4, 1), rule=(128, 128, 64, 4, 1), kernel="transposed"),
            "ragged_dot_t 1408x2048": _swept(None, kernel="ragged_dot_t", k=1408, n=2048),
            "ragged_dot 1408x2048": _swept((128, 256, 64, 3, 2), k=1408, n=2048),
        }
    )
    tuned = gpu_tune.tuned_blocks(res)
    assert tuned == {"ragged_dot 2048 1408": [64, 128, 64, 4, 2], "ragged_dot 1408 2048": [128, 256, 64, 3, 2]}
    assert gpu_tune.tuned_blocks({}) == {} and gpu_tune.tuned_blocks(dict(skipped="not a Hopper GPU")) == {}
    monkeypatch.setattr(moe_hopper, "BLOCKS", dict(moe_hopper.BLOCKS))
    assert moe_hopper.blocks("ragged_dot", 32768, 60, 1408, 2048) == Blocks(128, 128, 64, 4, 2)  # the rule
    gpu_tune.apply_blocks(json.loads(json.dumps(tuned)))  # as a part's process gets it
    assert moe_hopper.blocks("ragged_dot", 32768, 60, 1408, 2048) == Blocks(128, 256, 64, 3, 2)
    assert moe_hopper.blocks("ragged_dot", 32768, 60, 2048, 1408) == Blocks(64, 128, 64, 4, 2)
    assert moe_hopper.blocks("ragged_dot", 1024, 60, 1408, 2048).block_m == 64  # small groups: the rule still
    with pytest.raises(ValueError, match="unknown kernel"):
        gpu_tune.apply_blocks({"gmm 8 8": [64, 64, 64, 2, 1]})


def test_sections_after_the_sweep_run_with_its_blocks(monkeypatch, tmp_path):
    """The check runs the sweep before the MoE layer and the train step, whose plans then carry its blocks, and each
    part applies them in its own process before measuring; without a sweep (or a better block) the plans carry none."""
    tune_at = gpu_check.SECTIONS.index("tune")
    assert tune_at < gpu_check.SECTIONS.index("moe_layer") and tune_at < gpu_check.SECTIONS.index("train_step")
    env = dict(moe_default="mgpu", moe_impls=["auto", "mgpu", "triton"])
    tune = dict(calls={"ragged_dot 2048x1408": _swept((64, 128, 64, 4, 2))})
    for section in ("moe_layer", "train_step"):
        plans = gpu_check.plans(section, "full", env, dict(tune=tune))
        assert plans and all(p["blocks"] == {"ragged_dot 2048 1408": [64, 128, 64, 4, 2]} for p in plans)
        assert all("blocks" not in p for p in gpu_check.plans(section, "full", env, {}))
    monkeypatch.setattr(moe_hopper, "BLOCKS", dict(moe_hopper.BLOCKS))
    plan = gpu_check.plans("moe_layer", "small", env, dict(tune=tune))[0]
    gpu_check.run_part("env", json.loads(json.dumps(plan)), time.time() + 60, str(tmp_path / "env.json"))
    assert moe_hopper.BLOCKS[("ragged_dot", 2048, 1408)] == Blocks(64, 128, 64, 4, 2)
    res = dict(
        size="full", seconds=1.0, budget_s=300, env={}, sections=dict(moe_layer=dict(tuned_blocks=plan["blocks"]))
    )
    assert gpu_report.summary(res)["blocks"] == {"moe_layer": "the sweep's (1 entry)", "train_step": "as shipped"}
