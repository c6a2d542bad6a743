"""`cisjax generate`: rollouts sampled from a rollout server: prompts jsonl in, one line per sample out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cisjax import errors
from cisjax.commands import remote
from cisjax.files import write_jsonl_atomic
from cisjax.rollout.client import RolloutClient, RolloutError
from cisjax.rollout.params import SamplingParams

# the columns of a sample's line (Sample.to_json's keys, in order; those a sample has)
KEYS = (
    "prompt_index",
    "sample_index",
    "prompt_ids",
    "response_ids",
    "logprobs",
    "version",
    "versions",
    "finish_reason",
    "topk_ids",
    "topk_logprobs",
    "routing",
    "prompt_routing",
    "timing",
)


def read_prompts(path: str | Path) -> list[list[int]]:
    """The token ids of each line's {"prompt_ids": [...]}; UserError naming the first bad line."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise errors.UserError(f"{path}:{n}: not JSON ({err})") from None
            ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise errors.UserError(f"{path}:{n}: 'prompt_ids' must be a non-empty list of token ids")
            prompts.append(ids)
    return prompts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, help="rollout server HOST:PORT")
    p.add_argument("--input", required=True, help='jsonl with {"prompt_ids": [...]} per line')
    p.add_argument("--output", required=True, help="jsonl, one line per sample (written atomically)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", type=int, nargs="*", default=[], help="stop token ids")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--logprobs", type=int, default=0, help="also write top-K ids/logprobs per token")
    p.add_argument(
        "--routing",
        action="store_true",
        help="also write routed expert ids: 'routing' [token][moe_layer][k] of the passes that produced the response "
        "tokens, 'prompt_routing' of the prompt's other positions (the engine batches such calls among themselves)",
    )
    remote.add_token(p, "the server's bearer token")
    remote.add_client_tls(p)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline per call, seconds")
    p.add_argument("--retry", type=float, default=120.0, help="seconds to keep retrying an unavailable server")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Sample every prompt of --input from the server; write one line per sample to --output."""
    if overrides:
        raise errors.UserError(f"cisjax generate takes no --config overrides: {overrides}")
    if not Path(args.input).is_file():
        raise errors.MissingInput(f"--input {args.input}: no such file")
    prompts = read_prompts(args.input)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=args.stop,
        seed=args.seed,
        greedy=args.greedy,
        logprobs=args.logprobs,
        return_routing=args.routing,
    )
    token, tls = remote.token(args), remote.client_tls(args)
    with RolloutClient(args.server, token=token, tls=tls, timeout_s=args.timeout, retry_s=args.retry) as client:
        try:
            samples = client.generate(prompts, params)
        except RolloutError as err:
            raise errors.UserError(str(err)) from None
    records = [s.to_json() for per_prompt in samples for s in per_prompt]
    write_jsonl_atomic(args.output, records, KEYS)
    print(
        f"generated {len(records)} samples for {len(prompts)} prompts, {sum(len(r['response_ids']) for r in records)} tokens -> {args.output}"
    )
    return 0
