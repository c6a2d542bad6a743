"""The GPU check's cost model against the two checks measured on an H200 on 2026-11-28 (tests/fixtures/gpu_check):
each part that ended is estimated within a quarter of what it took, and each part that was killed at its time box is
estimated to need more than the box gave it (a check planned with the model would not have started it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cisjax.bench import gpu_budget

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_check"
KILLED = "timed out"


def _load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _measured_parts():
    """(section, the part's plan in today's terms, its measured seconds, how it ended) for every part the two checks
    started: then one process per train-step combo and per MoE layer shape."""
    train = _load("check_train_step.json")["sections"]["train_step"]
    combos = [k for k, v in train.items() if isinstance(v, dict) and "@" in k]
    ended = [r for r in train["runs"]]
    # call 2's parts, in its order: mgpu 4 x 2048, 8 x 2048, 1 x 16384 (killed), tiled, gmm (refused), triton and
    # ragged (killed)
    order = [("mgpu", 4, 2048), ("mgpu", 8, 2048), ("mgpu", 1, 16384), ("tiled", 4, 2048), ("gmm", 4, 2048)]
    order += [("triton", 4, 2048), ("ragged", 4, 2048)]
    assert len(ended) == len(order) and {f"{i}@{r}x{s}" for i, r, s in order} >= set(combos)
    for combo, run in zip(order, ended):
        if combo[0] != "gmm":  # refused by the platform: never planned on a GPU now
            yield "train_step", dict(size="full", combos=[list(combo)]), run["seconds"], run["status"]
    first = _load("check_exactness_tune_layer_torch.json")
    secs = first["sections"]
    # call 1: its four train-step parts (mgpu 4 x 2048, 8 x 2048, 1 x 16384, tiled 4 x 2048), all killed
    for combo, run in zip(order[:4], secs["train_step"]["runs"]):
        yield "train_step", dict(size="full", combos=[list(combo)]), run["seconds"], run["status"]
    ex = secs["exactness"]
    cases = [
        ["moe", impl, dtype]
        for impl, row in ex["moe"].items()
        for dtype, r in row.items()
        if "worst" in r  # the cases it measured; the rest were skipped at no cost
    ]
    yield "exactness", dict(size="full", cases=cases), ex["runs"][0]["seconds"], ex["runs"][0]["status"]
    for (name, shape), run in zip(secs["moe_layer"]["shapes"].items(), secs["moe_layer"]["runs"]):
        units = [[name, impl, 8192] for impl, r in shape["impls"].items() if r["status"] == "ok"]
        yield "moe_layer", dict(size="full", units=units), run["seconds"], run["status"]
    torch = secs["torch_step"]
    combos = [[k.split("@")[0], *map(int, k.split("@")[1].split("x"))] for k in torch if "@" in k]
    yield "torch_step", dict(size="full", combos=combos), torch["runs"][0]["seconds"], torch["runs"][0]["status"]
    yield "tune", dict(size="full"), secs["tune"]["runs"][0]["seconds"], secs["tune"]["runs"][0]["status"]
    yield "env", dict(size="full"), first["env"]["run"]["seconds"], first["env"]["run"]["status"]


def test_the_cost_model_predicts_the_measured_parts():
    parts = list(_measured_parts())
    killed = [p for p in parts if p[3].startswith(KILLED)]
    assert len(parts) == 17 and len(killed) == 7  # every part the two checks started (gmm: refused)
    for section, plan, seconds, status in parts:
        estimate = gpu_budget.part_s(section, plan)
        if status.startswith(KILLED):  # the box it had was too short: the model must say so
            assert estimate > seconds, (section, plan, seconds, estimate)
        else:
            assert status == "ok" and estimate == pytest.approx(seconds, rel=0.25), (section, plan, seconds, estimate)


def test_units_by_hand():
    # 25.8 s of compile and first call, then five steps of 0.132 s
    assert gpu_budget.train_unit_s("mgpu", 4, 2048) == pytest.approx(25.8 + 5 * 0.132)
    # unmeasured: the default compile, half as much again past 8,192 tokens in a row; tokens at the impl's rate
    assert gpu_budget.train_unit_s("triton", 2, 16384) == pytest.approx(27.0 * 1.5 + 5 * 32768 / 30_000.0)
    assert gpu_budget.layer_unit_s("qwen15_moe", "mgpu", 16384) == pytest.approx(25.1 + 2.0)
    assert gpu_budget.layer_unit_s("qwen15_moe", "mgpu", 32768) == pytest.approx(25.1 + 4.0)
    assert gpu_budget.case_s("dense", "float32") == gpu_budget.DEFAULT_CASE_S
    # one process with its weights built once: the process, setup and init once, the units after each other
    plan = dict(size="full", combos=[["mgpu", 4, 2048], ["mgpu", 8, 2048]])
    once = gpu_budget.PROCESS_S + gpu_budget.SETUP_S + gpu_budget.INIT_S
    assert gpu_budget.part_s("train_step", plan) == pytest.approx(once + 25.8 + 27.3 + 5 * (0.132 + 0.218))


def test_exactness_workers_overlap_and_the_rest_add_up():
    a = dict(size="full", cases=[["moe", "mgpu", "float32"]])
    b = dict(size="full", cases=[["moe", "tiled", "float32"], ["moe", "tiled", "bfloat16"]])
    assert gpu_budget.section_s("exactness", [a, b]) == pytest.approx(gpu_budget.PROCESS_S + 38.0)
    s = dict(size="full", which="jax"), dict(size="full", which="torch")
    assert gpu_budget.section_s("sampler", list(s)) == pytest.approx(
        gpu_budget.PROCESS_S + gpu_budget.SAMPLER_S["jax"] + gpu_budget.TORCH_PROCESS_S + gpu_budget.SAMPLER_S["torch"]
    )
    with pytest.raises(ValueError, match="no cost model"):
        gpu_budget.part_s("nonsense", dict(size="full"))
