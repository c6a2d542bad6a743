"""`cisjax mismatch measure --sampler jax --pairs xla-jax [--exact]` end to end on a tiny Qwen2-MoE (its JAX server a
child the command starts), in fp32 and bf16: with --exact every token's p equals its q (exact_frac 1), without it
the plain paths' do not all; what --exact refuses."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from cisjax import errors
from cisjax.commands import mismatch as command
from cisjax.mismatch import records, spec

N_PROMPTS, N, NEW = 3, 2, 12


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_hf_dir):
    """The tiny Qwen2-MoE and a jsonl of token-id prompts."""
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rng = np.random.default_rng(0)
    lines = [
        json.dumps({"prompt_ids": rng.integers(2, 90, int(rng.integers(3, 20))).tolist()}) for _ in range(N_PROMPTS)
    ]
    prompts.write_text("\n".join(lines) + "\n")
    return tiny_hf_dir("qwen2_moe"), prompts


def _args(model, out, *extra):
    p = argparse.ArgumentParser()
    command.add_args(p)
    model_dir, prompts = model
    argv = ["measure", "--out", str(out), "--model", str(model_dir), "--prompts", str(prompts)]
    argv += ["--sampler", "jax", "--pairs", "xla-jax", "--n", str(N), "--max-new-tokens", str(NEW), "--seed", "1"]
    return p.parse_args([*argv, "--no-progress", "--startup-s", "300", *extra])


@pytest.mark.slow  # a rollout server subprocess per case
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "plain"])
def test_exact_frac(model, tmp_path, capsys, dtype, exact):
    out = tmp_path / "out"
    flags = ["--dtype", dtype, "--engine-dtype", dtype] + (["--exact"] if exact else [])
    assert command.run(_args(model, out, *flags), []) == 0
    m = records.load(out / "xla-jax")
    logp, logq = m.tokens["logp"], m.tokens["logq"]
    assert N_PROMPTS * N < m.n_tokens <= N_PROMPTS * N * NEW
    frac = float(np.mean(logp == logq))
    assert m.meta["exact_frac"] == frac and m.meta["exact"] is exact
    assert m.meta["max_abs_log_k"] == float(np.max(np.abs(logp - logq)))
    assert f"exact_frac {frac}" in capsys.readouterr().out
    if exact:
        assert frac == 1.0 and m.meta["max_abs_log_k"] == 0.0
        assert m.meta["engines"]["jax"]["engine"] == "jax-exact" and "exact forward" in m.meta["side_p"]
    else:  # the plain sampler and the plain trainer forward: close, but not bit for bit everywhere
        assert frac < 1.0 and 0 < m.meta["max_abs_log_k"] < (1e-4 if dtype == "float32" else 0.2)


@pytest.mark.slow  # a rollout server subprocess
def test_exact_frac_of_truncated_sampling(model, tmp_path):
    """--top-k / --top-p with --exact: p renormalised over each token's support by the exact forward, still q bit for
    bit."""
    out = tmp_path / "out"
    assert command.run(_args(model, out, "--exact", "--top-k", "6", "--top-p", "0.9"), []) == 0
    m = records.load(out / "xla-jax")
    assert m.meta["top_k"] == 6 and m.meta["exact_frac"] == 1.0 and m.n_tokens > N_PROMPTS * N
    np.testing.assert_array_equal(m.tokens["logp"], m.tokens["logq"])


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(sampler="vllm"), "--sampler vllm"),
        (dict(pairs=("xla-jax", "xla-vllm")), "only xla-jax"),
        (dict(perturb="int8"), "--perturb int8"),
        (dict(topk=5, probe_positions=3), "--topk"),
        (dict(routing=True), "--routing"),
        (dict(engine_dtype="float32"), "--engine-dtype float32 with --dtype bfloat16"),
    ],
)
def test_exact_refuses_what_would_make_p_and_q_differ(model, tmp_path, changes, match):
    base = dict(out=tmp_path, model=Path(model[0]), prompts=model[1], pairs=("xla-jax",), sampler="jax", exact=True)
    with pytest.raises(errors.UserError, match=match):
        spec.check(spec.MeasureSpec(**{**base, **changes}))
    spec.check(spec.MeasureSpec(**{**base, "engine_dtype": "bfloat16"}))  # the defaults: accepted
