"""Reusable parity checks against the transformers reference: jitted forward, logits/log-prob/routing comparison, packing layouts."""

from __future__ import annotations

import flax.nnx as nnx
import jax.numpy as jnp
import numpy as np

from tests.support.hf import hf_forward, log_softmax

LOGITS_TOL = 1e-4  # fp32 logits, max abs
LOGPROB_TOL = 1e-5  # fp32 per-token log-softmax, max abs


@nnx.jit
def forward(model, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    """(fp32 logits [B, L, V], expert ids [X, B, L, k] sorted along k, or None) — one compile per shape."""
    out = model(tokens_BxL, positions_BxL, segment_ids_BxL)
    ids = out.expert_ids_XxBxLxK
    return model.logits(out.hidden_BxLxD), (None if ids is None else jnp.sort(ids, axis=-1))


def run(model, tokens_BxL, positions_BxL=None, segment_ids_BxL=None) -> tuple[np.ndarray, np.ndarray | None]:
    """forward() on numpy inputs, numpy outputs."""
    as_jnp = lambda a: None if a is None else jnp.asarray(a, jnp.int32)  # noqa: E731
    logits, ids = forward(model, as_jnp(tokens_BxL), as_jnp(positions_BxL), as_jnp(segment_ids_BxL))
    return np.asarray(logits), (None if ids is None else np.asarray(ids))


def assert_matches_hf(
    model_dir: str, model, tokens_BxL: np.ndarray, *, logits_tol=LOGITS_TOL, logprob_tol=LOGPROB_TOL
) -> dict:
    """Our fp32 forward vs the torch fp32 reference on the same tokens: logits, log-softmax and the
    sorted routed expert ids of every MoE layer on every token. Returns the max errors."""
    ref_logits, ref_ids = hf_forward(model_dir, tokens_BxL)
    logits, ids = run(model, tokens_BxL)
    assert logits.shape == ref_logits.shape, (logits.shape, ref_logits.shape)
    errs = {
        "logits": float(np.abs(logits - ref_logits).max()),
        "logprobs": float(np.abs(log_softmax(logits) - log_softmax(ref_logits)).max()),
    }
    assert errs["logits"] <= logits_tol, errs
    assert errs["logprobs"] <= logprob_tol, errs
    assert_same_routing(ids, ref_ids)
    return errs


def assert_same_routing(ids, ref_ids, where: str = "") -> None:
    """Identical sorted expert ids per MoE layer and token (both None for a dense model)."""
    if ref_ids is None:
        assert ids is None, f"{where}: model returned routing but the reference has no MoE layer"
        return
    assert ids is not None and ids.shape == ref_ids.shape, (where, None if ids is None else ids.shape, ref_ids.shape)
    bad = np.argwhere((ids != ref_ids).any(-1))
    assert bad.size == 0, f"{where}: routing differs at (layer, row, token) {bad[:5].tolist()} of {len(bad)}"


# ----------------------------------------------------------------------------- packing


def pack(rows: list[list], length: int, pad_token: int | np.ndarray = 0):
    """Pack rows of items into [B, length] tokens, segment ids and positions.

    Each item is a token sequence (an int array: the next segment, ids 1, 2, ... per row, positions
    0..n-1) or an int n (n padding tokens: segment 0). Whatever is left at the end of a row is
    padding too. Padding tokens are `pad_token` (a scalar, or a [B, length] array to take them from).
    Returns (tokens, segment_ids, positions, spans) with spans[r] = [(segment, start, stop), ...].
    """
    b = len(rows)
    pad = np.broadcast_to(np.asarray(pad_token, np.int32), (b, length))
    tokens, seg, pos = pad.copy(), np.zeros((b, length), np.int32), np.zeros((b, length), np.int32)
    spans = []
    for r, items in enumerate(rows):
        at, s, row_spans = 0, 0, []
        for item in items:
            if isinstance(item, (int, np.integer)):
                pos[r, at : at + item] = np.arange(item)  # positions of padding are arbitrary
                at += item
                continue
            n = len(item)
            s += 1
            tokens[r, at : at + n], seg[r, at : at + n], pos[r, at : at + n] = item, s, np.arange(n)
            row_spans.append((s, at, at + n))
            at += n
        assert at <= length, f"row {r} needs {at} > {length} tokens"
        spans.append(row_spans)
    return tokens, seg, pos, spans
