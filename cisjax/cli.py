"""`cisjax <command>`: the command-line entry point; each command lives in its own module of cisjax.commands."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from cisjax import console, errors
from cisjax.config import split_overrides

# command -> one-line help. Each is the module cisjax.commands.<command>: add_args(parser) and run(args, overrides).
COMMANDS = {
    "train": "the RL loop: rollouts from the rollout server, rewards, CIS-weighted GRPO update, weights published each "
    "step",
    "demo": "prepare the offline demo: synthetic arithmetic task, character tokenizer, tiny MoE warmed up",
    "score": "training-side (XLA) logprobs of response tokens: jsonl in, jsonl out",
    "serve": "rollout gRPC server (token ids in/out) over an inference engine backend",
    "generate": "sample rollouts from a rollout server: prompts jsonl in, one line per sample out",
    "mismatch": "the mismatch observatory: measure XLA vs vLLM token by token, then report (Appendix A)",
    "eval": "greedy pass@1 (and avg@K/pass@K) on GSM8K, MATH-500, SVAMP, Minerva Math, OlympiadBench through the "
    "rollout service",
    "export": "export a train checkpoint's weights as a versioned HF directory for the rollout server",
    "plan": "compile the train step for a TPU slice or GPU set on this host: HBM per chip, fit, FLOPs, roofline",
    "sweep": "correction arms x seeds as train runs (here, one after another, or as commands), then sweep.md + plots",
    "info": "describe a Hugging Face model directory as cisjax loads it",
    "config": "print a config file with --config.x=y overrides applied",
}
# bench -> one-line help. Each is the module cisjax.bench.<bench>: add_args(parser) and run(args, overrides).
BENCHES = {
    "moe": "MoE layer forward+backward vs a dense MLP of equal active FLOPs",
    "logprobs": "chunked vs naive logprobs: peak memory, time, equality",
    "step": "train step: CIS vs no correction, JAX vs transformers/torch fwd+bwd+loss",
    "export": "weight export + server reload bytes/s vs a plain sequential write; streamed updates; --delta: delta vs full publishing per step",
    "rollout": "rollout tokens/s through gRPC vs the same vLLM engine called in-process; --replicas N: a pinned fleet "
    "vs one",
    "loop": "RL loop step time with rollouts ahead of training (async) vs synchronous, same config",
    "optimizer": "a tiny MoE's loss curve with bf16 and host-offloaded AdamW state vs fp32 moments on the device",
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Only the module of the command named in `argv` is imported (none for `cisjax --help`; every one
    when argv is None, for tests that walk all commands): `cisjax serve` must not pull the trainer's imports into the
    server process, nor the trainer the server's."""
    words = [a for a in (argv or []) if not a.startswith("-")]
    every = argv is None
    chosen = words[0] if words else None
    chosen_bench = words[1] if len(words) > 1 and chosen == "bench" else None
    parser = argparse.ArgumentParser(
        prog="cisjax",
        description="JAX/Flax RL training with calibrated importance sampling for MoE LLMs. "
        "Config overrides: --config.path.to.field=value (see configs/base.py). --verbose (anywhere): the libraries' "
        "INFO logging (orbax, absl, vLLM, jax) and cisjax's DEBUG lines, which are off by default.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if every or chosen == name:
            _attach(p, f"cisjax.commands.{name}")
    bench = sub.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, help_text in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        if every or chosen == "bench" and chosen_bench == name:
            _attach(p, f"cisjax.bench.{name}")
    return parser


def _attach(p: argparse.ArgumentParser, module: str) -> None:
    mod = importlib.import_module(module)
    mod.add_args(p)
    p.set_defaults(_run=mod.run)


def main(argv: list[str] | None = None) -> int:
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
