"""`python -m cisjax.bench.gpu_check`: one call checks a GPU machine (kernel exactness, the MoE layer table, the train
step per MoE impl, transformers' step; on request the Hopper kernels' block sweep), each part in a process of its own
under one time budget; one JSON, a table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cisjax.bench import gpu_exact, gpu_parts, gpu_report, gpu_tune

REPO = Path(__file__).resolve().parents[2]
# In this order. "tune" (the block sweep, minutes of compiles) runs only when asked for (--only), before the MoE layer
# and the train step, which then run the Hopper kernels with the blocks it found best (gpu_tune.tuned_blocks).
SECTIONS = ("exactness", "tune", "moe_layer", "train_step", "torch_step")
DEFAULT_SECTIONS = ("exactness", "moe_layer", "train_step", "torch_step")
# Each section's share of the budget (after the environment probe); what one leaves unused passes to the next.
SHARES = {"exactness": 0.15, "moe_layer": 0.30, "train_step": 0.40, "torch_step": 0.15, "tune": 0.40}
DEFAULT_BUDGET_S = 330.0  # 5.5 minutes: within 6 on one H100 / H200 with the machine's start-up outside it
ENV_S = 60.0  # the environment probe's own time box (a JAX start on the device)
GRACE_S = 20.0  # a part's process may run this long past its deadline (ending its current unit) before it is killed
MIN_UNIT_S = {"full": 15.0, "small": 2.0}  # a part is not started with less than this left to it


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="PATH", help="where to write the JSON (its folder is made)")
    parser.add_argument(
        "--size",
        default="auto",
        choices=("auto", "full", "small"),
        help="full: the paper's shapes (a GPU); small: toy shapes that run every section on a CPU in about a minute; "
        "auto: small when JAX's backend is the CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds for the whole check; each section is time-boxed within it and what would overrun is skipped, "
        "saying so (default: %(default)s)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=list(DEFAULT_SECTIONS),
        help="the sections to run (default: %(default)s; tune: the block sweep of the Hopper grouped matmuls at the "
        "MoE layer table's shapes, best configurations printed as moe_hopper.BLOCKS entries and used by the MoE "
        "layer and train step sections that follow it)",
    )
    # a part's own process (the check starts these)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- a part, in its own process


def run_part(name: str, plan: dict, deadline: float, out_path: str) -> None:
    """One part of the check, its result written (atomically) to `out_path` after every unit it measures."""

    def save(result) -> None:
        tmp = f"{out_path}.tmp"
        Path(tmp).write_text(json.dumps(result, default=str))
        os.replace(tmp, out_path)

    size = plan.get("size", "small")
    gpu_tune.apply_blocks(plan.get("blocks", {}))
    if name == "env":
        save(dict(gpu_parts.env(), versions=gpu_parts.versions()))
    elif name == "exactness":
        save(gpu_exact.run(size, deadline, save))
    elif name == "moe_layer":
        save(gpu_parts.moe_layer(size, plan["shapes"], plan["impls"], deadline, save))
    elif name == "train_step":
        save(gpu_parts.train_steps(size, plan["combos"], deadline, save))
    elif name == "torch_step":
        save(gpu_parts.torch_steps(size, plan["combos"], deadline, save))
    elif name == "tune":
        save(gpu_tune.run(size, deadline, save))
    else:
        raise SystemExit(f"unknown part {name!r}")


def spawn(name: str, plan: dict, deadline: float, kill_at: float, tmp: Path) -> dict:
    """Run a part in a fresh Python process (its own device memory; JAX and torch never share one), killed at
    `kill_at`: its result, and how it ended ("ok", "timed out" with what it had saved, "crashed" with its log's
    tail)."""
    out, log = tmp / f"{name}.json", tmp / f"{name}.log"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    cmd = [sys.executable, "-m", "cisjax.bench.gpu_check", "--out", str(out), "--part", name]
    cmd += ["--plan", json.dumps(plan), "--deadline", str(deadline), "--part-out", str(out)]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=max(kill_at - time.time(), 1.0))
            how = "ok" if proc.returncode == 0 else f"crashed (exit code {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            how = "timed out (killed at the time box; what it had measured is kept)"
    result = json.loads(out.read_text()) if out.is_file() else {}
    ended = dict(status=how, seconds=time.time() - t0)
    if how != "ok":
        ended["log_tail"] = log.read_text()[-3000:]
    return dict(result=result, run=ended)


# ----------------------------------------------------------------------------- the check


def _runnable(exactness: dict, impls: list[str]) -> list[str]:
    """The impls the exactness section did not find refused by the platform (unmeasured ones included)."""

    def refused(impl):
        rows = exactness.get("moe", {}).get(impl, {})
        return bool(rows) and all(str(r.get("skipped", "")).startswith("not on") for r in rows.values())

    return [i for i in impls if not refused(i)]


def _layer_ratio(layer: dict, impl: str) -> float:
    """An impl's MoE layer time over the dense MLP's at the first shape measured (inf where it was not)."""
    for shape in layer.get("shapes", {}).values():
        ratio = shape["impls"].get(impl, {}).get("moe", {}).get("ratio")
        if ratio is not None:
            return ratio
    return float("inf")


def plans(section: str, size: str, env: dict, sections: dict) -> list[dict]:
    """A section's units, one process each on a GPU (a clean device for each: peak memory, out of memory), one in all
    on a small run. The default impl comes first everywhere; the train step takes the others fastest first by the MoE
    layer table (the E/k-fold dense impl last where it is unmeasured); impls the exactness section found refused by
    the platform are left out."""
    default = env.get("moe_default", "auto")
    impls = gpu_exact.impls_to_check(tuple(env.get("moe_impls", ("auto",))), default)
    impls = sorted(_runnable(sections.get("exactness", {}), impls), key=lambda i: (i != default, i == "dense"))
    tokens = [list(t) for t in gpu_parts.STEP_TOKENS[size]]
    small = size == "small"
    if section in ("exactness", "tune"):
        return [dict(size=size)]
    tuned = gpu_tune.tuned_blocks(sections.get("tune", {}))
    base = dict(size=size, blocks=tuned) if tuned else dict(size=size)
    if section == "moe_layer":
        shapes = list(gpu_parts.MOE_LAYER[size]["shapes"])
        if small:
            return [dict(base, shapes=shapes, impls=[default])]
        return [dict(base, shapes=[s], impls=impls) for s in shapes]
    if section == "train_step":
        combos = [[default, *t] for t in tokens]
        if small:
            return [dict(base, combos=combos)]
        others = sorted(
            (i for i in impls if i != default), key=lambda i: _layer_ratio(sections.get("moe_layer", {}), i)
        )
        return [dict(base, combos=[c]) for c in combos + [[i, *tokens[0]] for i in others]]
    combos = [["fastest", *tokens[0]], ["fastest", *tokens[1]], ["eager", *tokens[0]]]
    return [dict(size=size, combos=combos)]


def _merge(section: str, parts: list[dict]) -> dict:
    """One section's result from its parts' results (moe_layer: shapes; the steps: one entry per combo)."""
    out = dict(parts[0]["result"]) if parts else {}
    for p in parts[1:]:
        r = p["result"]
        if section == "moe_layer":
            out.setdefault("shapes", {}).update(r.get("shapes", {}))
            out.update({k: v for k, v in r.items() if k != "shapes"})
        else:
            out.update(r)
    out["runs"] = [p["run"] for p in parts]
    return out


def check(args) -> dict:
    """The environment probe, then each section of args.only in turn under its share of args.budget_s: the result."""
    start = time.time()
    end = start + args.budget_s
    res = dict(check="gpu", budget_s=args.budget_s, environment=_environment(), sections={})
    with tempfile.TemporaryDirectory(prefix="cisjax_gpu_check_") as tmp:
        tmp = Path(tmp)
        probe = spawn("env", {}, start + ENV_S, start + ENV_S + GRACE_S, tmp)
        env = res["env"] = dict(probe["result"], run=probe["run"])
        size = args.size if args.size != "auto" else ("small" if env.get("backend", "cpu") == "cpu" else "full")
        res["size"] = size
        pool, carry = end - time.time(), 0.0  # the sections' time, shared out by SHARES
        for section in SECTIONS:
            if section not in args.only:
                continue
            t_section = time.time()
            share = SHARES[section] / sum(SHARES[s] for s in SECTIONS if s in args.only) * pool
            sec_deadline = min(t_section + share + carry, end)
            units = plans(section, size, env, res["sections"])
            print(f"== {section}: {len(units)} part(s), {sec_deadline - t_section:.0f} s", flush=True)
            parts, skipped = [], []
            for i, plan in enumerate(units):
                left = sec_deadline - time.time()
                if left < MIN_UNIT_S[size]:
                    skipped.append(dict(plan=plan, reason=f"time box: {left:.0f} s left of the section's budget"))
                    continue
                unit_deadline = time.time() + left / (len(units) - i)
                parts.append(spawn(section, plan, unit_deadline, min(unit_deadline, end) + GRACE_S, tmp))
                print(f"   part {i + 1}/{len(units)}: {parts[-1]['run']['status']}", flush=True)
            res["sections"][section] = dict(_merge(section, parts), skipped_parts=skipped)
            if units and "blocks" in units[0]:  # the Hopper kernels ran with the sweep's blocks
                res["sections"][section]["tuned_blocks"] = units[0]["blocks"]
            res["sections"][section]["seconds"] = used = time.time() - t_section
            carry = max(share + carry - used, 0.0)
    res["seconds"] = time.time() - start
    res["summary"] = gpu_report.summary(res)
    return res


def _environment() -> dict:
    """What the check runs with, from the outside: the variables that set JAX's and XLA's memory, the GPU's name
    (nvidia-smi), the package versions."""
    names = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS", "JAX_PLATFORMS")
    out = {k: os.environ.get(k) for k in names}
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        out["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["nvidia_smi"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cisjax.bench.gpu_check", description=__doc__)
    add_args(parser)
    args = parser.parse_args(argv)
    if args.part:
        run_part(args.part, json.loads(args.plan), args.deadline, args.part_out)
        return 0
    res = check(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    gpu_report.show(res)
    print(f"JSON: {args.out}")
    return 1 if res["summary"]["exactness"]["ok"] is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
