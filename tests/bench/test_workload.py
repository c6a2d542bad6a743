"""The rollout benches' shared workload (cisjax.bench.workload) and the benches' random model flags
(cisjax.bench.tiny_model), without engines."""

import argparse

import pytest

from cisjax.bench import harness, tiny_model, workload


def _args(**kw):
    base = dict(seed=0, prompts=5, prompt_len=8, n=2, max_new_tokens=3, temperature=0.7)
    return argparse.Namespace(**{**base, **kw})


def test_prompts_seeded_and_within_bounds():
    a = workload.prompts(_args(), vocab=50)
    assert a == workload.prompts(_args(), vocab=50)  # the seed decides
    assert a != workload.prompts(_args(seed=1), vocab=50)
    assert len(a) == 5 and all(4 <= len(p) <= 8 and all(0 <= t < 50 for t in p) for p in a)


def test_sampling_and_requests():
    params, warm = workload.sampling(_args())
    assert (params.n, params.max_new_tokens, params.temperature, params.seed) == (2, 3, 0.7, 0)
    assert (warm.n, warm.max_new_tokens) == (2, 2)  # the warm-up: at most 2 new tokens
    want = dict(prompts=2, samples=4, prompt_tokens=3, new_tokens=12)
    assert workload.requests(_args(), [[1, 2], [3]]) == {**want, "stop_token_ids": []}  # fixed lengths: no stops
    varied = _args(lengths="varied", vocab=100)
    stops = list(range(100 - tiny_model.STOP_TOKENS, 100))  # the vocabulary's last ids
    assert workload.requests(varied, [[1, 2], [3]]) == {**want, "stop_token_ids": stops}


def test_throughput_rows_against_a_baseline():
    times = harness.Timings(wall_s={"base": [2.0, 4.0, 2.0], "fast": [1.0, 1.0, 2.0]}, cpu_s={})
    names = {"base": "the baseline", "fast": "the candidate"}
    rows = workload.throughput_rows(times, names, {"base": 10, "fast": 10}, "base", paired_base=False)
    base, fast = rows
    assert base == dict(
        candidate="the baseline", key="base", median_s=2.0, min_s=2.0, tokens=10, tokens_per_s=5.0, ratio=1.0
    )
    assert fast["ratio"] == pytest.approx(2.0) and fast["tokens_per_s"] == 10.0
    assert fast["ratio_paired"] == pytest.approx(2.0)  # median of 2, 4, 1
    with_base = workload.throughput_rows(times, names, {"base": 10, "fast": 10}, "base", paired_base=True)
    assert with_base[0]["ratio_paired"] == 1.0


def test_same_samples_and_tokens():
    a = [[([1, 2], None), ([3], None)], [([4], None)]]
    b = [[([1, 2], None), ([5], None)], [([4], None)]]
    assert workload.same_samples(a, b) == dict(identical_samples=2, compared_samples=3)
    assert workload.tokens(a) == 4


def test_title():
    res = dict(
        model=dict(
            architectures=["Qwen2MoeForCausalLM"],
            hidden_size=64,
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            vocab_size=256,
        ),
        requests=dict(prompts=4),
        config=dict(dtype="float32", n=2, max_new_tokens=8),
    )
    assert workload.title(res) == (
        "random Qwen2MoeForCausalLM hidden 64, 2 layers, 4 experts top-2, vocab 256, float32; "
        "4 prompts x n=2 x 8 new tokens"
    )


def test_tiny_model_flags_and_config():
    p = argparse.ArgumentParser()
    tiny_model.add_args(p, tiny_model.Sizes(64, 2, 2, 1, 4, 2, 32, 64, 256))
    args = p.parse_args(["--experts", "8"])
    assert (args.hidden, args.layers, args.heads, args.kv_heads, args.experts, args.top_k) == (64, 2, 2, 1, 8, 2)
    assert (args.moe_intermediate, args.shared_intermediate, args.vocab) == (32, 64, 256)
    assert set(tiny_model.SIZE_FLAGS) <= set(vars(args))
    hf = tiny_model.hf_config(args, max_positions=128)
    assert hf["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (hf["num_experts"], hf["moe_intermediate_size"], hf["max_position_embeddings"]) == (8, 32, 128)
