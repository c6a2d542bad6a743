"""`cisjax bench rollout`'s JAX sampler figures from two reads of its phases (the bench itself:
tests/bench/test_serving_benches.py)."""

import pytest

from cisjax import cli
from cisjax.bench import rollout
from cisjax.plan import hardware


def test_phase_figures_by_hand():
    """Two reads of the JAX sampler's phases; the decode read 1 GB in its 0.5 s: 2 GB/s, on an H200 (4.8 TB/s) 2 / 4,800
    of its roofline; a CPU lists no bandwidth: the fraction omitted, with the reason."""
    before = dict(prefill_tokens=10, prefill_s=1.0, decode_tokens=100, decode_steps=8, decode_rows=16,
                  decode_row_steps=128, decode_s=2.0, decode_bytes=3e9)  # fmt: skip
    after = dict(prefill_tokens=50, prefill_s=1.5, decode_tokens=148, decode_steps=16, decode_rows=24,
                 decode_row_steps=192, decode_s=2.5, decode_bytes=4e9)  # fmt: skip
    on = lambda kind, d: dict(d, device_kind=kind)  # noqa: E731
    got = rollout.phase_figures(on("NVIDIA H200", before), on("NVIDIA H200", after))
    assert got["prefill_tokens_per_s"] == 80.0 and got["decode_tokens_per_s"] == 96.0
    assert got["decode_slot_use"] == 48 / 64  # 48 tokens over 8 rows x 8 steps
    assert got["decode_bytes_per_s"] == pytest.approx(2e9)
    assert got["decode_roofline"] == pytest.approx(2e9 / hardware.device_bandwidth("NVIDIA H200")[0])
    cpu = rollout.phase_figures(on("cpu", before), on("cpu", after))
    assert cpu["decode_roofline"] is None and "'cpu'" in cpu["decode_roofline_omitted"]
    assert rollout.phase_figures(on("cpu", after), on("cpu", after))["decode_tokens_per_s"] is None  # nothing ran


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--exact"], "give --jax with it"),
        (["--jax", "--exact", "--tls"], "not with --replicas or --tls"),
        (["--jax", "--exact", "--replicas", "2"], "not with --replicas or --tls"),
    ],
)
def test_exact_is_the_two_jax_samplers_alone(capsys, flags, error):
    assert cli.main(["bench", "rollout", *flags]) == 2
    assert error in capsys.readouterr().err
