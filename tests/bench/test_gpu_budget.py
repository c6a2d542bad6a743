"""The GPU check's cost model against the checks measured on an H200 on 2026-11-28 and 2026-11-30
(tests/fixtures/gpu_check): each part that ended is estimated within a quarter of what it took, and each part that was
killed at its time box is estimated to need more than the box gave it (a check planned with the model would not have
started it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cisjax.bench import gpu_budget, gpu_check, gpu_torch_generate

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
    assert gpu_budget.case_s("nonsense", "float32") == gpu_budget.DEFAULT_CASE_S
    # never measured: mgpu_ws costs what mgpu measured (gpu_budget.ASSUMED_AS), its optimizer options too
    assert gpu_budget.train_unit_s("mgpu_ws", 4, 2048) == gpu_budget.train_unit_s("mgpu", 4, 2048)
    assert gpu_budget.train_unit_s("mgpu_ws+offload", 4, 2048) == pytest.approx(24.6 + 5 * 0.914)
    assert gpu_budget.layer_unit_s("qwen3_30b_a3b", "mgpu_ws", 8192) == 31.2
    assert gpu_budget.case_s("mgpu_ws", "bfloat16") == 12.2
    # four processes at once: each case 1 + 3 x 0.53 times as long as alone; attention's triton is its own case
    assert gpu_budget.case_s("mgpu", "float32", workers=4) == pytest.approx(7.6 * 2.59)
    assert gpu_budget.case_s("triton", "float32", kind="attention") == 4.0 != gpu_budget.case_s("triton", "float32")
    # one process with its weights built once: the process, setup and init once, the units after each other
    plan = dict(size="full", combos=[["mgpu", 4, 2048], ["mgpu", 8, 2048]])
    once = gpu_budget.PROCESS_S + gpu_budget.SETUP_S + gpu_budget.INIT_S
    assert gpu_budget.part_s("train_step", plan) == pytest.approx(once + 25.8 + 27.3 + 5 * (0.132 + 0.218))
    # an option of the optimizer state builds its state from the impl's weights, not weights of its own
    plan = dict(size="full", combos=[["mgpu", 4, 2048], ["mgpu+offload", 4, 2048]])
    assert gpu_budget.part_s("train_step", plan) == pytest.approx(once + 24.6 + 25.8 + 24.6 + 5 * (0.132 + 0.914))
    # the loop's two runs at once after the warm-up: the longer one, slowed by the other
    assert gpu_budget.part_s("loop", dict(size="full")) == pytest.approx(67.3 + 1.2 * 83.1)


def test_exactness_workers_overlap_and_the_rest_add_up():
    a = dict(size="full", cases=[["moe", "mgpu", "float32"]], workers=2)
    b = dict(size="full", cases=[["moe", "tiled", "float32"], ["moe", "tiled", "bfloat16"]], workers=2)
    assert gpu_budget.section_s("exactness", [a, b]) == pytest.approx(gpu_budget.PROCESS_S + (19.0 + 8.4) * 1.53)
    s = dict(size="full", which="jax"), dict(size="full", which="torch")
    assert gpu_budget.section_s("sampler", list(s)) == pytest.approx(
        gpu_budget.PROCESS_S + gpu_budget.SAMPLER_S["jax"] + gpu_budget.TORCH_PROCESS_S + gpu_budget.SAMPLER_S["torch"]
    )
    with pytest.raises(ValueError, match="no cost model"):
        gpu_budget.part_s("nonsense", dict(size="full"))


def _kept(times: list[float]) -> list[float]:
    """The timed calls gpu_torch_generate.timed_calls keeps today of calls measured before its TIMED_S rule."""
    kept: list[float] = []
    for t in times:
        if kept and sum(kept) + kept[-1] > gpu_torch_generate.TIMED_S:
            break
        kept.append(t)
    return kept


def test_the_cost_model_predicts_the_2026_11_30_parts():
    first = _load("check_loop_sampler_2026-11-30.json")["sections"]
    stages = first["loop"]["stages"]  # run one after another then: LOOP_S holds each stage's seconds
    for name, seconds in gpu_budget.LOOP_S.items():
        assert stages[name]["status"] == "ok" and seconds == pytest.approx(stages[name]["seconds"], rel=0.05)
    assert first["loop"]["runs"][0]["seconds"] == pytest.approx(sum(gpu_budget.LOOP_S.values()), rel=0.05)
    # the sampler's parts, less the timed calls the TIMED_S rule now leaves out
    jax_part, torch_part = first["sampler"]["runs"]
    jax_batches, torch_batches = first["sampler"]["jax"]["batches"], first["sampler"]["torch"]["batches"]
    dropped = sum(sum(b["decode"]["times_s"]) - sum(_kept(b["decode"]["times_s"])) for b in jax_batches.values())
    assert dropped > 0  # batch 256: 3 x 4.0 s, past 12 s
    plan = dict(size="full", which="jax")
    assert gpu_budget.part_s("sampler", plan) == pytest.approx(jax_part["seconds"] - dropped, rel=0.1)
    dropped = sum(sum(b["times_s"]) - sum(_kept(b["times_s"])) for b in torch_batches.values())
    assert dropped > 20  # batch 256: two of its three 12.4 s calls
    plan = dict(size="full", which="torch")
    assert gpu_budget.part_s("sampler", plan) == pytest.approx(torch_part["seconds"] - dropped, rel=0.1)

    second = _load("check_train_step_exactness_2026-11-30.json")["sections"]
    train = second["train_step"]
    combos = [[k.split("@")[0], *map(int, k.split("@")[1].split("x"))] for k in train if "@" in k]
    assert len(combos) == 6 and train["runs"][0]["status"] == "ok"
    plan = dict(size="full", combos=combos, trace_dir="x")
    assert gpu_budget.part_s("train_step", plan) == pytest.approx(train["runs"][0]["seconds"], rel=0.1)
    # the exactness cases it measured, in four processes at once: the section within a quarter of its longest worker
    ex = second["exactness"]
    cases = [
        [kind, impl, dtype]
        for kind in ("moe", "attention")
        for impl, row in ex[kind].items()
        for dtype, r in row.items()
        if "worst" in r
    ]
    assert len(cases) == 11
    parts = [dict(size="full", cases=g, workers=4) for g in gpu_check._workers(cases, 4)]
    longest = max(r["seconds"] for r in ex["runs"])
    assert gpu_budget.section_s("exactness", parts) == pytest.approx(longest, rel=0.25)
