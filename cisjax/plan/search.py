"""The largest rows per micro-batch whose train step fits in HBM, found by compiling: a bracket narrowed by probes."""

from __future__ import annotations

from cisjax.plan import report


def search_rows(compile_at, *, start: int, step: int, usable: float, max_rows: int, log, known=None) -> dict:
    """The largest multiple of `step` rows whose train step fits, by compiling: grow or shrink from `start` by
    doubling until the fit flips, then narrow the bracket, probing where a straight line through the bracket's
    two measured totals meets the usable HBM (memory is close to affine in the rows) and halving otherwise."""
    tried: dict[int, dict] = {}

    def probe(r: int) -> bool:
        c = (known or {}).get(r) or compile_at(r)
        total = c.total()
        ok = bool(c.ok and total is not None and total <= usable)
        # a refusal's temporaries alone exceed the HBM: a lower bound of the total, good enough to aim the next probe
        tried[r] = dict(
            rows=r,
            fits=ok,
            total_bytes=total,
            memory=c.memory,
            compile_s=c.seconds,
            refused=not c.ok,
            oom_temporaries_bytes=c.oom_temporaries,
            estimate_bytes=total if total is not None else c.oom_temporaries,
        )
        log(f"  rows {r}: {report.fmt_compiled(c, usable)}")
        return ok

    log(f"searching the largest rows per micro-batch that fit (multiples of {step}) ...")
    lo, hi = 0, None  # lo: largest fitting rows known (0: none); hi: smallest non-fitting rows known
    r = max(step, start - start % step)
    while True:
        if probe(r):
            lo = max(lo, r)
        else:
            hi = r if hi is None else min(hi, r)
        if hi is not None and hi - lo <= step:
            break
        if hi is None:
            if r * 2 > max_rows:
                break
            r *= 2
        elif lo == 0:
            if r == step:
                break  # not even one shard's worth of rows fits
            r = max(step, (r // 2) // step * step)
        else:
            r = _interpolate(lo, hi, tried, usable, step)
    return dict(
        best_rows=lo,
        tried=[tried[k] for k in sorted(tried)],
        step=step,
        capped=hi is None,
        note="capped at --max-rows" if hi is None else "",
    )


def _interpolate(lo: int, hi: int, tried: dict, usable: float, step: int) -> int:
    mid = (lo + hi) // 2 // step * step
    m_lo, m_hi = tried[lo]["estimate_bytes"], tried[hi]["estimate_bytes"]
    guess = mid
    if m_lo is not None and m_hi is not None and m_hi > m_lo:
        guess = int(lo + (usable - m_lo) * (hi - lo) / (m_hi - m_lo)) // step * step
    if guess <= lo:  # the line puts the boundary within a step above lo: check that step
        guess = lo + step
    elif guess >= hi:
        guess = hi - step
    return guess if lo < guess < hi else (mid if lo < mid < hi else lo + step)
