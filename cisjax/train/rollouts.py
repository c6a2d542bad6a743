"""Rollouts ahead of training: a producer thread (prompts -> Generate -> rewards) held within a staleness bound."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cisjax.rollout.params import SamplingParams
from cisjax.train.batching import Rollout

log = logging.getLogger(__name__)


@dataclass
class StepRollouts:
    """Everything one optimizer step consumes from the rollout side."""

    index: int  # which step's batch this is (0, 1, ...)
    groups: list  # [prompt][sample] Rollout
    data_state: dict  # the prompt stream's position after this batch (what a checkpoint saves)
    server_version: int  # the weights version the server held when generation started
    timings: dict = field(default_factory=dict)  # generate_s, reward_s
    texts: list = field(default_factory=list)  # decoded responses, [prompt][sample] (for logs and dumps)


class RolloutProducer:
    """Produces StepRollouts in order on a background thread, never more than `max_staleness`
    versions ahead of the trainer: batch s is generated only once version s - max_staleness has
    been published (max_staleness 0 = synchronous: batch s waits for the weights of step s).

    `generate(problems, index) -> (samples, texts)` and `reward(samples, texts, problems) -> groups of Rollout`
    are the loop's callables (Sampler's); `stream` is a cisjax.data.PromptStream. An error on the thread is raised
    by the next `get`. With `end`, batches `end` and later are never generated (the run's last step consumes
    batch end - 1: a batch past it would be sampled for nothing and cut off by the shutdown)."""

    def __init__(
        self,
        stream,
        generate,
        reward,
        *,
        max_staleness: int,
        first_index: int,
        published_version: int,
        server_version=None,
        end: int | None = None,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.stream, self._generate, self._reward = stream, generate, reward
        self.max_staleness = int(max_staleness)
        self._server_version = server_version or (lambda: self._published)
        self._next, self._end = first_index, end
        self._published = published_version
        self._ready: dict[int, StepRollouts] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
        self._thread.start()

    # -- trainer side
    def published(self, version: int) -> None:
        """The trainer made `version` the served weights."""
        with self._cv:
            self._published = version
            self._cv.notify_all()

    def get(self, index: int, timeout_s: float | None = None) -> StepRollouts:
        """The rollouts of batch `index` (waits for them)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while index not in self._ready:
                if self._error is not None:
                    raise RuntimeError(
                        f"rollout producer failed: {type(self._error).__name__}: {self._error}"
                    ) from self._error
                if self._stop:
                    raise RuntimeError("rollout producer stopped")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no rollouts for batch {index} after {timeout_s}s")
                self._cv.wait(timeout=left if left is not None else 1.0)
            return self._ready.pop(index)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    # -- producer thread
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    # batch s may start once version s - max_staleness is served; and at most
                    # max_staleness + 1 batches wait unconsumed
                    while not self._stop and (
                        self._published < self._next - self.max_staleness or len(self._ready) > self.max_staleness
                    ):
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                    index = self._next
                    if self._end is not None and index >= self._end:  # the run needs no more batches
                        self._stop = True
                        self._cv.notify_all()
                        return
                try:
                    problems = self.stream.next_batch()
                except StopIteration:
                    problems = None
                if problems is None:  # the data is exhausted
                    with self._cv:
                        self._stop = True
                        self._cv.notify_all()
                    return
                version = self._server_version()
                t0 = time.monotonic()
                samples, texts = self._generate(problems, index)
                t1 = time.monotonic()
                groups = self._reward(samples, texts, problems)
                t2 = time.monotonic()
                out = StepRollouts(
                    index=index,
                    groups=groups,
                    data_state=self.stream.state(),
                    server_version=version,
                    timings={"generate_s": t1 - t0, "reward_s": t2 - t1},
                    texts=texts,
                )
                with self._cv:
                    self._ready[index] = out
                    self._next = index + 1
                    self._cv.notify_all()
        except BaseException as err:  # noqa: BLE001  (handed to the trainer by get)
            log.exception("rollout producer failed")
            with self._cv:
                self._error = err
                self._cv.notify_all()


@dataclass(frozen=True)
class Sampler:
    """The rollout side of a run on process 0, as the producer calls it: prompts -> Generate -> samples and their
    texts; texts -> rewards -> Rollouts."""

    client: Any  # RolloutClient or RolloutFleet
    formatter: Any  # data.PromptFormatter
    pool: Any  # rl.rewards.RewardPool
    sampling: SamplingParams
    seed: int  # rollout.seed; -1 = fresh randomness

    def generate(self, problems, index: int):
        """([prompt][sample] client Samples, their decoded texts) of batch `index`."""
        prompts = [self.formatter.encode(p.question) for p in problems]
        # a fixed rollout.seed makes the run's samples reproducible: one seed per batch
        seed = None if self.seed < 0 else self.seed * 1_000_003 + index
        samples = self.client.generate(prompts, dataclasses.replace(self.sampling, seed=seed))
        texts = [[self.formatter.decode(s.response_ids) for s in per] for per in samples]
        return samples, texts

    def reward(self, samples, texts, problems) -> list:
        """The groups of Rollout, each with its reward (math-verify of its text against the problem's answer)."""
        refs = [p.answer for p, per in zip(problems, samples) for _ in per]
        scores = iter(self.pool.score([t for ts in texts for t in ts], refs))
        return rollouts_from_samples(samples, problems, [[float(next(scores)) for _ in per] for per in samples])


def rollouts_from_samples(samples, problems, rewards) -> list:
    """Client Samples ([prompt][sample]) and their rewards ([prompt][sample]) -> groups of Rollout."""
    return [
        [
            Rollout(
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                logprobs=s.logprobs,
                versions=s.versions,
                reward=r,
                finish_reason=s.finish_reason,
                problem_id=str(getattr(p, "id", i)),
                routing=s.input_routing,
                support=s.support,
            )
            for s, r in zip(per, rs)
        ]
        for i, (per, p, rs) in enumerate(zip(samples, problems, rewards))
    ]
