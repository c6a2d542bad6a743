"""`cisjax score`: training-side (XLA) logprobs of response tokens: jsonl in, jsonl out."""

from __future__ import annotations

import argparse
from pathlib import Path

from cisjax import config as config_lib
from cisjax import errors, files
from cisjax import score as score_lib


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--input", required=True, help='jsonl with {"prompt_ids": [...], "response_ids": [...]} per line')
    p.add_argument("--output", required=True, help='jsonl written line for line: {"logprobs": [...], ...}')
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="parameter and compute dtype (default bfloat16, as the rollout engine)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature of the rollouts (default: config logprobs.temperature)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="also write top-k ids/logprobs per token (default: config logprobs.top_k)",
    )
    p.add_argument("--entropy", action="store_true", help="also write the per-token entropy")
    p.add_argument(
        "--routing",
        action="store_true",
        help="also write selected expert ids per MoE layer: 'routing' [token][layer][k] of the passes that produced "
        "the response tokens, 'prompt_routing' of the prompt's other positions",
    )
    p.add_argument("--config", default=None, help=config_lib.FLAG_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Load the model as the config says, score every item of --input and write the asked-for keys to --output."""
    cfg = config_lib.load(args.config, overrides or [])
    if not Path(args.input).is_file():  # before the model loads
        raise errors.MissingInput(f"--input {args.input}: no such file")
    spec = score_lib.ScoreSpec.from_config(cfg)
    loaded = score_lib.load_for_scoring(args.model, args.dtype, spec)
    items = score_lib.read_items(args.input, loaded.config.vocab_size)
    top_k = cfg.logprobs.top_k if args.top_k is None else args.top_k
    temperature = cfg.logprobs.temperature if args.temperature is None else args.temperature
    if temperature <= 0:
        raise errors.UserError("--temperature must be > 0 (greedy rollouts: score at temperature 1)")
    results = score_lib.score_items(
        loaded.model,
        items,
        loaded.mesh,
        loaded.rules,
        temperature=temperature,
        chunk_size=spec.chunk_size,
        top_k=top_k,
        row_tokens=spec.row_tokens,
        rows_per_call=spec.rows,
        progress=not args.no_progress,
    )
    keys = (
        ["logprobs"]
        + (["entropy"] if args.entropy else [])
        + (["topk_ids", "topk_logprobs"] if top_k else [])
        + (["routing", "prompt_routing"] if args.routing else [])
    )
    files.write_jsonl_atomic(args.output, results, keys)
    print(
        f"scored {len(items)} sequences, {sum(len(it.response_ids) for it in items)} response tokens -> {args.output}"
    )
    return 0
