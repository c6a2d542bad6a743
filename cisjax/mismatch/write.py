"""A measurement's records: the run's meta fields, and one records.Measurement per engine pair from its two sides."""

from __future__ import annotations

from collections import Counter

import numpy as np

from cisjax.mismatch import records
from cisjax.mismatch.sample import Probes, Sampled
from cisjax.mismatch.scoring import XlaScores
from cisjax.mismatch.sides import Side
from cisjax.mismatch.spec import MeasureSpec


def run_meta(
    spec: MeasureSpec,
    hf: dict,
    n_prompts: int,
    sampled: Sampled,
    probes: Probes,
    *,
    engines: dict,
    timings: dict[str, float],
    perturbed: dict | None,
    xla: list[XlaScores],
) -> dict:
    """The meta.json fields every pair of the run shares."""
    n_tokens = sampled.n_tokens
    meta = {
        "model": str(spec.model.resolve()),
        "vocab_size": int(hf["vocab_size"]),
        "architecture": (hf.get("architectures") or [None])[0],
        "sampler": spec.sampler,  # the engine that sampled the tokens (its side: the sampling step's logprobs)
        "n": spec.n,
        "temperature": 1.0,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
        "max_new_tokens": spec.max_new_tokens,
        "prompts": n_prompts,
        "prompts_file": str(spec.prompts),
        "sequences": len(sampled.items),
        "tokens": n_tokens,
        # controlled mismatch: the engines served a perturbed copy of "model" (XLA rescored with "model" itself)
        "perturb": perturbed,
        "seed": spec.seed,
        "probe_seed": spec.seed + 1,
        "probe_positions": probes.count,
        "topk": spec.topk,
        "xla_dtype": spec.dtype,
        "exact": spec.exact,  # the exact sampler against the trainer's exact forward (measure --exact)
        "engine_dtypes": {k: v["dtype"] for k, v in engines.items()},
        "engines": engines,
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "finish_reasons": dict(Counter(s.finish_reason for s in sampled.samples)),
    }
    total_tokens = int(sum(len(it) for it in sampled.items))  # prompt + response, what a forward computes
    for r in xla:
        best = r.score_s[-1]  # the last pass runs compiled code: the steady-state throughput
        meta[f"xla_{r.dtype}_rescore_tokens_per_s"] = n_tokens / best
        meta[f"xla_{r.dtype}_rescore_all_tokens_per_s"] = total_tokens / best
        meta["xla_devices"] = r.devices
    return meta


def pair_measurement(
    pair: str, p: Side, q: Side, meta: dict, sampled: Sampled, probes: Probes, spec: MeasureSpec
) -> records.Measurement:
    """The measurement of `pair`: side p (training) against side q (inference) on the sampled tokens."""
    logp = np.minimum(p.logp_N, 0.0)  # float rounding can give +1e-7 for a certain token; a probability is <= 1
    logq = np.minimum(q.logp_N, 0.0)
    k = np.exp(logp - logq)
    meta = dict(
        meta,
        pair=pair,
        side_p=p.label,
        side_q=q.label,
        mean_k=float(np.mean(k)),
        mean_abs_log_k=float(np.mean(np.abs(logp - logq))),
        max_abs_log_k=float(np.max(np.abs(logp - logq))),
        exact_frac=float(np.mean(logp == logq)),  # the tokens whose p equals q bit for bit
    )
    if p.logp_full_N is not None:
        # truncated sampling: logp is renormalised over each token's sampling support (mask replay); the same k with
        # p over the whole vocabulary, the bias the renormalisation removes
        logk_full = np.minimum(p.logp_full_N, 0.0) - logq
        meta["renormalised_over_support"] = True
        meta["control_mean_k_full_vocabulary"] = float(np.mean(np.exp(logk_full)))
        meta["control_mean_abs_log_k_full_vocabulary"] = float(np.mean(np.abs(logk_full)))
    if p.router_flip_frac is not None:
        # where the XLA routers' own top-k set differs from vLLM's (the routes replay overrode), per (token, layer)
        meta["routing_replay"] = True
        meta["router_flip_frac"] = p.router_flip_frac
    meta["control_rescore_max_abs_diff"] = p.control
    if p.control_dtype:
        meta["control_rescore_dtype"] = p.control_dtype
    tokens = {
        **({"logp_full": p.logp_full_N} if p.logp_full_N is not None else {}),
        "logp": logp,
        "logq": logq,
        "seq_id": sampled.seq_id_N,
        "position": sampled.position_N,
        "token_id": sampled.token_id_N,
    }
    topk = None
    if spec.topk:
        topk = {
            "token_index": probes.index_T.astype(np.int64),
            "ids_p": p.topk[0],
            "logp_p": p.topk[1],
            "ids_q": q.topk[0],
            "logp_q": q.topk[1],
        }
    routing = None
    if spec.routing:
        a, b = p.routing_LxTxK, q.routing_LxTxK
        routing = {"token_index": probes.routing_index.astype(np.int64), "experts_p": a, "experts_q": b}
        meta["routing_agreement"] = float(np.mean(np.sort(a, -1) == np.sort(b, -1))) if a.size else None
    return records.Measurement(meta=meta, tokens=tokens, topk=topk, routing=routing)
