"""The plan: a config's training programs compiled for a target's devices, gathered into one JSON-able report."""

from __future__ import annotations

import copy
import itertools
import math
from importlib import metadata

import flax.nnx as nnx
import jax

from cisjax import sharding
from cisjax.plan import costs, hardware, inputs, report
from cisjax.plan import flops as flops_lib
from cisjax.plan.programs import StepPrograms
from cisjax.plan.search import search_rows
from cisjax.train import offload as offload_lib

PROGRAM_NAMES = ("train_step", "rescore", "canary", "sampler")
SEARCHES = ("rows", "options")
# --search options: the memory options tried, cheapest first (field, value, what it costs)
MEMORY_OPTIONS = (
    ("train.optimizer_state_dtype", "bfloat16", "AdamW's moments in bf16, stochastically rounded"),
    ("train.grad_sum_dtype", "bfloat16", "the micro-batches' gradient sum in bf16, stochastically rounded"),
    ("train.offload_optimizer", True, "the moments in host memory: host-link traffic of twice their bytes per step"),
    ("model.param_dtype", "bfloat16", "bf16 master weights: bf16 gradients, updates stochastically rounded"),
    ("model.remat", "full", "each layer's forward recomputed in the backward: about a third more FLOPs"),
)
DEFAULT_PROGRAMS = ("train_step", "rescore", "canary")  # the sampler's (a colocated JAX sampler) on request

NOTES = [
    "Memory: the compiler's buffer assignment per chip; total = arguments + outputs - aliased (donated) + "
    "temporaries + code, against the HBM one program may use. The TPU compiler refuses a program only when its "
    "temporaries alone exceed the HBM; it accepts larger totals (arguments + temporaries + code), counted here as "
    "not fitting.",
    "FLOPs per layer kind: XLA's cost model of loop-free one-layer programs (cost_analysis counts a loop body "
    "once, so the whole step's own figure undercounts), times layers, micro-batches and logprob chunks.",
    "Roofline and MFU are estimates from the compiler's cost model (max of FLOPs / peak and bytes / HBM bandwidth "
    "per program part; no collectives, no overlap), not measurements.",
]
GPU_NOTE = (
    "GPU: compiled without a GPU, so without autotuning; XLA:GPU has no cost analysis of "
    "its own, so XLA's HloCostAnalysis runs on the optimized GPU module through the CPU client. A GPU program fits "
    "when its total plus a reserve of one copy of the parameters at rest stays within the usable memory: what a "
    "measured H200 peak held beyond the plan (55.1 GiB against 44.3; cisjax.plan.planner.runtime_reserve)."
)


def plan(
    cfg,
    *,
    target_name: str,
    mesh_text: str = "",
    hf_config: str | None = None,
    num_layers: int = 0,
    rows: int = 0,
    seq_len: int = 0,
    programs=DEFAULT_PROGRAMS,
    layer_costs: bool = True,
    search: str | None = None,
    max_rows: int = 4096,
    log=lambda msg: None,
) -> dict:
    """Compile the config's programs for `target_name`; the report as a JSON-able dict."""
    target = hardware.target(target_name)
    hf, hf_source = inputs.read_architecture(cfg, hf_config, num_layers)
    log(f"target {target.name}: {target.chips} x {target.chip.name} ({target.platform}, topology {target.topology})")
    mesh = sharding.make_mesh(inputs.mesh_shape(cfg, mesh_text), target.devices())
    progs = StepPrograms(cfg, hf, mesh)
    shape = inputs.step_shape(cfg, progs.rows_multiple, rows, seq_len)
    chunks, chunk_tokens = progs.head_chunks(shape["rows"], shape["seq_len"])
    shape.update(
        tokens_per_micro_batch=shape["rows"] * shape["seq_len"], head_chunks=chunks, head_chunk_tokens=chunk_tokens
    )
    out = _describe(cfg, target, hf, hf_source, progs, shape)
    reserve = runtime_reserve(target, out["params_per_chip"])
    compiled = _compile_programs(out, progs, programs, shape, target.chip.usable_bytes, reserve, log)
    if progs.spec.step.optim.offload_optimizer and "train_step" in out["programs"]:
        out["offload"] = offload_report(out["programs"]["train_step"], progs, target)
        step = out["programs"]["train_step"]
        log(
            f"  train_step with the moments in host memory ({out['offload']['host_memory']}): "
            f"{report.gib(step['total_bytes'])} GiB per chip on the device, fits: {step['fits']}"
        )
    if layer_costs:
        _add_layer_costs(out, compiled, progs, target, shape, log)
    if search not in (None, *SEARCHES):
        raise ValueError(f"search {search!r}; one of {SEARCHES}")
    if search == "rows":
        m, t = shape["micro_batches"], shape["seq_len"]
        out["search"] = search_rows(
            lambda r: progs.train_step(m, r, t),
            start=shape["rows"],
            step=progs.rows_multiple,
            usable=target.chip.usable_bytes - reserve,
            max_rows=max_rows,
            log=log,
            known={shape["rows"]: compiled.get("train_step")},
        )
    if search == "options":
        out["search"] = search_options(
            cfg,
            out,
            lambda c, recost: plan(
                c,
                target_name=target_name,
                mesh_text=mesh_text,
                hf_config=hf_config,
                num_layers=num_layers,
                rows=rows,
                seq_len=seq_len,
                programs=("train_step",),
                layer_costs=layer_costs and recost,
                log=log,
            ),
            log,
        )
    out["estimate"] = step_estimate(out)
    out["notes"] += NOTES + ([GPU_NOTE] if target.platform == "cuda" else [])
    return out


def step_estimate(report: dict, costs_from: dict | None = None) -> dict:
    """The train step's estimated seconds: the roofline of its programs (train step, and the rescoring when the
    loop runs one; those of `costs_from` when given: a plan whose FLOPs are the same) plus, with the optimizer
    offloaded, the moments' round trip over the host link (not overlapped: an upper bound of its cost)."""
    progs = (costs_from or report)["programs"]
    train = (progs.get("train_step") or {}).get("roofline_s")
    rescore = (progs.get("rescore") or {}).get("roofline_s")
    transfer = (report.get("offload") or {}).get("transfer_s", 0.0)
    return dict(
        train_step_s=None if train is None else train + transfer,
        rescore_s=rescore,
        offload_transfer_s=transfer,
    )


def search_options(cfg, base: dict, plan_with, log) -> dict:
    """The smallest set of MEMORY_OPTIONS (fewest options, then the cheapest) with which the train step fits,
    compiling the config with each set in that order until one fits; options the config already sets are not tried.
    No option adds memory, so the set of all is compiled first: when it does not fit, none does, and the search
    stops there. Each tried set: its memory per chip, fit, and estimated step. `plan_with(cfg, recost)` plans the
    train step; the per-layer costs are compiled again only when the options change the FLOPs (remat), else the
    base's roofline serves (bf16 moments, the bf16 sum and offload change the memory and host traffic, not the
    compute)."""

    def row(options, report):
        step = report["programs"].get("train_step", {})
        return dict(
            options=options,
            total_bytes=step.get("total_bytes"),
            host_bytes=(step.get("memory") or {}).get("host_total", 0),
            fits=bool(step.get("fits")),
            estimate=step_estimate(report, None if "model.remat" in options else base),
        )

    tried = [row({}, base)]
    if tried[0]["fits"]:
        return dict(kind="options", best={}, tried=tried)
    free = [(k, v) for k, v, _ in MEMORY_OPTIONS if _get(cfg, k) != v]

    def trial(options):
        log(f"options: trying {', '.join(f'{k}={v}' for k, v in options.items())} ...")
        trial = copy.deepcopy(cfg)
        for k, v in options.items():
            section, field = k.split(".")
            trial[section][field] = v
        return row(options, plan_with(trial, "model.remat" in options))

    every = trial(dict(free)) if len(free) > 1 else None
    if every is not None:
        tried.append(every)
        if not every["fits"]:
            return dict(kind="options", best=None, tried=tried, note="not even with every option: none fits")
    for size in range(1, len(free) + 1):
        for combo in itertools.combinations(free, size):
            got = every if every is not None and size == len(free) else trial(dict(combo))
            if got is not every:
                tried.append(got)
            if got["fits"]:
                return dict(kind="options", best=got["options"], tried=tried)
    return dict(kind="options", best=None, tried=tried, note="no set of the options fits")


def _get(cfg, key: str):
    section, field = key.split(".")
    return cfg[section][field]


def offload_report(step: dict, progs: StepPrograms, target: hardware.Target) -> dict:
    """train.offload_optimizer's figures per chip and per host: the moments held in host memory, the bytes that
    cross the host link per step (each moment read to the device and written back) and their time at the link's
    bandwidth. Where the compiler did not place the moments in host memory (JAX's compile-only GPU devices offer no
    memory kinds, so it compiles them as device arrays), the train step's device memory is corrected by the moments'
    bytes, which the state's shapes and shardings give exactly."""
    moments = offload_lib.moment_bytes(progs.tx, progs.state.opt_state, progs.params)
    mem = step.get("memory")
    counted = bool(mem and mem.get("host_total"))
    if mem and not counted:  # the moments were device arguments, donated: arguments, outputs and aliased each hold them
        for key in ("arguments", "outputs", "aliased", "total"):  # total = arguments + outputs - aliased + ...
            mem[key] -= moments
        mem.update(host_arguments=moments, host_outputs=moments, host_aliased=moments, host_total=moments)
        _fit(step, mem["total"], step["error"] is None, step["usable_bytes"], step["reserve_bytes"])
    bandwidth, source = hardware.host_link(target.chip)
    transfer = 2 * moments  # to the device and back, every step
    return dict(
        moments_bytes_per_chip=moments,
        host_bytes_per_chip=mem["host_total"] if mem else moments,
        host_bytes_per_process=(mem["host_total"] if mem else moments) * target.chips_per_host,
        chips_per_process=target.chips_per_host,
        host_memory="the compiler's buffer assignment" if counted else "counted from the state (not compiled)",
        transfer_bytes_per_step=transfer,
        host_link_bytes_per_s=bandwidth,
        host_link_source=source,
        transfer_s=transfer / bandwidth,
    )


def _describe(cfg, target, hf: dict, hf_source: str, progs: StepPrograms, shape: dict) -> dict:
    """The report before anything compiles: target, model, mesh, parameters per chip, batch shape, versions."""
    mesh, rules = progs.mesh, progs.rules
    out = dict(
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
            moe_impl_resolved=progs.moe_impl,
            attention_impl=cfg.model.attention_impl,
            attention_impl_resolved=progs.attention_impl,
        ),
        mesh={k: int(v) for k, v in mesh.shape.items()},
        params_per_chip=params_per_chip(progs.params, mesh, rules, progs.mcfg.dtype),
        shape=shape,
        precision=cfg.train.precision,
        versions=versions(),
        programs={},
        notes=[],
    )
    if mesh.shape.get("expert", 1) > 1 and out["params_per_chip"]["experts_unsplit"]:
        out["warnings"] = [
            f"mesh expert={mesh.shape['expert']} does not split the expert stacks' E dimension (it must divide the "
            "number of experts): no expert parallelism, the MoE gathers every expert on every chip"
        ]
    return out


def runtime_reserve(target: hardware.Target, params_per_chip: dict) -> float:
    """Bytes per chip a program's compiled total must leave free to fit, for what the runtime adds beside it.

    GPU: one copy of the parameters at rest (fp32 master weights: 4 bytes per parameter per GPU). On one H200
    (2026-11-28) the full-width 4-layer Qwen1.5-MoE cut's train step at 4 x 2,048 tokens peaked at 55.1 GiB where
    the deviceless plan of the same step said 44.3; the 10.8 GiB between them equal its 2.905B parameters x 4 bytes
    (10.82 GiB). The process's peak covers the weights' initialisation, the compile's autotuning buffers, cuBLAS's
    workspaces and the allocator, and a compile with the GPU may schedule otherwise than one without; the GPU check
    now records the state's bytes, the real compile's own figures and the peak apart, to split them. TPU: none (the
    compiler's buffer assignment is what the runtime allocates; no measurement says otherwise)."""
    return float(params_per_chip["all_bytes"]) if target.platform == "cuda" else 0.0


def _fit(d: dict, total: float | None, ok: bool, usable: float, reserve: float, resident: float = 0.0) -> None:
    """A program's verdict into `d`: fits when compiled and total + reserve + resident <= usable; the margin left.
    `resident`: the run's arrays that stay on the device beside a program without being its arguments (the
    optimizer's moments, beside the rescoring, the canary and a colocated sampler)."""
    d.update(
        total_bytes=total,
        usable_bytes=usable,
        reserve_bytes=reserve,
        resident_bytes=resident,
        fits=bool(ok and total is not None and total + reserve + resident <= usable),
        margin_bytes=None if total is None else usable - reserve - resident - total,
    )


def _compile_programs(
    out: dict, progs: StepPrograms, programs, shape: dict, usable: float, reserve: float, log
) -> dict:
    """Compile the loop's programs named in `programs` (the canary only when the config runs it) into
    out["programs"], each with its fit against `usable` bytes per chip less `reserve` (runtime_reserve);
    {name: Compiled}."""
    m, b, t = shape["micro_batches"], shape["rows"], shape["seq_len"]
    # the moments on the device (not offloaded) stay there while the other programs run
    offloaded = progs.spec.step.optim.offload_optimizer
    resident = float(offload_lib.moment_bytes(progs.tx, progs.state.opt_state))
    if offloaded:
        resident -= offload_lib.moment_bytes(progs.tx, progs.state.opt_state, progs.params)
    compiled = {}
    if "sampler" in programs:
        sampler = inputs.sampler_shape(progs.cfg)
        sampler["kv_cache_bytes"] = progs.kv_cache_bytes(sampler["batch"] * sampler["n"], sampler["slots"])
        out["sampler"] = sampler
    for name in programs:
        if name == "canary" and not int(progs.cfg.publish.canary.every):
            continue
        if name == "rescore" and progs.spec.step.proximal == "step":  # the step computes p_prox: no such program
            continue
        if name == "sampler":
            what = f"{out['sampler']['batch']} prompts x {out['sampler']['n']} samples, {out['sampler']['slots']} slots"
        else:
            what = "canary batch" if name == "canary" else f"{m} x {b} rows x {t} tokens"
        log(f"compiling {name} ({what}) ...")
        sampler = [out["sampler"][k] for k in ("batch", "prompt_len", "n", "new_tokens")] if name == "sampler" else []
        if name == "sampler" and progs.cfg.rollout.exact:  # rollout.exact: ExactEngine's prefill and decode step
            done = progs.exact_sampler(*sampler)
        else:
            done = [
                {
                    "train_step": lambda: progs.train_step(m, b, t),
                    "rescore": lambda: progs.rescore(m, b, t),
                    "canary": progs.canary,
                    "sampler": lambda s=sampler: progs.sampler(*s),
                }[name]()
            ]
        for c in done:
            compiled[c.name] = c
            d = c.as_dict()
            _fit(d, c.total(), c.ok, usable, reserve, 0.0 if c.name == "train_step" else resident)
            out["programs"][c.name] = d
            log(f"  {c.name}: {report.fmt_compiled(c, usable - reserve)}")
    return compiled


def _add_layer_costs(out: dict, compiled: dict, progs: StepPrograms, target, shape: dict, log) -> None:
    """The per-layer-kind FLOP tables and the roofline into `out`, and each compiled program's roofline time."""
    layer = costs.layer_costs_report(progs, target, shape, log)
    warnings = out.get("warnings", []) + layer.pop("warnings", [])
    out.update(layer, **({"warnings": warnings} if warnings else {}))
    if "canary" in compiled and compiled["canary"].ok:
        out["programs"]["canary"]["roofline_s"] = costs.roofline(compiled["canary"], target.chip)
    for name in ("train_step", "rescore"):
        if name in out["programs"]:
            out["programs"][name]["roofline_s"] = out["roofline"].get(f"{name}_s")


def params_per_chip(params, mesh, rules, compute_dtype) -> dict:
    """Bytes of the parameters one chip holds at rest, from their shardings (a dimension the mesh does not divide
    evenly is replicated, so all shards are equal): all of them, and the routed-expert stacks (the variables whose
    first logical axis, after a stack's "layers", is "expert"). And the stacks' bytes one chip multiplies with, in the compute dtype, per layer
    summed: the MoE dispatch gathers D ("embed", FSDP) and keeps E split only where the rules put "expert" on a mesh
    axis (expert parallelism, cisjax.models.expert_parallel), F where they put "expert_mlp"."""
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


# packages installed off the import path (`make setup`), found in their directories
_OFF_PATH = {"libtpu": hardware.libtpu_dir, "jax-cuda12-plugin": hardware.cuda_plugin_dir}


def versions() -> dict:
    """The compiler stack's versions: jax, jaxlib, libtpu, the CUDA plugin (those installed)."""
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            path = _OFF_PATH[name]() if name in _OFF_PATH else None
            dist = next(path.glob(f"{name.replace('-', '_')}-*.dist-info"), None) if path else None
            if dist is not None:
                out[name] = dist.name.split("-")[1].removesuffix(".dist")
    return out
