"""`cisjax score`: training-side (XLA) logprobs of given response tokens, packed and sharded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import flax.nnx as nnx
import jax
import numpy as np

from cisjax import config as config_lib
from cisjax import errors, files, forward, runtime, sharding
from cisjax import rows as rows_lib
from cisjax.models import hf_io


def read_items(path: str | Path, vocab_size: int) -> list[rows_lib.Seq]:
    """Parse `{"prompt_ids": [...], "response_ids": [...]}` lines; errors name the line."""
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                raise errors.UserError(f"{path}:{n}: empty line")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise errors.UserError(f"{path}:{n}: not JSON ({err})") from None
            if not isinstance(obj, dict):
                raise errors.UserError(f"{path}:{n}: expected a JSON object")
            ids = {}
            for key in ("prompt_ids", "response_ids"):
                value = obj.get(key)
                if not isinstance(value, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in value
                ):
                    raise errors.UserError(f"{path}:{n}: {key!r} must be a list of token ids")
                bad = [t for t in value if not 0 <= t < vocab_size]
                if bad:
                    raise errors.UserError(
                        f"{path}:{n}: {key!r} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                    )
                ids[key] = value
            if not ids["prompt_ids"]:
                raise errors.UserError(f"{path}:{n}: 'prompt_ids' is empty (the first response token needs a context)")
            items.append(rows_lib.Seq(ids["prompt_ids"], ids["response_ids"]))
    return items


class Scorer:
    """The trainer forward (forward.make_scorer) over packed rows of `row_tokens` positions, `rows_per_call` rows per
    call (rounded up to the mesh's batch shards; empty rows pad the last call)."""

    def __init__(
        self,
        model,
        mesh,
        rules,
        *,
        temperature: float,
        chunk_size: int,
        top_k: int,
        row_tokens: int,
        rows_per_call: int,
    ):
        self.graphdef, self.params = nnx.split(model)
        self.mesh, self.rules, self.top_k, self.row_tokens = mesh, rules, int(top_k), int(row_tokens)
        multiple = sharding.axis_multiple(mesh, rules, "batch")
        self.rows_per_call = -(-int(rows_per_call) // multiple) * multiple
        self.fn = forward.make_scorer(
            self.graphdef,
            mesh,
            rules,
            precision=runtime.precision_of(model.cfg.dtype),
            temperature=temperature,
            chunk_size=chunk_size,
            top_k=top_k,
        )

    def prepare(self, seqs: list[rows_lib.Seq]) -> list[rows_lib.Rows]:
        """The host rows of every call (packing first-fit-decreasing; row_tokens 0 = the longest, rounded to 128)."""
        row_tokens = self.row_tokens or -(-max(s.positions for s in seqs) // 128) * 128
        layout = rows_lib.pack(seqs, row_tokens)
        n = self.rows_per_call
        return [rows_lib.build(seqs, layout[i : i + n], row_tokens, rows=n) for i in range(0, len(layout), n)]

    def run(self, rows: rows_lib.Rows) -> forward.Output:
        """One call on one prepare()d group of rows; the outputs on the host (numpy)."""
        routing = () if rows.routing_RxTxXxK is None else (rows.routing_RxTxXxK,)  # replayed when the items carry it
        placed = sharding.place(tuple(rows[:4]) + routing, self.mesh, self.rules)
        out = self.fn(self.params, *placed)
        return jax.tree.map(np.asarray, out)

    def collect(self, seqs, prepared, outs, results: list) -> None:
        """Per sequence of `prepared` (outs = run() of each): logprobs, entropy, top-k and routing of its response
        tokens into results[i]; with routing, also "prompt_routing", that of the prompt's other positions."""
        for rows, out in zip(prepared, outs):
            stats, expert_ids = out
            for i in rows.where:
                r, sl = rows.response_slice(seqs, i)  # the positions that predict the response tokens
                res = {"logprobs": stats.logprobs_N[r, sl].tolist(), "entropy": stats.entropy_N[r, sl].tolist()}
                if self.top_k:
                    res["topk_ids"] = stats.topk_ids_NxK[r, sl].tolist()
                    res["topk_logprobs"] = stats.topk_logprobs_NxK[r, sl].tolist()
                if expert_ids is not None:
                    # routing of the passes that produced the response tokens (the logprobs' positions), and of the
                    # prompt positions before them (0 .. P-2), as the rollout service reports them: [position][layer][k]
                    res["routing"] = np.transpose(expert_ids[:, r, sl], (1, 0, 2)).tolist()
                    prompt = slice(rows.where[i][1], sl.start)
                    res["prompt_routing"] = np.transpose(expert_ids[:, r, prompt], (1, 0, 2)).tolist()
                results[i] = res


def score_items(
    model,
    items: list[rows_lib.Seq],
    mesh,
    rules,
    *,
    temperature=1.0,
    chunk_size=1024,
    top_k=0,
    row_tokens=0,
    rows_per_call=8,
    progress=True,
) -> list[dict]:
    """Per item: logprobs (and entropy, top-k, routing) of its response tokens, in input order."""
    if not items:
        return []
    scorer = Scorer(
        model,
        mesh,
        rules,
        temperature=temperature,
        chunk_size=chunk_size,
        top_k=top_k,
        row_tokens=row_tokens,
        rows_per_call=rows_per_call,
    )
    prepared = scorer.prepare(items)
    results: list[dict | None] = [None] * len(items)
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("scoring", total=sum(len(rows.where) for rows in prepared))
    try:
        for rows in prepared:
            scorer.collect(items, [rows], [scorer.run(rows)], results)
            if bar:
                bar.advance(task, len(rows.where))
    finally:
        if bar:
            bar.stop()
    return results


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
    p.add_argument(
        "--config", default=None, help="config file (default configs/base.py); --config.x=y overrides follow"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    cfg = config_lib.load(args.config, overrides or [])
    if not Path(args.input).is_file():  # before the model loads
        raise errors.MissingInput(f"--input {args.input}: no such file")
    rules = sharding.rules_from_config(cfg.sharding.rules.to_dict())
    mesh = sharding.make_mesh(cfg.mesh.to_dict())
    model, mcfg, _ = hf_io.load(
        args.model,
        mesh=mesh,
        rules=rules,
        dtype=args.dtype,
        param_dtype=args.dtype,
        router_dtype=cfg.model.router_dtype,
        moe_impl=cfg.model.moe_impl,
        moe_tile=cfg.model.moe_tile or None,
    )
    items = read_items(args.input, mcfg.vocab_size)
    top_k = cfg.logprobs.top_k if args.top_k is None else args.top_k
    temperature = cfg.logprobs.temperature if args.temperature is None else args.temperature
    if temperature <= 0:
        raise errors.UserError("--temperature must be > 0 (greedy rollouts: score at temperature 1)")
    results = score_items(
        model,
        items,
        mesh,
        rules,
        temperature=temperature,
        chunk_size=cfg.logprobs.chunk_size,
        top_k=top_k,
        row_tokens=cfg.score.row_tokens,
        rows_per_call=cfg.score.rows,
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
