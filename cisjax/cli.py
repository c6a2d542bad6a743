"""`cisjax <command>`: the command-line entry point; each command lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys

from cisjax import console, errors

# command -> (module, one-line help). Modules define add_args(parser) and run(args, overrides)
# (or add_<command>_args / run_<command> when one module serves two commands); benches run(args) or run(args, overrides).
COMMANDS = {
    "train": (
        "cisjax.train.loop",
        "the RL loop: rollouts from the rollout server, rewards, CIS-weighted GRPO update, weights published each step",
    ),
    "demo": (
        "cisjax.demo",
        "prepare the offline demo: synthetic arithmetic task, character tokenizer, tiny MoE warmed up",
    ),
    "score": ("cisjax.score", "training-side (XLA) logprobs of response tokens: jsonl in, jsonl out"),
    "serve": ("cisjax.rollout.server", "rollout gRPC server (token ids in/out) over an inference engine backend"),
    "generate": (
        "cisjax.rollout.client",
        "sample rollouts from a rollout server: prompts jsonl in, one line per sample out",
    ),
    "mismatch": (
        "cisjax.mismatch.command",
        "the mismatch observatory: measure XLA vs vLLM token by token, then report (Appendix A)",
    ),
    "eval": (
        "cisjax.evaluation.command",
        "greedy pass@1 (and avg@K/pass@K) on GSM8K, MATH-500, SVAMP, Minerva Math, OlympiadBench through the rollout service",
    ),
    "export": (
        "cisjax.export",
        "export a train checkpoint's weights as a versioned HF directory for the rollout server",
    ),
    "plan": (
        "cisjax.plan.command",
        "compile the train step for a TPU slice or GPU set on this host: HBM per chip, fit, FLOPs, roofline",
    ),
    "sweep": (
        "cisjax.sweep.command",
        "correction arms x seeds as train runs (here, one after another, or as commands), then sweep.md + plots",
    ),
    "info": ("cisjax.info", "describe a Hugging Face model directory as cisjax loads it"),
    "config": ("cisjax.info", "print a config file with --config.x=y overrides applied"),
}
BENCHES = {
    "moe": ("cisjax.bench.moe", "MoE layer forward+backward vs a dense MLP of equal active FLOPs"),
    "logprobs": ("cisjax.bench.logprobs", "chunked vs naive logprobs: peak memory, time, equality"),
    "step": ("cisjax.bench.step", "train step: CIS vs no correction, JAX vs transformers/torch fwd+bwd+loss"),
    "export": (
        "cisjax.bench.export",
        "weight export + server reload bytes/s vs a plain sequential write; streamed update bytes/s",
    ),
    "rollout": (
        "cisjax.bench.rollout",
        "rollout tokens/s through gRPC vs the same vLLM engine called in-process; --replicas N: a pinned fleet vs one",
    ),
    "loop": (
        "cisjax.bench.loop",
        "RL loop step time with rollouts ahead of training (async) vs synchronous, same config",
    ),
}


def _module(name: str):
    return importlib.import_module(name)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Only the module of the command named in `argv` is imported (all of them for
    `--help` or when argv is None): `cisjax serve` must not pull the trainer's imports into the
    server process, nor the trainer the server's."""
    words = [a for a in (argv or []) if not a.startswith("-")]
    chosen = words[0] if words else None
    chosen_bench = words[1] if len(words) > 1 and chosen == "bench" else None
    parser = argparse.ArgumentParser(
        prog="cisjax",
        description="JAX/Flax RL training with calibrated importance sampling for MoE LLMs. "
        "Config overrides: --config.path.to.field=value (see configs/base.py). --verbose (anywhere): the libraries' "
        "INFO logging (orbax, absl, vLLM, jax) and cisjax's DEBUG lines, which are off by default.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if chosen in (None, name) or chosen not in COMMANDS and chosen != "bench":
            mod = _module(module)
            (getattr(mod, f"add_{name}_args", None) or mod.add_args)(p)
            p.set_defaults(_run=getattr(mod, f"run_{name}", None) or mod.run)
    bench = sub.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        if chosen in (None, "bench") and chosen_bench in (None, name):
            mod = _module(module)
            mod.add_args(p)
            takes_overrides = len(inspect.signature(mod.run).parameters) > 1  # `bench loop` takes --config.x=y
            p.set_defaults(
                _run=lambda args, overrides, run=mod.run, t=takes_overrides: run(args, overrides) if t else run(args)
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    from cisjax.config import split_overrides

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv:  # any position: libraries' INFO logging back on, in this process and its children
        argv = [a for a in argv if a != "--verbose"]
        os.environ[console.ENV] = "1"
    console.setup()
    rest, overrides = split_overrides(argv)
    args = build_parser(rest).parse_args(rest)
    run = args._run
    del args._run  # not an argument: keep the namespace JSON-serialisable for the commands that record it
    try:
        code = run(args, overrides)
    except errors.UserError as err:
        # declared user errors: one clear line, no traceback (anything else is a bug: its traceback shows)
        print(f"cisjax {args.command}: error: {err}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
