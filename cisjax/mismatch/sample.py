"""Sampling on the inference engine (q of each token from the sampling step, paper C.5) and the probed positions."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cisjax import errors
from cisjax.rollout.client import RolloutClient
from cisjax.rollout.params import SamplingParams
from cisjax.rows import Seq


def flat_logprobs(per_seq, n_tokens: int, what: str) -> np.ndarray:
    """Per-sequence logprob lists -> one float64 array [N], checked to hold the N response tokens."""
    arr = np.concatenate([np.asarray(x, np.float64) for x in per_seq] or [np.zeros(0)])
    if arr.shape[0] != n_tokens:
        raise RuntimeError(f"{what}: {arr.shape[0]} logprobs for {n_tokens} response tokens")
    return arr


@dataclass(frozen=True, eq=False)
class Sampled:
    """The engine's samples, flattened to the response tokens [N] in sequence order."""

    samples: list  # client Samples, prompt by prompt
    items: list[Seq]  # (prompt ids, response ids) of each sample
    token_id_N: np.ndarray
    seq_id_N: np.ndarray  # the sample each token belongs to
    position_N: np.ndarray  # the token's index within its response
    logq_N: np.ndarray  # the engine's logprob of the token at the sampling step
    generate_s: float
    support: list | None = None  # truncated sampling: per sample, (kept ids, a count per token) (Sample.support)

    @property
    def n_tokens(self) -> int:
        return int(self.token_id_N.shape[0])


def sample(
    client: RolloutClient,
    prompts,
    *,
    n: int,
    max_new_tokens: int,
    stop_ids,
    seed: int,
    routing: bool,
    vocab_size: int,
    engine: str = "vllm",
    top_k: int = 0,
    top_p: float = 1.0,
) -> Sampled:
    """`n` samples per prompt at temperature 1 (with the engine's routing when `routing`) on `engine`; with `top_k` /
    `top_p`, truncated, and each token's sampling support returned."""
    truncated = top_k > 0 or top_p < 1.0
    params = SamplingParams(
        n=n,
        temperature=1.0,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids,
        seed=seed,
        return_routing=routing,
        return_sampling_mask=truncated,
    )
    t0 = time.monotonic()
    samples = [s for per_prompt in client.generate(prompts, params) for s in per_prompt]
    generate_s = time.monotonic() - t0
    items = [Seq(list(s.prompt_ids), list(s.response_ids)) for s in samples]
    lengths = np.asarray([len(it.response_ids) for it in items], np.int64)
    n_tokens = int(lengths.sum())
    if n_tokens == 0:
        raise RuntimeError("the engine sampled no response tokens")
    token_id = np.concatenate([np.asarray(it.response_ids, np.int64) for it in items])
    if token_id.max() >= vocab_size or token_id.min() < 0:
        raise errors.UserError(
            f"the server sampled token id {int(token_id.max())} outside --model's vocabulary [0, {vocab_size}): not the same model"
        )
    return Sampled(
        samples=samples,
        items=items,
        token_id_N=token_id,
        seq_id_N=np.repeat(np.arange(len(items)), lengths),
        position_N=np.concatenate([np.arange(k) for k in lengths]),
        logq_N=flat_logprobs([s.logprobs for s in samples], n_tokens, f"{engine} sampling"),
        generate_s=generate_s,
        support=[s.support for s in samples] if truncated else None,
    )


@dataclass(frozen=True, eq=False)
class Probes:
    """The probed positions: a seeded sample of T tokens whose top-K (and routing) each side reports. The top-K passes
    score each probed sequence up to its last probe."""

    index_T: np.ndarray  # token indices into [N], sorted (empty: no probes)
    routing_index: np.ndarray  # the tokens whose routing is stored: the probes, or every token without probes
    seqs: tuple[int, ...]  # the sequences holding a probe, sorted
    items: list[Seq]  # those sequences truncated after their last probe (with top-K only)
    seq_of_T: np.ndarray  # the probe's sequence
    position_of_T: np.ndarray  # the probe's position in its response

    @property
    def count(self) -> int:
        return int(self.index_T.shape[0])

    def topk_at(self, per_probe_seq) -> tuple[np.ndarray, np.ndarray]:
        """Top-K lists of the truncated probe sequences (one record per `items`) -> ids, logprobs [T, K]."""
        ids, lps = [], []
        where = {s: j for j, s in enumerate(self.seqs)}
        for s, pos in zip(self.seq_of_T, self.position_of_T):
            rec = per_probe_seq[where[int(s)]]
            ids.append(rec["topk_ids"][int(pos)])
            lps.append(rec["topk_logprobs"][int(pos)])
        return np.asarray(ids, np.int64).reshape(self.count, -1), np.asarray(lps, np.float32).reshape(self.count, -1)


def choose_probes(sampled: Sampled, positions: int, *, seed: int, topk: bool) -> Probes:
    """`positions` tokens drawn without replacement (seed `seed`); the truncated sequences only when `topk`."""
    rng = np.random.default_rng(seed)
    n_probe = min(positions, sampled.n_tokens)
    probes = np.sort(rng.choice(sampled.n_tokens, n_probe, replace=False)) if n_probe else np.zeros(0, np.int64)
    seq_of, position_of = sampled.seq_id_N[probes], sampled.position_N[probes]
    last_probe: dict[int, int] = {}
    for s, pos in zip(seq_of, position_of):
        last_probe[int(s)] = max(last_probe.get(int(s), 0), int(pos))
    seqs = tuple(sorted(last_probe))
    items = sampled.items
    truncated = [Seq(items[s].prompt_ids, items[s].response_ids[: last_probe[s] + 1]) for s in seqs] if topk else []
    return Probes(
        index_T=probes,
        routing_index=probes if n_probe else np.arange(sampled.n_tokens),
        seqs=seqs,
        items=truncated,
        seq_of_T=seq_of,
        position_of_T=position_of,
    )
