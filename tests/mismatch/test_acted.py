"""Where each operator acts, from the training code path, against hand-counted tokens (the counts in comments)."""

import numpy as np
import pytest

from cisjax.mismatch import acted as A

# the operators' parameters the counts below assume (configs/base.py's today)
OPERATORS = dict(lam=2.3, kappa=5e-3, cap=2.0, threshold=2.0)

P_ACT = [0.5, 0.1, 0.999, 0.2, 0.05, 1.0]
K_ACT = [3.0, 0.25, 1.5, 1.0, 10.0, 1.0]  # the last token: p = q = 1


def _acted_inputs():
    logp = np.log(np.array(P_ACT))
    return logp, logp - np.log(np.array(K_ACT))


def test_acted_fractions_token_operators():
    # tis (k > 2): t0, t4. icepop (k outside [0.5, 5]): t1, t4. cis caps 2.15, 1.0115, 3.185: t0, t2, t4.
    # cis_two_sided adds t1 (lifted to (1 + 0.1) / 2 = 0.55). kpop_shipped: t5 (p = q = 1 -> NaN metric);
    # kpop-dagger keeps every token (largest binary KL 1.67 at t2). exact: no k beyond [1e-6, 1e6].
    want = dict(none=0, exact=0, tis=2, icepop=2, kpop=0, kpop_shipped=1, gspo=0, fp16=0, cis=3, cis_two_sided=4)
    for chunk in (4, 1 << 20):  # 4: two chunks, the second padded
        out = A.acted_fractions(*_acted_inputs(), chunk_tokens=chunk, **OPERATORS)
        assert set(out) == {"acted_frac"}
        assert out["acted_frac"] == pytest.approx({m: n / 6 for m, n in want.items()})


def test_acted_fractions_sequence_operators():
    lengths = np.array([1, 0, 1, 3, 1])  # responses {t0}, {}, {t1}, {t2, t3, t4}, {t5}
    out = A.acted_fractions(
        *_acted_inputs(),
        ["seq_tis", "seq_mis", "tis", "cis_two_sided", "kpop_shipped"],
        response_lengths=lengths,
        chunk_tokens=4,
        **OPERATORS,
    )
    # K per response: 3, 0.25, 1.5 * 1 * 10 = 15, 1. seq_tis (K > 2): {t0}, {t2..t4}; seq_mis (K outside [0.5, 2])
    # also rejects {t1}. The empty response counts in neither fraction.
    assert out["acted_frac"] == pytest.approx(
        dict(seq_tis=4 / 6, seq_mis=5 / 6, tis=2 / 6, cis_two_sided=4 / 6, kpop_shipped=1 / 6)
    )
    assert out["acted_seq_frac"] == pytest.approx(
        dict(seq_tis=0.5, seq_mis=0.75, tis=0.5, cis_two_sided=0.75, kpop_shipped=0.25)
    )


def test_acted_fractions_bad_inputs():
    logp, logq = _acted_inputs()
    with pytest.raises(ValueError, match="response_lengths"):
        A.acted_fractions(logp, logq, ["seq_tis"], **OPERATORS)
    with pytest.raises(ValueError, match="sum to"):
        A.acted_fractions(logp, logq, ["tis"], response_lengths=[2, 2], **OPERATORS)
    with pytest.raises(ValueError, match="unknown correction method"):
        A.acted_fractions(logp, logq, ["bogus"], **OPERATORS)
    with pytest.raises(ValueError, match="logp has 3 tokens but logq has 2"):
        A.acted_fractions(np.log([0.5, 0.5, 0.5]), np.log([0.5, 0.5]), **OPERATORS)
