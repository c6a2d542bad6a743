"""The measurement directory layout: round trip, validation errors that name the problem, finding pair directories."""

import numpy as np
import pytest

from cisjax.mismatch import records


def _m(n=5, t=2, k=3, layers=2):
    rng = np.random.default_rng(0)
    tokens = dict(
        logp=-rng.random(n).astype(np.float32),
        logq=-rng.random(n).astype(np.float32),
        seq_id=np.array([0, 0, 0, 1, 1][:n], np.int32),
        position=np.array([0, 1, 2, 0, 1][:n], np.int32),
        token_id=np.arange(n, dtype=np.int32),
    )
    topk = dict(
        token_index=np.array([0, 3]),
        ids_p=np.zeros((t, k), np.int32),
        logp_p=np.zeros((t, k), np.float32),
        ids_q=np.ones((t, k), np.int32),
        logp_q=np.zeros((t, k), np.float32),
    )
    routing = dict(
        token_index=np.array([1, 4]),
        experts_p=np.zeros((layers, t, 2), np.int32),
        experts_q=np.ones((layers, t, 2), np.int32),
    )
    return records.Measurement(
        meta={"pair": "xla-vllm", "side_p": "xla/float32", "side_q": "vllm/float32"},
        tokens=tokens,
        topk=topk,
        routing=routing,
    )


def test_round_trip(tmp_path):
    m = _m()
    records.save(tmp_path / "xla-vllm", m)
    back = records.load(tmp_path / "xla-vllm")
    assert back.meta == m.meta and back.n_tokens == 5
    for part in ("tokens", "topk", "routing"):
        for key, value in getattr(m, part).items():
            np.testing.assert_array_equal(getattr(back, part)[key], value)
    assert back.tokens["logp"].dtype == np.float32 and back.tokens["seq_id"].dtype == np.int32
    no_extras = records.Measurement(meta=m.meta, tokens=m.tokens)
    records.save(tmp_path / "plain", no_extras)
    assert records.load(tmp_path / "plain").topk is None and records.load(tmp_path / "plain").routing is None


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda m: m.meta.pop("side_q"), "lacks 'side_q'"),
        (lambda m: m.tokens.pop("token_id"), r"lacks \['token_id'\]"),
        (lambda m: m.tokens.update(logq=np.zeros(4, np.float32)), r"tokens.logq has shape \(4,\), expected \(5,\)"),
        (lambda m: m.tokens["logp"].__setitem__(2, 0.5), "tokens.logp has positive log-probabilities"),
        (lambda m: m.topk.update(token_index=np.array([0, 5])), r"topk.token_index out of range \[0, 5\)"),
        (
            lambda m: m.topk.update(ids_q=np.zeros((3, 3), np.int32)),
            r"topk.ids_q has shape \(3, 3\), expected \(2, K\)",
        ),
        (lambda m: m.routing.update(experts_q=np.zeros((3, 2, 2), np.int32)), "routing experts_p"),
    ],
)
def test_validation_names_the_problem(tmp_path, break_it, message):
    m = _m()
    break_it(m)
    with pytest.raises(ValueError, match=message):
        records.save(tmp_path / "bad", m)
    assert not (tmp_path / "bad" / "meta.json").exists()  # nothing half-valid written


def test_find_and_missing(tmp_path):
    records.save(tmp_path / "out" / "xla-vllm", _m())
    records.save(tmp_path / "out" / "xla-transformers", _m())
    (tmp_path / "out" / "notes").mkdir()
    assert [p.name for p in records.find([tmp_path / "out"])] == ["xla-transformers", "xla-vllm"]
    assert records.find([tmp_path / "out" / "xla-vllm"]) == [tmp_path / "out" / "xla-vllm"]
    with pytest.raises(FileNotFoundError, match="no mismatch measurement"):
        records.find([tmp_path / "nowhere"])
    with pytest.raises(FileNotFoundError, match="not a mismatch measurement"):
        records.load(tmp_path / "out" / "notes")
