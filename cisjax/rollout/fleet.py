"""A rollout fleet: several rollout servers behind one client (dispatch, weights to all, re-sending a dead one's work)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc

from cisjax.rollout import client as client_lib
from cisjax.rollout import manifest as manifest_lib
from cisjax.rollout.client import RolloutClient, RolloutError, Sample
from cisjax.rollout.fanout import Fanout
from cisjax.rollout.params import SamplingParams
from cisjax.rollout.replica import Replica

log = logging.getLogger("cisjax.rollout.fleet")

_DOWN = {grpc.StatusCode.UNAVAILABLE}  # a replica that answers this is out of rotation; its work goes elsewhere


class RolloutFleet:
    """RolloutClient's interface (generate, score, update_weights, update_weights_from_tensors, info, health,
    wait_ready, expected_version, close) over N servers, each behind its own RolloutClient built with retry_s=0 (a
    replica that fails fails fast: the fleet, not the replica's client, decides where its work goes).

    generate: each prompt (with its n samples: a group never splits, so one prefix cache serves it) goes to the
    in-rotation replica with the fewest in-flight tokens, counting the calls of every thread. Prompts keep their
    position in the whole call as their id on the wire, and the servers derive each sample's seed from (seed,
    prompt id, sample index): a seeded call returns the same samples whichever replica serves a prompt, and the
    order is the caller's. A replica whose call fails UNAVAILABLE, or whose samples carry a version older than the one
    it was sent at (it restarted unnoticed), is taken out of rotation and its unfinished prompts go to the others (a
    prompt's samples come whole from one replica: nothing twice). With none in rotation, the call waits (logging
    every `log_every_s`) for one to return, at most `retry_s`.

    Out-of-rotation replicas are probed at the start of each call (at most every `probe_s`): one that serves again
    rejoins once it holds `expected_version`; an older one is first sent the current weights (the last exported
    directory; after a streamed update it waits for the next update, which goes to every serving replica). So no
    replica serves an older version than the fleet's. Weight updates go to all replicas in parallel (one thread each;
    a streamed update reads the tensors once and hands them to every replica); with a `check` (the publisher's
    weight canary) each replica is checked after its reload, before it gets new work, and one that fails is
    quarantined until a later checked update passes on it."""

    def __init__(
        self,
        clients: list[RolloutClient],
        *,
        retry_s: float = 120.0,
        restarts: list | None = None,
        restart: list | None = None,
        probe_s: float = 1.0,
        log_every_s: float = 30.0,
    ):
        if not clients:
            raise ValueError("RolloutFleet: no replicas")
        self.replicas = [
            Replica(
                i,
                c,
                restarts=None if restarts is None else restarts[i],
                restart=None if restart is None else restart[i],
            )
            for i, c in enumerate(clients)
        ]
        for c in clients:
            c.retry_s = 0.0  # fail fast: the fleet re-sends elsewhere
        self.target = ",".join(c.target for c in clients)
        self.timeout_s = max(c.timeout_s for c in clients)
        self.retry_s, self.probe_s, self.log_every_s = retry_s, probe_s, log_every_s
        self.expected_version = 0
        self._restore = None  # (path, checksums) of the last directory update: what a returning replica is sent
        self._check = None  # the check of the last update that had one (for the replicas that are sent it later)
        self.last_checks: dict[int, tuple] = {}  # replica -> (passed, detail, message) of the last checked update
        self._lock = threading.Lock()  # replica state (rotation, in-flight tokens, counters)
        self._update_lock = threading.Lock()  # one weight update (or restore) at a time
        # generate's calls on one pool; weight updates on their own, so that they never queue behind generate calls
        self._pool = futures.ThreadPoolExecutor(max_workers=max(8, 4 * len(clients)), thread_name_prefix="fleet")
        self._updates = futures.ThreadPoolExecutor(max_workers=len(clients) + 1, thread_name_prefix="fleet-update")

    @classmethod
    def connect(
        cls, targets: list[str], *, token: str | None = None, tls=None, timeout_s: float = 600.0, **kw
    ) -> RolloutFleet:
        """A fleet of running servers HOST:PORT."""
        return cls([RolloutClient(t, token=token, tls=tls, timeout_s=timeout_s) for t in targets], **kw)

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._updates.shutdown(wait=False, cancel_futures=True)
        for r in self.replicas:
            r.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ rotation
    def _in_rotation(self) -> list[Replica]:
        with self._lock:
            return [r for r in self.replicas if r.in_rotation]

    def _take_out(self, r: Replica, why: str) -> None:
        with self._lock:
            if not r.take_out():
                return
        log.warning("rollout replica %d (%s) out of rotation: %s", r.index, r.client.target, why)

    def _revive(self, force: bool = False) -> None:
        """Probe the replicas out of rotation (each at most every probe_s unless `force`); bring back those serving
        the current weights, sending them the last exported directory first when they hold an older version, and
        running the last update's check (if it had one) before they rejoin. A quarantined replica (failed its check)
        is probed only when it came back on an older version (restarted). Under the update lock: a rejoin never
        interleaves with a weight update."""
        now = time.monotonic()
        with self._lock:
            due = [r for r in self.replicas if not r.in_rotation and (force or now - r.probed >= self.probe_s)]
            for r in due:
                r.probed = now
        if not due:
            return
        with self._update_lock:
            for r in due:
                try:
                    if r.client.health() != "SERVING":
                        continue
                    version = r.client.info()["version"]
                    if r.quarantined and version >= self.expected_version:
                        continue  # the next checked update decides
                    if version < self.expected_version and self._restore is not None:
                        path, checksums = self._restore
                        log.warning(
                            "rollout replica %d (%s) is back on version %d: sending version %d",
                            r.index,
                            r.client.target,
                            version,
                            self.expected_version,
                        )
                        version = r.client.update_weights(path, version=self.expected_version, checksums=checksums)
                    if version != self.expected_version:  # after a streamed update: it gets the next one
                        continue
                    if self._check is not None and not self._run_check(r, self._check):
                        continue
                except (grpc.RpcError, RolloutError) as err:
                    log.debug("replica %d not back yet: %s", r.index, err)
                    continue
                with self._lock:
                    r.rejoin(version)
                log.warning("rollout replica %d (%s) rejoined on version %d", r.index, r.client.target, version)

    def _run_check(self, r: Replica, check, restart: bool = False) -> bool:
        """check(client) -> (passed, detail, message) on a replica that holds the current weights, its outcome kept in
        last_checks; a failure quarantines it (message: why, for the log) and, with `restart`, restarts its process
        when the fleet can (embedded replicas): it comes back on its initial weights, is sent the current export and
        checked again before it rejoins. (Only after a publish: a replica failing again right after its restart
        waits for the next publish, not another restart.)"""
        try:
            passed, detail, message = check(r.client)
        except RolloutError as err:
            if err.code in _DOWN:
                raise
            passed, detail, message = False, None, f"the check failed: {err}"
        self.last_checks[r.index] = (passed, detail, message)
        if not passed:
            with self._lock:
                r.quarantine(message or "failed its check")
            log.error(
                "rollout replica %d (%s) failed its check, out of rotation:\n%s", r.index, r.client.target, message
            )
            if restart and r.restart is not None:
                log.warning("restarting rollout replica %d (%s)", r.index, r.client.target)
                r.restart()
        return passed

    def _wait_for_replica(self, what: str, start: float, last_log: list) -> None:
        """No replica in rotation: probe until one returns; RolloutError after retry_s."""
        while True:
            self._revive(force=True)
            if self._in_rotation():
                log.warning("%s: rollout replica back after %.0fs", what, time.monotonic() - start)
                return
            waited = time.monotonic() - start
            if waited > self.retry_s:
                raise RolloutError(
                    f"{what}: no rollout replica serving after {waited:.0f}s ({self.target})",
                    grpc.StatusCode.UNAVAILABLE,
                )
            if time.monotonic() - last_log[0] >= self.log_every_s:
                last_log[0] = time.monotonic()
                log.warning(
                    "%s: all %d rollout replicas are down; waiting for one (%.0fs of %.0fs)",
                    what,
                    len(self.replicas),
                    waited,
                    self.retry_s,
                )
            time.sleep(min(self.probe_s, 1.0))

    def _pick(self, costs: list[int]) -> list[Replica]:
        """Least-loaded placement of items of these token costs on the replicas in rotation (their in-flight tokens
        raised accordingly): a replica per item, or [] when none is in rotation."""
        with self._lock:
            live = [r for r in self.replicas if r.in_rotation and not r.probation]
            if not live:
                return []
            out = []
            for cost in costs:
                r = min(live, key=lambda r: (r.in_flight, r.index))
                r.in_flight += cost
                out.append(r)
            return out

    # ------------------------------------------------------------------ calls
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[Sample]]:
        """n samples per prompt, as [prompt][sample] (RolloutClient.generate), spread over the replicas."""
        params = params or SamplingParams()
        self._revive()
        costs = [len(p) + params.max_new_tokens * params.n for p in prompts]
        done: dict[int, list] = {}
        pending = list(range(len(prompts)))
        running: dict[futures.Future, tuple[Replica, list[int], int]] = {}  # replica, prompts, version sent at
        start, last_log = time.monotonic(), [time.monotonic()]
        try:
            while pending or running:
                if pending:
                    placed = self._pick([costs[i] for i in pending])
                    if not placed:
                        if not running:
                            self._wait_for_replica("Generate", start, last_log)
                            continue
                    else:
                        per: dict[int, list[int]] = {}
                        for i, r in zip(pending, placed):
                            per.setdefault(r.index, []).append(i)
                        for ri, ids in per.items():
                            r = self.replicas[ri]
                            for lo in range(0, len(ids), r.client.batch_size):
                                chunk = ids[lo : lo + r.client.batch_size]
                                fut = self._pool.submit(
                                    r.client.generate, [prompts[i] for i in chunk], params, ids=chunk
                                )
                                running[fut] = (r, chunk, self.expected_version)
                        pending = []
                if not running:
                    continue
                finished, _ = futures.wait(list(running), return_when=futures.FIRST_COMPLETED)
                for fut in finished:
                    r, chunk, want = running.pop(fut)
                    with self._lock:
                        r.in_flight -= sum(costs[i] for i in chunk)
                    try:
                        samples = fut.result()
                    except RolloutError as err:
                        if err.code not in _DOWN:
                            raise
                        self._take_out(r, str(err))
                        log.warning("re-sending %d prompts of replica %d to the others", len(chunk), r.index)
                        pending.extend(chunk)
                        continue
                    oldest = min((min(s.versions) for per in samples for s in per if s.versions), default=want)
                    if oldest < want:  # it restarted unnoticed (on its initial weights): never serve those
                        self._take_out(r, f"it served version {oldest} < {want} (restarted?)")
                        pending.extend(chunk)
                        continue
                    with self._lock:
                        r.tokens += sum(len(s.response_ids) for per_prompt in samples for s in per_prompt)
                    for i, per_prompt in zip(chunk, samples):
                        for s in per_prompt:
                            s.prompt_index = i
                        done[i] = per_prompt
        finally:
            for fut, (r, chunk, _) in running.items():  # an error above: do not count their tokens forever
                fut.cancel()
                with self._lock:
                    r.in_flight -= sum(costs[i] for i in chunk)
        return [done[i] for i in range(len(prompts))]

    def score(
        self, items: list[tuple[list[int], list[int]]], *, temperature: float = 1.0, logprobs: int = 0, routing=False
    ) -> list[dict]:
        """RolloutClient.score on the least-loaded replica (another one if it is down)."""
        return self._one(
            "Score",
            sum(len(p) + len(r) for p, r in items),
            lambda c: c.score(items, temperature=temperature, logprobs=logprobs, routing=routing),
        )

    def info(self) -> dict:
        """RolloutClient.info of a replica in rotation, with `replicas`: how many the fleet has."""
        return dict(self._one("Info", 0, lambda c: c.info()), replicas=len(self.replicas))

    def _one(self, what: str, cost: int, call):
        self._revive()
        start, last_log = time.monotonic(), [time.monotonic()]
        while True:
            placed = self._pick([cost])
            if not placed:
                self._wait_for_replica(what, start, last_log)
                continue
            r = placed[0]
            try:
                return call(r.client)
            except RolloutError as err:
                if err.code not in _DOWN:
                    raise
                self._take_out(r, str(err))
            finally:
                with self._lock:
                    r.in_flight -= cost

    def health(self, service: str = "") -> str:
        """SERVING when any replica serves, else the first replica's status (raises as RolloutClient.health when
        none answers)."""
        error, first = None, None
        for r in self.replicas:
            try:
                status = r.client.health(service)
            except grpc.RpcError as err:
                error = error or err
                continue
            if status == "SERVING":
                return status
            first = first or status
        if first is None:
            raise error
        return first

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every replica serves (RolloutError naming the first that does not)."""
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            r.client.wait_ready(max(deadline - time.monotonic(), 0.0))

    # ------------------------------------------------------------------ weights
    def update_weights(self, path: str, *, version: int = 0, checksums: bool | dict = True, check=None) -> int:
        """RolloutClient.update_weights on every replica in parallel (those out of rotation too, when they serve):
        the version they all hold. A replica that fails is out of rotation (it gets this directory when it is back).
        With every replica down, it waits (as `generate` does, up to retry_s) for one to come back and sends it the
        directory; another error on every replica is raised.

        `check(client) -> (passed, detail, message)` (the publisher's weight canary): run on each replica after its reload,
        before it gets new work (replicas reloading take none); one that fails is quarantined: out of rotation until
        a later checked update passes. `last_checks` holds each replica's outcome; with a check, the version is
        served even when every replica failed it (the caller decides)."""
        if checksums is True:  # computed once here, not once per replica
            checksums = manifest_lib.recorded_checksums(path) or client_lib.sha256_manifest(path)
        start = time.monotonic()
        with self._update_lock:
            version = version or self.expected_version + 1
            updated = self._to_all(
                lambda r: r.client.update_weights(path, version=version, checksums=checksums), version, check=check
            )
            # a replica that is back later is sent this directory; with none updated, they all are (in the wait below)
            self._restore, self.expected_version = (path, checksums), version
        if not updated:
            self._wait_for_replica("UpdateWeights", start, [start])
        return version

    def update_weights_from_tensors(self, tensors, *, version: int = 0, chunk_bytes: int = 1 << 20, check=None) -> int:
        """RolloutClient.update_weights_from_tensors on every replica in parallel; `tensors.items()` is read once
        and each tensor handed to every replica's stream (at most a few tensors on the host per replica). A replica
        that fails is out of rotation until the next update (streamed tensors cannot be sent again); RolloutError
        when none took it. `check` as in update_weights."""
        with self._update_lock:
            version = version or self.expected_version + 1
            targets = self._update_targets()
            fan = Fanout(tensors, [r.index for r in targets])

            def send(r):
                try:
                    return r.client.update_weights_from_tensors(
                        fan.view(r.index), version=version, chunk_bytes=chunk_bytes
                    )
                finally:
                    fan.stop(r.index)  # done, or failed part-way

            producer = self._updates.submit(fan.run)
            errors: list = []
            updated = self._to_all(send, version, targets=targets, errors=errors, check=check)
            producer.result()
            if not updated:
                raise errors[0] if errors else self._none_serving()
            self._restore, self.expected_version = None, version
        return version

    def update_weights_each(self, send, *, version: int = 0, check=None) -> int:
        """`send(client) -> version` on every replica in parallel (the publisher's delta, or the full set to a replica
        that refused it: each replica may hold another version). A replica that fails is out of rotation until the
        next update (which it is sent whole); RolloutError when none took it. `check` as in update_weights."""
        with self._update_lock:
            version = version or self.expected_version + 1
            errors: list = []
            updated = self._to_all(lambda r: send(r.client), version, errors=errors, check=check)
            if not updated:
                raise errors[0] if errors else self._none_serving()
            self._restore, self.expected_version = None, version
        return version

    def _none_serving(self) -> RolloutError:
        return RolloutError(f"UpdateWeights: no rollout replica serving ({self.target})", grpc.StatusCode.UNAVAILABLE)

    def _update_targets(self) -> list[Replica]:
        """Replicas a weight update goes to: those in rotation and those out of it that serve again."""
        out = []
        for r in self.replicas:
            if not r.in_rotation:
                try:
                    if r.client.health() != "SERVING":
                        continue
                except grpc.RpcError:
                    continue
            out.append(r)
        return out

    def _to_all(
        self, send, version: int, targets: list[Replica] | None = None, errors: list | None = None, check=None
    ) -> bool:
        """send(replica) on every target in parallel, each to report `version`, then `check` it (while on probation:
        no new work). Those that report it and pass are in rotation on it; one that fails its check is quarantined;
        every other replica is out of rotation (its error appended to `errors`). Whether any replica holds `version`
        now; raises the first error when none does and not every failure was UNAVAILABLE (a bad export, not replicas
        down)."""
        targets = self._update_targets() if targets is None else targets
        errors = [] if errors is None else errors
        if check is not None:
            self._check, self.last_checks = check, {}
            with self._lock:
                for r in targets:
                    r.probation = True
        try:
            jobs = {r.index: self._updates.submit(send, r) for r in targets}
            updated, failed = [], []
            for r in targets:
                try:
                    got = jobs[r.index].result()
                except RolloutError as err:
                    failed.append((r, err))
                    continue
                if got != version:
                    msg = f"{r.client.target} reports version {got} after update to {version}"
                    failed.append((r, RolloutError(msg)))
                    continue
                updated.append(r)
            errors.extend(err for _, err in failed)
            if not updated and any(err.code not in _DOWN for err in errors):
                raise errors[0]
            for r, err in failed:
                self._take_out(r, f"weight update to version {version} failed: {err}")
            with self._lock:
                self.expected_version = version if updated else self.expected_version
                for r in updated:
                    r.version = version
            passed = set()
            if check is not None:  # in parallel: each replica's check is its own scoring call
                checks = {r.index: self._updates.submit(self._run_check, r, check, True) for r in updated}
                for r in updated:
                    try:
                        if checks[r.index].result():
                            passed.add(r.index)
                    except RolloutError as err:  # down during its check
                        self._take_out(r, f"down during its check: {err}")
            else:
                passed = {r.index for r in updated if not r.quarantined}
            with self._lock:
                for r in self.replicas:
                    if r.index in passed:
                        if r.rejoin():
                            log.warning(
                                "rollout replica %d (%s) rejoined on version %d", r.index, r.client.target, version
                            )
                    elif r.version != version:  # not reached: it must not serve the old version
                        r.take_out()
            return bool(updated)
        finally:
            with self._lock:
                for r in targets:
                    r.probation = False

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Per replica, for the loop's log: Replica.metrics of each (tokens/s since the last call, in-flight tokens,
        weights version, in rotation, failures, rejoins, check failures, process restarts)."""
        now = time.monotonic()
        with self._lock:
            return {k: v for r in self.replicas for k, v in r.metrics(now).items()}
