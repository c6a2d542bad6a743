"""Math rewards: answers.verify (or an injected scorer) in a spawn process pool with hard per-item timeouts."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from cisjax import errors
from cisjax.answers import verify

log = logging.getLogger(__name__)

__all__ = ["RewardPool"]


# ----------------------------------------------------------------------------- the pool


def _resolve(fn: Callable | str) -> Callable:
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(conn, fn_spec) -> None:
    """A pool worker: (index, text, reference) in, ("ok", index, score) or ("err", index, message) out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes the pool
    try:
        fn = _resolve(fn_spec)
        # import sympy and build math-verify's parsers (about 1 s) before the first timed item; done for any
        # fn, since injected ones usually wrap verify
        verify("\\boxed{1}", "1")
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("fail", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if msg is None:
            return
        i, text, ref = msg
        try:
            conn.send(("ok", i, float(fn(text, ref))))
        except Exception as e:  # noqa: BLE001 - one bad item scores 0, the worker lives on
            conn.send(("err", i, f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, fn_spec):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, fn_spec), daemon=True, name="cisjax-reward")
        self.proc.start()
        child.close()  # so that the worker's death reads as EOF here
        self.started_at = time.monotonic()
        self.ready = False
        self.item: int | None = None  # the index it is scoring
        self.item_started = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """`score(texts, refs) -> list[float]` with `fn` (default: `verify`) in `workers` spawn processes.

    A hard timeout per item (`timeout_s`, from when a worker takes it): a hanging item scores 0.0, is
    counted in `timed_out`, and its worker is killed and replaced. (The default is above verify's three
    math-verify timeouts, so that a merely slow item ends there, scoring 0, and keeps its worker.) A worker that dies (killed, crashed)
    is replaced and its item re-run once; an item that kills its worker twice scores 0.0 (`crashed`).
    An item whose `fn` raises scores 0.0 (`errors`, message in `last_error`). `batch_deadline_s` bounds a
    whole call: whatever is unfinished by then scores 0.0 (counted as timed out). Counters are
    cumulative (`metrics()`); `restarts` counts replaced workers.

    `fn(text, reference) -> float` must be importable in a fresh process: a module-level function, or a
    "module:name" string. Own processes rather than ProcessPoolExecutor: the pool knows which worker runs
    which item since when, so it kills only the hung one, and the others keep going.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 10.0,
        batch_deadline_s: float = 300.0,
        *,
        fn: Callable[[str, str], float] | str = verify,
        start_timeout_s: float = 120.0,
    ):
        if workers < 1 or timeout_s <= 0 or batch_deadline_s <= 0:
            raise errors.UserError(
                f"need workers >= 1 and positive timeouts, got workers={workers}, timeout_s={timeout_s}, batch_deadline_s={batch_deadline_s}"
            )
        if isinstance(fn, str):
            if ":" not in fn:
                raise ValueError(f"fn {fn!r}: expected 'module:function'")
        else:
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise ValueError(
                    f"fn {fn!r} cannot be sent to a spawned process: use a module-level function or a 'module:function' string"
                ) from e
        self.n_workers, self.timeout_s, self.batch_deadline_s = workers, float(timeout_s), float(batch_deadline_s)
        self.start_timeout_s = start_timeout_s
        self._fn = fn
        self._ctx = multiprocessing.get_context("spawn")  # fork would copy the trainer's threads and JAX state
        self._lock = threading.Lock()
        self.timed_out = self.restarts = self.crashed = self.errors = 0
        self.last_error: str | None = None
        self._workers: list[_Worker] = []
        self._closed = False
        self._start_failures = 0  # consecutive workers that died before they were ready
        try:
            self._workers = [_Worker(self._ctx, fn) for _ in range(workers)]
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # -- public

    def metrics(self) -> dict[str, int]:
        return {"timed_out": self.timed_out, "restarts": self.restarts, "crashed": self.crashed, "errors": self.errors}

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def score(
        self,
        texts: Sequence[str],
        refs: Sequence[str],
        *,
        deadline_s: float | None = None,
        outcomes: list | None = None,
    ) -> list[float]:
        """One score per (text, reference) pair, in order; `deadline_s` overrides `batch_deadline_s`. A list passed
        as `outcomes` is filled with how each item ended: "ok" (scored by fn), "timeout" (past `timeout_s` or the
        deadline), "error" (fn raised) or "crashed" (killed its worker twice); all but "ok" score 0.0."""
        if len(texts) != len(refs):
            raise ValueError(f"score: {len(texts)} texts but {len(refs)} references")
        for name, seq in (("texts", texts), ("refs", refs)):
            bad = next((i for i, x in enumerate(seq) if not isinstance(x, str)), None)
            if bad is not None:
                raise TypeError(f"score: {name}[{bad}] is {type(seq[bad]).__name__}, not str")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            try:
                status = ["ok"] * len(texts)
                scores = self._score(
                    list(texts), list(refs), time.monotonic() + (deadline_s or self.batch_deadline_s), status
                )
                if outcomes is not None:
                    outcomes[:] = status
                return scores
            except BaseException:
                for w in list(self._workers):  # an abandoned call (Ctrl-C, a fatal error): drop its in-flight items
                    if w.item is not None and not self._closed:
                        self._replace(w)
                raise

    def close(self) -> None:
        """Stop the workers: idle ones exit on request, busy or still starting ones are killed (no state to lose).
        A score call in flight on another thread then raises RuntimeError."""
        self._closed = True
        for w in self._workers:
            if w.ready and w.item is None:
                try:
                    w.conn.send(None)
                except (OSError, ValueError):
                    pass
        for w in self._workers:
            if w.ready and w.item is None:
                w.proc.join(timeout=1)
            w.kill()
        self._workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals

    def _wait_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            self._handle(self._poll(time.monotonic() + 1.0), results=None, attempts=None, pending=None, status=None)

    def _check_open(self) -> None:
        # close() may run on another thread while a score call is in flight (the trainer's shutdown): the call
        # then ends here rather than replacing the workers close() just killed
        if self._closed:
            raise RuntimeError("RewardPool was closed during the call")

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._check_open()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self._fn)
        self.restarts += 1

    def _poll(self, until: float) -> list[_Worker]:
        """Workers with something to read (a message, or EOF from a dead one) before `until`."""
        by_conn = {w.conn: w for w in self._workers}
        try:
            ready = multiprocessing.connection.wait(list(by_conn), timeout=max(0.0, until - time.monotonic()))
        except (OSError, ValueError):  # a connection close() just closed
            self._check_open()
            raise
        return [by_conn[c] for c in ready]

    def _handle(self, readable, results, attempts, pending, status) -> None:
        for w in readable:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None:  # died: replace it; a death mid-item re-runs the item once
                self._check_open()  # (or close() killed it)
                w.proc.join(timeout=1)  # reap it, for the exit code
                if not w.ready:
                    # a deterministic start-up failure reports "fail"; a bare death (OOM killer, a stray
                    # signal) gets a few fresh tries before the pool gives up
                    self._start_failures += 1
                    if self._start_failures > 3:
                        raise RuntimeError(
                            f"reward worker (fn {self._fn!r}) exited with code {w.proc.exitcode} while starting, {self._start_failures} times in a row"
                        )
                i = w.item
                if i is not None:
                    attempts[i] += 1
                    if attempts[i] < 2:
                        pending.appendleft(i)
                    else:
                        self.crashed += 1
                        results[i] = 0.0
                        status[i] = "crashed"
                log.warning("reward worker %d died (exit code %s); replacing it", w.proc.pid, w.proc.exitcode)
                self._replace(w)
            elif msg[0] == "ready":
                w.ready = True
                self._start_failures = 0
            elif msg[0] == "fail":
                raise RuntimeError(f"reward worker cannot start fn {self._fn!r}: {msg[1]}")
            else:
                kind, i, value = msg
                if kind == "err":
                    self.errors += 1
                    self.last_error = value
                    value = 0.0
                if w.item == i:
                    results[i] = value
                    if kind == "err":
                        status[i] = "error"
                w.item = None
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.started_at > self.start_timeout_s:
                raise RuntimeError(f"reward worker (fn {self._fn!r}) not ready after {self.start_timeout_s:.0f} s")

    def _score(self, texts, refs, deadline, status) -> list[float]:
        n = len(texts)
        results: list[float | None] = [None] * n
        attempts = [0] * n
        pending = deque(range(n))
        while True:
            self._check_open()
            for w in self._workers:  # hand out work
                if w.ready and w.item is None and pending:
                    w.item, w.item_started = pending.popleft(), time.monotonic()
                    try:
                        w.conn.send((w.item, texts[w.item], refs[w.item]))
                    except OSError:
                        pass  # it just died: the poll below reads its EOF and re-runs the item
            busy = [w for w in self._workers if w.item is not None]
            if not busy and not pending:
                return [0.0 if r is None else r for r in results]
            until = min([deadline] + [w.item_started + self.timeout_s for w in busy])
            self._handle(self._poll(until), results, attempts, pending, status)
            now = time.monotonic()
            for w in [w for w in self._workers if w.item is not None and now - w.item_started >= self.timeout_s]:
                log.warning("reward item %d timed out after %.1f s; replacing its worker", w.item, self.timeout_s)
                results[w.item] = 0.0
                status[w.item] = "timeout"
                self.timed_out += 1
                self._replace(w)
            if now >= deadline:
                unfinished = [w for w in self._workers if w.item is not None]
                self.timed_out += len(pending) + len(unfinished)
                log.warning("reward batch deadline: %d items unscored, scored 0", len(pending) + len(unfinished))
                for i in [w.item for w in unfinished] + list(pending):
                    results[i] = 0.0
                    status[i] = "timeout"
                for w in unfinished:
                    self._replace(w)
                pending.clear()
