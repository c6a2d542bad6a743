"""The weight canary's pure parts (cisjax.train.canary) against hand-computed values."""

import math

import ml_dtypes
import numpy as np
import pytest

from cisjax.train import canary

# ----------------------------------------------------------------------------- sequences


def test_canary_sequences_deterministic_and_in_range():
    a = canary.canary_sequences(11, num=3, prompt_len=4, response_len=5, seed=7)
    b = canary.canary_sequences(11, num=3, prompt_len=4, response_len=5, seed=7)
    assert a == b
    assert len(a) == 3 and all(len(p) == 4 and len(r) == 5 for p, r in a)
    assert all(isinstance(t, int) and 0 <= t < 11 for p, r in a for t in p + r)
    assert canary.canary_sequences(11, num=3, prompt_len=4, response_len=5, seed=8) != a
    assert canary.canary_sequences(1, num=1, prompt_len=2, response_len=1, seed=0) == [([0, 0], [0])]


@pytest.mark.parametrize("field", ["vocab_size", "num", "prompt_len", "response_len"])
def test_canary_sequences_reject_bad_sizes(field):
    kw = dict(vocab_size=5, num=2, prompt_len=2, response_len=2)
    kw[field] = 0
    with pytest.raises(ValueError, match=field):
        canary.canary_sequences(kw.pop("vocab_size"), seed=0, **kw)


# ----------------------------------------------------------------------------- compare


def test_compare_hand_computed():
    # |Δ| = [0.5, 0, 0.25] -> mean 0.25, max 0.5 at sequence 0, token 0; per sequence [0.5, 0.25]
    r = canary.compare([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]], max_abs=1.0, mean_abs=0.3)
    assert r.ok and r.exceeded == ()
    assert (r.tokens, r.sequences) == (3, 2)
    assert r.mean_abs == 0.25 and r.max_abs == 0.5
    assert (r.worst_sequence, r.worst_position) == (0, 0)
    assert (r.trainer_at_worst, r.engine_at_worst) == (-1.0, -1.5)
    assert r.per_sequence_max == (0.5, 0.25)
    text = r.summary()
    assert (
        "ok" in text and "mean 2.500e-01" in text and "max 5.000e-01" in text and "sequence 0, response token 0" in text
    )


def test_compare_bounds_each_fail_and_name_themselves():
    t, e = [[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]]
    mean_fail = canary.compare(t, e, max_abs=1.0, mean_abs=0.2)
    assert not mean_fail.ok and mean_fail.exceeded == ("mean_abs",)
    max_fail = canary.compare(t, e, max_abs=0.4, mean_abs=1.0)
    assert not max_fail.ok and max_fail.exceeded == ("max_abs",)
    assert "FAILED (max_abs exceeded)" in max_fail.summary()
    # bounds are inclusive; inf = not checked
    assert canary.compare(t, e, max_abs=0.5, mean_abs=0.25).ok
    assert canary.compare(t, e, max_abs=math.inf, mean_abs=math.inf).ok
    assert "not checked" in canary.compare(t, e, max_abs=math.inf, mean_abs=0.3).summary()


def test_compare_worst_in_a_later_sequence():
    r = canary.compare([[0.0], [-1.0, -3.0, -2.0]], [[-0.125], [-1.0, -1.0, -2.5]], max_abs=10, mean_abs=10)
    # |Δ| = [0.125], [0, 2, 0.5] -> mean 2.625 / 4
    assert r.mean_abs == 2.625 / 4 and r.max_abs == 2.0
    assert (r.worst_sequence, r.worst_position, r.trainer_at_worst, r.engine_at_worst) == (1, 1, -3.0, -1.0)
    assert r.per_sequence_max == (0.125, 2.0)


def test_compare_non_finite():
    # equal -inf on both sides agree; a NaN or a one-sided -inf is an infinite difference
    assert canary.compare([[-math.inf, -1.0]], [[-math.inf, -1.0]], max_abs=0.0, mean_abs=0.0).ok
    nan = canary.compare([[-1.0, -2.0]], [[math.nan, -2.0]], max_abs=1.0, mean_abs=1.0)
    assert not nan.ok and nan.max_abs == math.inf and nan.worst_position == 0
    assert not canary.compare([[-1.0]], [[-math.inf]], max_abs=math.inf, mean_abs=1.0).ok


def test_compare_length_mismatches():
    with pytest.raises(ValueError, match="2 trainer sequences but 1 engine"):
        canary.compare([[-1.0], [-1.0]], [[-1.0]], max_abs=1, mean_abs=1)
    with pytest.raises(ValueError, match="sequence 1 has 2 trainer logprobs but 1 engine"):
        canary.compare([[-1.0], [-1.0, -2.0]], [[-1.0], [-1.0]], max_abs=1, mean_abs=1)
    with pytest.raises(ValueError, match="no response tokens"):
        canary.compare([[]], [[]], max_abs=1, mean_abs=1)
    with pytest.raises(ValueError, match="mean_abs"):
        canary.compare([[-1.0]], [[-1.0]], max_abs=1, mean_abs=-1)
    with pytest.raises(ValueError, match="max_abs"):
        canary.compare([[-1.0]], [[-1.0]], max_abs=math.nan, mean_abs=1)


# ----------------------------------------------------------------------------- families


@pytest.mark.parametrize(
    "name, want",
    [
        ("model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.*.mlp.experts.*.down_proj.weight"),
        ("model.layers.12.self_attn.q_proj.bias", "model.layers.*.self_attn.q_proj.bias"),
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.*.mlp.shared_expert.gate_proj.weight"),
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("model.layers.1.mlp.experts.0", "model.layers.*.mlp.experts.*"),
        ("model.layers.1x.q_proj.weight", "model.layers.1x.q_proj.weight"),  # only whole numeric components
    ],
)
def test_family(name, want):
    assert canary.family(name) == want


def test_family_differences_hand_computed():
    expected = {
        "model.layers.0.mlp.experts.0.down_proj.weight": np.array([[3.0, 4.0]]),  # ||.||^2 = 25
        "model.layers.0.mlp.experts.1.down_proj.weight": np.array([[0.0, 0.0]]),
        "model.layers.1.mlp.experts.0.down_proj.weight": np.array([[0.0, 0.0]]),
        "model.layers.0.input_layernorm.weight": np.array([1.0, 1.0, 1.0, 1.0]),  # ||.||^2 = 4
        "model.layers.1.input_layernorm.weight": np.array([1.0, 1.0, 1.0, 1.0]),  # ||.||^2 = 4
        "model.embed_tokens.weight": np.array([[1.0, 2.0]]),
        "model.norm.weight": np.array([1.0, 1.0]),
        "lm_head.weight": np.array([[1.0, 2.0]]),
    }
    actual = dict(expected)
    actual["model.layers.0.mlp.experts.1.down_proj.weight"] = np.array([[0.0, 5.0]])  # diff^2 = 25 -> relative 1, max 5
    actual["model.layers.1.input_layernorm.weight"] = np.array(
        [1.0, 1.0, 1.0, 1.5]
    )  # diff^2 = 0.25 / 8 -> relative 0.25 / sqrt(2)
    del actual["model.norm.weight"]
    actual["lm_head.weight"] = np.array([[1.0], [2.0]])
    actual["model.layers.0.extra.weight"] = np.array([1.0])

    diffs = canary.family_differences(expected, actual)
    by = {d.family: d for d in diffs}
    experts = by["model.layers.*.mlp.experts.*.down_proj.weight"]
    assert (experts.max_abs, experts.relative, experts.tensors) == (5.0, 1.0, 3)
    assert experts.worst == "model.layers.0.mlp.experts.1.down_proj.weight" and experts.note == ""
    norm = by["model.layers.*.input_layernorm.weight"]
    assert norm.max_abs == 0.5 and norm.relative == pytest.approx(0.5 / math.sqrt(8), rel=1e-12) and norm.tensors == 2
    assert norm.worst == "model.layers.1.input_layernorm.weight"
    assert by["model.embed_tokens.weight"][1:4] == (0.0, 0.0, 1) and by["model.embed_tokens.weight"].worst == ""
    assert (
        by["model.norm.weight"].note == "1 missing (e.g. model.norm.weight)"
        and by["model.norm.weight"].max_abs == math.inf
    )
    assert by["lm_head.weight"].note == "shape (2, 1) != (1, 2) in lm_head.weight"
    assert by["model.layers.*.extra.weight"].note == "1 extra (e.g. model.layers.0.extra.weight)"
    assert by["model.layers.*.extra.weight"].tensors == 1
    # order: structural problems first (by family name), then by relative difference
    assert [d.family for d in diffs] == [
        "lm_head.weight",
        "model.layers.*.extra.weight",
        "model.norm.weight",
        "model.layers.*.mlp.experts.*.down_proj.weight",
        "model.layers.*.input_layernorm.weight",
        "model.embed_tokens.weight",
    ]
    text = canary.format_differences(diffs, top=4)
    assert "1 missing" in text and "relative 1.000e+00, max |diff| 5.000e+00" in text and "and 1 more" in text
    assert "embed_tokens" not in text  # identical families are not listed


def test_family_differences_bf16_nan_and_identical():
    bf16 = np.dtype(ml_dtypes.bfloat16)
    e = {"a.weight": np.array([1.0, 2.0], bf16), "b.weight": np.array([np.inf, 1.0], np.float32)}
    same = canary.family_differences(e, {k: v.copy() for k, v in e.items()})
    assert all(d.max_abs == 0 and d.relative == 0 for d in same)
    assert canary.format_differences(same) == "  all 2 tensor families identical"
    # 1.0 -> 1.0078125 (the next bfloat16 above 1): |diff| 2^-7
    off = canary.family_differences(
        e, {"a.weight": np.array([1.0078125, 2.0], bf16), "b.weight": np.array([np.inf, np.nan], np.float32)}
    )
    assert off[0].family == "b.weight" and off[0].max_abs == math.inf
    assert (
        off[1].family == "a.weight"
        and off[1].max_abs == 2.0**-7
        and off[1].relative == pytest.approx(2.0**-7 / math.sqrt(5))
    )


def test_family_differences_iterates_expected_once():
    calls = []

    class Lazy(dict):
        def items(self):
            calls.append(1)
            return iter(list(super().items()))

    canary.family_differences(Lazy({"x": np.zeros(1)}), {"x": np.zeros(1)})
    assert calls == [1]
