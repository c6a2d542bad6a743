"""The report's analysis: the operators' defaults come from configs/base.py, read on use."""

from pathlib import Path

from cisjax import config
from cisjax.mismatch import analysis


def test_operator_defaults_are_the_base_configs():
    """configs/base.py is the one source of the operators' defaults; a report's spec takes them when not given."""
    c = config.load(None).correction
    assert tuple(analysis.operator_defaults()) == (c.lam, c.kappa, c.cap, c.threshold)
    spec = analysis.ReportSpec(out=Path("x"))
    assert (spec.lam, spec.kappa, spec.cap, spec.threshold) == (c.lam, c.kappa, c.cap, c.threshold)
    given = analysis.ReportSpec(out=Path("x"), lam=1.0, threshold=0.5)
    assert (given.lam, given.kappa, given.threshold) == (1.0, c.kappa, 0.5)
