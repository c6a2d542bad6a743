"""The fake engine called directly: samples a pure function of the request, logprobs of the distribution sampled from
(Score gives them again), max_new_tokens / stop ids / n / top-k / top-p / greedy honoured, weight updates checked and
counted."""

import json
import shutil

import numpy as np
import pytest

from cisjax.engines import fake
from cisjax.errors import MissingInput
from cisjax.rollout import server
from cisjax.rollout.backend import RequestError, check_routing
from tests.support.engines import engine_params
from tests.support.servers import fake_model_dir

PROMPT = [1, 2, 3, 4]
WEIGHTS = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}


@pytest.fixture
def engine(tmp_path):
    b = fake.Backend(fake_model_dir(tmp_path / "model", tensors=WEIGHTS), dtype="float32")
    yield b
    b.close()


def _tokens(samples):
    return [s.token_ids for s in samples]


def test_registered_as_a_serve_backend(tmp_path):
    assert server.BACKENDS["fake"] == "cisjax.engines.fake"
    b = server.open_backend("fake", fake_model_dir(tmp_path / "m", vocab_size=50, max_len=64), dtype="bfloat16")
    assert (b.engine, b.vocab_size, b.max_model_len, b.version, b.dtype) == ("fake", 50, 64, 0, "bfloat16")
    assert b.architecture == "Qwen2MoeForCausalLM"
    with pytest.raises(RequestError, match="runs no model"):
        check_routing(b)
    with pytest.raises(MissingInput, match="no config.json"):
        fake.Backend(str(tmp_path))


def test_samples_are_a_pure_function_of_the_request(engine, tmp_path):
    params = engine_params(n=4, max_new_tokens=12, seed=7)
    a = engine.generate(PROMPT, 3, params)
    assert [s.sample_index for s in a] == [0, 1, 2, 3] and len(set(map(tuple, _tokens(a)))) == 4
    # another engine on another directory of the same config, after a weight update: the same samples
    other = fake.Backend(fake_model_dir(tmp_path / "other", tensors=WEIGHTS))
    other.load_tensors(WEIGHTS, 5)
    b = other.generate(PROMPT, 3, params)
    assert _tokens(b) == _tokens(a) and [s.logprobs for s in b] == [s.logprobs for s in a]
    assert all(s.versions == [5] * 12 for s in b) and all(s.versions == [0] * 12 for s in a)
    # each of seed, prompt id, prompt tokens and sample index changes them
    assert _tokens(engine.generate(PROMPT, 3, engine_params(n=4, max_new_tokens=12, seed=8))) != _tokens(a)
    assert _tokens(engine.generate(PROMPT, 4, params)) != _tokens(a)
    assert _tokens(engine.generate([1, 2, 3, 5], 3, params)) != _tokens(a)
    assert _tokens(engine.generate(PROMPT, 3, engine_params(n=5, max_new_tokens=12, seed=7)))[:4] == _tokens(a)
    # unseeded: as seed 0
    assert _tokens(engine.generate(PROMPT, 3, engine_params(n=2))) == _tokens(
        engine.generate(PROMPT, 3, engine_params(n=2, seed=0))
    )


def test_logprobs_are_the_sampling_distribution(engine):
    for temperature in (1.0, 0.6):
        samples = engine.generate(PROMPT, 0, engine_params(n=3, max_new_tokens=10, seed=1, temperature=temperature))
        for s in samples:
            lp = np.asarray(s.logprobs)
            assert len(lp) == 10 and np.isfinite(lp).all() and (lp < 0).all()
            assert all(0 <= t < engine.vocab_size for t in s.token_ids)
            scored = engine.score(PROMPT, s.token_ids, temperature, 0)
            np.testing.assert_allclose(scored["logprobs"], lp, rtol=0, atol=1e-12)
    # the model is not one-hot: a spread of logprobs
    assert -8 < float(np.mean([s.logprobs for s in samples])) < -0.2


def test_max_new_tokens_stop_ids_and_top_logprobs(engine):
    free = engine.generate(PROMPT, 0, engine_params(n=8, max_new_tokens=30, seed=2))
    stop = {free[0].token_ids[5], free[1].token_ids[3]}  # tokens the samples do draw
    samples = engine.generate(PROMPT, 0, engine_params(n=8, max_new_tokens=30, seed=2, stop_token_ids=stop, logprobs=3))
    assert any(s.finish_reason == "stop" for s in samples)
    for s, f in zip(samples, free, strict=True):
        n = len(s.token_ids)
        assert s.token_ids == f.token_ids[:n] and s.logprobs == f.logprobs[:n]  # the stop ids change no draw
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stop and not set(s.token_ids[:-1]) & stop
        else:
            assert n == 30 and not set(s.token_ids) & stop
        assert len(s.top_ids) == len(s.top_logprobs) == n
        for t, lp, ids, tops in zip(s.token_ids, s.logprobs, s.top_ids, s.top_logprobs):
            assert len(ids) == 3 and tops == sorted(tops, reverse=True) and (t not in ids or lp == tops[ids.index(t)])


def test_greedy_and_truncated_sampling(engine):
    greedy = engine.generate(PROMPT, 0, engine_params(n=3, max_new_tokens=6, greedy=True))
    assert _tokens(greedy)[0] == _tokens(greedy)[1] == _tokens(greedy)[2]
    scored = engine.score(PROMPT, greedy[0].token_ids, 1.0, 1)
    assert [ids[0] for ids in scored["top_ids"]] == greedy[0].token_ids  # each the argmax
    params = engine_params(n=4, max_new_tokens=8, seed=3, top_k=5, top_p=0.7, return_sampling_mask=True)
    for s in engine.generate(PROMPT, 0, params):
        ids, counts = s.support
        assert len(counts) == 8 and sum(counts) == len(ids) and all(1 <= c <= 5 for c in counts)
        starts = np.cumsum([0, *counts])
        for i, t in enumerate(s.token_ids):
            assert t in ids[starts[i] : starts[i + 1]]  # the sampled token is in its support
        assert all(lp <= 0 and np.isfinite(lp) for lp in s.logprobs)
    plain = engine.generate(PROMPT, 0, engine_params(max_new_tokens=4, seed=3, return_sampling_mask=True))
    assert plain[0].support == ([], [0, 0, 0, 0])  # nothing cut


def test_weight_updates_are_checked_and_counted(engine, tmp_path):
    export = shutil.copytree(engine.model, tmp_path / "exports" / "v1")
    engine.update("directory", export, 1)
    assert engine.version == 1
    engine.update("tensors", dict(WEIGHTS), 2)
    assert engine.version == 2
    with pytest.raises(RequestError, match="lacks 1 tensors"):
        engine.update("tensors", {"a": WEIGHTS["a"]}, 3)
    other = tmp_path / "other"
    shutil.copytree(export, other)
    (other / "config.json").write_text(json.dumps({**engine.config_json, "vocab_size": 98}))
    with pytest.raises(RequestError, match="vocab_size=98 differs"):
        engine.update("directory", other, 3)
    assert engine.version == 2  # a refused update keeps the version
    assert engine.generate(PROMPT, 0, engine_params(max_new_tokens=3))[0].versions == [2, 2, 2]
