"""What a decode step reads (cisjax.engines.jax.costs), by hand (the engine's sums: tests/engines/jax/test_engine.py)."""

import pytest

from cisjax.engines.jax import costs


def test_decode_bytes_per_step_by_hand():
    """1,000 shared and 6,000 expert parameters (E = 60, k = 4) in bf16: 2 rows touch 8 experts, 2 x (1000 + 6000 x
    8 / 60) = 3,600 bytes, + 400 of KV cache; 16 rows (64 >= 60) read every expert."""
    args = dict(shared_params=1000, expert_params=6000, num_experts=60, top_k=4, kv_bytes=400)
    two = costs.decode_bytes_per_step(rows=2, **args)
    assert two == dict(experts_touched=8, param_bytes=3600.0, kv_bytes=400, bytes=4000.0)
    assert costs.decode_bytes_per_step(rows=16, **args)["bytes"] == 2 * 7000 + 400
    assert costs.roofline_fraction(4000, 2e-6, 4e9) == pytest.approx(0.5)  # 1 us of 2 at 4 GB/s
