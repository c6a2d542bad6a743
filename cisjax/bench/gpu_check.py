"""`python -m cisjax.bench.gpu_check`: one call checks a GPU machine (the RL loop, the JAX sampler, the train step,
kernel exactness, the MoE layer table, transformers' step; on request the Hopper kernels' block sweep), each part in a
process of its own, planned against a cost model within one time budget; one JSON, a table, the next call's command."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cisjax.bench import (
    gpu_budget,
    gpu_exact,
    gpu_loop,
    gpu_parts,
    gpu_report,
    gpu_sampler,
    gpu_torch_generate,
    gpu_tune,
)
from cisjax.models import attention, moe

REPO = Path(__file__).resolve().parents[2]
# In the order they run, which is their value when the budget cannot hold them all: the loop and the sampler have
# never run on a GPU, then the train step, exactness, the MoE layer table, transformers' step. "tune" (the block
# sweep, minutes of compiles) runs only when asked for (--only), before the train step and the MoE layer, which then
# run the Hopper kernels with the blocks it found best (gpu_tune.tuned_blocks).
SECTIONS = ("loop", "sampler", "tune", "train_step", "exactness", "moe_layer", "torch_step")
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "tune")
DEFAULT_BUDGET_S = 540.0  # 9 minutes: one device call of 10 with the machine's start outside it
# Kernels for another platform: never tried on a GPU (the CPU suite runs them in Pallas's interpreter).
TPU_ONLY = {"moe": ("gmm",), "attention": ("splash",)}
EXACTNESS_WORKERS = 4  # exactness processes at once on a GPU (no timing in them; compiles are the host's work)
GRACE_S = 20.0  # a part's process may run this long past its deadline (ending its current unit) before it is killed
# What a dry run and the cost model assume the device is (an H200: what `auto` picks there).
ASSUMED_ENV = dict(backend="gpu", device_kind="NVIDIA H200", compute_capability="9.0", moe_default="mgpu_ws")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="PATH", help="where to write the JSON (its folder is made)")
    parser.add_argument(
        "--size",
        default="auto",
        choices=("auto", "full", "small"),
        help="full: the paper's shapes (a GPU); small: toy shapes that run every section on a CPU in a few minutes; "
        "auto: small when JAX's backend is the CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds for the whole check: a part whose estimate (cisjax.bench.gpu_budget) does not fit what is left "
        "is not started, and the printed next call runs it (default: %(default)s)",
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
    parser.add_argument(
        "--impls",
        default="default",
        choices=("default", "all"),
        help="MoE layer and train step: the default impl only, or every impl the platform runs (default: %(default)s)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (sections, parts, estimated seconds on an H200, what the budget defers) and exit; "
        "needs no device",
    )
    parser.add_argument(
        "--work-dir",
        default=None,
        help="where the loop section's runs go (default: a temporary folder, removed at the end)",
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="profiler traces of one train step and one decode step are written here (default: none)",
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
    elif name == "loop":
        save(gpu_loop.run(size, deadline, save, plan["work_dir"]))
    elif name == "sampler":
        if plan["which"] == "torch":
            save(gpu_torch_generate.run(size, deadline, save))
        else:
            save(gpu_sampler.run(size, deadline, save, trace_dir=plan.get("trace_dir")))
    elif name == "exactness":
        save(gpu_exact.run(size, deadline, save, cases=plan.get("cases")))
    elif name == "moe_layer":
        save(gpu_parts.moe_layer(size, plan["units"], deadline, save))
    elif name == "train_step":
        save(gpu_parts.train_steps(size, plan["combos"], deadline, save, trace_dir=plan.get("trace_dir")))
    elif name == "torch_step":
        save(gpu_parts.torch_steps(size, plan["combos"], deadline, save))
    elif name == "tune":
        save(gpu_tune.run(size, deadline, save))
    else:
        raise SystemExit(f"unknown part {name!r}")


class _Process:
    """A part in a fresh Python process (its own device memory; JAX and torch never share one), killed at
    `kill_at`."""

    def __init__(self, name: str, plan: dict, deadline: float, kill_at: float, tmp: Path, tag: str, env: dict):
        self.out, self.log, self.kill_at = tmp / f"{tag}.json", tmp / f"{tag}.log", kill_at
        self.out.unlink(missing_ok=True)
        path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
        cmd = [sys.executable, "-m", "cisjax.bench.gpu_check", "--out", str(self.out), "--part", name]
        cmd += ["--plan", json.dumps(plan), "--deadline", str(deadline), "--part-out", str(self.out)]
        self.t0 = time.time()
        self.fh = open(self.log, "w")  # noqa: SIM115  (closed in wait)
        self.proc = subprocess.Popen(
            cmd, env=dict(os.environ, PYTHONPATH=path, **env), stdout=self.fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait(self) -> dict:
        """Its result, and how it ended ("ok", "timed out" with what it had saved, "crashed" with its log's tail)."""
        try:
            self.proc.wait(timeout=max(self.kill_at - time.time(), 1.0))
            how = "ok" if self.proc.returncode == 0 else f"crashed (exit code {self.proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            how = "timed out (killed at the time box; what it had measured is kept)"
        self.fh.close()
        result = json.loads(self.out.read_text()) if self.out.is_file() else {}
        ended = dict(status=how, seconds=time.time() - self.t0)
        if how != "ok":
            ended["log_tail"] = self.log.read_text(errors="replace")[-3000:]
        return dict(result=result, run=ended)


def spawn(name: str, plan: dict, deadline: float, kill_at: float, tmp: Path) -> dict:
    """Run one part in its own process and wait for it: its result and how it ended."""
    return _Process(name, plan, deadline, kill_at, tmp, name, {}).wait()


# ----------------------------------------------------------------------------- the plan


# Impls measured beside the default until a GPU run has shown which is faster: JAX's Hopper kernels ("mgpu", the
# fallback) beside cisjax's warp-specialized ones ("mgpu_ws"), which "auto" picks on compute capability 9.x
CANDIDATES = {"mgpu_ws": ("mgpu",)}


def _impls(kind: str, env: dict, which: str) -> list[str]:
    """The MoE impls a section measures: the default ("auto"'s pick) and its CANDIDATES, or ("all") every impl the
    platform runs, the default first and the E/k-fold dense one last."""
    default = env.get("moe_default", "auto")
    if which == "default":
        return [default, *CANDIDATES.get(default, ())]
    impls = gpu_exact.impls_to_check(tuple(env.get("moe_impls", ("auto",))), default)
    on_gpu = env.get("backend", "cpu") != "cpu"
    impls = [i for i in impls if not (on_gpu and i in TPU_ONLY[kind])]
    return sorted(impls, key=lambda i: (i != default, i == "dense"))


def _exactness_cases(env: dict) -> tuple[list[list[str]], list[list[str]]]:
    """(the cases to run, the TPU-only cases left out on a GPU): [kind, impl, dtype] for every impl of moe.IMPLS and
    attention.IMPLS ("auto"'s picks first) in fp32 and bf16."""
    platform = env.get("backend", "cpu")
    defaults = dict(moe=moe.default_impl(platform), attention=attention.default_impl(platform, "bfloat16"))
    cases, left_out = [], []
    for kind, impls in (("moe", moe.IMPLS), ("attention", attention.IMPLS)):
        for impl in gpu_exact.impls_to_check(impls, defaults[kind]):
            for dtype in gpu_exact.DTYPES:
                tpu_only = platform != "cpu" and impl in TPU_ONLY[kind]
                (left_out if tpu_only else cases).append([kind, impl, dtype])
    return cases, left_out


def _workers(cases: list[list[str]], n: int) -> list[list[list[str]]]:
    """The cases in `n` groups of about equal estimated time (longest first onto the least loaded), each in order."""
    groups: list[list] = [[] for _ in range(min(n, len(cases)))]
    load = [0.0] * len(groups)
    for case in sorted(cases, key=lambda c: -gpu_budget.case_s(c[1], c[2], kind=c[0])):
        i = load.index(min(load))
        groups[i].append(case)
        load[i] += gpu_budget.case_s(case[1], case[2], kind=case[0])
    return [sorted(g, key=cases.index) for g in groups if g]


def plans(section: str, size: str, env: dict, sections: dict, impls: str = "default", dirs: dict | None = None):
    """A section's parts: each a plan dict for its process (size, its units, the sweep's blocks where the Hopper
    kernels run). One process per section, except the exactness workers on a GPU (running at once) and transformers'
    generate (a process without JAX)."""
    dirs = dirs or {}
    base = dict(size=size)
    if section in ("tune", "env"):
        return [base]
    if section == "loop":
        return [dict(base, work_dir=dirs.get("work_dir"))]
    if section == "sampler":
        return [dict(base, which="jax", trace_dir=dirs.get("trace_dir")), dict(base, which="torch")]
    if section == "exactness":
        cases, _ = _exactness_cases(env)
        if size == "small" or env.get("backend", "cpu") == "cpu":
            return [dict(base, cases=cases)]
        groups = _workers(cases, EXACTNESS_WORKERS)
        return [dict(base, cases=group, workers=len(groups)) for group in groups]
    tuned = gpu_tune.tuned_blocks(sections.get("tune", {}))
    if tuned:
        base["blocks"] = tuned
    tokens = [list(t) for t in gpu_parts.STEP_TOKENS[size]]
    if section == "moe_layer":
        names = list(gpu_parts.MOE_LAYER[size]["shapes"])
        units = [[s, i, t] for t in gpu_parts.LAYER_TOKENS[size] for s in names for i in _impls("moe", env, impls)]
        return [dict(base, units=units)]
    if section == "train_step":
        first, *others = _impls("moe", env, impls)
        # the default impl at each shape, then with each memory option of the optimizer state (on a GPU only with
        # --impls all: measured on an H200 on 2026-11-30, docs/results.md; 117 s of a 222 s section), the other impls
        with_options = impls == "all" or size == "small"
        options = [[f"{first}+{o}", *tokens[0]] for o in gpu_parts.STATE_OPTIONS] if with_options else []
        # a candidate at 8 x 2,048 tokens (issue 47's MFU shape), any other impl at the first shape
        candidates = CANDIDATES.get(first, ())
        combos = [[first, *t] for t in tokens] + options
        combos += [[i, *(tokens[1] if i in candidates else tokens[0])] for i in others]
        return [dict(base, combos=combos, trace_dir=dirs.get("trace_dir"))]
    if section == "torch_step":
        combos = [["fastest", *tokens[0]], ["fastest", *tokens[1]]]
        return [dict(base, combos=combos + ([["eager", *tokens[0]]] if impls == "all" else []))]
    raise ValueError(f"unknown section {section!r}")


def _merge(section: str, parts: list[dict]) -> dict:
    """One section's result from its parts' results (exactness: the workers' cases; sampler: jax and torch)."""
    out: dict = {}
    if section == "exactness":
        for p in parts:
            r = p["result"]
            for key, v in r.items():
                if key in ("moe", "attention"):
                    for impl, rows in v.items():
                        out.setdefault(key, {}).setdefault(impl, {}).update(rows)
                elif key == "failures":
                    out.setdefault("failures", []).extend(v)
                elif key != "ok":
                    out[key] = v
        # a case over its bound fails the check; a worker that did not finish leaves its cases unmeasured (None)
        finished = bool(parts) and all(p["run"]["status"] == "ok" and "ok" in p["result"] for p in parts)
        out["ok"] = False if out.get("failures") else (True if finished else None)
    elif section == "sampler":
        for p, which in zip(parts, ("jax", "torch")):
            out[which] = p["result"]
    else:
        for p in parts:
            out.update(p["result"])
    out["runs"] = [p["run"] for p in parts]
    return out


# ----------------------------------------------------------------------------- the check


def _part_deadline(now: float, estimate: float, end: float, size: str = "full") -> float:
    """Until when a part may start units: its estimate with room for error (half as much again, at least 20 s), never
    past the check's end; at toy sizes (a CPU, often loaded: nothing is timed) the check's end."""
    if size == "small":
        return end
    return min(now + max(1.5 * estimate, estimate + 20.0), end)


def schedule(sections: list[str], size: str, env: dict, budget_s: float, impls: str = "default") -> dict:
    """The plan of a check, for --dry-run and its printed next call: per section its parts' estimates, in order, and
    which parts a budget of `budget_s` (after the environment probe) defers to a next call."""
    left = budget_s - gpu_budget.part_s("env", dict(size=size))
    rows, deferred = [], []
    for section in [s for s in SECTIONS if s in sections]:
        parts = plans(section, size, env, {}, impls)
        est = gpu_budget.section_s(section, parts)
        fits = est <= left
        rows.append(dict(section=section, parts=len(parts), estimate_s=est, fits=fits))
        if fits:
            left -= est
        else:
            deferred.append(section)
    total = sum(r["estimate_s"] for r in rows)
    return dict(rows=rows, total_s=total, deferred=deferred, budget_s=budget_s)


def next_call(deferred: list[str], size: str, impls: str) -> str | None:
    """The launcher's command that runs what a check deferred (None: nothing was)."""
    if not deferred:
        return None
    parts = {s: plans(s, size, ASSUMED_ENV if size == "full" else {}, {}, impls) for s in deferred}
    need = gpu_budget.part_s("env", dict(size=size)) + sum(gpu_budget.section_s(s, p) for s, p in parts.items())
    extra = "" if impls == "default" else f" --impls {impls}"
    return (
        f"OUT=runs/gpu_check2 BUDGET_S={int(need) + 30} bash launchers/gpu_check.sh --only {' '.join(deferred)}{extra}"
    )


def check(args) -> dict:
    """The environment probe, then each section of args.only in order, each part started only when its estimate fits
    what is left of args.budget_s: the result, with what was deferred and the next call that runs it."""
    start = time.time()
    end = start + args.budget_s
    res = dict(check="gpu", budget_s=args.budget_s, environment=_environment(), sections={}, deferred={})
    with tempfile.TemporaryDirectory(prefix="cisjax_gpu_check_") as tmp:
        tmp = Path(tmp)
        probe = spawn("env", {}, start + 60.0, start + 60.0 + GRACE_S, tmp)
        env = res["env"] = dict(probe["result"], run=probe["run"])
        size = args.size if args.size != "auto" else ("small" if env.get("backend", "cpu") == "cpu" else "full")
        res["size"] = size
        dirs = dict(work_dir=args.work_dir or str(tmp / "loop"), trace_dir=args.trace_dir)
        beside = None  # small: the loop runs beside the other sections (nothing is timed at toy sizes on a CPU)
        for section in [s for s in SECTIONS if s in args.only]:
            t_section = time.time()
            units = plans(section, size, env, res["sections"], args.impls, dirs)
            estimate = gpu_budget.section_s(section, units)
            left = end - time.time()
            print(f"== {section}: {len(units)} part(s), estimated {estimate:.0f} s, {left:.0f} s left", flush=True)
            if estimate > left:
                res["deferred"][section] = f"estimated {estimate:.0f} s, {left:.0f} s left of the budget"
                print(f"   deferred: {res['deferred'][section]}", flush=True)
                continue
            if section == "loop" and size == "small":
                deadline = _part_deadline(t_section, estimate, end, size)
                beside = (
                    t_section,
                    estimate,
                    _Process(section, units[0], deadline, deadline + GRACE_S, tmp, "loop", {}),
                )
                continue
            _record(res, section, units, _run_section(section, units, end, tmp), estimate, t_section)
        if beside is not None:
            t_section, estimate, proc = beside
            part = proc.wait()
            part["run"]["estimate_s"] = estimate
            _record(res, "loop", [{}], [part], estimate, t_section)
            res["sections"] = {s: res["sections"][s] for s in SECTIONS if s in res["sections"]}
    res["seconds"] = time.time() - start
    res["next_call"] = next_call(list(res["deferred"]), res["size"], args.impls)
    res["summary"] = gpu_report.summary(res)
    return res


def _record(res: dict, section: str, units: list[dict], parts: list[dict], estimate: float, t0: float) -> None:
    """A section's merged result into res, with its estimate, its seconds and the sweep's blocks where it used them."""
    res["sections"][section] = dict(_merge(section, parts), estimate_s=estimate)
    if units and "blocks" in units[0]:  # the Hopper kernels ran with the sweep's blocks
        res["sections"][section]["tuned_blocks"] = units[0]["blocks"]
    res["sections"][section]["seconds"] = time.time() - t0


def _run_section(section: str, units: list[dict], end: float, tmp: Path) -> list[dict]:
    """A section's parts: the exactness workers at once (each with a share of the device's memory), the others one
    after another; each part's deadline from its estimate (the JSON records both)."""
    now = time.time()
    if section == "exactness" and len(units) > 1:
        est = [gpu_budget.part_s(section, u) for u in units]
        share = dict(XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / len(units):.3f}", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        procs = []
        for i, (u, e) in enumerate(zip(units, est)):
            deadline = _part_deadline(now, e, end, u["size"])
            procs.append(_Process(section, u, deadline, min(deadline, end) + GRACE_S, tmp, f"{section}{i}", share))
        parts = [p.wait() for p in procs]
        for p, e in zip(parts, est):
            p["run"]["estimate_s"] = e
        print(f"   {len(parts)} workers: {', '.join(p['run']['status'] for p in parts)}", flush=True)
        return parts
    parts = []
    for i, u in enumerate(units):
        e = gpu_budget.part_s(section, u)
        now = time.time()
        deadline = _part_deadline(now, e, end, u["size"])
        p = _Process(section, u, deadline, min(deadline, end) + GRACE_S, tmp, f"{section}{i}", {}).wait()
        p["run"]["estimate_s"] = e
        parts.append(p)
        print(f"   part {i + 1}/{len(units)}: {p['run']['status']} ({p['run']['seconds']:.0f} s, estimated {e:.0f})")
    return parts


def _environment() -> dict:
    """What the check runs with, from the outside: the variables that set JAX's and XLA's memory and caches, the GPU's
    name (nvidia-smi), the package versions."""
    names = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS", "JAX_PLATFORMS")
    names += ("JAX_COMPILATION_CACHE_DIR",)
    out = {k: os.environ.get(k) for k in names}
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        out["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["nvidia_smi"] = None
    return out


def dry_run(args) -> int:
    """Print the plan on an assumed H200 (or the toy sizes) without a device."""
    size = "small" if args.size == "small" else "full"
    env = ASSUMED_ENV if size == "full" else dict(backend="cpu", moe_default="tiled")
    env = dict(env, moe_impls=list(moe.IMPLS))
    plan = schedule(args.only, size, env, args.budget_s, args.impls)
    print(f"GPU check plan ({size}; estimates for {env.get('device_kind', 'a CPU')} from cisjax.bench.gpu_budget):")
    for row in plan["rows"]:
        verdict = "runs" if row["fits"] else "deferred"
        print(f"  {row['section']:<11} {row['parts']} part(s)  {row['estimate_s']:6.0f} s  {verdict}")
    env_s = gpu_budget.part_s("env", dict(size=size))
    print(f"  {'(probe)':<11} {'':9}  {env_s:6.0f} s")
    runs = env_s + sum(r["estimate_s"] for r in plan["rows"] if r["fits"])
    print(f"this call: {runs:.0f} s of a budget of {args.budget_s:.0f} s")
    call = next_call(plan["deferred"], size, args.impls)
    if call:
        print(f"deferred: {plan['total_s'] + env_s - runs:.0f} s ({', '.join(plan['deferred'])})")
        print(f"next call: {call}")
    print(f"total {plan['total_s'] + env_s:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cisjax.bench.gpu_check", description=__doc__)
    add_args(parser)
    args = parser.parse_args(argv)
    if args.part:
        run_part(args.part, json.loads(args.plan), args.deadline, args.part_out)
        return 0
    if args.dry_run:
        return dry_run(args)
    res = check(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    gpu_report.show(res)
    if res["next_call"]:
        print(f"deferred by the budget: {', '.join(res['deferred'])}; the next call runs them:\n  {res['next_call']}")
    print(f"JSON: {args.out}")
    return 1 if res["summary"]["exactness"]["ok"] is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
