"""The optimizer updates of one rollout batch: its mini-batches, their proximal logprobs, one step each."""

from __future__ import annotations

import jax
import numpy as np

from cisjax import distributed, forward, sharding
from cisjax.records import TrainBatch
from cisjax.rl import corrections


def split(host: TrainBatch, updates: int) -> list[TrainBatch]:
    """The host batch [U*M, B, T] of a rollout batch as its U mini-batches [M, B, T] (train.updates_per_batch = U,
    each of train.micro_batches = M micro-batches): mini-batch u holds micro-batches u*M .. (u+1)*M - 1."""
    total = host.tokens_MxBxT.shape[0]
    if updates < 1 or total % updates:
        raise ValueError(f"{total} micro-batches do not split into {updates} updates")
    m = total // updates
    return [TrainBatch(*(None if x is None else x[u * m : (u + 1) * m] for x in host)) for u in range(updates)]


def place(hosts: list[TrainBatch], run) -> list:
    """Each mini-batch on the run's mesh, where the step and the rescoring want it."""
    return [sharding.place(h, run.mesh, run.rules, sharding.BATCH_AXES) for h in hosts]


def rescore(run, params, batches: list):
    """(the mini-batches with p_prox of every token under `params`, the routing flips or None): the proximal
    rescoring of the whole rollout batch under the params before its first update (train.proximal=rescore)."""
    out, flips = [], []
    for batch in batches:
        if run.replay:
            prox, f = run.rescore(params, batch)
            flips.append(f)
        else:
            prox = run.rescore(params, batch)
        out.append(batch._replace(prox_logprobs_MxBxT=prox))
    jax.block_until_ready([b.prox_logprobs_MxBxT for b in out])
    return out, (flips or None)


def update(run, state, batches: list, flips):
    """(the state after one optimizer step per mini-batch, in order, the steps' metrics as floats combined over the
    rollout batch (combine), the mini-batches with p_prox, the routing flips or None). Under train.proximal=step (one
    mini-batch) p_prox and the flips are the step's own forward's."""
    metrics, out_batches = [], []
    for batch in batches:
        state, m, out = run.train_step.with_outputs(state, batch)
        if out.prox_logprobs_MxBxT is not None:
            batch = batch._replace(prox_logprobs_MxBxT=out.prox_logprobs_MxBxT)
            flips = None if out.flips is None else [out.flips]
        metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
        out_batches.append(batch)
    return state, combine(metrics), out_batches, flips


def combine(metrics: list[dict]) -> dict:
    """The metrics of a rollout batch's updates: one update's as they are; several combined as the step combines its
    micro-batches (corrections.combine_metrics: counts add up, "_max" keys by max, per-sequence means by sequences,
    the rest by tokens), except "skipped" (updates skipped: a sum) and "lr" (the last update's)."""
    if len(metrics) == 1:
        return metrics[0]
    out = {k: float(v) for k, v in corrections.combine_metrics(metrics).items()}
    out["skipped"] = float(sum(m["skipped"] for m in metrics))
    out["lr"] = metrics[-1]["lr"]
    return out


def host_prox(batches: list) -> np.ndarray:
    """p_prox of the whole rollout batch [U*M, B, T] on the host (collective when it spans processes)."""
    return np.concatenate([np.asarray(distributed.to_host(b.prox_logprobs_MxBxT)) for b in batches])


def host_flips(flips) -> forward.Flips | None:
    """The routing flips of the rollout batch's mini-batches as one, on the host (collective): layers [U*M, B, T],
    per_layer summed."""
    if flips is None:
        return None
    got = [forward.Flips(*map(distributed.to_host, f)) for f in flips]
    return forward.Flips(
        np.concatenate([np.asarray(f.layers_BxT) for f in got]), np.sum([np.asarray(f.per_layer_X) for f in got], 0)
    )
