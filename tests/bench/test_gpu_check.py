"""The GPU check (launchers/gpu_check.sh, cisjax.bench.gpu_check) at toy sizes on the CPU, every section end to end
through the launcher; its exactness check failing on a wrong reference; the time boxes; MFU's peak table."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from cisjax.bench import gpu_budget, gpu_check, gpu_exact, gpu_parts, gpu_report, mfu, torch_step
from cisjax.models import attention, moe
from cisjax.plan import hardware
from tests.support import xla_flags
from tests.test_launchers import REPO

# The launcher's sections in three calls (--only), one test each, which pytest-xdist spreads over its workers: one call
# of every section was the suite's longest test (6-8 min on a loaded CI worker), the loop running beside the others.
# Three, not one a section: each call pays the launcher's start and the environment probe (~8 s). The loop still runs
# beside a section here (the MoE layer table), its result put back in the sections' order. That a call without --only
# runs every section: test_default_call_runs_every_section.
CALLS = {
    "loop": ("loop", "moe_layer"),
    "sampler": ("sampler", "torch_step"),
    "kernels": ("train_step", "exactness"),
}


def _check(tmp_path, sections) -> tuple[dict, str]:
    """launchers/gpu_check.sh --only SECTIONS with this Python, one CPU device and the suite's cheap compile: (its
    JSON, its output), checked for what every call of the check has: the environment, every part ok within the
    budget, the targets, the tables of the sections that ran."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "PYTHONPATH")}
    env.update(
        OUT=str(tmp_path),
        PYTHON=sys.executable,
        BUDGET_S="600",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join(xla_flags.COMPILE),
    )
    r = subprocess.run(
        ["bash", str(REPO / "launchers" / "gpu_check.sh"), "--only", *sections],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = r.stdout + r.stderr
    assert r.returncode == 0 and (tmp_path / "gpu_check.json").is_file(), output[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["size"] == "small" and res["env"]["backend"] == "cpu" and res["env"]["device_kind"] == "cpu"
    assert res["environment"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.93"  # the launcher's
    assert res["env"]["versions"]["jax"] and res["env"]["versions"]["python"]
    secs = res["sections"]
    assert list(secs) == list(sections) and not res["deferred"] and res["next_call"] is None  # in SECTIONS' order
    assert all(run["status"] == "ok" for s in secs.values() for run in s["runs"]), output[-3000:]
    assert all(_real(s["estimate_s"]) and _real(s["seconds"]) for s in secs.values())  # the budget's columns
    targets = {t["name"]: t for t in res["summary"]["targets"]}
    assert {t["issue"] for t in targets.values()} == {45, 46, 47, 49}
    assert all(t["verdict"] in ("met", "missed", "not measured") for t in targets.values())
    assert all(t["why"] for t in targets.values() if t["verdict"] == "not measured")
    assert targets["the check fits its budget"]["verdict"] == "met"
    tables = {"loop": "the RL loop", "sampler": "the JAX sampler", "exactness": "exactness", "train_step": "train step"}
    tables.update(torch_step="torch step", moe_layer="MoE layer fwd+bwd")
    for table in [tables[s] for s in sections] + ["targets", "budget"]:
        assert table in output  # the printed tables
    return res, output


def _real(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_gpu_check_loop_beside_the_moe_layer_small_on_cpu(tmp_path):
    res, output = _check(tmp_path, CALLS["loop"])
    loop = res["sections"]["loop"]["stages"]
    assert [loop[k]["status"] for k in ("prepare", "colocated", "exact", "gpu_local")] == ["ok"] * 4, output[-3000:]
    for stage in ("colocated", "gpu_local"):  # four steps each, end to end, the canary read at every publish
        run = loop[stage]["run"]
        assert run["steps"] == 4 and all(0.0 <= r <= 1.0 for r in run["rewards"])
        assert run["canary"]["checked"] == 4 and all(_real(run["phases"][p]["median_s"]) for p in ("train", "step"))
    assert loop["colocated"]["run"]["eval"]  # the in-loop evaluation ran on the colocated sampler
    targets = {t["name"]: t for t in res["summary"]["targets"]}
    assert targets["loop: gpu_local.sh"]["verdict"] == "met"
    # rollout.exact's run: q == p for every token of every step; the plain colocated run's fraction is below 1
    exact = loop["exact"]["run"]
    assert exact["steps"] == 3 and exact["exact_frac"] == [1.0] * 3 and exact["abs_logk_max"] == 0.0
    assert min(loop["colocated"]["run"]["exact_frac"]) < 1.0
    assert targets["loop: rollout.exact, q == p"]["verdict"] == "met"

    layer = res["sections"]["moe_layer"]
    tokens = gpu_parts.MOE_LAYER["small"]["tokens"]
    assert list(layer["shapes"]) == [f"{s}@{tokens}" for s in gpu_parts.MOE_LAYER["small"]["shapes"]]
    for shape in layer["shapes"].values():
        row = shape["impls"][res["env"]["moe_default"]]
        assert row["status"] == "ok" and _real(row["moe"]["ratio"]) and _real(row["moe"]["tflops"])
        assert row["moe"]["mfu"] is None  # no peak for a CPU: omitted, with the reason
    assert "no documented peak" in layer["mfu_omitted"]


@pytest.mark.slow
def test_gpu_check_sampler_and_torch_step_small_on_cpu(tmp_path):
    res, _ = _check(tmp_path, CALLS["sampler"])
    sam = res["sections"]["sampler"]
    assert sam["jax"]["batches"] and sam["torch"]["batches"]
    torch = res["sections"]["torch_step"]
    assert torch["device"] == "cpu" and any(k.startswith("fastest@") for k in torch)
    assert all(torch[k]["status"] == "ok" and _real(torch[k]["tokens_per_s"]) for k in torch if "@" in k)


@pytest.mark.slow
def test_gpu_check_train_step_and_exactness_small_on_cpu(tmp_path):
    res, _ = _check(tmp_path, CALLS["kernels"])
    steps = res["sections"]["train_step"]
    combos = [k for k in steps if "@" in k]
    default, (rows0, seq0) = res["env"]["moe_default"], gpu_parts.STEP_TOKENS["small"][0]
    assert combos == [f"{default}@{r}x{t}" for r, t in gpu_parts.STEP_TOKENS["small"]] + [
        f"{default}+{o}@{rows0}x{seq0}"
        for o in gpu_parts.STATE_OPTIONS  # the optimizer state's memory options
    ]
    for key in combos:
        r = steps[key]
        assert r["status"] == "ok" and _real(r["tokens_per_s"]) and _real(r["train_flops"]) and r["mfu"] is None
        assert r["peak_gib"] is None and r["memory_note"] and math.isfinite(r["loss"])
        split = r["memory_split"]  # the compiler's buffer assignment of the step it ran, beside the peak
        assert split["live_before_gib"] is None and split["compiled_gib"]["arguments"] > 0
        assert split["compiled_gib"]["aliased"] > 0 and split["compiled_gib"]["temporaries"] > 0  # state donated

    ex = res["sections"]["exactness"]
    assert ex["ok"] and not ex["failures"] and res["summary"]["exactness"]["ok"] is True
    assert set(ex["moe"]) == set(moe.IMPLS) - {"auto"} and set(ex["attention"]) == set(attention.IMPLS) - {"auto"}
    measured = set()
    for kind in ("moe", "attention"):
        for impl, row in ex[kind].items():
            assert set(row) == set(gpu_exact.DTYPES)
            for dtype, r in row.items():
                if "skipped" in r:  # refused by the platform (a GPU-only kernel), said so
                    assert r["skipped"].startswith("not on cpu"), (impl, r)
                    continue
                measured.add(impl)
                # real figures: the kernel's output and gradients differ from float64 by rounding, within the bound
                assert all(_real(e) for e in r["max_rel"].values()), (kind, impl, dtype, r)
                assert r["worst"] <= gpu_exact.BOUNDS[dtype] and r["ok"]
                if kind == "moe":
                    assert set(r["max_rel"]) == {"y", "dx", "dwg", "dwu", "dwo", "dw"} and r["empty_groups_zero_grad"]
    assert {"tiled", "ragged", "dense", "einsum"} <= measured  # XLA's own impls run everywhere
    sizes = ex["moe_group_sizes"]
    assert 0 in sizes and len(set(s for s in sizes if s)) > 1  # empty and ragged groups
    targets = {t["name"]: t for t in res["summary"]["targets"]}
    assert targets["exactness"]["verdict"] == "met"


def test_default_call_runs_every_section():
    """Without --only the check runs every section but the sweep, and the calls above together run them all."""
    parser = argparse.ArgumentParser()
    gpu_check.add_args(parser)
    assert parser.parse_args(["--out", "x.json"]).only == list(gpu_check.DEFAULT_SECTIONS)
    assert sorted(s for call in CALLS.values() for s in call) == sorted(gpu_check.DEFAULT_SECTIONS)


def test_exactness_fails_on_a_wrong_reference():
    """The check compares against the float64 reference for real: one wrong gradient entry of the reference, or a
    reference attention that ignores the segments, and the kernel fails."""
    inputs = gpu_exact.moe_inputs("small")
    assert gpu_exact.check_moe("ragged", "float32", inputs)["ok"]

    def off(*args):
        out = gpu_exact.moe_reference(*args)
        out["dwo"][0, 0, 0] += 0.05 * np.abs(out["dwo"]).max()
        return out

    r = gpu_exact.check_moe("ragged", "float32", inputs, reference=off)
    assert not r["ok"] and r["max_rel"]["dwo"] > gpu_exact.BOUNDS["float32"] and r["max_rel"]["y"] < 1e-5

    a = gpu_exact.attention_inputs("small")
    assert gpu_exact.check_attention("einsum", "bfloat16", a)["ok"]
    one_segment = lambda q, k, v, ids, ct, scale: gpu_exact.attention_reference(q, k, v, ids > 0, ct, scale)  # noqa: E731
    assert not gpu_exact.check_attention("einsum", "bfloat16", a, reference=one_segment)["ok"]


def test_parts_past_their_deadline_are_skipped_saying_so():
    saved = []
    res = gpu_exact.run("small", time.time() - 1, saved.append)
    rows = [r for kind in ("moe", "attention") for row in res[kind].values() for r in row.values()]
    assert rows and all(r["skipped"].startswith("time box") for r in rows) and res["ok"]
    steps = gpu_parts.train_steps("small", [["tiled", 2, 32]], time.time() - 1, saved.append)
    assert steps["tiled@2x32"]["status"] == "skipped" and "time box" in steps["tiled@2x32"]["reason"]


def test_out_of_memory_is_recorded_as_such():
    try:
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 47.00GiB")
    except RuntimeError as err:
        assert gpu_parts.failure(err)["status"] == "oom"
    try:
        raise ValueError("bad shape")
    except ValueError as err:
        assert gpu_parts.failure(err)["status"] == "error"


H200 = dict(gpu_check.ASSUMED_ENV, moe_impls=list(moe.IMPLS))


def test_plans_one_process_per_section_default_impl_first_tpu_kernels_never_on_a_gpu():
    default = gpu_check.plans("train_step", "full", H200, {})
    first = list(gpu_parts.STEP_TOKENS["full"][0])
    shapes = [["mgpu_ws", *t] for t in map(list, gpu_parts.STEP_TOKENS["full"])]
    candidate = ["mgpu", *gpu_parts.STEP_TOKENS["full"][1]]  # beside the default until a GPU run has ranked them
    assert len(default) == 1 and default[0]["combos"] == [*shapes, candidate]  # the state's options only when asked
    every = gpu_check.plans("train_step", "full", H200, {}, impls="all")[0]["combos"]
    options = [["mgpu_ws+bf16moments", *first], ["mgpu_ws+offload", *first], ["mgpu_ws+bf16sum", *first]]
    assert every[: len(shapes) + 3] == shapes + options
    assert [c[0] for c in every[len(shapes) + 3 :]] == ["tiled", "triton", "mgpu", "ragged", "dense"]
    layer = gpu_check.plans("moe_layer", "full", H200, {})
    assert len(layer) == 1 and len(layer[0]["units"]) == 12  # three shapes at 8,192 and at 16,384 tokens, two impls
    assert {u[1] for u in layer[0]["units"]} == {"mgpu", "mgpu_ws"} and {u[2] for u in layer[0]["units"]} == {
        8192,
        16384,
    }
    units = gpu_check.plans("moe_layer", "full", H200, {}, impls="all")[0]["units"]
    assert "gmm" not in {u[1] for u in units} and [u[1] for u in units[:6]] == [
        "mgpu_ws",
        "tiled",
        "triton",
        "mgpu",
        "ragged",
        "dense",
    ]
    workers = gpu_check.plans("exactness", "full", H200, {})
    assert len(workers) == gpu_check.EXACTNESS_WORKERS
    cases = [c for w in workers for c in w["cases"]]
    run, left_out = gpu_check._exactness_cases(H200)
    assert sorted(cases) == sorted(run) and len(cases) == len(set(map(tuple, cases)))  # every case, once
    assert {c[1] for c in left_out} == {"gmm", "splash"} and not {c[1] for c in run} & {"gmm", "splash"}
    assert len(run) + len(left_out) == 2 * (len(moe.IMPLS) - 1 + len(attention.IMPLS) - 1)
    loads = [gpu_budget.part_s("exactness", w) for w in workers]
    assert max(loads) - min(loads) <= max(gpu_budget.CASE_S.values())  # balanced to within one case
    cpu = dict(backend="cpu", moe_default="tiled", moe_impls=list(moe.IMPLS))
    assert len(gpu_check.plans("exactness", "small", cpu, {})) == 1  # a CPU runs them in one process
    torch_combos = gpu_check.plans("torch_step", "full", H200, {})[0]["combos"]
    assert torch_combos == [["fastest", 4, 2048], ["fastest", 8, 2048]]


def test_schedule_defers_what_the_budget_cannot_hold_in_value_order(capsys):
    plan = gpu_check.schedule(list(gpu_check.DEFAULT_SECTIONS), "full", H200, 1e6)
    assert [r["section"] for r in plan["rows"]] == list(gpu_check.DEFAULT_SECTIONS) and not plan["deferred"]
    by = {r["section"]: r["estimate_s"] for r in plan["rows"]}
    # a budget that holds the loop and the sampler but not the train step: the train step is deferred, and the
    # sections after it that still fit run (a part that cannot finish is not started; the next one gets the time)
    budget = gpu_budget.ENV_S + by["loop"] + by["sampler"] + by["torch_step"] + 1.0
    plan = gpu_check.schedule(list(gpu_check.DEFAULT_SECTIONS), "full", H200, budget)
    assert plan["deferred"] == ["train_step", "exactness", "moe_layer"]
    call = gpu_check.next_call(plan["deferred"], "full", "default")
    assert call.endswith("--only train_step exactness moe_layer") and "BUDGET_S=" in call
    assert gpu_check.main(["--out", "x.json", "--dry-run", "--budget-s", "540"]) == 0
    shown = capsys.readouterr().out
    assert all(s in shown for s in gpu_check.DEFAULT_SECTIONS) and "total" in shown and "NVIDIA H200" in shown
    # the default call: what its budget runs fits the 540 s of one device call; what it defers is the printed next call
    this_call = float(re.search(r"this call: (\d+) s of a budget of 540 s", shown).group(1))
    assert this_call <= 540 and ("next call:" in shown) == ("deferred:" in shown)


def test_peak_table():
    for kind, peak in hardware.DEVICE_PEAKS.items():
        assert (
            peak.kind == kind and peak.bf16 > 0 and ("data sheet" in peak.source or "cloud.google.com" in peak.source)
        )
        assert peak.fp32 is None or 0 < peak.fp32 < peak.bf16
    for chip, spec in hardware.GPU_CHIPS.values():  # the plan's GPUs: the same bf16 peak under their device names
        assert hardware.device_peak(spec.description).bf16 == chip.peak_flops
    h100 = mfu.peak("NVIDIA H100 80GB HBM3", "bfloat16")
    assert h100["peak_tflops"] == pytest.approx(989.4) and "H100" in h100["peak_source"]
    assert mfu.utilization(494.7e12, 1.0, h100) == dict(tflops=pytest.approx(494.7), mfu=pytest.approx(0.5))
    assert "no documented float32 peak" in mfu.peak("TPU v5", "float32")["mfu_omitted"]
    cpu = mfu.peak("cpu", "bf16")
    assert "mfu_omitted" in cpu and mfu.utilization(1e12, 2.0, cpu) == dict(tflops=0.5, mfu=None)


def test_the_checking_process_never_starts_jax():
    """The process that runs the parts must not start a JAX backend: on a GPU it would reserve most of the memory the
    parts need."""
    code = (
        "from jax._src import xla_bridge as xb; from cisjax.bench import gpu_check as g; g._environment(); "
        "g.gpu_parts.versions(); g.gpu_report.summary(dict(sections={}, env={})); print(bool(xb._backends))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1] == "False", r.stderr


def test_torch_side_follows_the_jax_device_and_asks_for_grouped_mm_first():
    assert torch_step.device("cpu") == "cpu" and torch_step.device_kind("cpu") == "cpu"
    assert torch_step.experts_kwargs(torch_step.FASTEST) == [{"experts_implementation": "grouped_mm"}, {}]
    assert torch_step.experts_kwargs("eager") == [{"experts_implementation": "eager"}] and torch_step.experts_kwargs(
        None
    ) == [{}]


def test_exactness_workers_merge_failures_and_unfinished_cases():
    """The workers' cases under one result: a case over its bound fails the check (exit code 1); a worker killed at
    its time box leaves its cases unmeasured (ok None: the target says "not measured", the check does not fail)."""
    ok_row = dict(worst=1e-7, ok=True)
    w1 = dict(result=dict(moe={"mgpu": {"float32": ok_row}}, attention={}, ok=True, failures=[]), run=dict(status="ok"))
    w2 = dict(
        result=dict(moe={"mgpu": {"bfloat16": ok_row}}, attention={}, ok=True, failures=[]), run=dict(status="ok")
    )
    merged = gpu_check._merge("exactness", [w1, w2])
    assert merged["ok"] is True and set(merged["moe"]["mgpu"]) == {"float32", "bfloat16"} and len(merged["runs"]) == 2
    killed = dict(result=dict(moe={"tiled": {"float32": ok_row}}), run=dict(status="timed out (killed ...)"))
    assert gpu_check._merge("exactness", [w1, killed])["ok"] is None
    bad = dict(w2, result=dict(w2["result"], ok=False, failures=["moe mgpu bfloat16"]))
    merged = gpu_check._merge("exactness", [w1, bad, killed])
    assert merged["ok"] is False and merged["failures"] == ["moe mgpu bfloat16"]


def test_the_exact_target_needs_every_step_bitwise():
    """rollout.exact's verdict on the hardware: met only when train/exact_frac is 1.0 at every step (one token of
    9,335 an fp32 unit off at one step is a miss), not measured without the stage or its figures."""

    def verdict(stage):
        res = dict(size="full", sections=dict(loop=dict(stages={} if stage is None else dict(exact=stage))))
        (target,) = [t for t in gpu_report._loop_targets(res) if t["issue"] == 49]
        return target["verdict"]

    def stage(fracs, status="ok"):
        return dict(status=status, run=dict(exact_frac=fracs, abs_logk_max=0.0))

    assert verdict(stage([1.0, 1.0, 1.0])) == "met"
    assert verdict(stage([1.0, 0.99989, 1.0])) == "missed"
    assert verdict(stage([1.0], status="timed out")) == "not measured"
    assert verdict(stage([])) == "not measured" and verdict(None) == "not measured"
