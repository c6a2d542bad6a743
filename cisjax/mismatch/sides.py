"""The engine sides of a measurement, one frozen Side per engine: the sampler's own logprobs, another engine's Score
of its tokens, the trainer's (XLA) rescoring."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from cisjax import errors
from cisjax import score as score_lib
from cisjax.mismatch import scoring
from cisjax.mismatch.sample import Probes, Sampled, flat_logprobs
from cisjax.mismatch.spec import MeasureSpec
from cisjax.rollout.client import RolloutClient
from cisjax.rows import Seq


@dataclass(frozen=True, eq=False)
class Side:
    """One engine's view of the sampled tokens."""

    logp_N: np.ndarray  # its logprob of every sampled token
    label: str  # e.g. "xla/bfloat16", "vllm/bfloat16 (sampling)"
    topk: tuple[np.ndarray, np.ndarray] | None = None  # ids, logprobs [T, K] at the probes
    routing_LxTxK: np.ndarray | None = None  # expert ids of every MoE layer at Probes.routing_index
    control_dtype: str | None = None  # an XLA side: the dtype whose two-pass control applies
    control: float | None = None  # ... and its max |logp| difference
    router_flip_frac: float | None = None  # the replay side: where the XLA routers' own choice differs from vLLM's
    timings: Mapping[str, float] = field(default_factory=dict)  # meta.json timings this side took
    # truncated sampling: logp_N is renormalised over each token's sampling support; this is p over the vocabulary
    logp_full_N: np.ndarray | None = None


def routing_array(per_seq, token_index: np.ndarray, n_tokens: int, what: str) -> np.ndarray:
    """[token][layer][k] lists of every sequence -> [L, T, k] at the token indices."""
    flat = [t for seq in per_seq for t in seq]
    if len(flat) != n_tokens:
        raise RuntimeError(f"{what}: routing of {len(flat)} tokens for {n_tokens} response tokens")
    arr = np.asarray([flat[i] for i in token_index], np.int32)  # [T, L, k]
    if arr.ndim != 3:
        arr = arr.reshape(len(token_index), 0, 0)
    return np.ascontiguousarray(np.transpose(arr, (1, 0, 2))).astype(
        np.int16 if arr.size == 0 or arr.max() < 32768 else np.int32
    )


def support_log_mass(results: list[dict], support: list, n_tokens: int, what: str) -> np.ndarray:
    """log sum_{v in S_t} p(v) of every sampled token [N]: its sampling support S_t (a sample's (ids, counts)) looked up
    in the side's best ids and logprobs of that token ("topk_ids", "topk_logprobs"); 0 where nothing was cut. A
    support id outside those best ids is an error naming the token (the margin was too small)."""
    out = np.zeros(n_tokens, np.float64)
    t = 0
    for s, (res, (ids, counts)) in enumerate(zip(results, support, strict=True)):
        ends = np.cumsum(counts)
        for j, (end, c) in enumerate(zip(ends, counts, strict=True)):
            if c:
                best = dict(zip(res["topk_ids"][j], res["topk_logprobs"][j], strict=True))
                kept = ids[end - c : end]
                missing = [int(v) for v in kept if int(v) not in best]
                if missing:
                    raise RuntimeError(
                        f"{what}: token {j} of sample {s}: support ids {missing[:5]} are not among the side's "
                        f"{len(best)} most likely tokens"
                    )
                out[t + j] = np.logaddexp.reduce(np.array([best[int(v)] for v in kept], np.float64))
        t += len(counts)
    if t != n_tokens:
        raise RuntimeError(f"{what}: sampling supports of {t} tokens for {n_tokens} response tokens")
    return out


def _pairs(items) -> list[tuple]:
    return [(it.prompt_ids, it.response_ids) for it in items]


def sampling_side(
    engine: str, client: RolloutClient, info: dict, sampled: Sampled, probes: Probes, spec: MeasureSpec
) -> Side:
    """The sampler's side: q from the sampling step itself; top-K by a Score pass over the probe items; routing from
    the sampling."""
    topk, timings, routing = None, {}, None
    if spec.topk:
        t0 = time.monotonic()
        topk = probes.topk_at(client.score(_pairs(probes.items), logprobs=spec.topk))
        timings[f"{engine}_topk_s"] = time.monotonic() - t0
    if spec.routing:
        per_seq = [[] if s.routing is None else s.routing for s in sampled.samples]
        routing = routing_array(per_seq, probes.routing_index, sampled.n_tokens, f"{engine} sampling")
    label = f"{engine}/{info['dtype']} (sampling)"
    return Side(sampled.logq_N, label, topk=topk, routing_LxTxK=routing, timings=timings)


def score_side(
    engine: str, client: RolloutClient, info: dict, sampled: Sampled, probes: Probes, spec: MeasureSpec
) -> Side:
    """Another engine's Score (prefill) of the sampled tokens (and of the probe items for top-K)."""
    t0 = time.monotonic()
    res = client.score(_pairs(sampled.items), routing=spec.routing)
    timings = {f"{engine}_score_s": time.monotonic() - t0}
    logp = flat_logprobs([r["logprobs"] for r in res], sampled.n_tokens, f"{engine} Score")
    topk = probes.topk_at(client.score(_pairs(probes.items), logprobs=spec.topk)) if spec.topk else None
    routing = None
    if spec.routing:
        per_seq = [r.get("routing", []) for r in res]
        routing = routing_array(per_seq, probes.routing_index, sampled.n_tokens, f"{engine} Score")
    label = f"{engine}/{info['dtype']} (Score)"
    return Side(logp, label, topk=topk, routing_LxTxK=routing, timings=timings)


def xla_side(scores: scoring.XlaScores, sampled: Sampled, probes: Probes, spec: MeasureSpec) -> Side:
    """The trainer's rescoring in one dtype (two passes: the control)."""
    res, dtype = scores.results, scores.dtype
    logp = flat_logprobs([x["logprobs"] for x in res], sampled.n_tokens, f"XLA {dtype}")
    full = None
    if sampled.support is not None:  # mask replay: p renormalised over the sampler's support of each token
        full = logp
        logp = full - support_log_mass(res, sampled.support, sampled.n_tokens, f"XLA {dtype}")
    topk = probes.topk_at(scores.probe) if spec.topk else None
    routing = None
    if spec.routing:
        if "routing" not in res[0]:
            raise errors.UserError(
                f"--routing: {spec.model} is not a mixture-of-experts model (the XLA model reports no routing)"
            )
        per_seq = [x["routing"] for x in res]
        routing = routing_array(per_seq, probes.routing_index, sampled.n_tokens, f"XLA {dtype}")
    return Side(
        logp,
        f"xla/{dtype}",
        topk=topk,
        routing_LxTxK=routing,
        control_dtype=dtype,
        control=scores.control_max_abs_diff,
        logp_full_N=full,
    )


def replay_side(sampled: Sampled, probes: Probes, spec: MeasureSpec, score_spec: score_lib.ScoreSpec) -> Side:
    """The XLA side with vLLM's routing replayed (cisjax.models.moe): the same items, each carrying the engine's expert
    ids of every position (the prompt's from the prefill). Its routing is the XLA routers' own choice, so N_flip in
    the report counts where replay overrode them."""
    replayed = []
    for i, (s, it) in enumerate(zip(sampled.samples, sampled.items)):
        if s.input_routing is None:
            raise errors.UserError(f"--replay: the vLLM server returned no routing for sample {i} (an MoE model?)")
        replayed.append(Seq(it.prompt_ids, it.response_ids, routing=s.input_routing))
    # the top-K probes: the truncated sequences, each with the routing of its own positions
    probe_items = [
        Seq(
            it.prompt_ids, it.response_ids, routing=replayed[s].routing[: len(it.prompt_ids) + len(it.response_ids) - 1]
        )
        for s, it in zip(probes.seqs, probes.items)
    ]
    r = scoring.xla_scores(
        spec.model, spec.dtype, replayed, probe_items, score_spec, top_k=spec.topk, twice=False, progress=spec.progress
    )
    n_tokens, res = sampled.n_tokens, r.results
    logp = flat_logprobs([x["logprobs"] for x in res], n_tokens, f"XLA {spec.dtype} replay")
    if "routing" not in res[0]:
        raise errors.UserError(f"--replay: {spec.model} is not a mixture-of-experts model (no routing to replay)")
    own = routing_array([x["routing"] for x in res], np.arange(n_tokens), n_tokens, "XLA replay")
    engine = routing_array([s.routing for s in sampled.samples], np.arange(n_tokens), n_tokens, "vllm sampling")
    return Side(
        logp,
        f"xla/{spec.dtype} + vLLM routing replayed",
        topk=probes.topk_at(r.probe) if spec.topk else None,
        routing_LxTxK=own[:, probes.routing_index] if spec.routing else None,
        router_flip_frac=float(np.mean(np.any(np.sort(own, -1) != np.sort(engine, -1), axis=-1))),
        timings={f"xla_replay_{spec.dtype}_score_s": r.score_s[0]},
    )
