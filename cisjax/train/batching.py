"""Rollout groups -> one optimizer step's TrainBatch (host numpy): rows, masks, q, GRPO advantages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cisjax import errors
from cisjax import rows as rows_lib
from cisjax.models.padding import round_up
from cisjax.records import SamplingSupport, TrainBatch
from cisjax.rl import advantages as adv_lib
from cisjax.rl.advantages import AdvantageSpec


@dataclass(frozen=True)
class Rollout:
    """One sampled response and its reward (built once both are known: train.rollouts.Sampler.reward)."""

    prompt_ids: list
    response_ids: list
    logprobs: list  # log q of each response token, from the engine's sampling step
    versions: list  # policy version that produced each token
    reward: float
    finish_reason: str = "length"
    problem_id: str = ""
    # the engine's routed expert ids of every input position (prompt, then response): [P + R - 1, layers, k], or None
    routing: np.ndarray | None = None
    # truncated sampling: each response token's sampling support (the ids top-k / top-p kept), or None
    support: SamplingSupport | None = None


def build_batch(
    groups: list[list[Rollout]],
    *,
    micro_batches: int,
    rows_multiple: int,
    length_multiple: int = 64,
    advantages: AdvantageSpec | None = None,
    max_length: int = 0,
    replay: bool = False,
) -> tuple[TrainBatch, dict]:
    """A TrainBatch [M, B, T] of numpy arrays with `prox_logprobs` zero (filled by the proximal rescoring).

    One response per row (prompt then response, left-aligned); row r of the batch is group r // N,
    sample r % N. Rows are padded with empty rows (mask false) to M * B with B a multiple of
    `rows_multiple` (the mesh's batch axes); T is the longest sequence - 1 rounded up to
    `length_multiple` (few distinct shapes, few recompiles). Advantages follow the recipe
    (cisjax.rl.advantages.compute_advantages with `advantages`, default its defaults) over the real rows only.
    replay: also the rollouts' routing (routing_MxBxTxXxK); a rollout without it is an error naming it.

    Rollouts with a sampling support (all or none of them) give support_MxBxTxS: each response token's kept ids at
    the position that predicts it, -1 elsewhere, S the largest support rounded up to a power of two (at least 8).

    Returns (batch, info) with info: rows (real), tokens (response tokens), length T, `index` [(group, sample)] of
    each real row in order, and `versions` [M * B, T] the policy version that sampled each response token (-1
    elsewhere; the token dumps' staleness)."""
    if not groups or any(not g for g in groups):
        raise ValueError("build_batch needs at least one group, each with at least one rollout")
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"every group needs the same number of samples; got {sorted({len(g) for g in groups})}")
    for g in groups:
        for r in g:
            if not r.prompt_ids:
                raise ValueError("a rollout has an empty prompt")
            if not len(r.logprobs) == len(r.versions) == len(r.response_ids):
                raise ValueError(
                    f"a rollout has {len(r.response_ids)} response tokens but {len(r.logprobs)} logprobs and "
                    f"{len(r.versions)} versions"
                )
    rows = [r for g in groups for r in g]
    longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rows) - 1
    t = round_up(max(longest, 1), length_multiple)
    if max_length and t > max_length:
        raise errors.UserError(f"a sequence needs {longest} positions, above the configured maximum {max_length}")
    if micro_batches < 1 or rows_multiple < 1:
        raise errors.UserError(f"micro_batches ({micro_batches}) and rows_multiple ({rows_multiple}) must be >= 1")
    b = round_up(-(-len(rows) // micro_batches), rows_multiple)
    total = micro_batches * b

    if replay:
        _check_routing(rows)
    built = rows_lib.build(
        [rows_lib.Seq(r.prompt_ids, r.response_ids, r.routing if replay else None) for r in rows],
        rows_lib.one_per_row(len(rows)),
        t,
        rows=total,
    )
    mask = built.response_RxT
    infer = np.zeros((total, t), np.float32)
    versions = np.full((total, t), -1, np.int64)
    for i, r in enumerate(rows):
        infer[i, mask[i]] = r.logprobs  # q of the response tokens, at the positions that predict them
        versions[i, mask[i]] = r.versions  # the policy version that sampled each

    adv_RxT = _advantages(groups, mask, advantages)
    support_RxTxS = _support(rows, total, t)

    shape = (micro_batches, b, t)
    routing = built.routing_RxTxXxK.reshape(*shape, *built.routing_RxTxXxK.shape[2:]) if replay else None
    batch = TrainBatch(
        tokens_MxBxT=built.tokens_RxT.reshape(shape),
        positions_MxBxT=built.positions_RxT.reshape(shape),
        segment_ids_MxBxT=built.segments_RxT.reshape(shape),
        targets_MxBxT=built.targets_RxT.reshape(shape),
        loss_mask_MxBxT=mask.reshape(shape),
        infer_logprobs_MxBxT=infer.reshape(shape),
        prox_logprobs_MxBxT=np.zeros(shape, np.float32),
        advantages_MxBxT=adv_RxT.reshape(shape),
        routing_MxBxTxXxK=routing,
        support_MxBxTxS=None if support_RxTxS is None else support_RxTxS.reshape(*shape, -1),
    )
    info = dict(
        rows=len(rows),
        tokens=int(mask.sum()),
        length=t,
        index=[(gi, si) for gi in range(len(groups)) for si in range(n)],
        versions=versions,
    )
    return batch, info


def _support(rows: list[Rollout], total: int, t: int) -> np.ndarray | None:
    """The rows' sampling supports as [total, T, S] ids (-1 padded), token i of a response at position P - 1 + i;
    None when no rollout has one."""
    have = [r.support is not None for r in rows]
    if not any(have):
        return None
    if not all(have):
        raise errors.UserError(
            f"{have.count(False)} of {len(rows)} rollouts came without their sampling support while the others have "
            "one: every sample of a truncated (top-k / top-p) rollout batch needs it"
        )
    for i, r in enumerate(rows):
        counts = np.asarray(r.support.counts)
        if len(counts) != len(r.response_ids) or int(counts.sum()) != len(r.support.ids) or np.any(counts < 0):
            raise errors.UserError(
                f"rollout {i} (problem {r.problem_id!r}): a sampling support of {len(counts)} counts summing to "
                f"{int(counts.sum())} for {len(r.response_ids)} response tokens and {len(r.support.ids)} ids"
            )
    widest = max(int(np.max(r.support.counts, initial=0)) for r in rows)
    s = max(8, 1 << (widest - 1).bit_length())
    out = np.full((total, t, s), -1, np.int32)
    for i, r in enumerate(rows):  # CSR -> (token, slot) of every id at once: no loop over the tokens
        counts = np.asarray(r.support.counts, np.int64)
        token = np.repeat(np.arange(len(counts)), counts)
        slot = np.arange(len(token)) - np.repeat(np.cumsum(counts) - counts, counts)
        out[i, len(r.prompt_ids) - 1 + token, slot] = np.asarray(r.support.ids, np.int32)
    return out


def _advantages(groups, mask_RxT, spec: AdvantageSpec | None):
    """Advantages [R, T] of every row: those of the real rows (groups laid out [G, N, T]), 0 on the padding rows."""
    g, n, t = len(groups), len(groups[0]), mask_RxT.shape[1]
    kw = {} if spec is None else spec.kwargs()
    rewards_GxN = np.asarray([[r.reward for r in grp] for grp in groups], np.float32)
    adv_GxNxT = np.asarray(adv_lib.compute_advantages(rewards_GxN, mask_RxT[: g * n].reshape(g, n, t), **kw))
    out = np.zeros(mask_RxT.shape, np.float32)
    out[: g * n] = adv_GxNxT.reshape(g * n, t)
    return out


def _check_routing(rows: list[Rollout]) -> None:
    """Routing replay needs every rollout's routing, one row per input position: errors name the rollout."""
    for i, r in enumerate(rows):
        need = len(r.prompt_ids) + len(r.response_ids) - 1
        if r.routing is None:
            raise errors.UserError(
                f"routing.replay is on but rollout {i} (problem {r.problem_id!r}) came without the engine's routing"
            )
        if r.routing.ndim != 3 or r.routing.shape[0] != need:
            raise errors.UserError(
                f"rollout {i} (problem {r.problem_id!r}): routing {r.routing.shape} for {need} input positions"
            )
    layers_k = {r.routing.shape[1:] for r in rows}
    if len(layers_k) != 1:
        raise errors.UserError(f"rollouts disagree on (MoE layers, k) of their routing: {sorted(layers_k)}")
