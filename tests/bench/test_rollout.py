"""`cisjax bench rollout`'s JAX sampler figures from two reads of its phases (the bench itself:
tests/bench/test_serving_benches.py)."""

from cisjax.bench import rollout


def test_phase_figures_by_hand():
    before = dict(prefill_tokens=10, prefill_s=1.0, decode_tokens=100, decode_steps=8, decode_rows=16,
                  decode_row_steps=128, decode_s=2.0)  # fmt: skip
    after = dict(prefill_tokens=50, prefill_s=1.5, decode_tokens=148, decode_steps=16, decode_rows=24,
                 decode_row_steps=192, decode_s=2.5)  # fmt: skip
    got = rollout.phase_figures(before, after)
    assert got["prefill_tokens_per_s"] == 80.0 and got["decode_tokens_per_s"] == 96.0
    assert got["decode_slot_use"] == 48 / 64  # 48 tokens over 8 rows x 8 steps
    assert rollout.phase_figures(after, after)["decode_tokens_per_s"] is None  # nothing ran between the reads
