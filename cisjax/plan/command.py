"""`cisjax plan`: compile the loop's programs for a TPU slice or GPU set on this host — HBM per chip, FLOPs, roofline."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

# Set before JAX starts (this module imports no jax at the top). plan never runs anything: its devices are the
# compiler's deviceless ones, so it uses no local accelerator (a TPU VM's chips stay free for a running job), and
# libtpu gets the host settings it asks for on a machine without a TPU instead of printing warnings about them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# libtpu locks a machine-wide file so that one process owns the TPU; compiling owns nothing, and several plans (or a
# plan beside a job on a TPU VM) may run at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from cisjax import errors  # noqa: E402
from cisjax.plan import hardware  # noqa: E402  (no jax at import)

PROGRAM_NAMES = ("train_step", "rescore", "canary")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="config file (default configs/base.py); --config.x=y overrides follow"
    )
    p.add_argument("--topology", required=True, help=f"the target: {hardware.NAMES_HELP}")
    p.add_argument(
        "--mesh",
        default="",
        help="mesh axes, e.g. fsdp=8,expert=1 (default: the config's mesh section; "
        "one size may be -1 = the rest of the chips)",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        help="the architecture's config.json (default: model.hf_config, else "
        "<model.path>/config.json); no weights are read",
    )
    p.add_argument("--num-layers", type=int, default=0, help="compile a cut of the model: its first N layers (0 = all)")
    p.add_argument(
        "--rows",
        type=int,
        default=0,
        help="rows per micro-batch (default: data.prompts_per_step x "
        "rollout.group_size / train.micro_batches, rounded up to the mesh's batch shards)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="padded tokens per row (default: data.max_prompt_tokens + "
        "rollout.max_new_tokens - 1, rounded up to train.length_multiple)",
    )
    p.add_argument(
        "--search",
        choices=["rows"],
        default=None,
        help="rows: also find the largest rows per micro-batch whose train step fits in HBM (a compile per probe)",
    )
    p.add_argument("--max-rows", type=int, default=4096, help="--search rows: stop growing at this many rows")
    p.add_argument(
        "--programs",
        default=",".join(PROGRAM_NAMES),
        help=f"which of the loop's programs to compile (comma-separated from {','.join(PROGRAM_NAMES)})",
    )
    p.add_argument(
        "--no-layer-costs", action="store_true", help="skip the per-layer-kind programs (no FLOP table, no roofline)"
    )
    p.add_argument("--json", default=None, help="also write the whole report as JSON to this file")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    from cisjax import config as config_lib

    cfg = config_lib.load(args.config, overrides or [])
    programs = [p for p in args.programs.split(",") if p]
    unknown = sorted(set(programs) - set(PROGRAM_NAMES))
    if unknown:
        raise errors.UserError(f"--programs: unknown {unknown}; from {list(PROGRAM_NAMES)}")
    report = plan(
        cfg,
        target_name=args.topology,
        mesh_text=args.mesh,
        hf_config=args.hf_config,
        num_layers=args.num_layers,
        rows=args.rows,
        seq_len=args.seq_len,
        programs=programs,
        layer_costs=not args.no_layer_costs,
        search=args.search,
        max_rows=args.max_rows,
        log=_console_log,
    )
    print_report(report)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


# ----------------------------------------------------------------------------- inputs


def read_architecture(cfg, hf_config: str | None = None, num_layers: int = 0) -> tuple[dict, str]:
    """(config.json dict, where it came from): --hf-config, else model.hf_config, else <model.path>/config.json."""
    source = hf_config or cfg.model.hf_config or (os.path.join(cfg.model.path, "config.json") if cfg.model.path else "")
    if not source:
        raise errors.UserError(
            "no architecture: pass --hf-config FILE, or set model.hf_config or model.path in the config"
        )
    path = Path(source)
    if not path.is_file():
        raise errors.MissingInput(f"architecture config not found: {path}")
    hf = json.loads(path.read_text())
    if num_layers:
        if not 0 < num_layers <= int(hf["num_hidden_layers"]):
            raise errors.UserError(f"--num-layers {num_layers}: the model has {hf['num_hidden_layers']} layers")
        hf["num_hidden_layers"] = num_layers
    return hf, str(path)


def mesh_shape(cfg, text: str) -> dict:
    """The config's mesh section with --mesh axis=size,... on top."""
    shape = {k: int(v) for k, v in cfg.mesh.to_dict().items()}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise errors.UserError(f"--mesh {text!r}: expected axis=size[,axis=size...]")
        axis, size = item.split("=", 1)
        try:
            shape[axis.strip()] = int(size)
        except ValueError:
            raise errors.UserError(
                f"--mesh {text!r}: size {size.strip()!r} of axis {axis.strip()!r} is not an integer"
            ) from None
    return shape


def step_shape(cfg, rows_multiple: int, rows: int = 0, seq_len: int = 0) -> dict:
    """The train batch the loop builds for this config at its largest: M micro-batches of `rows` rows of `seq_len`
    tokens (cisjax.train.batching.build_batch's rounding)."""
    m = int(cfg.train.micro_batches)
    samples = int(cfg.data.prompts_per_step) * int(cfg.rollout.group_size)
    per_micro_batch = -(-samples // m)  # ceil
    rows = rows or -(-per_micro_batch // rows_multiple) * rows_multiple
    if rows % rows_multiple:
        raise errors.UserError(f"--rows {rows}: must be a multiple of the mesh's batch shards ({rows_multiple})")
    if not seq_len:
        if int(cfg.data.max_prompt_tokens) <= 0:
            raise errors.UserError(
                "data.max_prompt_tokens=0 (no limit) leaves the row length open: set it, or pass --seq-len"
            )
        longest = int(cfg.data.max_prompt_tokens) + int(cfg.rollout.max_new_tokens) - 1
        multiple = int(cfg.train.length_multiple)
        seq_len = -(-longest // multiple) * multiple
    return dict(micro_batches=m, rows=rows, seq_len=seq_len, rows_multiple=rows_multiple, samples_per_step=samples)


# ----------------------------------------------------------------------------- the plan


def plan(
    cfg,
    *,
    target_name: str,
    mesh_text: str = "",
    hf_config: str | None = None,
    num_layers: int = 0,
    rows: int = 0,
    seq_len: int = 0,
    programs=PROGRAM_NAMES,
    layer_costs: bool = True,
    search: str | None = None,
    max_rows: int = 4096,
    log=lambda msg: None,
) -> dict:
    """Compile the config's programs for `target_name`; the report as a JSON-able dict."""
    import jax

    from cisjax import sharding
    from cisjax.plan import flops as flops_lib
    from cisjax.plan.programs import StepPrograms

    target = hardware.target(target_name)
    hf, hf_source = read_architecture(cfg, hf_config, num_layers)
    log(f"target {target.name}: {target.chips} x {target.chip.name} ({target.platform}, topology {target.topology})")
    mesh = sharding.make_mesh(mesh_shape(cfg, mesh_text), target.devices())
    rules = sharding.rules_from_config(cfg.sharding.rules.to_dict())
    progs = StepPrograms(cfg, hf, mesh, rules)
    shape = step_shape(cfg, progs.rows_multiple, rows, seq_len)
    m, b, t = shape["micro_batches"], shape["rows"], shape["seq_len"]
    chunks, chunk_tokens = progs.head_chunks(b, t)
    shape.update(tokens_per_micro_batch=b * t, head_chunks=chunks, head_chunk_tokens=chunk_tokens)
    usable = target.chip.usable_bytes

    report = dict(
        target=target.describe(),
        model=dict(
            architecture=(hf.get("architectures") or ["?"])[0],
            config=hf_source,
            layers=int(hf["num_hidden_layers"]),
            total_params=flops_lib.total_params(progs.model),
            active_params=flops_lib.active_params(progs.model),
            dtype=str(jax.numpy.dtype(progs.mcfg.dtype)),
            param_dtype=str(jax.numpy.dtype(progs.mcfg.param_dtype)),
            moe_impl=cfg.model.moe_impl,
            moe_impl_resolved=_moe_impl(cfg, target),
        ),
        mesh={k: int(v) for k, v in mesh.shape.items()},
        params_per_chip=params_per_chip(progs.params, mesh, rules, progs.mcfg.dtype),
        shape=shape,
        precision=cfg.train.precision,
        versions=_versions(),
        programs={},
        notes=[],
    )

    if mesh.shape.get("expert", 1) > 1 and report["params_per_chip"]["experts_unsplit"]:
        report["warnings"] = [
            f"mesh expert={mesh.shape['expert']} does not split the expert stacks' E dimension (it must divide the "
            "number of experts): no expert parallelism, the MoE gathers every expert on every chip"
        ]

    def fit(c):
        d = c.as_dict()
        total = c.total()
        d.update(
            total_bytes=total,
            usable_bytes=usable,
            fits=bool(c.ok and total is not None and total <= usable),
            margin_bytes=None if total is None else usable - total,
        )
        return d

    compiled = {}
    for name in programs:
        if name == "canary" and not int(cfg.publish.canary.every):
            continue
        log(
            f"compiling {name} " + ("(canary batch)" if name == "canary" else f"({m} x {b} rows x {t} tokens)") + " ..."
        )
        c = {
            "train_step": lambda: progs.train_step(m, b, t),
            "rescore": lambda: progs.rescore(m, b, t),
            "canary": progs.canary,
        }[name]()
        compiled[name] = c
        report["programs"][name] = fit(c)
        log(f"  {name}: {_fmt_compiled(c, usable)}")

    if layer_costs:
        costs = layer_costs_report(progs, target, shape, log)
        warnings = report.get("warnings", []) + costs.pop("warnings", [])
        report.update(costs, **({"warnings": warnings} if warnings else {}))
        if "canary" in compiled and compiled["canary"].ok:
            c = compiled["canary"]
            report["programs"]["canary"]["roofline_s"] = max(
                c.flops / target.chip.peak_flops, c.bytes / target.chip.hbm_bandwidth
            )
        for name in ("train_step", "rescore"):
            if name in report["programs"]:
                report["programs"][name]["roofline_s"] = report["roofline"].get(f"{name}_s")

    if search == "rows":
        report["search"] = search_rows(
            lambda r: progs.train_step(m, r, t),
            start=b,
            step=progs.rows_multiple,
            usable=usable,
            max_rows=max_rows,
            log=log,
            known={b: compiled.get("train_step")},
        )
    report["notes"] += [
        "Memory: the compiler's buffer assignment per chip; total = arguments + outputs - aliased (donated) + "
        "temporaries + code, against the HBM one program may use. The TPU compiler refuses a program only when its "
        "temporaries alone exceed the HBM; it accepts larger totals (arguments + temporaries + code), counted here as "
        "not fitting.",
        "FLOPs per layer kind: XLA's cost model of loop-free one-layer programs (cost_analysis counts a loop body "
        "once, so the whole step's own figure undercounts), times layers, micro-batches and logprob chunks.",
        "Roofline and MFU are estimates from the compiler's cost model (max of FLOPs / peak and bytes / HBM bandwidth "
        "per program part; no collectives, no overlap), not measurements.",
    ]
    if target.platform == "cuda":
        report["notes"].append(
            "GPU: compiled without a GPU, so without autotuning; XLA:GPU has no cost analysis of "
            "its own, so XLA's HloCostAnalysis runs on the optimized GPU module through the CPU client."
        )
    return report


def params_per_chip(params, mesh, rules, compute_dtype) -> dict:
    """Bytes of the parameters one chip holds at rest, from their shardings (a dimension the mesh does not divide
    evenly is replicated, so all shards are equal): all of them, and the routed-expert stacks (the variables whose
    first logical axis, after a stack's "layers", is "expert"). And the stacks' bytes one chip multiplies with, in the compute dtype, per layer
    summed: the MoE dispatch gathers D ("embed", FSDP) and keeps E split only where the rules put "expert" on a mesh
    axis (expert parallelism, cisjax.models.moe._expert_parallel), F where they put "expert_mlp"."""
    import flax.nnx as nnx
    import jax

    from cisjax import sharding

    out = dict(
        all_bytes=0,
        expert_stacks_bytes=0,
        expert_stacks_total_bytes=0,
        expert_stacks_compute_bytes=0,
        experts_unsplit=0,
    )
    for _, v in nnx.to_flat_state(params):
        x = v.get_value()  # a ShapeDtypeStruct with its sharding
        shard = math.prod(x.sharding.shard_shape(x.shape)) * jax.numpy.dtype(x.dtype).itemsize
        out["all_bytes"] += shard
        axes = v.get_metadata().get("axes") or (None,)
        lead = 1 if axes[0] == "layers" and len(axes) > 1 else 0  # stacked decoder layers: E follows the layers axis
        if axes[lead] == "expert":
            out["expert_stacks_bytes"] += shard
            out["expert_stacks_total_bytes"] += math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize
            spec = sharding.logical_to_spec([None if a == "embed" else a for a in axes], rules, mesh, x.shape)
            out["experts_unsplit"] += spec[lead] is None  # E on no mesh axis: every chip holds every expert
            local = jax.sharding.NamedSharding(mesh, spec).shard_shape(x.shape)
            out["expert_stacks_compute_bytes"] += math.prod(local) * jax.numpy.dtype(compute_dtype).itemsize
    return out


def _moe_impl(cfg, target) -> str:
    from cisjax.models import moe

    return moe.default_impl(target.platform) if cfg.model.moe_impl == "auto" else cfg.model.moe_impl


def layer_costs_report(progs, target, shape, log) -> dict:
    """Per layer kind: XLA's FLOPs and bytes (loop-free programs) scaled to the step, the analytic count, their
    ratio, and the roofline time; the train step's and the rescoring's roofline and the MFU estimate."""
    from cisjax.plan import flops as flops_lib

    m, b, t = shape["micro_batches"], shape["rows"], shape["seq_len"]
    chips, chip = target.chips, target.chip
    counts = flops_lib.layer_counts(progs.model)
    forward = flops_lib.forward_flops(progs.model, b, t)
    analytic = {"train_step": flops_lib.train_flops(forward, m), "rescore": flops_lib.rescore_flops(forward, m)}
    parts = {}
    for backward, program in ((False, "rescore"), (True, "train_step")):
        log(f"compiling one-layer programs ({'forward + backward' if backward else 'forward'}) ...")
        kinds = progs.layer_parts(b, t, backward=backward)
        kinds["head"] = progs.head_part(b, t, backward=backward)
        parts[program] = kinds
    # the step's head: its forward loop, then its backward loop
    parts["train_step"]["head"] = _sum_programs("head_fwd_bwd", parts["rescore"]["head"], parts["train_step"]["head"])
    log("compiling the optimizer update ...")
    optimizer = progs.optimizer_part()

    def roofline(c) -> float:
        if c.parts:  # programs run one after the other
            return sum(roofline(x) for x in c.parts)
        return max(c.flops / chip.peak_flops, c.bytes / chip.hbm_bandwidth)

    out = {"flops": {}, "roofline": {}, "layer_programs": {}}
    for program, kinds in parts.items():
        rows = {}
        total_s = 0.0
        for kind, c in kinds.items():
            times = m * (shape["head_chunks"] if kind == "head" else counts[kind])
            xla = c.flops * times if c.ok else None
            ana = analytic[program][kind] / chips
            seconds = roofline(c) * times if c.ok else None
            total_s += seconds or 0.0
            rows[kind] = dict(
                count=counts[kind],
                times_per_step=times,
                analytic_flops_per_chip=ana,
                xla_flops_per_chip=xla,
                ratio=(xla / ana) if xla is not None and ana else None,
                roofline_s=seconds,
                bytes_per_chip=c.bytes * times if c.ok else None,
            )
            out["layer_programs"][f"{program}/{kind}"] = c.as_dict()
            if c.has_loops:
                out.setdefault("warnings", []).append(f"{c.name} holds a loop: its cost figures undercount")
        if program == "train_step":
            seconds = roofline(optimizer) if optimizer.ok else None
            total_s += seconds or 0.0
            rows["optimizer"] = dict(
                count=1,
                times_per_step=1,
                analytic_flops_per_chip=0.0,
                xla_flops_per_chip=optimizer.flops,
                ratio=None,
                roofline_s=seconds,
                bytes_per_chip=optimizer.bytes,
            )
            out["layer_programs"]["train_step/optimizer"] = optimizer.as_dict()
        ana_total = sum(analytic[program].values()) / chips
        out["flops"][program] = dict(
            kinds=rows,
            analytic_flops_per_chip=ana_total,
            xla_flops_per_chip=sum(r["xla_flops_per_chip"] or 0.0 for r in rows.values()),
        )
        out["roofline"][f"{program}_s"] = total_s
        out["roofline"][f"{program}_mfu_estimate"] = ana_total / (chip.peak_flops * total_s) if total_s else None
    return out


def _sum_programs(name, a, b):
    """Two programs run one after the other, as one row: costs added, the roofline of each added."""
    from cisjax.plan.programs import Compiled

    if not (a.ok and b.ok):
        return a if not a.ok else b
    return Compiled(
        name,
        a.seconds + b.seconds,
        flops=a.flops + b.flops,
        bytes=a.bytes + b.bytes,
        has_loops=a.has_loops or b.has_loops,
        parts=[a, b],
    )


def search_rows(compile_at, *, start: int, step: int, usable: float, max_rows: int, log, known=None) -> dict:
    """The largest multiple of `step` rows whose train step fits, by compiling: grow or shrink from `start` by
    doubling until the fit flips, then narrow the bracket, probing where a straight line through the bracket's
    two measured totals meets the usable HBM (memory is close to affine in the rows) and halving otherwise."""
    tried: dict[int, dict] = {}

    def probe(r: int) -> bool:
        c = (known or {}).get(r) or compile_at(r)
        total = c.total()
        ok = bool(c.ok and total is not None and total <= usable)
        # a refusal's temporaries alone exceed the HBM: a lower bound of the total, good enough to aim the next probe
        tried[r] = dict(
            rows=r,
            fits=ok,
            total_bytes=total,
            memory=c.memory,
            compile_s=c.seconds,
            refused=not c.ok,
            oom_temporaries_bytes=c.oom_temporaries,
            estimate_bytes=total if total is not None else c.oom_temporaries,
        )
        log(f"  rows {r}: {_fmt_compiled(c, usable)}")
        return ok

    log(f"searching the largest rows per micro-batch that fit (multiples of {step}) ...")
    lo, hi = 0, None  # lo: largest fitting rows known (0: none); hi: smallest non-fitting rows known
    r = max(step, start - start % step)
    while True:
        if probe(r):
            lo = max(lo, r)
        else:
            hi = r if hi is None else min(hi, r)
        if hi is not None and hi - lo <= step:
            break
        if hi is None:
            if r * 2 > max_rows:
                break
            r *= 2
        elif lo == 0:
            if r == step:
                break  # not even one shard's worth of rows fits
            r = max(step, (r // 2) // step * step)
        else:
            r = _interpolate(lo, hi, tried, usable, step)
    return dict(
        best_rows=lo,
        tried=[tried[k] for k in sorted(tried)],
        step=step,
        capped=hi is None,
        note="capped at --max-rows" if hi is None else "",
    )


def _interpolate(lo: int, hi: int, tried: dict, usable: float, step: int) -> int:
    mid = (lo + hi) // 2 // step * step
    m_lo, m_hi = tried[lo]["estimate_bytes"], tried[hi]["estimate_bytes"]
    guess = mid
    if m_lo is not None and m_hi is not None and m_hi > m_lo:
        guess = int(lo + (usable - m_lo) * (hi - lo) / (m_hi - m_lo)) // step * step
    if guess <= lo:  # the line puts the boundary within a step above lo: check that step
        guess = lo + step
    elif guess >= hi:
        guess = hi - step
    return guess if lo < guess < hi else (mid if lo < mid < hi else lo + step)


# ----------------------------------------------------------------------------- output


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            path = hardware.cuda_plugin_dir() if name == "jax-cuda12-plugin" else None
            dist = next(path.glob("jax_cuda12_plugin-*.dist-info"), None) if path else None
            if dist is not None:
                out[name] = dist.name.split("-")[1].removesuffix(".dist")
    return out


def _gib(x) -> str:
    return "—" if x is None else f"{x / 2**30:.1f}"


def _fmt_compiled(c, usable) -> str:
    if not c.ok:
        need = f": its temporaries alone need {_gib(c.oom_temporaries)} GiB" if c.oom_temporaries else ""
        return f"does not fit (the compiler refused{need}) in {c.seconds:.0f} s"
    total = c.memory["total"]
    return f"{_gib(total)} GiB per chip of {_gib(usable)} ({'fits' if total <= usable else 'does NOT fit'}) in {c.seconds:.0f} s"


def _console_log(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False).print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:  # a log file: wide enough for the tables, not cut at 80 columns
        console = Console(highlight=False, width=150)
    tg, mo, sh = report["target"], report["model"], report["shape"]
    console.print(
        f"[bold]{mo['architecture']}[/bold] ({mo['layers']} layers, {mo['total_params'] / 1e9:.2f}B parameters, "
        f"{mo['active_params'] / 1e9:.2f}B active; {mo['dtype']} compute, {mo['param_dtype']} master weights, "
        f"MoE dispatch {mo['moe_impl_resolved']}) on [bold]{tg['name']}[/bold]: {tg['chips']} x {tg['chip']} "
        f"({tg['usable_gib_per_chip']:.2f} GiB usable per chip, {tg['peak_tflops_per_chip']:.0f} TFLOP/s bf16), "
        f"mesh {report['mesh']}"
    )
    pp = report.get("params_per_chip")
    if pp:
        console.print(
            f"parameters per chip: {_gib(pp['all_bytes'])} GiB, of which the routed-expert stacks "
            f"{_gib(pp['expert_stacks_bytes'])} GiB (of {_gib(pp['expert_stacks_total_bytes'])} GiB in all); the "
            f"expert stacks each chip computes with, all MoE layers: {_gib(pp['expert_stacks_compute_bytes'])} GiB"
        )
    console.print(
        f"train batch: {sh['micro_batches']} micro-batches x {sh['rows']} rows x {sh['seq_len']} tokens "
        f"({sh['samples_per_step']} samples per step; the logprob head in {sh['head_chunks']} chunks of "
        f"{sh['head_chunk_tokens']} tokens)"
    )

    table = Table(title="HBM per chip (GiB)")
    for col in (
        "program",
        "arguments",
        "temporaries",
        "outputs",
        "aliased",
        "total",
        "usable",
        "fits",
        "margin",
        "compile s",
        "roofline s",
    ):
        table.add_column(col, justify="left" if col == "program" else "right")
    for name, p in report["programs"].items():
        mem = p.get("memory") or {}
        fits = "[green]yes[/green]" if p["fits"] else "[red]no[/red]"
        if p.get("error"):
            fits += (
                f" (refused: temporaries {_gib(p['oom_temporaries'])})" if p.get("oom_temporaries") else " (refused)"
            )
        roof = p.get("roofline_s")
        table.add_row(
            name,
            _gib(mem.get("arguments")),
            _gib(mem.get("temporaries")),
            _gib(mem.get("outputs")),
            _gib(mem.get("aliased")),
            _gib(p["total_bytes"]),
            _gib(p["usable_bytes"]),
            fits,
            _gib(p["margin_bytes"]),
            f"{p['seconds']:.0f}",
            "—" if roof is None else f"{roof:.3f}",
        )
    console.print(table)

    for program, f in report.get("flops", {}).items():
        table = Table(title=f"{program}: FLOPs per chip per step (TFLOP)")
        for col in ("kind", "layers", "x per step", "analytic", "XLA", "XLA / analytic", "roofline s"):
            table.add_column(col, justify="left" if col == "kind" else "right")
        for kind, r in f["kinds"].items():
            if not r["count"]:
                continue
            xla = r["xla_flops_per_chip"]
            table.add_row(
                kind,
                str(r["count"]),
                str(r["times_per_step"]),
                f"{r['analytic_flops_per_chip'] / 1e12:.2f}",
                "—" if xla is None else f"{xla / 1e12:.2f}",
                "—" if r["ratio"] is None else f"{r['ratio']:.2f}",
                "—" if r["roofline_s"] is None else f"{r['roofline_s']:.3f}",
            )
        table.add_row(
            "total",
            "",
            "",
            f"{f['analytic_flops_per_chip'] / 1e12:.2f}",
            f"{f['xla_flops_per_chip'] / 1e12:.2f}",
            f"{f['xla_flops_per_chip'] / f['analytic_flops_per_chip']:.2f}" if f["analytic_flops_per_chip"] else "—",
            f"{report['roofline'][f'{program}_s']:.3f}",
        )
        console.print(table)
        mfu = report["roofline"].get(f"{program}_mfu_estimate")
        if mfu is not None:
            console.print(
                f"{program}: MFU estimate {100 * mfu:.1f}% (analytic FLOPs / (chips x peak x roofline time); "
                "from the compiler's cost model, not a measurement)"
            )
    if "search" in report:
        s = report["search"]
        tried = ", ".join(f"{t['rows']}{'✓' if t['fits'] else '✗'}" for t in s["tried"])
        console.print(
            f"largest rows per micro-batch that fit: [bold]{s['best_rows']}[/bold] (tried {tried}) {s['note']}"
        )
    for w in report.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {w}")
    for note in report["notes"]:
        console.print(f"[dim]{note}[/dim]")
