"""The benches' synthetic train batch: random tokens in full rows, a quarter prompt and the rest response."""

from __future__ import annotations

import numpy as np

from cisjax.records import TrainBatch


def train_batch(micro_batches: int, rows: int, seq: int, vocab: int, seed: int = 0, *, logprobs: bool = False):
    """A host TrainBatch [micro_batches, rows, seq] of random tokens in `vocab`, no padding: the loss mask covers the
    response (from a quarter of the row to its last target), advantages +-1 per row. Old logprobs: zeros (the step's
    proximal rescoring fills them), or with `logprobs` p_prox ~ -Exp(2) and q near it (timing only: the step's
    weights need not agree with them)."""
    rng = np.random.default_rng(seed)
    shape = (micro_batches, rows, seq)
    tokens = rng.integers(0, vocab, shape).astype(np.int32)
    targets = np.concatenate([tokens[..., 1:], np.zeros((*shape[:2], 1), np.int32)], axis=-1)
    mask = np.zeros(shape, bool)
    mask[..., seq // 4 - 1 : seq - 1] = True
    adv = (np.where(rng.random((*shape[:2], 1)) < 0.5, 1.0, -1.0) * mask).astype(np.float32)
    infer = prox = np.zeros(shape, np.float32)
    if logprobs:
        prox = -rng.exponential(2.0, shape).astype(np.float32)
        infer = np.minimum(prox + 0.3 * rng.standard_normal(shape), 0.0).astype(np.float32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy()
    return TrainBatch(tokens, positions, np.ones(shape, np.int32), targets, mask, infer, prox, adv)
