"""The JAX sampler end to end on tiny random models of every family (fp32, CPU): greedy output equal to the
transformers reference backend's, seeded samples independent of the batch, logprobs equal to a rescoring, stop
tokens, routing, and the programs compiled per bucket."""

import dataclasses

import flax.nnx as nnx
import numpy as np
import pytest

from cisjax.engines import transformers_backend
from cisjax.engines.jax.engine import Engine, Request, bucket
from cisjax.models import hf_io
from tests.models import parity
from tests.support.engines import engine_params
from tests.support.hf import TINY_FAMILIES, log_softmax

GREEDY = engine_params(seed=0, greedy=True, return_routing=True)
PROMPTS = [[5, 17, 3, 88, 41, 2, 9], [60, 7, 33]]


@pytest.fixture(scope="module")
def loaded(tiny_hf_dir):
    cache = {}

    def get(family):
        if family not in cache:
            model_dir = tiny_hf_dir(family)
            model = hf_io.load(model_dir)[0]
            cache[family] = (model_dir, model, Engine(*nnx.split(model), max_len=64))
        return cache[family]

    return get


def test_bucket():
    assert [bucket(n, 16) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_greedy_equals_the_reference_backend(loaded, family):
    model_dir, _, engine = loaded(family)
    ref = transformers_backend.Backend(model_dir, dtype="float32")
    params = dataclasses.replace(GREEDY, return_routing=ref.supports_routing)  # a dense model has none to return
    got = engine.generate(PROMPTS, [0, 1], params)
    for r, prompt in enumerate(PROMPTS):
        (want,) = ref.generate(prompt, r, params)
        (ours,) = got[r]
        assert ours.token_ids == want.token_ids, (r, ours.token_ids, want.token_ids)
        np.testing.assert_allclose(ours.logprobs, want.logprobs, atol=1e-4, rtol=0)
        assert ours.finish_reason == "length" and len(ours.token_ids) == GREEDY.max_new_tokens
        if want.routing is None:
            assert ours.routing is None
        else:
            np.testing.assert_array_equal(np.sort(ours.routing, -1), np.sort(want.routing, -1))
            np.testing.assert_array_equal(np.sort(ours.prompt_routing, -1), np.sort(want.prompt_routing, -1))


def test_seeded_samples_do_not_depend_on_the_batch_and_logprobs_equal_a_rescoring(loaded):
    _, model, engine = loaded("qwen2_moe")
    params = dataclasses.replace(GREEDY, greedy=False, n=3, seed=11, return_routing=False)
    alone = engine.generate([PROMPTS[1]], [7], params)[0]
    beside = engine.generate([PROMPTS[0], PROMPTS[1]], [3, 7], params)[1]
    assert [s.token_ids for s in alone] == [s.token_ids for s in beside]
    assert len({tuple(s.token_ids) for s in alone}) > 1  # the n samples differ from one another
    other_seed = engine.generate([PROMPTS[1]], [7], dataclasses.replace(params, seed=12))[0]
    assert [s.token_ids for s in other_seed] != [s.token_ids for s in alone]
    for s in alone:  # temperature 1, no truncation: the model's own log-probabilities of the tokens
        seq = np.array([PROMPTS[1] + s.token_ids])
        logits = parity.run(model, seq)[0][0, len(PROMPTS[1]) - 1 : -1]
        want = log_softmax(logits)[np.arange(len(s.token_ids)), s.token_ids]
        np.testing.assert_allclose(s.logprobs, want, atol=1e-4, rtol=0)


def test_a_stop_token_ends_the_sample_with_its_logprob(loaded):
    _, _, engine = loaded("qwen2")
    (full,) = engine.generate([PROMPTS[0]], [0], GREEDY)[0]
    stop = full.token_ids[2]
    first = full.token_ids.index(stop)
    (cut,) = engine.generate([PROMPTS[0]], [0], dataclasses.replace(GREEDY, stop_token_ids=frozenset({stop})))[0]
    assert cut.token_ids == full.token_ids[: first + 1] and cut.finish_reason == "stop"
    np.testing.assert_allclose(cut.logprobs, full.logprobs[: first + 1], atol=1e-6)


def test_top_logprobs_and_programs_per_bucket(loaded):
    _, _, engine = loaded("qwen3_moe")
    before = engine.compiled
    params = dataclasses.replace(GREEDY, logprobs=3, max_new_tokens=5)
    a = engine.generate([[1, 2, 3]], [0], params)[0][0]
    assert engine.compiled == before + 4  # prefill, the empty rows, the samples' entering, the decode
    engine.generate([[4, 5, 6, 7, 8, 9]], [1], dataclasses.replace(params, max_new_tokens=9))  # same buckets
    assert engine.compiled == before + 4
    assert len(a.top_ids) == 5 and all(len(t) == 3 for t in a.top_ids)
    assert [t[0] for t in a.top_ids] == a.token_ids  # greedy: the best token is the one taken
    np.testing.assert_allclose([v[0] for v in a.top_logprobs], a.logprobs, atol=1e-6)


def test_phases_count_prefill_and_decode_apart_but_not_a_compile(loaded):
    """Engine.phases: a bucket's first call (its compile) adds nothing; a second call adds its prompt tokens, its
    generated tokens (a stop token ends one sample early), the rows decoded (the batch bucket times n), the decode
    loop's steps (whole STOP_EVERY groups, up to the longest row) and time for each program."""
    _, _, engine = loaded("qwen2_moe")
    params = dataclasses.replace(GREEDY, n=2, max_new_tokens=7, return_routing=False)
    prompts = [[11, 12, 13, 14], [21, 22]]
    engine.generate(prompts, [0, 1], params)  # compiles the bucket
    before = engine.phases
    out = engine.generate(prompts, [0, 1], params)
    after = engine.phases
    got = {k: after[k] - before[k] for k in after}
    made = sum(len(s.token_ids) for samples in out for s in samples)
    assert made == 4 * 7  # greedy without a stop token: every sample at its length
    assert got["prefill_tokens"] == 6 and got["decode_tokens"] == made and got["decode_rows"] == 2 * 2
    assert got["decode_steps"] == 8 and got["decode_row_steps"] == 4 * 8  # 7 tokens in groups of STOP_EVERY = 4
    assert got["prefill_s"] > 0 and got["decode_s"] > 0
    # the bytes those steps read: 8 steps of the bucket's 4 rows over 16 + 16 slots (prompt and new-token buckets)
    assert got["decode_bytes"] == 8 * engine.step_bytes(4, 32)
    fresh = Engine(*nnx.split(loaded("qwen2_moe")[1]), max_len=64)
    fresh.generate(prompts, [0, 1], params)
    assert all(v == 0 for v in fresh.phases.values())  # the compiling call is not counted


def test_step_bytes_by_hand(loaded):
    """The tiny Qwen2-MoE (hidden 32, 2 layers, 4 heads of 8, 2 KV heads, 8 experts of 24 top-2, a shared expert of 48,
    vocabulary 97, untied): per layer q 32x32 + 32, k and v 32x16 + 16 each, o 32x32, two norms, the router 32x8, the
    shared expert 3x32x48 and its gate 32x1: 8,096 shared parameters; then the final norm and the 32x97 head (the
    embedding table is gathered, not read): 19,328. Routed: 2 x 8 x 3 x 32 x 24 = 36,864, all touched by 4 rows x 2
    (of 8), a quarter by 1 row (2 of 8). KV cache of 4 rows x 32 slots: 2 layers x (k, v) x 2 heads x 8."""
    _, model, engine = loaded("qwen2_moe")
    item = np.dtype(model.embed_VxD[...].dtype).itemsize
    assert engine.step_bytes(4, 32) == item * (19328 + 36864 + 2 * 2 * 4 * 32 * 2 * 8)
    assert engine.step_bytes(1, 32) == item * (19328 + 36864 / 4 + 2 * 2 * 1 * 32 * 2 * 8)
    assert engine.device_kind == model.embed_VxD[...].devices().pop().device_kind


def _tokens(out):
    return [[(s.token_ids, s.finish_reason) for s in per] for per in out]


def test_samples_past_the_rows_wait_and_enter_as_rows_end(loaded):
    """Six samples of different lengths through two rows: each enters a row that a sample left, and comes out as
    from a decode that holds them all at once (same tokens, logprobs, routing)."""
    _, model, wide = loaded("qwen2_moe")
    narrow = Engine(*nnx.split(model), max_len=64, max_rows=2)
    base = engine_params(n=2, seed=3, return_routing=True)
    requests = [
        Request(p, i, dataclasses.replace(base, max_new_tokens=m))
        for i, (p, m) in enumerate(zip(PROMPTS + [[9, 9, 4]], [3, 9, 5]))
    ]
    want, got = wide.generate_many(requests), narrow.generate_many(requests)
    assert _tokens(got) == _tokens(want)
    assert [len(s.token_ids) for per in got for s in per] == [3, 3, 9, 9, 5, 5]
    for a, b in zip((s for per in got for s in per), (s for per in want for s in per)):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(a.routing, b.routing)
        np.testing.assert_array_equal(a.prompt_routing, b.prompt_routing)
    before = narrow.phases
    narrow.generate_many(requests)
    got = {k: narrow.phases[k] - before[k] for k in before}
    assert got["decode_rows"] == 6 and got["decode_row_steps"] == 2 * got["decode_steps"]
    assert got["decode_steps"] >= 9 + 5  # the two rows take the samples in turn: the 9-token pair after the 3-token one


def test_the_decode_narrows_to_its_active_rows(loaded):
    """Once no sample waits, a decode call goes on at the width of its active rows: 8 rows for 4 steps, then the two
    long samples alone in 2 rows, with the tokens of the wide decode."""
    _, model, wide = loaded("qwen2_moe")
    engine = Engine(*nnx.split(model), max_len=64, min_rows=1, width_step=1, decode_steps=4)
    base = engine_params(n=2, seed=5, return_routing=False)
    lengths = [2, 2, 2, 12]
    prompts = PROMPTS + [[1, 2], [3, 4, 5, 6]]
    requests = [
        Request(p, i, dataclasses.replace(base, max_new_tokens=m)) for i, (p, m) in enumerate(zip(prompts, lengths))
    ]
    want = wide.generate_many(requests)
    engine.generate_many(requests)  # compiles
    before = engine.phases
    got = engine.generate_many(requests)
    ran = {k: engine.phases[k] - before[k] for k in before}
    assert _tokens(got) == _tokens(want)
    assert ran["decode_steps"] == 12 and ran["decode_row_steps"] == 8 * 4 + 2 * 8
    assert ran["decode_tokens"] == 2 * sum(lengths)


def test_each_decode_call_attends_over_the_slots_its_rows_can_reach(loaded):
    """Calls of 4 steps over a 16-token bucket: the k-th call attends over P + 4k slots (its rows' reach, the
    programs keyed by it), and the greedy tokens and logprobs are the transformers reference's (a bound below a
    row's own slots would hide its latest tokens from it)."""
    model_dir, model, _ = loaded("qwen2")
    engine = Engine(*nnx.split(model), max_len=64, decode_steps=4)
    ref = transformers_backend.Backend(model_dir, dtype="float32")
    params = dataclasses.replace(GREEDY, max_new_tokens=14, return_routing=False)
    got = engine.generate(PROMPTS, [0, 1], params)
    for r, prompt in enumerate(PROMPTS):
        (want,) = ref.generate(prompt, r, params)
        assert got[r][0].token_ids == want.token_ids
        np.testing.assert_allclose(got[r][0].logprobs, want.logprobs, atol=1e-4, rtol=0)
    p = bucket(max(map(len, PROMPTS)), engine.prompt_bucket)
    assert sorted(key[-1] for key in engine._programs if key[0] == "decode") == [p + 4, p + 8, p + 12, p + 16]


def test_the_sampler_decodes_through_the_kernels_as_through_the_einsum(tiny_hf_dir):
    """The JAX sampler's decode on a model whose attention_impl asks for a decode kernel (triton: the GPU's, splash:
    the TPU's; in every layer's decode step, in Pallas's interpreters here) gives the einsum model's greedy tokens and
    logprobs (fp32), left-padded prompts of different lengths, in calls of 16 steps."""
    model_dir = tiny_hf_dir("qwen2_moe")
    params = dataclasses.replace(engine_params(seed=0, greedy=True), max_new_tokens=40)
    prompts = [[5, 17, 3, 88, 41, 2, 9], [60, 7, 33]]
    got, seen = {}, {}
    for impl in ("einsum", "triton", "splash"):
        model = hf_io.load(model_dir, attention_impl=impl)[0]
        engine = Engine(*nnx.split(model), max_len=128, decode_steps=16)
        got[impl] = engine.generate(prompts, [0, 1], params)
        seen[impl] = sorted(key[-1] for key in engine._programs if key[0] == "decode")
    # 16 prompt slots and 64 new ones (a bucket of 64), 40 tokens in three calls: the calls attend over the slots their
    # rows can reach (the TPU kernel's blocks of 32, 16 and 64 slots), the GPU kernel's over all (it stops at each
    # row's last written slot itself: one program)
    assert seen == {"einsum": [32, 48, 64], "triton": [80], "splash": [32, 48, 64]}
    for impl in ("triton", "splash"):
        for a, b in zip(got[impl], got["einsum"]):
            assert a[0].token_ids == b[0].token_ids
            np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_sampling_mask_is_the_support_sampled_from(loaded, top_p):
    """return_sampling_mask: each token's support is what top-k 5 (then top-p on the renormalised five) kept of the
    model's own distribution at temperature 0.8; the sampled token is in it, its logprob is p renormalised over it,
    and asking for it changes no sample. An untruncated request: counts of 0."""
    _, model, engine = loaded("qwen2_moe")
    params = engine_params(n=2, seed=5, temperature=0.8, top_k=5, top_p=top_p, max_new_tokens=6)
    got = engine.generate(PROMPTS, [0, 1], dataclasses.replace(params, return_sampling_mask=True))
    plain = engine.generate(PROMPTS, [0, 1], params)
    assert [[s.token_ids for s in per] for per in got] == [[s.token_ids for s in per] for per in plain]
    for prompt, per in zip(PROMPTS, got, strict=True):
        for s in per:
            ids, counts = s.support
            assert len(counts) == len(s.token_ids) and sum(counts) == len(ids)
            seq = np.array([prompt + s.token_ids])
            lp = log_softmax(parity.run(model, seq)[0][0, len(prompt) - 1 : -1].astype(np.float64) / 0.8)
            for t, (tok, support) in enumerate(zip(s.token_ids, np.split(ids, np.cumsum(counts)[:-1]), strict=True)):
                best = np.argsort(-lp[t], kind="stable")[:5]
                p5 = np.exp(lp[t, best] - np.logaddexp.reduce(lp[t, best]))
                keep = best[(np.cumsum(p5) - p5) < top_p]
                assert sorted(support.tolist()) == sorted(keep.tolist()) and tok in keep
                np.testing.assert_allclose(s.logprobs[t], lp[t, tok] - np.logaddexp.reduce(lp[t, keep]), atol=1e-4)
    untruncated = dataclasses.replace(params, top_k=0, top_p=1.0, return_sampling_mask=True)
    (one,) = engine.generate([PROMPTS[0]], [0], untruncated)[0][:1]
    assert one.support == ([], [0] * len(one.token_ids))


def test_bad_input_is_named(loaded):
    _, _, engine = loaded("qwen2")
    with pytest.raises(ValueError, match="> 64"):
        engine.generate([list(range(60))], [0], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], [0], GREEDY)
