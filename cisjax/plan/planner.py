"""The plan: a config's training programs compiled for a target's devices, gathered into one JSON-able report."""

from __future__ import annotations

import math
from importlib import metadata

import flax.nnx as nnx
import jax

from cisjax import sharding
from cisjax.plan import costs, hardware, inputs, report
from cisjax.plan import flops as flops_lib
from cisjax.plan.programs import StepPrograms
from cisjax.plan.search import search_rows

PROGRAM_NAMES = ("train_step", "rescore", "canary", "sampler")
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
    "its own, so XLA's HloCostAnalysis runs on the optimized GPU module through the CPU client."
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
    rules = sharding.rules_from_config(cfg.sharding.rules.to_dict())
    progs = StepPrograms(cfg, hf, mesh, rules)
    shape = inputs.step_shape(cfg, progs.rows_multiple, rows, seq_len)
    chunks, chunk_tokens = progs.head_chunks(shape["rows"], shape["seq_len"])
    shape.update(
        tokens_per_micro_batch=shape["rows"] * shape["seq_len"], head_chunks=chunks, head_chunk_tokens=chunk_tokens
    )
    out = _describe(cfg, target, hf, hf_source, progs, shape)
    compiled = _compile_programs(out, progs, programs, shape, target.chip.usable_bytes, log)
    if layer_costs:
        _add_layer_costs(out, compiled, progs, target, shape, log)
    if search == "rows":
        m, t = shape["micro_batches"], shape["seq_len"]
        out["search"] = search_rows(
            lambda r: progs.train_step(m, r, t),
            start=shape["rows"],
            step=progs.rows_multiple,
            usable=target.chip.usable_bytes,
            max_rows=max_rows,
            log=log,
            known={shape["rows"]: compiled.get("train_step")},
        )
    out["notes"] += NOTES + ([GPU_NOTE] if target.platform == "cuda" else [])
    return out


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


def _compile_programs(out: dict, progs: StepPrograms, programs, shape: dict, usable: float, log) -> dict:
    """Compile the loop's programs named in `programs` (the canary only when the config runs it) into
    out["programs"], each with its fit against `usable` bytes per chip; {name: Compiled}."""
    m, b, t = shape["micro_batches"], shape["rows"], shape["seq_len"]
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
        c = {
            "train_step": lambda: progs.train_step(m, b, t),
            "rescore": lambda: progs.rescore(m, b, t),
            "canary": progs.canary,
            "sampler": lambda: progs.sampler(*(out["sampler"][k] for k in ("batch", "prompt_len", "n", "new_tokens"))),
        }[name]()
        compiled[name] = c
        d = c.as_dict()
        total = c.total()
        d.update(
            total_bytes=total,
            usable_bytes=usable,
            fits=bool(c.ok and total is not None and total <= usable),
            margin_bytes=None if total is None else usable - total,
        )
        out["programs"][name] = d
        log(f"  {name}: {report.fmt_compiled(c, usable)}")
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
