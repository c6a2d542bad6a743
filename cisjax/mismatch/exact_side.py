"""`cisjax mismatch measure --exact`'s trainer side: the exact forward's value (cisjax.exact_forward) of the sampled tokens."""

from __future__ import annotations

import functools
import time

import flax.nnx as nnx
import jax
import numpy as np

from cisjax import exact_forward, sharding
from cisjax.mismatch.sample import Sampled, flat_logprobs
from cisjax.mismatch.sides import Side
from cisjax.models import exact, hf_io

MASTER_DTYPE = "float32"  # the trainer's master weights, which `cisjax serve --exact` also loads
ROWS = 8  # sequences per call of the exact forward


def _rows(items, supports, t: int, s: int):
    """tokens, positions, targets [B, t] and the support ids [B, t, s] (-1 padded; None when s = 0) of `items`, each
    left-aligned in its row (slot = position, as the trainer's rows and the exact sampler's cache)."""
    b = len(items)
    tokens_BxT, targets_BxT = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    support_BxTxS = np.full((b, t, s), -1, np.int32) if s else None
    for i, it in enumerate(items):
        seq = list(it.prompt_ids) + list(it.response_ids)
        tokens_BxT[i, : len(seq)], targets_BxT[i, : len(seq) - 1] = seq, seq[1:]
        if s:
            ids, counts = supports[i]
            at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            for j, c in enumerate(counts):
                support_BxTxS[i, len(it.prompt_ids) - 1 + j, :c] = ids[at[j] : at[j + 1]]
    positions_BxT = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    return tokens_BxT, positions_BxT, targets_BxT, support_BxTxS


def exact_logprobs(model_dir, dtype: str, items, supports=None) -> tuple[list[np.ndarray], dict]:
    """Per item (rows.Seq), the exact forward's logprob (fp32) of each response token at temperature 1, on the model's
    fp32 weights computed in `dtype` (the trainer's value under rollout.exact; renormalised over each token's sampling
    support where `supports`, per item (ids, a count per token), cut it), on one device; and the load and score
    seconds."""
    t0 = time.monotonic()
    model, _, _ = hf_io.load(model_dir, dtype=dtype, param_dtype=MASTER_DTYPE)
    graphdef, params = nnx.split(model)
    load_s = time.monotonic() - t0
    mesh = sharding.make_mesh({}, devices=jax.devices()[:1])
    t = -(-max(len(it.prompt_ids) + len(it.response_ids) for it in items) // exact.BLOCK) * exact.BLOCK
    s = max((max(c, default=0) for _, c in supports), default=0) if supports is not None else 0
    fn = jax.jit(functools.partial(exact_forward.exact_value, graphdef, mesh, sharding.DEFAULT_TABLE, 1.0))
    out = []
    t0 = time.monotonic()
    for start in range(0, len(items), ROWS):
        part = list(items[start : start + ROWS])
        sup = None if not s else list(supports[start : start + ROWS])
        pad = ROWS - len(part)  # one program: the last call padded with copies of its first row
        tok, pos, tgt, support = _rows(part + part[:1] * pad, None if sup is None else sup + sup[:1] * pad, t, s)
        lp_BxT = np.asarray(fn(params, tok, pos, tgt, support))
        for i, it in enumerate(part):
            p = len(it.prompt_ids)
            out.append(lp_BxT[i, p - 1 : p - 1 + len(it.response_ids)])
    return out, {f"xla_exact_{dtype}_load_s": load_s, f"xla_exact_{dtype}_score_s": time.monotonic() - t0}


def exact_side(sampled: Sampled, model_dir, dtype: str) -> Side:
    """The XLA side of `--exact`: the exact forward's p of every sampled token (renormalised over its sampling support
    where the sampler truncated), to be equal bit for bit to the exact sampler's q."""
    lps, timings = exact_logprobs(model_dir, dtype, sampled.items, sampled.support)
    logp = flat_logprobs(lps, sampled.n_tokens, f"XLA exact {dtype}")
    return Side(logp, f"xla/{dtype} exact forward ({MASTER_DTYPE} weights)", timings=timings)
