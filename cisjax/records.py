"""Typed batches passed between stages (shape-suffixed fields; M micro-batches, B rows, T tokens)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class SamplingSupport(NamedTuple):
    """The sampling support of a sample's response tokens (what an engine's top-k / top-p kept at each step), in CSR
    form: token i's kept ids are ids[sum(counts[:i]) : sum(counts[:i + 1])]; a count of 0 means nothing was cut."""

    ids: np.ndarray  # int32 [sum(counts)]
    counts: np.ndarray  # int32 [response tokens]


class TrainBatch(NamedTuple):
    """One optimizer step's data: M micro-batches of B rows, one response per row.

    Position t of a row holds input token `tokens[t]` and predicts `targets[t]`; every per-token
    field below is aligned with the targets. Rows are left-aligned (prompt then response) and
    padded with segment id 0.
    """

    tokens_MxBxT: jax.Array  # int32 input ids (prompt + response, padded)
    positions_MxBxT: jax.Array  # int32 positions (0.. per sequence)
    segment_ids_MxBxT: jax.Array  # int32, 1 on the sequence, 0 on padding
    targets_MxBxT: jax.Array  # int32 next-token ids (any valid id where the mask is false)
    loss_mask_MxBxT: jax.Array  # bool, true where the target is a response token
    infer_logprobs_MxBxT: jax.Array  # fp32 q: logprob of the target at the rollout engine's sampling step
    prox_logprobs_MxBxT: jax.Array  # fp32 p: the trainer's logprob with the weights at the start of the step
    advantages_MxBxT: jax.Array  # fp32 advantage of the row's response, broadcast over its tokens
    # Routing replay (routing.replay = "rollout"): the rollout engine's expert ids of every input position and MoE
    # layer, uint8 (uint16 past 256 experts), prompt and response alike; None without replay.
    routing_MxBxTxXxK: jax.Array | None = None
    # Truncated sampling (rollout.top_p < 1 or rollout.top_k > 0): each target's sampling support, the token ids the
    # engine's top-k / top-p kept at that step, int32 padded with -1 (a row of -1: nothing truncated); p is then
    # renormalised over it (mask replay, cisjax.logprobs.token_logprobs' support). None: no truncation.
    support_MxBxTxS: jax.Array | None = None
