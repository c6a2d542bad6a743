"""What a decode step reads (cisjax.sampler.costs), by hand, and the rollout bench's phase figures from it."""

import pytest

from cisjax.bench.rollout import phase_figures
from cisjax.plan import hardware
from cisjax.sampler import costs


def test_decode_bytes_per_step_by_hand():
    """1,000 shared and 6,000 expert parameters (E = 60, k = 4) in bf16: 2 rows touch 8 experts, 2 x (1000 + 6000 x
    8 / 60) = 3,600 bytes, + 400 of KV cache; 16 rows (64 >= 60) read every expert."""
    args = dict(shared_params=1000, expert_params=6000, num_experts=60, top_k=4, kv_bytes=400)
    two = costs.decode_bytes_per_step(rows=2, **args)
    assert two == dict(experts_touched=8, param_bytes=3600.0, kv_bytes=400, bytes=4000.0)
    assert costs.decode_bytes_per_step(rows=16, **args)["bytes"] == 2 * 7000 + 400
    assert costs.roofline_fraction(4000, 2e-6, 4e9) == pytest.approx(0.5)  # 1 us of 2 at 4 GB/s


def test_phase_figures_roofline_where_the_bandwidth_is_listed():
    """Two reads of the JAX sampler's phases: 2 GB read in 1 s of decode is 2 GB/s; on an H200 (4.8 TB/s) that is
    2 / 4,800 of its roofline; a CPU lists no bandwidth: the fraction is omitted, with the reason."""
    zero = dict(prefill_tokens=0, prefill_s=0.0, decode_tokens=0, decode_steps=0, decode_rows=0, decode_row_steps=0)
    before = dict(zero, decode_s=1.0, decode_bytes=1e9)
    after = dict(
        zero,
        prefill_tokens=8,
        prefill_s=0.5,
        decode_tokens=64,
        decode_steps=16,
        decode_rows=8,
        decode_row_steps=128,
        decode_s=2.0,
        decode_bytes=3e9,
    )
    h200 = phase_figures(dict(before, device_kind="NVIDIA H200"), dict(after, device_kind="NVIDIA H200"))
    bw = hardware.device_bandwidth("NVIDIA H200")[0]
    assert h200["decode_bytes_per_s"] == pytest.approx(2e9) and h200["decode_roofline"] == pytest.approx(2e9 / bw)
    assert h200["decode_tokens_per_s"] == 64 and h200["decode_slot_use"] == 0.5 and h200["prefill_tokens_per_s"] == 16
    cpu = phase_figures(dict(before, device_kind="cpu"), dict(after, device_kind="cpu"))
    assert cpu["decode_roofline"] is None and "'cpu'" in cpu["decode_roofline_omitted"]
