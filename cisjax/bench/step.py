"""`cisjax bench step`: the train step with CIS vs without a correction and with routing replay, and JAX fwd+bwd+loss vs
transformers/torch, one run."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import tempfile

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax import config as config_lib
from cisjax import forward, sharding
from cisjax.bench import harness, mfu, synthetic, tiny_model, torch_step
from cisjax.models import moe as moe_lib
from cisjax.plan import flops as flops_lib
from cisjax.records import TrainBatch
from cisjax.rl import loss as loss_lib
from cisjax.train.build import Run, build
from cisjax.train.step import make_loss_fn

TARGET_CIS_OVERHEAD = 0.01  # median step time with CIS / without - 1
TARGET_JAX_VS_TORCH = 1.0  # JAX fwd+bwd+loss time / torch's
TARGET_REPLAY_OVERHEAD = 0.03  # median step time with CIS + routing replay / CIS alone - 1
TARGET_PROXIMAL_STEP = 0.9  # the loop's trainer time per step, train.proximal=step / rescore (rescoring + step)
TARGET_EXACT_STEP = 1.3  # --exact: median step time with rollout.exact / without (CIS both; issue 49)
STEPS = ("cis", "none", "cis+replay")  # the optimizer steps timed, interleaved call by call
EXACT = "cis+exact"  # --exact adds it: the step of rollout.exact (the exact forward's value, the plain gradient)
MODEL = tiny_model.Sizes(256, 4, 8, 4, 8, 2, 256, 256, 2048)


def add_args(parser: argparse.ArgumentParser) -> None:
    tiny_model.add_args(parser, MODEL)
    parser.add_argument("--batch", type=int, default=8, help="rows B (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row T (default: %(default)s)")
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches M of the step, each B x T (default: %(default)s)"
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16"),
        help="train.precision of the step; torch runs in the same compute dtype (default: %(default)s)",
    )
    parser.add_argument("--chunk-size", type=int, default=1024, help="logprobs.chunk_size (default: %(default)s)")
    harness.add_repeats(parser, 20, "timed calls per candidate after a warm-up")
    parser.add_argument(
        "--moe-impl",
        default="auto",
        choices=moe_lib.IMPLS,
        help="model.moe_impl of the JAX model (default: %(default)s)",
    )
    parser.add_argument(
        "--scan-layers",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="model.scan_layers of the JAX model: one lax.scan per stack of layers, or a loop (default: %(default)s)",
    )
    parser.add_argument(
        "--torch-experts",
        default=torch_step.FASTEST,
        help="transformers experts_implementation (eager, grouped_mm, ...; default: %(default)s = grouped_mm where "
        "transformers has it, else transformers' own choice; the one used is reported). The torch side runs on the "
        "JAX side's device: a CUDA GPU when JAX runs on one, else the CPU",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="also time the step of rollout.exact (the exact forward's logprobs, the plain forward's gradient) against "
        "the CIS step without it, interleaved with the others; the ratio of their times",
    )
    parser.add_argument("--model-dir", default=None, help="where to save the random HF model (default: a temp dir)")
    harness.add_seed(parser)
    harness.add_json(parser)


def bench(args) -> dict:
    """Three runs built as `cisjax train` builds one (STEPS) on a random model, their steps timed interleaved; then
    one micro-batch's forward + backward + loss, JAX against torch on the same weights."""
    cfg = config_lib.load(None)
    cfg.train.precision = args.precision
    cfg.logprobs.chunk_size = args.chunk_size
    cfg.train.lr = 1e-5
    cfg.model.moe_impl = args.moe_impl
    cfg.model.scan_layers = bool(args.scan_layers)
    mesh = sharding.make_mesh(cfg.mesh.to_dict())
    res = dict(
        config=harness.recorded(args),
        backend=jax.default_backend(),
        devices=len(jax.devices()),
        tokens_per_step=args.micro_batches * args.batch * args.seq,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or tmp
        tiny_model.save_random(args, model_dir, max_positions=max(args.seq, 128))
        # runs built as `cisjax train` builds one, each state donated by its step (inputs=False: the model directory
        # and the batches are this bench's)
        runs = {m: build(_arm(cfg, m), model_dir=model_dir, mesh=mesh, inputs=False) for m in _timed(args)}
        run = runs["none"]
        params = jax.tree.map(lambda x: x.copy(), run.state.params)  # for the fwd+bwd below: the steps donate theirs
        model_cfg = nnx.merge(run.graphdef, params).cfg
        res["jax_moe_impl"] = moe_lib.default_impl() if model_cfg.moe_impl == "auto" else model_cfg.moe_impl
        fwd = flops_lib.forward_flops(nnx.merge(run.graphdef, params), args.batch, args.seq)
        res["flops"] = dict(
            step=sum(flops_lib.train_flops(fwd, args.micro_batches).values()),
            fwd_bwd=sum(flops_lib.train_flops(fwd, 1).values()),
        )
        res["device_kind"] = mfu.device_kind()
        res.update(mfu.peak(res["device_kind"], args.precision))
        host, batches = _batches(args, run, params, model_cfg.vocab_size)
        res["replay_rescore"] = _rescore_overhead(runs, params, batches, args.repeats)
        own = build(_arm(cfg, "cis", proximal="step"), model_dir=model_dir, mesh=mesh, inputs=False)
        res["proximal"] = _proximal(runs["cis"], own, batches["cis"], args.repeats)  # before _steps donates states
        steps = _steps(args, runs, batches)
        # the loss of the fwd+bwd: the config's correction (cis)
        fwd_bwd = _fwd_bwd(args, runs["cis"], params, batches["cis"], host, model_dir)
    rows = steps.pop("rows") + fwd_bwd.pop("rows")
    for row in rows:  # achieved TFLOP/s of the analytic work (cisjax.plan.flops), MFU against the device's peak
        row.update(mfu.utilization(res["flops"][row["work"]], row["median_s"], res))
    res.update(steps)
    res.update(fwd_bwd, rows=rows)
    res["meets_cis_target"] = res["cis_overhead"] <= TARGET_CIS_OVERHEAD
    res["meets_torch_target"] = res["jax_vs_torch"] <= TARGET_JAX_VS_TORCH
    res["meets_replay_target"] = res["replay_overhead"] <= TARGET_REPLAY_OVERHEAD
    res["meets_proximal_target"] = res["proximal"]["ratio"] <= TARGET_PROXIMAL_STEP
    if args.exact:
        res["meets_exact_target"] = res["exact_step_ratio"] <= TARGET_EXACT_STEP
    return res


def _timed(args) -> tuple[str, ...]:
    """The steps timed: STEPS, and EXACT with --exact."""
    return STEPS + ((EXACT,) if args.exact else ())


def _arm(cfg, method: str, proximal: str = "rescore"):
    """The config of one of STEPS: its correction.method, and routing replay with "+replay"; train.proximal."""
    arm = copy.deepcopy(cfg)
    arm.correction.method = method.split("+")[0]
    arm.routing.replay = "rollout" if method.endswith("+replay") else "none"
    arm.train.proximal = proximal
    if method == EXACT:  # the trainer's step under rollout.exact (which needs the colocated JAX sampler)
        arm.rollout.update(exact=True, colocated=True, backend="jax")
    return arm


def _proximal(rescored: Run, own: Run, batch, repeats: int) -> dict:
    """The loop's trainer time per step, interleaved call by call (CIS, no replay): the rescoring pass then the step
    (train.proximal=rescore) against the step taking p_prox from its own forward (train.proximal=step). Each side
    trains its own copy of the initial state, as a run does."""
    states = {"rescore": jax.tree.map(jnp.copy, rescored.state), "step": jax.tree.map(jnp.copy, own.state)}

    def rescore_then_step():
        b = batch._replace(prox_logprobs_MxBxT=rescored.rescore(states["rescore"].params, batch))
        states["rescore"], met = rescored.train_step(states["rescore"], b)
        return jax.block_until_ready(met)

    def step_alone():
        states["step"], met = own.train_step(states["step"], batch)
        return jax.block_until_ready(met)

    calls = {"rescore": rescore_then_step, "step": step_alone}
    first = {m: harness.timed(calls[m])[0] for m in calls}
    times = harness.interleave(calls, repeats)
    return dict(
        rescore_s=times.median("rescore"),
        step_s=times.median("step"),
        ratio=times.median("step") / times.median("rescore"),
        ratio_paired=times.paired("step", "rescore"),
        first_call_s=first,
    )


def _batches(args, run: Run, params, vocab: int) -> tuple[TrainBatch, dict]:
    """The host batch with the proximal logprobs of the model and infer logprobs near them, and each step's batch on
    the mesh (cis+replay's carrying the routers' own ids as the engine's routing)."""
    mesh, rules = run.mesh, run.rules
    host = synthetic.train_batch(args.micro_batches, args.batch, args.seq, vocab, args.seed)
    prox = np.asarray(run.rescore(params, sharding.place(host, mesh, rules, sharding.BATCH_AXES)))
    noise = 0.3 * np.random.default_rng(args.seed + 1).standard_normal(prox.shape)
    host = host._replace(
        prox_logprobs_MxBxT=prox, infer_logprobs_MxBxT=np.minimum(prox + noise, 0.0).astype(np.float32)
    )
    batch = sharding.place(host, mesh, rules, sharding.BATCH_AXES)
    batches = {m: batch for m in (*STEPS, EXACT)}
    # replay: the routers' own ids as the engine's routing (an engine that agrees: the same work as any other ids)
    routed = _own_routing(run.graphdef, mesh, rules, params, host, args.precision)
    batches["cis+replay"] = sharding.place(host._replace(routing_MxBxTxXxK=routed), mesh, rules, sharding.BATCH_AXES)
    return host, batches


def _steps(args, runs: dict[str, Run], batches: dict) -> dict:
    """The full optimizer steps, CIS vs none vs CIS with routing replay, interleaved call by call: their rows, paired
    overheads, XLA flop counts and last metrics."""
    timed = tuple(runs)
    states = {m: runs[m].state for m in timed}

    def stepper(method):
        def call():
            states[method], met = runs[method].train_step(states[method], batches[method])
            return jax.block_until_ready(met)

        return call

    calls = {m: stepper(m) for m in timed}
    compile_s = {m: harness.timed(calls[m])[0] for m in timed}
    times = harness.interleave(calls, args.repeats)
    rows = [
        dict(
            candidate=f"JAX step ({m})",
            median_s=times.median(m),
            min_s=times.min(m),
            tokens_per_s=args.micro_batches * args.batch * args.seq / times.median(m),
            work="step",
            first_call_s=compile_s[m],
        )
        for m in timed
    ]
    flops = {}
    for m in timed:
        cost = runs[m].train_step.jitted.lower(states[m], batches[m]).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops[m] = float((cost or {}).get("flops", float("nan")))
    exact = {}
    if EXACT in timed:  # each exact step against the CIS step of its round
        exact = dict(
            exact_step_ratio=times.paired(EXACT, "cis"),
            exact_step_ratio_of_medians=times.median(EXACT) / times.median("cis"),
            exact_flops_ratio=flops[EXACT] / flops["cis"],
        )
    return dict(
        **exact,
        rows=rows,
        # paired: each CIS call against the no-correction call right after it, so that load drift cancels
        cis_overhead=times.paired("cis", "none") - 1.0,
        cis_overhead_of_medians=times.median("cis") / times.median("none") - 1.0,
        cis_overhead_min=times.min("cis") / times.min("none") - 1.0,
        replay_overhead=times.paired("cis+replay", "cis") - 1.0,
        replay_overhead_of_medians=times.median("cis+replay") / times.median("cis") - 1.0,
        xla_flops=flops,
        cis_flops_overhead=flops["cis"] / flops["none"] - 1.0,
        replay_flops_overhead=flops["cis+replay"] / flops["cis"] - 1.0,
        step_metrics={m: {k: float(v) for k, v in met.items()} for m, met in times.last.items()},
    )


def _fwd_bwd(args, run: Run, params, batch, host: TrainBatch, model_dir: str) -> dict:
    """Forward + backward + loss of one micro-batch (no optimizer), JAX vs torch on the same weights, interleaved
    call by call so that a change in the machine's load hits both sides alike: their rows, the ratio, and the loss and
    gradient norm of each."""
    spec = run.spec.step
    loss_fn = make_loss_fn(run.graphdef, spec, run.mesh, run.rules)
    mb = jax.tree.map(lambda x: x[0], batch)
    denominator = loss_lib.loss_denominator(mb.loss_mask_MxBxT, spec.loss.aggregation)
    fwd_bwd = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    jax_first, ((_, aux), grads) = harness.timed(lambda: jax.block_until_ready(fwd_bwd(params, mb, denominator)))
    jax_grad_norm = float(
        jax.jit(lambda g: jax.numpy.sqrt(sum((x.astype(np.float32) ** 2).sum() for x in jax.tree.leaves(g))))(grads)
    )
    del grads
    torch_mb = jax.tree.map(lambda x: np.asarray(x[0]), host)
    model = torch_step.load(model_dir, experts=args.torch_experts, device=torch_step.device(jax.default_backend()))
    torch_run = torch_step.TorchFwdBwd(model, torch_mb, spec, precision=args.precision)
    calls = {"jax": lambda: jax.block_until_ready(fwd_bwd(params, mb, denominator)), "torch": torch_run}
    times = harness.interleave(calls, args.repeats)
    torch_res = torch_run.info(times.wall_s["torch"])
    tokens = args.batch * args.seq
    rows = [
        dict(
            candidate="JAX fwd+bwd+loss",
            median_s=times.median("jax"),
            min_s=times.min("jax"),
            tokens_per_s=tokens / times.median("jax"),
            work="fwd_bwd",
            first_call_s=jax_first,
        ),
        dict(
            candidate=f"torch fwd+bwd+loss ({torch_res['experts']}, {torch_res['attention']})",
            median_s=torch_res["median_s"],
            min_s=torch_res["min_s"],
            tokens_per_s=tokens / torch_res["median_s"],
            work="fwd_bwd",
            first_call_s=torch_res["first_call_s"],
        ),
    ]
    return dict(
        rows=rows,
        jax_vs_torch_paired=times.paired("jax", "torch"),
        jax_vs_torch=times.median("jax") / torch_res["median_s"],
        loss=dict(jax=float(aux["loss"]), torch=torch_res["loss"]),
        grad_norm=dict(jax=jax_grad_norm, torch=torch_res["grad_norm"]),
        torch=torch_res,
    )


def _rescore_overhead(runs, params, batches, repeats: int) -> dict:
    """The proximal rescoring with routing replay (and its flip counts) vs the plain one, interleaved: median s each
    and the median of paired ratios - 1."""
    calls = {m: (lambda m=m: jax.block_until_ready(runs[m].rescore(params, batches[m]))) for m in ("cis", "cis+replay")}
    for call in calls.values():
        call()  # compile
    times = harness.interleave(calls, repeats)
    return dict(
        plain_s=times.median("cis"),
        replay_s=times.median("cis+replay"),
        overhead=times.paired("cis+replay", "cis") - 1.0,
    )


def _own_routing(graphdef, mesh, rules, params, host, precision: str):
    """The model's own expert ids of every position of the host batch, [M, B, T, X, k] uint8 (the forward at the
    step's train.precision, the one the model was built for)."""
    fwd = jax.jit(forward.make_forward(graphdef, mesh, rules, precision=precision, temperature=1.0, chunk_size=1024))
    out = []
    for i in range(host.tokens_MxBxT.shape[0]):
        args = (host.tokens_MxBxT[i], host.positions_MxBxT[i], host.segment_ids_MxBxT[i], host.targets_MxBxT[i])
        ids_XxBxTxK = np.asarray(fwd(params, *args).expert_ids_XxBxTxK)
        out.append(np.moveaxis(ids_XxBxTxK, 0, 2))
    return np.stack(out).astype(np.uint8)


def _print(res: dict) -> None:
    c = res["config"]
    title = (
        f"train step on a random Qwen2-MoE: hidden {c['hidden']}, {c['layers']} layers, {c['experts']} experts "
        f"top-{c['top_k']}, vocab {c['vocab']}, M x B x T = {c['micro_batches']} x {c['batch']} x {c['seq']}, "
        f"{c['precision']}, {res['backend']} x {res['devices']}"
    )
    columns = ("candidate", "median s", "min s", "tokens/s", "first call s", "TFLOP/s", "MFU")
    cells = [
        (
            r["candidate"],
            f"{r['median_s']:.4f}",
            f"{r['min_s']:.4f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['first_call_s']:.1f}",
            f"{r['tflops']:.3g}",
            "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
        )
        for r in res["rows"]
    ]
    caption = (
        f"TFLOP/s: the analytic work (cisjax.plan.flops) per median second; {res['device_kind']}: {mfu.describe(res)}; "
        f"torch on {res['torch']['device']}"
    )
    console = harness.console(140)
    console.print(harness.table(title, columns, cells, caption))
    ok = harness.verdict
    console.print(
        f"CIS step overhead vs none: {res['cis_overhead']:+.2%} (median of paired ratios; ratio of medians "
        f"{res['cis_overhead_of_medians']:+.2%}, of minima {res['cis_overhead_min']:+.2%}; XLA flop count "
        f"{res['cis_flops_overhead']:+.5%}); target <= {TARGET_CIS_OVERHEAD:.0%}: {ok(res['meets_cis_target'])}"
    )
    console.print(
        f"routing replay step overhead vs CIS alone: {res['replay_overhead']:+.2%} (median of paired ratios; ratio of "
        f"medians {res['replay_overhead_of_medians']:+.2%}; XLA flop count {res['replay_flops_overhead']:+.5%}); "
        f"target <= {TARGET_REPLAY_OVERHEAD:.0%}: {ok(res['meets_replay_target'])}; the rescoring "
        f"{res['replay_rescore']['overhead']:+.2%} ({res['replay_rescore']['replay_s']:.4f} s vs "
        f"{res['replay_rescore']['plain_s']:.4f} s)"
    )
    p = res["proximal"]
    console.print(
        f"the loop's trainer time per step, train.proximal=step / rescore (rescoring + step): {p['ratio']:.2f}x "
        f"({p['step_s']:.4f} s vs {p['rescore_s']:.4f} s; median of paired ratios {p['ratio_paired']:.2f}x); target "
        f"<= {TARGET_PROXIMAL_STEP:.1f}x: {ok(res['meets_proximal_target'])}"
    )
    if "exact_step_ratio" in res:
        console.print(
            f"rollout.exact step time / the CIS step's: {res['exact_step_ratio']:.2f}x (median of paired ratios; ratio "
            f"of medians {res['exact_step_ratio_of_medians']:.2f}x; XLA flop count {res['exact_flops_ratio']:.2f}x); "
            f"target <= {TARGET_EXACT_STEP:.1f}x: {ok(res['meets_exact_target'])}"
        )
    console.print(
        f"JAX / torch fwd+bwd+loss time: {res['jax_vs_torch']:.2f}x (median of paired ratios "
        f"{res['jax_vs_torch_paired']:.2f}x); target <= {TARGET_JAX_VS_TORCH:.1f}x: "
        f"{ok(res['meets_torch_target'])}"
    )
    console.print(
        f"same objective: loss JAX {res['loss']['jax']:.6f} vs torch {res['loss']['torch']:.6f}; "
        f"grad norm JAX {res['grad_norm']['jax']:.6f} vs torch {res['grad_norm']['torch']:.6f}"
    )


def run(args, overrides=()) -> int:
    if harness.smallest(args, ("hidden", "layers", "experts", "top_k", "vocab", "batch", "seq", "micro_batches")) < 1:
        raise SystemExit("sizes must be positive")
    if args.seq < 8 or args.repeats < 1:
        raise SystemExit("--seq must be >= 8 and --repeats >= 1")
    for name in ("torch", "transformers"):  # imported where used (torch_step, tiny_model.save_random)
        if importlib.util.find_spec(name) is None:
            raise SystemExit(
                "cisjax bench step needs torch and transformers (the reference side and the model's weights): "
                f"No module named {name!r}"
            )
    return harness.report(bench(args), _print, args.json)


if __name__ == "__main__":
    raise SystemExit(harness.main("step", add_args, run))
