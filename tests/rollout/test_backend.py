"""The engine contract's request checks (cisjax.rollout.backend) on protocol messages, without a server or an engine."""

import grpc
import pytest

from cisjax.rollout import backend, protos

PB = protos.load().rollout_pb2


class Tiny(backend.Backend):
    engine = "tiny"
    vocab_size = 10
    max_model_len = 8


def _generate(prompts, **params):
    return PB.GenerateRequest(
        prompts=[PB.Prompt(token_ids=p, id=i) for i, p in enumerate(prompts)],
        params=PB.SamplingParams(**{"n": 2, "temperature": 1.0, "max_new_tokens": 4, **params}),
    )


def test_generate_request_becomes_params_and_prompts():
    params, prompts = backend.check_generate(_generate([[1, 2], [3]], top_p=0, seed=5, stop_token_ids=[9]), Tiny())
    assert prompts == [[1, 2], [3]]
    assert (params.n, params.top_p, params.seed, params.stop_token_ids, params.greedy) == (2, 1.0, 5, {9}, False)
    greedy, _ = backend.check_generate(_generate([[1]], temperature=0, greedy=True), Tiny())
    assert greedy.temperature == 1.0 and greedy.seed is None


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([], {}, "no prompts in the request"),
        ([[1]], {"n": 0}, r"n must be in \[1, 1024\], got 0"),
        ([[1]], {"temperature": 0}, "temperature must be > 0"),
        ([[1]], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ([[1]], {"logprobs": 101}, r"logprobs \(top-k to return\) must be in \[0, 100\]"),
        ([[1]], {"stop_token_ids": [10]}, r"stop_token_ids outside the vocabulary \[0, 10\): \[10\]"),
        ([[1], []], {}, "prompt 1 is empty"),
        ([[1, 12]], {}, r"prompt 0 has token ids outside the vocabulary \[0, 10\): \[12\]"),
        ([[1] * 5], {}, "prompt 0: 5 tokens \\+ max_new_tokens 4 exceeds the model's context length 8"),
    ],
)
def test_generate_request_refused(prompts, params, message):
    with pytest.raises(backend.RequestError, match=message) as err:
        backend.check_generate(_generate(prompts, **params), Tiny())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_routing_refused_by_an_engine_without_it():
    with pytest.raises(backend.RequestError, match="the tiny backend does not return routing") as err:
        backend.check_generate(_generate([[1]], return_routing=True), Tiny())
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    score = PB.ScoreRequest(sequences=[PB.Sequence(prompt_ids=[1], response_ids=[2])], return_routing=True)
    with pytest.raises(backend.RequestError, match="does not return routing"):
        backend.check_score(score, Tiny())


def test_score_request():
    req = PB.ScoreRequest(sequences=[PB.Sequence(prompt_ids=[1, 2], response_ids=[]), PB.Sequence(prompt_ids=[3])])
    assert backend.check_score(req, Tiny()) == (1.0, [([1, 2], []), ([3], [])])
    for bad, message in [
        (PB.ScoreRequest(), "no sequences in the request"),
        (PB.ScoreRequest(sequences=req.sequences, temperature=-1), "temperature must be > 0, got -1"),
        (PB.ScoreRequest(sequences=req.sequences, logprobs=101), r"logprobs must be in \[0, 100\], got 101"),
        (
            PB.ScoreRequest(sequences=[PB.Sequence(prompt_ids=[1] * 5, response_ids=[2] * 4)]),
            "sequence 0: 9 tokens exceed the model's context length 8",
        ),
        (PB.ScoreRequest(sequences=[PB.Sequence(response_ids=[2])]), "sequence 0 prompt_ids is empty"),
    ]:
        with pytest.raises(backend.RequestError, match=message):
            backend.check_score(bad, Tiny())


def test_sample_seed_depends_on_the_prompt_and_sample_only():
    seeds = {backend.sample_seed(7, p, j) for p in range(3) for j in range(3)}
    assert len(seeds) == 9 and all(0 <= s < 1 << 63 for s in seeds)
    assert backend.sample_seed(7, 2, 1) == backend.sample_seed(7, 2, 1) != backend.sample_seed(8, 2, 1)
