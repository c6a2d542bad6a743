"""`cisjax mismatch measure|report`: the mismatch observatory: measure XLA vs vLLM (or the JAX sampler) token by token,
then report."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from cisjax import config as config_lib
from cisjax import errors
from cisjax import score as score_lib
from cisjax.commands import remote
from cisjax.mismatch import analysis, dumps, records
from cisjax.mismatch import measure as measure_lib
from cisjax.mismatch import report as report_lib
from cisjax.mismatch import spec as spec_lib
from cisjax.mismatch.prompts import PROMPT_FORMATS

STEPS = {
    "measure": "sample with the inference engine, rescore with the trainer: per-token data of each engine pair",
    "report": "Appendix A tables, plots and report.md from one or more measurements",
}


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mismatch_command", metavar="STEP", required=True)
    for name, help_text in STEPS.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        {"measure": _measure_args, "report": _report_args}[name](q)


def _measure_args(p: argparse.ArgumentParser) -> None:
    p.description = (p.description or "") + "\n\n" + PROMPT_FORMATS
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add = p.add_argument
    add("--out", required=True, help="output directory: one measurement directory per pair (OUT/xla-vllm, ...)")
    add("--model", default=None, help="Hugging Face model directory: the weights every engine loads")
    add("--prompts", default=None, help="jsonl of prompts (see above)")
    add("--kind", default="dapo_math_17k", help="row layout of problem rows (cisjax.data.KINDS; default dapo_math_17k)")
    add("--num-prompts", type=int, default=0, help="use a seeded random sample of this many prompts (0 = all)")
    add(
        "--pairs",
        default="xla-vllm",
        help=f"comma-separated engine pairs: {', '.join(spec_lib.PAIRS)} (default xla-vllm)",
    )
    add("--n", type=int, default=8, help="samples per prompt (temperature 1)")
    add(
        "--top-k",
        type=int,
        default=0,
        help="truncated sampling: the sampler's top-k (0 = off; with --top-p, in [1, 1024]); the XLA side is then p "
        "renormalised over each token's sampling support (mask replay), and meta.json also reports k with p over the "
        "whole vocabulary (control_mean_k_full_vocabulary). Needs --sampler jax and pairs xla*-jax",
    )
    add("--top-p", type=float, default=1.0, help="truncated sampling: the sampler's top-p (1 = off; needs --top-k)")
    add("--max-new-tokens", type=int, default=1024)
    add("--seed", type=int, default=0, help="seed of the sampling, the prompt sample and the probe positions")
    add(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="XLA rescoring dtype (float32 is the control)",
    )
    add("--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the servers started here")
    add("--topk", type=int, default=0, help="also store each side's top-K at the probed positions")
    add(
        "--probe-positions",
        type=int,
        default=0,
        help="number of token positions (seeded sample) for --topk and --routing "
        "(0: routing at every token; --topk needs it)",
    )
    add("--routing", action="store_true", help="also store the routed expert ids of every MoE layer on both sides")
    add(
        "--replay",
        action="store_true",
        help="also rescore on the XLA side with vLLM's routing of every position replayed (an MoE model): the pair "
        "xla_replay-vllm, measured beside xla-vllm; its routing, with --routing, is the XLA routers' own choice",
    )
    add(
        "--perturb",
        default="none",
        help="controlled mismatch (cisjax.train.perturb, as the trainer's rollout.perturb): the engines started here "
        "serve a perturbed copy of --model (none | int8 | int4 | fp8 | noise) while XLA rescores with --model itself",
    )
    add("--perturb-scale", type=float, default=0.0, help="--perturb noise: the relative rms (e.g. 0.01)")
    add("--perturb-seed", type=int, default=0, help="--perturb noise: its seed")
    add(
        "--sampler",
        choices=spec_lib.SAMPLERS,
        default="vllm",
        help="the engine that samples the tokens every pair is measured on; its side is the sampling step's logprobs, "
        "another engine's side its Score of those tokens (default vllm; jax: cisjax's own sampler, serve --backend jax)",
    )
    add(
        "--exact",
        action="store_true",
        help="bitwise on-policy (rollout.exact): the JAX sampler is the exact one (serve --backend jax --exact: fp32 "
        "master weights computed in --dtype) and the XLA side the trainer's exact forward, so every token's p equals "
        "its q (exact_frac 1); needs --sampler jax --pairs xla-jax, no --perturb, --topk, --routing or --replay, and "
        "--engine-dtype equal to --dtype",
    )
    add("--server", default=None, help="a running vLLM rollout server HOST:PORT (default: start one as a child)")
    add(
        "--transformers-server",
        default=None,
        help="a running transformers rollout server HOST:PORT (default: start one when a pair needs it)",
    )
    add(
        "--jax-server",
        default=None,
        help="a running JAX rollout server HOST:PORT (default: start one when a pair needs it)",
    )
    add("--startup-s", type=float, default=900.0, help="seconds a child server may take to start")
    remote.add_token(p, "bearer token of the running servers")
    remote.add_client_tls(p)
    add(
        "--dump",
        default=None,
        help="also (or only) read RUN_DIR/dumps/step_*.npz of a training run into OUT/train-dump",
    )
    add(
        "--config",
        default=None,
        help="config file or name for the XLA side (default base: configs/base.py); --config.x=y overrides follow",
    )
    add("--no-progress", action="store_true", help="no progress bars")


def _report_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add(
        "measurements",
        nargs="+",
        metavar="MEAS",
        help="measurement directories (or directories holding one per engine pair), see mismatch/records.py",
    )
    add("--out", required=True, help="output directory: report.md, summary.json, *.png, raw/*.npz")
    defaults = analysis.operator_defaults()  # base.py's correction.*
    add("--lam", type=float, default=defaults.lam, help="CIS lambda (default %(default)s)")
    add("--kappa", type=float, default=defaults.kappa, help="CIS floor kappa (default %(default)s)")
    add("--cap", type=float, default=defaults.cap, help="TIS cap C (default %(default)s)")
    add("--threshold", type=float, default=defaults.threshold, help="KPop's threshold phi (default %(default)s)")
    add("--plot-points", type=int, default=200_000, help="tokens subsampled per measurement for scatter plots")
    add(
        "--spearman-tokens",
        type=int,
        default=300_000,
        help="tokens subsampled for the Spearman correlations (the paper: 300,000)",
    )
    add("--seed", type=int, default=0, help="seed of the subsamples")
    add("--no-raw", action="store_true", help="do not write raw/<pair>.npz (per-token eps, log k)")


def _spec(cls, args: argparse.Namespace, **given):
    """A spec dataclass with its fields from the like-named arguments, except those `given`."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in given}, **given)


def _measure(args: argparse.Namespace, overrides) -> int:
    """The engine pairs (--model, --prompts) and/or a training run's dumps (--dump), one measurement each."""
    if args.dump is None and args.prompts is None:
        raise errors.UserError(
            "give --prompts (and --model) to measure engine pairs, or --dump RUN_DIR to read a run's token dumps"
        )
    written = []
    if args.prompts is not None or args.model is not None:
        pairs = spec_lib.parse_pairs(args.pairs)
        if args.model is None or args.prompts is None:
            raise errors.UserError("--model and --prompts are needed to measure engine pairs (or give only --dump)")
        score_spec = score_lib.ScoreSpec.from_config(config_lib.load(args.config, list(overrides or [])))
        spec = _spec(
            spec_lib.MeasureSpec,
            args,
            out=Path(args.out),
            model=Path(args.model),
            prompts=Path(args.prompts),
            pairs=pairs,
            token=remote.token(args),
            tls=remote.client_tls(args),
            progress=not args.no_progress,
        )
        written += measure_lib.measure(spec, score_spec)
    elif overrides:
        raise errors.UserError(f"--dump alone takes no --config overrides: {list(overrides)}")
    if args.dump is not None:
        written.append(records.save(Path(args.out) / "train-dump", dumps.read_dumps(args.dump)))
    for d in written:
        m = records.load(d)
        full = m.meta.get("control_mean_k_full_vocabulary")
        also = "" if full is None else f" (p over the whole vocabulary: {full})"
        exact = (
            f", exact_frac {m.meta['exact_frac']}, max |log k| {m.meta['max_abs_log_k']}"
            if "exact_frac" in m.meta
            else ""
        )
        print(f"{m.meta['pair']}: {m.n_tokens} tokens, mean k {m.meta.get('mean_k')}{exact}{also} -> {d}")
    return 0


def _report(args: argparse.Namespace, overrides) -> int:
    """report.md, summary.json and the figures of the measurements named."""
    if overrides:
        raise errors.UserError(f"mismatch report takes no --config overrides, got {list(overrides)}")
    if args.plot_points < 1 or args.spearman_tokens < 2:
        raise errors.UserError("--plot-points must be >= 1 and --spearman-tokens >= 2")
    spec = _spec(report_lib.ReportSpec, args, out=Path(args.out), raw=not args.no_raw)
    done = report_lib.report(args.measurements, spec)
    for w in done.warnings:
        print(f"cisjax mismatch report: warning: {w}", file=sys.stderr)
    print(f"cisjax mismatch report: {len(done.paths)} measurement(s), {done.elapsed_s:.1f} s -> {done.markdown}")
    return 0


def run(args: argparse.Namespace, overrides=()) -> int:
    return {"measure": _measure, "report": _report}[args.mismatch_command](args, overrides)
