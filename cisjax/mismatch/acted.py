"""Where each correction operator acts (paper tab:train_stats "Acted on"), from the training code path in JAX."""

from __future__ import annotations

import functools

import jax
import numpy as np

from cisjax.mismatch.arrays import checked_logprobs, fraction
from cisjax.rl import corrections

SEQ_METHODS = ("seq_tis", "seq_mis")


@functools.cache
def _acted_fn(method, lam, kappa, cap, low, high, threshold):
    """Jitted acted-on flags [1, C] of cisjax.rl.corrections.correction (the training code path itself)."""

    def acted(lp_1xC, lq_1xC, mask_1xC):
        return corrections.correction(
            method, lp_1xC, lq_1xC, mask_1xC, lam=lam, kappa=kappa, cap=cap, low=low, high=high, threshold=threshold
        ).acted_BxT

    return jax.jit(acted)


def acted_fractions(
    logp,
    logq,
    methods=None,
    *,
    response_lengths=None,
    lam,
    kappa,
    cap,
    threshold,
    low=None,
    high=None,
    chunk_tokens=1 << 20,
):
    """Fraction of tokens each operator acts on (tab:train_stats "Acted on", Appendix D.5), from the training code path:
    cisjax.rl.corrections.correction's acted flag (masks: masked; caps: weight != k; seq operators: every token of a
    capped / rejected response; none, gspo, fp16: never), with its fp32 arithmetic and sanitising.

    methods: default every token-level operator in corrections.METHODS, plus seq_tis / seq_mis when response_lengths
    (tokens per response, in order, summing to N) is given; the sequence operators need it. Returns
      acted_frac: {method: acted tokens / N}, and with response_lengths also
      acted_seq_frac: {method: responses (with >= 1 token) holding an acted-on token / such responses}.
    Token operators run on fixed [1, chunk_tokens] chunks (one compile per operator, bounded memory). For the
    sequence operators the per-response sum of the fp32 log k (non-finite -> 0) is formed here in float64 and handed
    to correction() as a one-token row, whose K = exp(clip(sum, -20, 20)) is then the operator's own.
    lam, kappa, cap, threshold, low, high (None: the method's default): as correction()."""
    lp, lq = checked_logprobs(logp, logq)
    n = lp.size
    lengths = None
    if response_lengths is not None:
        lengths = np.asarray(response_lengths)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths.size and lengths.min() < 0):
            raise ValueError("response_lengths must be a flat array of non-negative integers")
        if int(lengths.sum()) != n:
            raise ValueError(f"response_lengths sum to {int(lengths.sum())} but there are {n} tokens")
    if methods is None:
        methods = tuple(m for m in corrections.METHODS if lengths is not None or m not in SEQ_METHODS)
    kw = dict(
        lam=float(lam),
        kappa=float(kappa),
        cap=float(cap),
        low=None if low is None else float(low),
        high=None if high is None else float(high),
        threshold=float(threshold),
    )
    seq_id = None if lengths is None else np.repeat(np.arange(lengths.size), lengths)
    has_tokens = None if lengths is None else lengths > 0
    frac, seq_frac = {}, {}
    lp32, lq32 = lp.astype(np.float32), lq.astype(np.float32)
    for m in methods:
        if m in SEQ_METHODS:
            if lengths is None:
                raise ValueError(f"{m} is a sequence operator: pass response_lengths")
            with np.errstate(invalid="ignore"):
                logk32 = lp32 - lq32
            logk32[~np.isfinite(logk32)] = 0.0  # correction()'s sanitising
            sum_B = np.bincount(seq_id, weights=logk32, minlength=lengths.size).astype(np.float32)
            acted_B = np.asarray(
                _acted_fn(m, **kw)(sum_B[:, None], np.zeros_like(sum_B)[:, None], has_tokens[:, None])
            )[:, 0]
            frac[m] = fraction(int(lengths[acted_B].sum()), n)
            seq_frac[m] = fraction(int(acted_B.sum()), int(has_tokens.sum()))
            continue
        fn = _acted_fn(m, **kw)
        size = max(1, min(int(chunk_tokens), n))
        acted_N = np.zeros(n, bool)
        for start in range(0, n, size):
            stop = min(start + size, n)
            # the last chunk is padded (mask False, never acted on) to keep the one compiled shape
            lp_1xC, lq_1xC, mask_1xC = (
                np.zeros((1, size), np.float32),
                np.zeros((1, size), np.float32),
                np.zeros((1, size), bool),
            )
            lp_1xC[0, : stop - start], lq_1xC[0, : stop - start] = lp32[start:stop], lq32[start:stop]
            mask_1xC[0, : stop - start] = True
            acted_N[start:stop] = np.asarray(fn(lp_1xC, lq_1xC, mask_1xC))[0, : stop - start]
        frac[m] = fraction(int(acted_N.sum()), n)
        if lengths is not None:
            acted_B = np.bincount(seq_id, weights=acted_N, minlength=lengths.size) > 0
            seq_frac[m] = fraction(int(acted_B.sum()), int(has_tokens.sum()))
    out = dict(acted_frac=frac)
    if lengths is not None:
        out["acted_seq_frac"] = seq_frac
    return out
