"""The measure spec: engine pairs, the sides they need, and the checks made before anything starts."""

import json
from pathlib import Path

import pytest

from cisjax import errors
from cisjax.mismatch import spec as spec_lib
from cisjax.mismatch.spec import MeasureSpec


def _spec(tmp_path, **kw):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 97}))
    return MeasureSpec(out=tmp_path / "out", model=model, prompts=tmp_path / "p.jsonl", **kw)


def test_parse_pairs_keeps_order_and_drops_repeats():
    assert spec_lib.parse_pairs(" xla-vllm, vllm-transformers,xla-vllm ") == ("xla-vllm", "vllm-transformers")
    with pytest.raises(errors.UserError, match="unknown engine pair.*xla-sglang"):
        spec_lib.parse_pairs("xla-vllm,xla-sglang")
    with pytest.raises(errors.UserError, match="unknown engine pair"):
        spec_lib.parse_pairs(" , ")


def test_replay_adds_its_pair_and_the_sides_follow():
    s = MeasureSpec(
        out=Path("o"), model=Path("m"), prompts=Path("p"), pairs=("xla-vllm",), replay=True, dtype="float32"
    )
    assert s.measured_pairs == ("xla-vllm", "xla_replay-vllm")
    assert s.sides == {"xla", "vllm", "xla_replay"}
    named = MeasureSpec(out=Path("o"), model=Path("m"), prompts=Path("p"), pairs=("xla_replay-vllm",), replay=True)
    assert named.measured_pairs == ("xla_replay-vllm",)
    assert (s.xla_dtype("xla"), s.xla_dtype("xla_bf16"), s.xla_dtype("xla_fp32")) == ("float32", "bfloat16", "float32")
    assert s.xla_dtype("vllm") is None and s.xla_dtype("xla_replay") is None


def test_check_names_what_is_wrong(tmp_path):
    assert spec_lib.check(_spec(tmp_path)) == {"vocab_size": 97}
    with pytest.raises(FileNotFoundError, match="--model .*not a Hugging Face model directory"):
        spec_lib.check(MeasureSpec(out=tmp_path, model=tmp_path / "none", prompts=tmp_path))
    with pytest.raises(errors.UserError, match="--n and --max-new-tokens"):
        spec_lib.check(_spec(tmp_path, n=0))
    with pytest.raises(errors.UserError, match="--topk needs --probe-positions"):
        spec_lib.check(_spec(tmp_path, topk=5))
    with pytest.raises(errors.UserError, match="drop --server"):
        spec_lib.check(_spec(tmp_path, perturb="int8", server="localhost:1"))
