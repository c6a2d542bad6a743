"""The vLLM backend's routing capture, worker side: the routers' expert ids of each forward, split per request and position.

vLLM's own routed-experts capture needs its V2 model runner (not on CPU); this one hooks the V1 runner (which
cisjax.rollout.engine_env keeps vLLM on) through the routers' capture callback that vLLM's own capture uses. The
functions taking a `worker` run inside the engine's worker (`LLM.collective_rpc`), STORE being that process's store."""

from __future__ import annotations

import numpy as np


class RoutingStore:
    """Worker side of the routing capture: the routers' ids of each forward, split per request and position.

    The V1 model runner lays a step's tokens out request by request in `input_batch.req_ids` order,
    `num_scheduled_tokens` each, request i's first one at position `num_computed_tokens_cpu[i]`
    (`_prepare_inputs`); that layout is recorded as the step is prepared, and the rows the routers saw
    in its forward are split along it once the forward has run."""

    def __init__(self):
        self.step = None  # (req ids, tokens each, first position each) of the forward being run
        self.ids: list = []  # (MoE layer, routed ids [tokens, k]) of that forward
        self.requests: dict = {}  # internal request id -> [prompt ids, [(first position, ids [n, layers, k])]]

    def clear(self) -> None:
        self.step, self.ids, self.requests = None, [], {}

    def begin(self, runner, num_scheduled) -> None:
        n = runner.input_batch.num_reqs
        self.step = (
            list(runner.input_batch.req_ids[:n]),
            np.asarray(num_scheduled[:n], np.int64).copy(),
            np.asarray(runner.input_batch.num_computed_tokens_cpu[:n], np.int64).copy(),
        )
        self.ids = []

    def end(self, runner, layers: int) -> None:
        step, captured = self.step, self.ids
        self.step, self.ids = None, []
        if step is None:
            if captured:
                raise RuntimeError("routing capture: the routers ran in a forward that no scheduled step laid out")
            return
        req_ids, counts, starts = step
        total = int(counts.sum())
        per_layer = [[] for _ in range(layers)]
        for layer, ids in captured:
            per_layer[layer].append(ids)
        stacked = []
        for layer, parts in enumerate(per_layer):
            rows = np.concatenate(parts) if parts else np.zeros((0, 0), np.int32)
            if rows.shape[0] > total:  # rows past the scheduled tokens must be the runner's padding
                padding = getattr(runner, "is_padding", None)
                pad = None if padding is None else padding[: rows.shape[0]].cpu().numpy()
                if pad is None or pad[:total].any() or not pad[total:].all():
                    raise RuntimeError(
                        f"routing capture: MoE layer {layer} routed {rows.shape[0]} tokens in a step that scheduled "
                        f"{total}, and the extra rows are not the model runner's padding"
                    )
                rows = rows[:total]
            if rows.shape[0] != total:
                raise RuntimeError(
                    f"routing capture: MoE layer {layer} routed {rows.shape[0]} tokens in a step that scheduled {total}"
                )
            stacked.append(rows)
        rows = np.stack(stacked, axis=1)  # [tokens, layers, k]
        offset = 0
        for rid, count, start in zip(req_ids, counts.tolist(), starts.tolist()):
            if count:
                rec = self.requests.get(rid)
                if rec is None:
                    rec = self.requests[rid] = [tuple(runner.requests[rid].prompt_token_ids), []]
                rec[1].append((start, rows[offset : offset + count]))
            offset += count

    def positions(self, rid: str, n: int, seen: frozenset = frozenset()):
        """Rows [n, layers, k] of positions 0 .. n-1 of a request; a prefix it read from the prefix cache taken from
        the request of this phase that computed it (the same prompt tokens up to there)."""
        rec = self.requests.get(rid)
        if rec is None:
            raise RuntimeError(f"routing capture: no forward of request {rid} was captured")
        prompt, chunks = rec
        out, filled = None, np.zeros(n, bool)
        for start, rows in chunks:  # in step order: a recomputation (after a preemption) overwrites
            m = min(len(rows), n - start)
            if m > 0:
                if out is None:
                    out = np.empty((n, *rows.shape[1:]), rows.dtype)
                out[start : start + m] = rows[:m]
                filled[start : start + m] = True
        missing = np.flatnonzero(~filled)
        if missing.size == 0:
            return out
        cached = int(missing[-1]) + 1
        if missing.size != cached or cached >= len(prompt) or out is None:
            raise RuntimeError(
                f"routing capture: request {rid} has no routing for {missing.size} of its {n} positions "
                f"(first {int(missing[0])}), not a prefix of its prompt"
            )
        head = prompt[:cached]
        sources = [  # requests that computed some of the prefix themselves (the rest, if any, from their own source)
            (chunks_[0][0], other)
            for other, (p, chunks_) in self.requests.items()
            if chunks_
            and chunks_[0][0] < cached
            and other != rid
            and other not in seen
            and len(p) > cached
            and p[:cached] == head
        ]
        if sources:
            out[:cached] = self.positions(min(sources)[1], cached, seen | {rid})
            return out
        raise RuntimeError(
            f"routing capture: prompt positions 0..{cached - 1} of request {rid} came from the prefix cache, "
            "but no request of this routing phase computed them"
        )


STORE = RoutingStore()  # in the worker's process (the engine's own, in-process)


def install(worker, on: bool) -> int:
    """Install (or remove) the routing capture: a callback on every fused-MoE router of the model and, around
    the model runner's `_prepare_inputs` and `execute_model`, the bookkeeping that splits each forward's rows per
    request (`RoutingStore`); runs inside the worker, returns the number of MoE layers. Either way the store starts
    empty.

    vLLM's own routed-experts capture needs its V2 model runner (not on CPU); the routers' capture
    hook is the same one it uses, called with the logical expert ids each layer routes to."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter  # lazy: vllm

    runner = worker.model_runner
    if on and not all(hasattr(runner, a) for a in ("_prepare_inputs", "input_batch", "requests")):
        raise RuntimeError(f"routing capture needs vLLM's V1 model runner, not {type(runner).__name__}")
    n = 0
    for module in runner.get_model().modules():
        router = getattr(module, "router", None)
        if isinstance(router, FusedMoERouter):
            fn = (
                (lambda ids, layer=n: STORE.ids.append((layer, ids.detach().cpu().numpy().astype(np.int32))))
                if on
                else None
            )
            router.set_capture_fn(fn)
            n += 1
    STORE.clear()
    for name in ("_prepare_inputs", "execute_model"):
        runner.__dict__.pop(name, None)  # the class's own method again
    if on:
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            STORE.begin(runner, num_scheduled_tokens)
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(*args, **kwargs):
            STORE.step, STORE.ids = None, []
            try:
                out = execute(*args, **kwargs)
            except BaseException:
                STORE.step, STORE.ids = None, []
                raise
            STORE.end(runner, n)
            return out

        runner._prepare_inputs, runner.execute_model = _prepare_inputs, execute_model
    return n


def read(worker, wanted: list) -> list:
    """[(internal request id, positions n)] -> their captured rows [n, layers, k]; runs inside the worker."""
    return [STORE.positions(rid, n) for rid, n in wanted]


def split(captured, prompt_len: int, count: int):
    """(prompt rows, response rows) of a request's captured routing ([positions, layers, k]): positions
    0 .. prompt_len - 2 (the prefill's), then the passes that produced the `count` tokens after the prompt."""
    first = prompt_len - 1
    if captured.shape[0] < first + count:
        raise RuntimeError(f"routing capture has {captured.shape[0]} positions, expected at least {first + count}")
    return captured[:first], captured[first : first + count]
