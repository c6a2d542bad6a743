"""The trainer's side: `cisjax score`'s engine (the trainer forward, XLA) rescoring the sampled tokens, timed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import numpy as np

from cisjax import score as score_lib


@dataclass(frozen=True, eq=False)
class XlaScores:
    """One dtype's rescoring of the items: per item {"logprobs", and "routing" for an MoE}, and the timings."""

    dtype: str
    results: list[dict]
    probe: list[dict] | None  # top-K records of the truncated probe items (None: no top-K asked)
    load_s: float
    score_s: tuple[float, ...]  # per pass: the first includes compilation, a later one is the steady state
    devices: int
    control_max_abs_diff: float | None  # max |logp| difference between two passes over the same rows (twice only)

    @property
    def timings(self) -> dict[str, float]:
        """The meta.json timings of a two-pass rescoring."""
        return {
            f"xla_{self.dtype}_load_s": self.load_s,
            f"xla_{self.dtype}_score_s": self.score_s[0],
            f"xla_{self.dtype}_rescore_s": self.score_s[1],
        }


def _max_abs_diff(a_results, b_results) -> float:
    a = np.concatenate([np.asarray(r["logprobs"], np.float64) for r in a_results] or [np.zeros(0)])
    b = np.concatenate([np.asarray(r["logprobs"], np.float64) for r in b_results] or [np.zeros(0)])
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def xla_scores(
    model_dir,
    dtype: str,
    items,
    probe_items,
    spec: score_lib.ScoreSpec,
    *,
    top_k: int,
    twice: bool,
    progress: bool,
    support_k: int = 0,
) -> XlaScores:
    """cisjax score's engine on `items` (and top-K on the truncated `probe_items`): logprobs, routing, timings. The
    Scorer is compiled once and run over the same rows once, or `twice` (the second pass: the control and the
    steady-state throughput). `support_k`: also every token's `support_k` best ids and logprobs (the full
    distribution's, for renormalising over a sampling support)."""
    t0 = time.monotonic()
    loaded = score_lib.load_for_scoring(model_dir, dtype, spec)
    load_s = time.monotonic() - t0
    kw = dict(temperature=1.0, chunk_size=spec.chunk_size, row_tokens=spec.row_tokens, rows_per_call=spec.rows)
    scorer = score_lib.Scorer(loaded.model, loaded.mesh, loaded.rules, top_k=support_k, **kw)
    prepared = scorer.prepare(items)
    passes, times = [], []
    for _ in range(2 if twice else 1):
        results, seconds = scorer.run_timed(items, prepared)
        keys = ("logprobs", "routing", "topk_ids", "topk_logprobs")
        passes.append([{k: r[k] for k in keys if k in r} for r in results])
        times.append(seconds)
    probe = None
    if top_k and probe_items:
        probe = score_lib.score_items(
            loaded.model, probe_items, loaded.mesh, loaded.rules, top_k=top_k, progress=progress, **kw
        )
    return XlaScores(
        dtype=dtype,
        results=passes[0],
        probe=probe,
        load_s=load_s,
        score_s=tuple(times),
        devices=len(jax.devices()),
        control_max_abs_diff=_max_abs_diff(passes[0], passes[1]) if twice else None,
    )
