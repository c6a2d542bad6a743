"""vLLM's finished request outputs as the engine contract's results: SampleResult per sample, a score dict per sequence."""

from __future__ import annotations

import time

import numpy as np

from cisjax.engines.vllm import routing_capture
from cisjax.rollout.backend import SampleResult
from cisjax.rollout.params import SamplingParams


def _finish_reason(reason) -> str:
    return "stop" if reason == "stop" else "length" if reason == "length" else "abort"


def _ranked(d: dict, k: int) -> list:
    """(token id, logprob) of a vLLM logprobs dict's top-k by rank, best first, finite only."""
    ranked = sorted(
        ((lp.rank, tid, lp.logprob) for tid, lp in d.items() if lp.rank is not None and lp.rank <= k),
        key=lambda x: x[0],
    )
    return [(tid, float(v)) for _, tid, v in ranked if np.isfinite(v)][:k]


def samples(
    outs: list, params: SamplingParams, prompt_len: int, *, version: int, started: float, captured: list | None
) -> list:
    """The SampleResult of each of a prompt's requests (`outs`, one RequestOutput per sample, in sample order), made
    by weights `version` since `started` (time.monotonic); `captured`: each request's routed ids [positions, layers,
    k] (routing_capture.read), or None without routing."""
    results = []
    finished = time.monotonic()
    for j, out in enumerate(outs):
        c = out.outputs[0]
        tokens = list(c.token_ids)
        prompt_rows, rows = (
            routing_capture.split(captured[j], prompt_len, len(tokens)) if captured is not None else (None, None)
        )
        lps, top_ids, top_lps = [], [], []
        for t, d in zip(tokens, c.logprobs):
            lps.append(float(d[t].logprob))
            if params.logprobs:
                ranked = _ranked(d, params.logprobs)
                top_ids.append([a for a, _ in ranked])
                top_lps.append([b for _, b in ranked])
        results.append(
            SampleResult(
                sample_index=j,
                token_ids=tokens,
                logprobs=lps,
                finish_reason=_finish_reason(c.finish_reason),
                versions=[version] * len(tokens),
                top_ids=top_ids if params.logprobs else None,
                top_logprobs=top_lps if params.logprobs else None,
                routing=rows,
                prompt_routing=prompt_rows,
                timing={"started": started, "finished": finished},
            )
        )
    return results


def scored(
    res, prompt_len: int, response_ids: list, temperature: float, top_k: int, *, version: int, captured: list | None
) -> dict:
    """Backend.score's dict (plus "version") of a scored sequence's RequestOutput `res` (prompt logprobs of every
    position); `captured` as in `samples` (one request), or None without routing."""
    out = {"logprobs": [], "version": version}
    if top_k:
        out["top_ids"], out["top_logprobs"] = [], []
    if captured is not None:
        out["prompt_routing"], out["routing"] = routing_capture.split(captured[0], prompt_len, len(response_ids))
    if not response_ids:
        return out
    dicts = res.prompt_logprobs[prompt_len:]  # entry i: the distribution over token i given tokens < i
    for t, d in zip(response_ids, dicts):
        if temperature != 1.0:  # prompt logprobs are of the raw (temperature 1) distribution: rescale and renormalise
            ids = np.fromiter(d.keys(), np.int64, len(d))
            x = np.array([v.logprob for v in d.values()], np.float64) / temperature
            x = x - np.logaddexp.reduce(x)
            out["logprobs"].append(float(x[ids == t][0]))
            if top_k:
                order = np.argsort(-x, kind="stable")[:top_k]
                out["top_ids"].append(ids[order].tolist())
                out["top_logprobs"].append(x[order].tolist())
        else:
            out["logprobs"].append(float(d[t].logprob))
            if top_k:
                ranked = _ranked(d, top_k)
                out["top_ids"].append([a for a, _ in ranked])
                out["top_logprobs"].append([b for _, b in ranked])
    return out
