"""One measurement per pair from two sides: the meta fields, the token arrays, top-K and routing."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cisjax.mismatch import records, write
from cisjax.mismatch import sample as sample_lib
from cisjax.mismatch.scoring import XlaScores
from cisjax.mismatch.sides import Side
from cisjax.mismatch.spec import MeasureSpec
from cisjax.rows import Seq


def _run(topk=2, routing=True):
    n = 4
    sampled = sample_lib.Sampled(
        samples=[SimpleNamespace(finish_reason="stop"), SimpleNamespace(finish_reason="length")],
        items=[Seq([1, 2], [3, 4]), Seq([1], [5, 6])],
        token_id_N=np.array([3, 4, 5, 6]),
        seq_id_N=np.array([0, 0, 1, 1]),
        position_N=np.array([0, 1, 0, 1]),
        logq_N=np.log(np.full(n, 0.5)),
        generate_s=1.0,
    )
    probes = sample_lib.Probes(
        index_T=np.array([1, 2]),
        routing_index=np.array([1, 2]),
        seqs=(0, 1),
        items=[],
        seq_of_T=np.array([0, 1]),
        position_of_T=np.array([1, 0]),
    )
    spec = MeasureSpec(
        out=Path("out"), model=Path("m"), prompts=Path("p.jsonl"), n=1, topk=topk, probe_positions=2, routing=routing
    )
    experts = np.array([[[0, 1], [2, 3]]], np.int16)  # [L=1, T=2, k=2]
    p = Side(
        np.array([np.log(0.5), np.log(0.25), 1e-7, np.log(0.5)]),
        "xla/float32",
        topk=(np.zeros((2, topk), np.int64), np.zeros((2, topk), np.float32)),
        routing_LxTxK=experts,
        control_dtype="float32",
        control=0.0,
    )
    q = Side(sampled.logq_N, "vllm/float32 (sampling)", topk=p.topk, routing_LxTxK=experts[:, :, ::-1])
    return sampled, probes, spec, p, q


def test_pair_measurement_fields():
    sampled, probes, spec, p, q = _run()
    m = write.pair_measurement("xla-vllm", p, q, {"model": "m"}, sampled, probes, spec)
    m.validate()
    assert m.meta["pair"] == "xla-vllm" and m.meta["side_p"] == "xla/float32" and m.meta["model"] == "m"
    np.testing.assert_array_equal(m.tokens["logp"][2], 0.0)  # rounding above 0 clipped: a probability is <= 1
    assert m.meta["mean_k"] == pytest.approx((1 + 0.5 + 2 + 1) / 4)
    assert m.meta["max_abs_log_k"] == pytest.approx(np.log(2))
    assert m.meta["control_rescore_max_abs_diff"] == 0.0 and m.meta["control_rescore_dtype"] == "float32"
    assert "routing_replay" not in m.meta and m.meta["routing_agreement"] == 1.0  # the same sets, other order
    np.testing.assert_array_equal(m.topk["token_index"], [1, 2])
    np.testing.assert_array_equal(m.routing["experts_p"], p.routing_LxTxK)
    replay = Side(p.logp_N, "xla/float32 + vLLM routing replayed", router_flip_frac=0.25)
    sampled, probes, spec, _, q = _run(topk=0, routing=False)
    m = write.pair_measurement("xla_replay-vllm", replay, q, {}, sampled, probes, spec)
    assert m.meta["routing_replay"] is True and m.meta["router_flip_frac"] == 0.25
    assert m.meta["control_rescore_max_abs_diff"] is None and "control_rescore_dtype" not in m.meta
    assert m.topk is None and m.routing is None


def test_run_meta(tmp_path):
    sampled, probes, spec, p, q = _run()
    xla = XlaScores("float32", [], None, load_s=1.0, score_s=(4.0, 2.0), devices=1, control_max_abs_diff=0.0)
    meta = write.run_meta(
        spec,
        {"vocab_size": 97, "architectures": ["Qwen2MoeForCausalLM"]},
        2,
        sampled,
        probes,
        engines={"vllm": {"dtype": "float32"}},
        timings={"generate_s": 1.23456, **xla.timings},
        perturbed=None,
        xla=[xla],
    )
    assert meta["tokens"] == 4 and meta["sequences"] == 2 and meta["prompts"] == 2 and meta["probe_positions"] == 2
    assert meta["finish_reasons"] == {"stop": 1, "length": 1} and meta["engine_dtypes"] == {"vllm": "float32"}
    assert meta["timings"] == {
        "generate_s": 1.235,
        "xla_float32_load_s": 1.0,
        "xla_float32_score_s": 4.0,
        "xla_float32_rescore_s": 2.0,
    }
    assert meta["xla_float32_rescore_tokens_per_s"] == 2.0  # 4 response tokens in the last pass's 2 s
    assert meta["xla_float32_rescore_all_tokens_per_s"] == 3.5  # 7 prompt + response tokens
    assert meta["architecture"] == "Qwen2MoeForCausalLM" and meta["probe_seed"] == spec.seed + 1
    m = write.pair_measurement("xla-vllm", p, q, meta, sampled, probes, spec)
    assert records.load(records.save(tmp_path / "xla-vllm", m)).meta["tokens"] == 4
