"""`cisjax bench step`: the train step with CIS vs without a correction and with routing replay, and JAX fwd+bwd+loss vs
transformers/torch, one run."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

from cisjax.bench import tiny_model

TARGET_CIS_OVERHEAD = 0.01  # median step time with CIS / without - 1
TARGET_JAX_VS_TORCH = 1.0  # JAX fwd+bwd+loss time / torch's
TARGET_REPLAY_OVERHEAD = 0.03  # median step time with CIS + routing replay / CIS alone - 1
STEPS = ("cis", "none", "cis+replay")  # the optimizer steps timed, interleaved call by call


def add_args(parser: argparse.ArgumentParser) -> None:
    tiny_model.add_args(
        parser,
        hidden=256,
        layers=4,
        heads=8,
        kv_heads=4,
        experts=8,
        top_k=2,
        moe_intermediate=256,
        shared_intermediate=256,
        vocab=2048,
    )
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
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed calls per candidate after a warm-up (default: %(default)s)"
    )
    parser.add_argument(
        "--moe-impl",
        default="auto",
        choices=("auto", "tiled", "ragged", "dense"),
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
        default=None,
        help="transformers experts_implementation (default: transformers' own choice, reported)",
    )
    parser.add_argument("--model-dir", default=None, help="where to save the random HF model (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")


def _host_batch(args, vocab: int):
    """M x B full rows (no padding): a quarter prompt, the rest response; advantages +-1 per row; infer logprobs are
    filled after the proximal rescoring."""
    import numpy as np

    from cisjax.records import TrainBatch

    rng = np.random.default_rng(args.seed)
    m, b, t = args.micro_batches, args.batch, args.seq
    tokens = rng.integers(0, vocab, (m, b, t)).astype(np.int32)
    targets = np.concatenate([tokens[..., 1:], np.zeros((m, b, 1), np.int32)], axis=-1)
    mask = np.zeros((m, b, t), bool)
    mask[..., t // 4 - 1 : t - 1] = True
    adv = np.where(rng.random((m, b, 1)) < 0.5, 1.0, -1.0) * mask
    zeros = np.zeros((m, b, t), np.float32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (m, b, t)).copy()
    return TrainBatch(
        tokens, positions, np.ones((m, b, t), np.int32), targets, mask, zeros, zeros, adv.astype(np.float32)
    )


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench(args) -> dict:
    import flax.nnx as nnx
    import jax
    import numpy as np

    from cisjax import config as config_lib
    from cisjax import sharding
    from cisjax.models import moe as moe_lib
    from cisjax.rl import loss as loss_lib
    from cisjax.train import step as step_lib
    from cisjax.train import validate
    from cisjax.train.build import build

    cfg = config_lib.load(None)
    cfg.train.precision = args.precision
    cfg.logprobs.chunk_size = args.chunk_size
    cfg.train.lr = 1e-5
    cfg.model.moe_impl = args.moe_impl
    cfg.model.scan_layers = bool(args.scan_layers)
    mesh = sharding.make_mesh(cfg.mesh.to_dict())
    res = dict(
        config={k: v for k, v in vars(args).items() if k != "json"},
        backend=jax.default_backend(),
        devices=len(jax.devices()),
        tokens_per_step=args.micro_batches * args.batch * args.seq,
    )

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or tmp
        tiny_model.save_random(args, model_dir, max_positions=max(args.seq, 128))
        # --- the full optimizer step, CIS vs none vs CIS with routing replay: runs built as `cisjax train` builds one
        # (each state is donated)
        runs = {}
        for method in STEPS:
            run_cfg = copy.deepcopy(cfg)
            run_cfg.correction.method = method.split("+")[0]
            run_cfg.routing.replay = "rollout" if method.endswith("+replay") else "none"
            runs[method] = build(
                run_cfg, model_dir=model_dir, mesh=mesh, inputs=False
            )  # the model and batch are made here
        run = runs["none"]
        graphdef, rules = run.graphdef, run.rules
        params = jax.tree.map(lambda x: x.copy(), run.state.params)  # for the fwd+bwd below: the steps donate theirs
        mcfg = nnx.merge(graphdef, params).cfg
        res["jax_moe_impl"] = moe_lib.default_impl() if mcfg.moe_impl == "auto" else mcfg.moe_impl
        host = _host_batch(args, mcfg.vocab_size)
        prox = np.asarray(run.rescore(params, sharding.place(host, mesh, rules, sharding.BATCH_AXES)))
        noise = 0.3 * np.random.default_rng(args.seed + 1).standard_normal(prox.shape)
        host = host._replace(
            prox_logprobs_MxBxT=prox, infer_logprobs_MxBxT=np.minimum(prox + noise, 0.0).astype(np.float32)
        )
        batch = sharding.place(host, mesh, rules, sharding.BATCH_AXES)
        # replay: the routers' own ids as the engine's routing (an engine that agrees: the same work as any other ids)
        routed = _own_routing(graphdef, mesh, rules, params, host)
        batches = {m: batch for m in STEPS}
        batches["cis+replay"] = sharding.place(
            host._replace(routing_MxBxTxXxK=routed), mesh, rules, sharding.BATCH_AXES
        )
        res["replay_rescore"] = _rescore_overhead(runs, params, batches, args.repeats)

        steps, states, compile_s = {}, {}, {}
        for method in STEPS:
            steps[method] = runs[method].train_step
            t0 = time.perf_counter()
            state, met = steps[method](runs[method].state, batches[method])
            jax.block_until_ready(met)
            compile_s[method] = time.perf_counter() - t0
            states[method] = state
        del runs, run
        times = {m: [] for m in STEPS}
        metrics = {}
        for _ in range(args.repeats):
            for method in STEPS:
                t0 = time.perf_counter()
                states[method], met = steps[method](states[method], batches[method])
                jax.block_until_ready(met)
                times[method].append(time.perf_counter() - t0)
                metrics[method] = {k: float(v) for k, v in met.items()}
        rows = []
        for method in STEPS:
            med = statistics.median(times[method])
            rows.append(
                dict(
                    candidate=f"JAX step ({method})",
                    median_s=med,
                    min_s=min(times[method]),
                    tokens_per_s=res["tokens_per_step"] / med,
                    first_call_s=compile_s[method],
                )
            )
        # paired: each CIS call against the no-correction call right after it, so that load drift cancels
        res["cis_overhead"] = statistics.median(c / n for c, n in zip(times["cis"], times["none"])) - 1.0
        res["cis_overhead_of_medians"] = rows[0]["median_s"] / rows[1]["median_s"] - 1.0
        res["cis_overhead_min"] = rows[0]["min_s"] / rows[1]["min_s"] - 1.0
        res["replay_overhead"] = statistics.median(r / c for r, c in zip(times["cis+replay"], times["cis"])) - 1.0
        res["replay_overhead_of_medians"] = rows[2]["median_s"] / rows[0]["median_s"] - 1.0
        flops = {}
        for method in STEPS:
            cost = steps[method].jitted.lower(states[method], batches[method]).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            flops[method] = float((cost or {}).get("flops", float("nan")))
        res["xla_flops"] = flops
        res["cis_flops_overhead"] = flops["cis"] / flops["none"] - 1.0
        res["replay_flops_overhead"] = flops["cis+replay"] / flops["cis"] - 1.0
        res["step_metrics"] = metrics
        del states

        # --- forward + backward + loss of one micro-batch (no optimizer), JAX vs torch on the same weights
        loss_fn = step_lib.make_loss_fn(graphdef, validate.check(cfg, inputs=False).step, mesh, rules)
        mb = jax.tree.map(lambda x: x[0], batch)
        denominator = loss_lib.loss_denominator(mb.loss_mask_MxBxT, cfg.loss.aggregation)
        fwd_bwd = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        t0 = time.perf_counter()
        (_, aux), grads = jax.block_until_ready(fwd_bwd(params, mb, denominator))
        jax_first = time.perf_counter() - t0
        jax_loss = float(aux["loss"])
        jax_grad_norm = float(
            jax.jit(lambda g: jax.numpy.sqrt(sum((x.astype(np.float32) ** 2).sum() for x in jax.tree.leaves(g))))(grads)
        )
        del grads
        torch_run = _torch_fwd_bwd(args, model_dir, jax.tree.map(lambda x: np.asarray(x[0]), host), cfg)
        # interleaved call by call, so that a change in the machine's load hits both sides alike
        jax_times, torch_times = [], []
        for _ in range(args.repeats):
            jax_times += _timed(lambda: jax.block_until_ready(fwd_bwd(params, mb, denominator)), 1)
            torch_times += _timed(torch_run, 1)
        torch_res = torch_run.info(torch_times)
        res["jax_vs_torch_paired"] = statistics.median(j / t for j, t in zip(jax_times, torch_times))
    tokens = args.batch * args.seq
    jax_med = statistics.median(jax_times)
    rows.append(
        dict(
            candidate="JAX fwd+bwd+loss",
            median_s=jax_med,
            min_s=min(jax_times),
            tokens_per_s=tokens / jax_med,
            first_call_s=jax_first,
        )
    )
    rows.append(
        dict(
            candidate=f"torch fwd+bwd+loss ({torch_res['experts']}, {torch_res['attention']})",
            median_s=torch_res["median_s"],
            min_s=torch_res["min_s"],
            tokens_per_s=tokens / torch_res["median_s"],
            first_call_s=torch_res["first_call_s"],
        )
    )
    res["rows"] = rows
    res["jax_vs_torch"] = jax_med / torch_res["median_s"]
    res["loss"] = dict(jax=jax_loss, torch=torch_res["loss"])
    res["grad_norm"] = dict(jax=jax_grad_norm, torch=torch_res["grad_norm"])
    res["meets_cis_target"] = res["cis_overhead"] <= TARGET_CIS_OVERHEAD
    res["meets_torch_target"] = res["jax_vs_torch"] <= TARGET_JAX_VS_TORCH
    res["meets_replay_target"] = res["replay_overhead"] <= TARGET_REPLAY_OVERHEAD
    return res


def _own_routing(graphdef, mesh, rules, params, host):
    """The model's own expert ids of every position of the host batch, [M, B, T, X, k] uint8."""
    import jax
    import numpy as np

    from cisjax import forward

    fwd = jax.jit(forward.make_forward(graphdef, mesh, rules, precision="fp32", temperature=1.0, chunk_size=1024))
    out = []
    for i in range(host.tokens_MxBxT.shape[0]):
        args = (host.tokens_MxBxT[i], host.positions_MxBxT[i], host.segment_ids_MxBxT[i], host.targets_MxBxT[i])
        ids_XxBxTxK = np.asarray(fwd(params, *args).expert_ids_XxBxTxK)
        out.append(np.moveaxis(ids_XxBxTxK, 0, 2))
    return np.stack(out).astype(np.uint8)


def _rescore_overhead(runs, params, batches, repeats: int) -> dict:
    """The proximal rescoring with routing replay (and its flip counts) vs the plain one, interleaved: median s each
    and the median of paired ratios - 1."""
    import jax

    fns = {m: runs[m].rescore for m in ("cis", "cis+replay")}
    for m, fn in fns.items():
        jax.block_until_ready(fn(params, batches[m]))  # compile
    times = {m: [] for m in fns}
    for _ in range(repeats):
        for m, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, batches[m]))
            times[m].append(time.perf_counter() - t0)
    return dict(
        plain_s=statistics.median(times["cis"]),
        replay_s=statistics.median(times["cis+replay"]),
        overhead=statistics.median(r / p for r, p in zip(times["cis+replay"], times["cis"])) - 1.0,
    )


def _torch_fwd_bwd(args, model_dir: str, mb, cfg):
    """The same objective in transformers/torch (CIS weights, decoupled PPO clip, global token mean) as a callable
    doing forward + loss + backward; `.info(times)` summarises its timings, loss and gradient norm."""
    import numpy as np
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.float32
    kwargs = {} if args.torch_experts is None else {"experts_implementation": args.torch_experts}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).train()
    experts = getattr(model.config, "_experts_implementation", None) or "eager"
    attention = getattr(model.config, "_attn_implementation", None) or "?"
    t = lambda x: torch.as_tensor(np.array(x))  # noqa: E731  (a writable copy)
    tokens, positions, targets = t(mb.tokens_MxBxT).long(), t(mb.positions_MxBxT).long(), t(mb.targets_MxBxT).long()
    mask, adv = t(mb.loss_mask_MxBxT), t(mb.advantages_MxBxT)
    prox, infer = t(mb.prox_logprobs_MxBxT), t(mb.infer_logprobs_MxBxT)
    temperature, lam, kappa = cfg.logprobs.temperature, cfg.correction.lam, cfg.correction.kappa
    clip_low, clip_high = cfg.loss.clip_low, cfg.loss.clip_high
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def run():
        model.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=tokens, position_ids=positions).logits
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = logp_all.gather(-1, targets[..., None])[..., 0]
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # as the JAX side reports it
            k = torch.exp(torch.where(mask, prox - infer, 0.0))
            w = torch.minimum(k, 1 + lam * torch.clamp(1 - prox.exp(), min=kappa)) * mask
        ratio = torch.exp(torch.where(mask, logp - prox, 0.0))
        surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
        loss = (w * surrogate * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        return loss.detach(), entropy

    t0 = time.perf_counter()
    loss, _ = run()
    first = time.perf_counter() - t0
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()

    def info(times):
        return dict(
            median_s=statistics.median(times),
            min_s=min(times),
            first_call_s=first,
            loss=float(loss),
            grad_norm=grad_norm,
            experts=experts,
            attention=attention,
            threads=torch.get_num_threads(),
        )

    run.info = info
    return run


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = res["config"]
    table = Table(
        title=(
            f"train step on a random Qwen2-MoE: hidden {c['hidden']}, {c['layers']} layers, {c['experts']} experts "
            f"top-{c['top_k']}, vocab {c['vocab']}, M x B x T = {c['micro_batches']} x {c['batch']} x {c['seq']}, "
            f"{c['precision']}, {res['backend']} x {res['devices']}"
        )
    )
    for col in ("candidate", "median s", "min s", "tokens/s", "first call s"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for r in res["rows"]:
        table.add_row(
            r["candidate"],
            f"{r['median_s']:.4f}",
            f"{r['min_s']:.4f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['first_call_s']:.1f}",
        )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    console.print(table)
    ok = lambda b: "[green]met[/]" if b else "[red]NOT met[/]"  # noqa: E731
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
    if (
        min(args.hidden, args.layers, args.experts, args.top_k, args.vocab, args.batch, args.seq, args.micro_batches)
        < 1
    ):
        raise SystemExit("sizes must be positive")
    if args.seq < 8 or args.repeats < 1:
        raise SystemExit("--seq must be >= 8 and --repeats >= 1")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            f"cisjax bench step needs torch and transformers (the reference side and the model's weights): {err}"
        ) from None
    res = bench(args)
    _print(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cisjax bench step", description=__doc__)
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
