"""One server of a rollout fleet: what the fleet knows of it, its moves in and out of rotation, and its metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cisjax.rollout.client import RolloutClient


@dataclass(eq=False)
class Replica:
    """One server of the fleet and what the fleet knows of it (changed under the fleet's lock)."""

    index: int
    client: RolloutClient
    restarts: Callable[[], int] | None = None  # how often its process was restarted (embedded children)
    restart: Callable[[], None] | None = None  # restarts its process (embedded children: kill, the watchdog restarts)
    in_rotation: bool = True
    in_flight: int = 0  # tokens of the calls in flight on it (prompt + max_new_tokens x n per prompt)
    version: int = 0  # the weights version it last reported
    failures: int = 0  # times it was taken out of rotation
    probation: bool = False  # reloaded, its check (a weight canary) not yet passed: no new work
    quarantined: str = ""  # why it failed its check: out of rotation until a later check passes
    check_failures: int = 0
    rejoins: int = 0
    tokens: int = 0  # response tokens it returned
    probed: float = 0.0  # monotonic time of the last probe while out of rotation
    metered: float = field(default_factory=time.monotonic)  # monotonic time of the last metrics()
    metered_tokens: int = 0  # `tokens` at the last metrics()

    def take_out(self) -> bool:
        """Out of rotation, counted as a failure; False (and nothing changed) when it already was."""
        if not self.in_rotation:
            return False
        self.in_rotation, self.probed = False, time.monotonic()
        self.failures += 1
        return True

    def quarantine(self, why: str) -> None:
        """Out of rotation for failing its check, until a later check passes."""
        self.in_rotation, self.quarantined, self.probed = False, why, time.monotonic()
        self.check_failures += 1

    def rejoin(self, version: int | None = None) -> bool:
        """Back in rotation (on `version`, when given), not quarantined; False when it already was in rotation."""
        if version is not None:
            self.version = version
        self.quarantined = ""
        if self.in_rotation:
            return False
        self.in_rotation = True
        self.rejoins += 1
        return True

    def metrics(self, now: float) -> dict:
        """Its rows of the fleet's metrics: response tokens/s since the last call, in-flight tokens, weights version,
        in rotation (0/1), failures (times taken out), rejoins, check failures, and process restarts (embedded)."""
        p = f"rollout/replica{self.index}/"
        out = {p + "tokens_per_s": (self.tokens - self.metered_tokens) / max(now - self.metered, 1e-9)}
        self.metered, self.metered_tokens = now, self.tokens
        out[p + "in_flight"] = float(self.in_flight)
        out[p + "version"] = float(self.version)
        out[p + "in_rotation"] = float(self.in_rotation)
        out[p + "failures"] = float(self.failures)
        out[p + "rejoins"] = float(self.rejoins)
        out[p + "check_failures"] = float(self.check_failures)
        if self.restarts is not None:
            out[p + "restarts"] = float(self.restarts())
        return out
