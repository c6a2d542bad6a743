"""The rollout producer: order, the staleness bound (how far ahead of the trainer it may run), errors, end of data."""

import threading
import time

import pytest

from cisjax.train.rollouts import RolloutProducer


class _Stream:
    def __init__(self, batches):
        self.batches, self.pos = batches, 0

    def next_batch(self):
        if self.pos >= self.batches:
            raise StopIteration
        self.pos += 1
        return [f"problem{self.pos - 1}"]

    def state(self):
        return {"pos": self.pos}


def _producer(max_staleness, batches=10, fail_at=None, end=None):
    started = []
    lock = threading.Lock()

    def generate(problems, index):
        with lock:
            started.append(problems[0])
        if fail_at is not None and problems[0] == f"problem{fail_at}":
            raise ValueError("engine exploded")
        return [[problems[0]]], [["text"]]

    def reward(groups, texts, problems):
        return groups

    p = RolloutProducer(
        _Stream(batches), generate, reward, max_staleness=max_staleness, first_index=0, published_version=0, end=end
    )
    return p, started


def _settle(started, n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while len(started) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # give a wrongly eager producer the chance to run further


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_runs_at_most_max_staleness_versions_ahead(staleness):
    p, started = _producer(staleness)
    try:
        _settle(started, staleness + 1)
        assert len(started) == staleness + 1  # batches 0..staleness from version 0, then it waits
        for s in range(4):
            ro = p.get(s, timeout_s=5)
            assert ro.index == s and ro.groups == [[f"problem{s}"]] and ro.data_state == {"pos": s + 1}
            p.published(s + 1)
            _settle(started, s + 2 + staleness)
            assert len(started) == s + 2 + staleness
    finally:
        p.close()


def test_error_reaches_the_trainer():
    p, _ = _producer(1, fail_at=1)
    try:
        assert p.get(0, timeout_s=5).index == 0
        p.published(1)
        with pytest.raises(RuntimeError, match="engine exploded"):
            p.get(1, timeout_s=5)
    finally:
        p.close()


def test_end_of_data():
    p, _ = _producer(2, batches=2)
    try:
        p.get(0, timeout_s=5)
        p.get(1, timeout_s=5)
        p.published(2)
        with pytest.raises(RuntimeError, match="stopped"):
            p.get(2, timeout_s=5)
    finally:
        p.close()


def test_no_batch_past_the_runs_last_step():
    """The run's steps end at batch 2 (end=3): batches 3 and 4, which the staleness bound would allow once version 3
    is out, are never generated; a get past the end is refused at once."""
    p, started = _producer(2, end=3)
    try:
        for s in range(3):
            assert p.get(s, timeout_s=5).index == s
            p.published(s + 1)
        _settle(started, 5)
        assert started == ["problem0", "problem1", "problem2"]
        with pytest.raises(RuntimeError, match="stopped"):
            p.get(3, timeout_s=5)
    finally:
        p.close()


def test_sampler_builds_rollouts_with_their_rewards():
    """Generate -> texts -> rewards -> Rollouts, each built once with its reward; the batch's seed from rollout.seed."""
    import dataclasses
    from types import SimpleNamespace

    from cisjax.rollout.params import SamplingParams
    from cisjax.rollout.samples import Sample
    from cisjax.train.rollouts import Sampler

    class Client:
        def generate(self, prompts, params):
            self.seed = params.seed
            return [
                [Sample(k, i, p, [7, i], [-0.5, -1.0], "stop", [3, 3]) for i in range(params.n)]
                for k, p in enumerate(prompts)
            ]

    class Formatter:
        def encode(self, question):
            return [len(question)]

        def decode(self, ids):
            return f"\\boxed{{{ids[-1]}}}"

    class Pool:
        def score(self, texts, refs):
            return [float(t == f"\\boxed{{{r}}}") for t, r in zip(texts, refs)]

    client = Client()
    sampler = Sampler(client, Formatter(), Pool(), SamplingParams(n=2), seed=5)
    problems = [
        SimpleNamespace(id="a", question="one", answer="1"),
        SimpleNamespace(id="b", question="three", answer="0"),
    ]
    samples, texts = sampler.generate(problems, index=2)
    assert client.seed == 5 * 1_000_003 + 2 and texts == [["\\boxed{0}", "\\boxed{1}"]] * 2
    groups = sampler.reward(samples, texts, problems)
    assert [[r.reward for r in g] for g in groups] == [[0.0, 1.0], [1.0, 0.0]]
    assert [g[0].problem_id for g in groups] == ["a", "b"] and groups[1][0].prompt_ids == [5]
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups[0][0].reward = 1.0
    fresh = Sampler(client, Formatter(), Pool(), SamplingParams(n=1), seed=-1)
    fresh.generate(problems, index=2)
    assert client.seed is None  # rollout.seed = -1: fresh randomness
