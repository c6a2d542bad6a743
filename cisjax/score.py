"""Training-side (XLA) logprobs of given response tokens, packed and sharded: `cisjax score`, the mismatch XLA side."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import flax.nnx as nnx
import jax
import ml_collections
import numpy as np
from rich.progress import Progress

from cisjax import errors, forward, runtime, sharding
from cisjax import rows as rows_lib
from cisjax.models import hf_io
from cisjax.models.padding import round_up


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


@dataclass(frozen=True)
class ScoreSpec:
    """What scoring takes from the config: the mesh and sharding rules, the model runtime (router dtype, MoE dispatch),
    the logprob chunk and the packing (score.row_tokens, score.rows)."""

    mesh: tuple[tuple[str, int], ...]  # mesh axis -> size (config mesh.*)
    rules: sharding.FrozenRules  # logical name -> mesh axes: config sharding.rules.* resolved, once
    router_dtype: str
    moe_impl: str
    moe_tile: int | None  # None: the dispatch's own tile
    attention_impl: str
    chunk_size: int
    row_tokens: int  # 0: the longest sequence, rounded up to 128
    rows: int

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict) -> ScoreSpec:
        return cls(
            mesh=tuple(cfg.mesh.to_dict().items()),
            rules=sharding.rules_from_config(cfg.sharding.rules.to_dict()),
            router_dtype=cfg.model.router_dtype,
            moe_impl=cfg.model.moe_impl,
            moe_tile=int(cfg.model.moe_tile) or None,  # as runtime.model_runtime reads it
            attention_impl=cfg.model.attention_impl,
            chunk_size=int(cfg.logprobs.chunk_size),
            row_tokens=int(cfg.score.row_tokens),
            rows=int(cfg.score.rows),
        )


@dataclass(frozen=True, eq=False)
class Loaded:
    """A model loaded for scoring, with the mesh and rules it is sharded over."""

    model: nnx.Module
    config: object  # the model's cisjax config (hf_io.model_config): vocab_size, dtype, ...
    mesh: jax.sharding.Mesh
    rules: sharding.FrozenRules  # the spec's own table


def load_for_scoring(model_dir: str | Path, dtype: str, spec: ScoreSpec) -> Loaded:
    """The HF model in `model_dir` with parameters and compute in `dtype`, sharded over the spec's mesh."""
    mesh = sharding.make_mesh(dict(spec.mesh))
    model, model_cfg, _ = hf_io.load(
        model_dir,
        mesh=mesh,
        rules=spec.rules,
        dtype=dtype,
        param_dtype=dtype,
        router_dtype=spec.router_dtype,
        moe_impl=spec.moe_impl,
        moe_tile=spec.moe_tile,
        attention_impl=spec.attention_impl,
    )
    return Loaded(model, model_cfg, mesh, spec.rules)


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
        self.rows_per_call = round_up(int(rows_per_call), multiple)
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
        row_tokens = self.row_tokens or round_up(max(s.positions for s in seqs), 128)
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
            stats, expert_ids = out.stats, out.expert_ids_XxBxTxK
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

    def run_timed(self, seqs, prepared) -> tuple[list, float]:
        """One pass over every prepare()d group: (collect()'s result per sequence, seconds of the calls alone, their
        outputs on the host). The first pass includes compilation; a later one gives the steady-state throughput."""
        t0 = time.monotonic()
        outs = [self.run(rows) for rows in prepared]  # on the host: waits for the device
        seconds = time.monotonic() - t0
        results: list = [None] * len(seqs)
        self.collect(seqs, prepared, outs, results)
        return results, seconds


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
