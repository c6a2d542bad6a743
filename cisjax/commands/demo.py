"""`cisjax demo prepare`: the offline demo's learnable start (synthetic arithmetic, character tokenizer, tiny MoE)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from cisjax.demo.task import BOXED_FRACTION
from cisjax.demo.write import prepare


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="demo_command", metavar="STEP", required=True)
    q = sub.add_parser(
        "prepare",
        help="write the synthetic task, the tokenizer and a tiny Qwen2-MoE, warmed up",
        description="Write DIR/data/{train,heldout,rl,test}.jsonl (synthetic two-digit arithmetic, GSM8K format), "
        "DIR/model (a character tokenizer with a chat template and a tiny Qwen2-MoE) and warm the model "
        "up with a short supervised phase on the train problems (cisjax's own train step), so that the "
        "RL phase on the held-out problems starts with a non-zero but imperfect reward. "
        "--config FILE / --config.x=y set the warm-up's train config.",
    )
    q.add_argument("--out", required=True, help="output directory (DIR/data, DIR/model, DIR/warmup.json)")
    q.add_argument("--seed", type=int, default=0, help="seed of the split, the init, the batch order and the sampling")
    q.add_argument("--warmup-steps", type=int, default=800, help="supervised steps (0 = keep the random init)")
    q.add_argument("--batch-size", type=int, default=64, help="problems per warm-up step")
    q.add_argument("--heldout", type=int, default=512, help="held-out problems (the RL phase's prompts)")
    q.add_argument(
        "--test",
        type=int,
        default=None,
        help="of the held-out problems, this many (whole groups) also go to DIR/data/test.jsonl and the rest to "
        "DIR/data/rl.jsonl: a sweep trains on rl and evaluates on test (heldout.jsonl keeps them all); default a "
        "quarter of --heldout; 0 = no rl/test files",
    )
    q.add_argument(
        "--eval-size", type=int, default=256, help="held-out problems sampled to measure accuracy (0 = none)"
    )
    q.add_argument(
        "--boxed-fraction",
        type=float,
        default=BOXED_FRACTION,
        help="share of warm-up examples that close with \\boxed{answer} as the instruction asks; the others close "
        "with 'so the answer is N', which the reward scores 0 (the instruction-following RL has to learn)",
    )
    q.add_argument("--config", default=None, help="config file, or a config's name (default base: configs/base.py)")


def run(args: argparse.Namespace, overrides: Sequence[str] = ()) -> int:
    """Write the demo's directory (cisjax.demo.write.prepare); --config.x=y overrides set the warm-up's config."""
    if args.demo_command != "prepare":
        raise ValueError(f"unknown demo step {args.demo_command!r}")
    return prepare(
        args.out,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
        batch_size=args.batch_size,
        heldout=args.heldout,
        test=args.test,
        eval_size=args.eval_size,
        boxed_fraction=args.boxed_fraction,
        config_file=args.config,
        overrides=overrides,
    )
