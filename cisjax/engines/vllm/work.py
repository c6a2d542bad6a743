"""The vLLM engine thread's inbox: the messages the callers send it and the work it holds (cisjax.engines.vllm.backend.Backend)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field


@dataclass(eq=False)
class Call:
    """The engine requests whose outputs resolve one future: the n samples of a prompt, or one scored sequence."""

    requests: list  # [(request id, TokensPrompt, SamplingParams)]
    finish: Callable  # (call, [RequestOutput in request order]) -> the future's result
    future: futures.Future
    routing: bool  # run in a routing phase, with the routers' ids captured per request
    outputs: dict = field(default_factory=dict)
    internal: dict = field(default_factory=dict)  # request id -> the engine's internal id (the model runner's)
    version: int = 0
    started: float = 0.0
    captured: list = field(default_factory=list)  # per request: routed ids [positions, layers, k] of every position


@dataclass(frozen=True, eq=False)
class Exclusive:
    """Work that needs the engine to itself (a weight reload): `fn` runs once nothing is in flight."""

    fn: Callable[[], object]
    future: futures.Future


@dataclass(frozen=True, eq=False)
class Cancel:
    """The caller of `future` went away: drop its requests."""

    future: futures.Future


class Stop:
    """Shut the engine thread down, failing what waits."""


@dataclass(eq=False)
class Work:
    """What the engine thread holds."""

    admitted: dict = field(default_factory=dict)  # request id -> Call, in the engine
    held: collections.deque = field(default_factory=collections.deque)  # other calls waiting behind exclusive work
    # Exclusive (run once the engine is idle) or a routing Call (starts or joins a routing phase), in arrival order
    exclusive: collections.deque = field(default_factory=collections.deque)
    phase: bool = False  # a routing phase runs: capture on, only routing calls admitted

    def idle(self) -> bool:
        return not (self.admitted or self.exclusive or self.held or self.phase)


def run_exclusive(work: Exclusive) -> None:
    """Exclusive work, its result or error handed to its future (unless cancelled)."""
    if work.future.set_running_or_notify_cancel():
        try:
            result = work.fn()
        except BaseException as err:  # noqa: BLE001  (handed to the caller)
            work.future.set_exception(err)
        else:
            work.future.set_result(result)
