"""`cisjax score`: training-side (XLA) logprobs of given response tokens, packed and sharded."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import flax.nnx as nnx
import jax
import numpy as np

from cisjax import config as config_lib
from cisjax import errors, files
from cisjax import logprobs as logprobs_lib
from cisjax import sharding
from cisjax.models import hf_io


@dataclass
class Item:
    prompt_ids: list[int]
    response_ids: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def read_items(path: str | Path, vocab_size: int) -> list[Item]:
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
                if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                    raise errors.UserError(f"{path}:{n}: {key!r} must be a list of token ids")
                bad = [t for t in value if not 0 <= t < vocab_size]
                if bad:
                    raise errors.UserError(f"{path}:{n}: {key!r} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
                ids[key] = value
            if not ids["prompt_ids"]:
                raise errors.UserError(f"{path}:{n}: 'prompt_ids' is empty (the first response token needs a context)")
            items.append(Item(ids["prompt_ids"], ids["response_ids"]))
    return items


def pack(items: list[Item], row_tokens: int) -> list[list[int]]:
    """First-fit-decreasing packing of item indices into rows of `row_tokens` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(items)), key=lambda i: -len(items[i])):
        need = len(items[i])
        if need > row_tokens:
            raise errors.UserError(f"item {i} has {need} tokens, more than a row ({row_tokens}); raise score.row_tokens")
        for r, space in enumerate(free):
            if space >= need:
                rows[r].append(i)
                free[r] -= need
                break
        else:
            rows.append([i])
            free.append(row_tokens - need)
    return rows


def build_rows(items: list[Item], rows: list[list[int]], row_tokens: int):
    """Token, position, segment and target arrays [R, T]; targets[j] = next token of the segment."""
    r = len(rows)
    tokens = np.zeros((r, row_tokens), np.int32)
    positions = np.zeros((r, row_tokens), np.int32)
    segments = np.zeros((r, row_tokens), np.int32)
    targets = np.zeros((r, row_tokens), np.int32)
    where = {}  # item -> (row, offset)
    for ri, members in enumerate(rows):
        offset = 0
        for seg, i in enumerate(members, 1):
            seq = items[i].prompt_ids + items[i].response_ids
            n = len(seq)
            tokens[ri, offset : offset + n] = seq
            positions[ri, offset : offset + n] = np.arange(n)
            segments[ri, offset : offset + n] = seg
            targets[ri, offset : offset + n - 1] = seq[1:]
            where[i] = (ri, offset)
            offset += n
    return tokens, positions, segments, targets, where


def make_scorer(model, mesh, rules, *, temperature: float, chunk_size: int, top_k: int):
    """A jitted (tokens, positions, segments, targets) -> (TokenStats, expert ids) over packed rows."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, tokens, positions, segments, targets):
        with sharding.use_mesh(mesh, rules):
            m = nnx.merge(graphdef, state)
            out = m(tokens, positions, segments)
            stats = logprobs_lib.token_logprobs(
                out.hidden_BxLxD, m.unembedding_DxV(), targets, temperature=temperature, chunk_size=chunk_size, top_k=top_k
            )
        return stats, out.expert_ids_XxBxLxK

    def run(*arrays):
        placed = [jax.device_put(a, sharding.named_sharding(("batch", "length"), rules, mesh, a.shape)) for a in arrays]
        return score(state, *placed)

    return run


def score_items(model, items: list[Item], mesh, rules, *, temperature=1.0, chunk_size=1024, top_k=0, row_tokens=0, rows_per_call=8, progress=True) -> list[dict]:
    """Per item: logprobs (and entropy, top-k, routing) of its response tokens, in input order."""
    if not items:
        return []
    if row_tokens <= 0:
        row_tokens = -(-max(len(it) for it in items) // 128) * 128
    rows = pack(items, row_tokens)
    n_data = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    rows_per_call = -(-rows_per_call // n_data) * n_data  # the batch dimension must split evenly
    scorer = make_scorer(model, mesh, rules, temperature=temperature, chunk_size=chunk_size, top_k=top_k)
    results: list[dict | None] = [None] * len(items)
    calls = range(0, len(rows), rows_per_call)
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("scoring", total=len(rows))
    try:
        for start in calls:
            chunk = rows[start : start + rows_per_call]
            chunk = chunk + [[] for _ in range(rows_per_call - len(chunk))]  # empty rows = padding
            tokens, positions, segments, targets, where = build_rows(items, chunk, row_tokens)
            stats, expert_ids = scorer(tokens, positions, segments, targets)
            stats = jax.tree.map(lambda x: None if x is None else np.asarray(x), stats)
            expert_ids = None if expert_ids is None else np.asarray(expert_ids)
            for i, (ri, offset) in where.items():
                p, n = len(items[i].prompt_ids), len(items[i])
                sl = slice(offset + p - 1, offset + n - 1)  # positions that predict the response tokens
                out = {"logprobs": stats.logprobs_N[ri, sl].tolist(), "entropy": stats.entropy_N[ri, sl].tolist()}
                if top_k:
                    out["topk_ids"] = stats.topk_ids_NxK[ri, sl].tolist()
                    out["topk_logprobs"] = stats.topk_logprobs_NxK[ri, sl].tolist()
                if expert_ids is not None:
                    # routing of the passes that produced the response tokens (the logprobs' positions),
                    # as the rollout service reports it: [token][layer][k]
                    out["routing"] = np.transpose(expert_ids[:, ri, sl], (1, 0, 2)).tolist()
                results[i] = out
            if bar:
                bar.advance(task, len([c for c in chunk if c]))
    finally:
        if bar:
            bar.stop()
    return results


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--input", required=True, help='jsonl with {"prompt_ids": [...], "response_ids": [...]} per line')
    p.add_argument("--output", required=True, help='jsonl written line for line: {"logprobs": [...], ...}')
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="parameter and compute dtype (default bfloat16, as the rollout engine)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature of the rollouts (default: config logprobs.temperature)")
    p.add_argument("--top-k", type=int, default=None, help="also write top-k ids/logprobs per token (default: config logprobs.top_k)")
    p.add_argument("--entropy", action="store_true", help="also write the per-token entropy")
    p.add_argument("--routing", action="store_true", help="also write selected expert ids per MoE layer ([token][layer][k])")
    p.add_argument("--config", default=None, help="config file (default configs/base.py); --config.x=y overrides follow")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    cfg = config_lib.load(args.config, overrides or [])
    if not Path(args.input).is_file():  # before the model loads
        raise errors.MissingInput(f"--input {args.input}: no such file")
    rules = sharding.rules_from_config(cfg.sharding.rules.to_dict())
    mesh = sharding.make_mesh(cfg.mesh.to_dict())
    model, mcfg, _ = hf_io.load(
        args.model, mesh=mesh, rules=rules, dtype=args.dtype, param_dtype=args.dtype,
        router_dtype=cfg.model.router_dtype, moe_impl=cfg.model.moe_impl, moe_tile=cfg.model.moe_tile or None,
    )
    items = read_items(args.input, mcfg.vocab_size)
    top_k = cfg.logprobs.top_k if args.top_k is None else args.top_k
    temperature = cfg.logprobs.temperature if args.temperature is None else args.temperature
    if temperature <= 0:
        raise errors.UserError("--temperature must be > 0 (greedy rollouts: score at temperature 1)")
    results = score_items(
        model, items, mesh, rules, temperature=temperature, chunk_size=cfg.logprobs.chunk_size, top_k=top_k,
        row_tokens=cfg.score.row_tokens, rows_per_call=cfg.score.rows, progress=not args.no_progress,
    )
    keys = ["logprobs"] + (["entropy"] if args.entropy else []) + (["topk_ids", "topk_logprobs"] if top_k else []) + (["routing"] if args.routing else [])
    files.write_jsonl_atomic(args.output, results, keys)
    print(f"scored {len(items)} sequences, {sum(len(it.response_ids) for it in items)} response tokens -> {args.output}")
    return 0
