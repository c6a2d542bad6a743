"""vLLM Backend: an in-process `vllm.LLM` over token ids (no tokenizer), continuously batching concurrent calls.

One engine thread owns the engine: it admits the requests of every call in flight, steps the
engine and resolves each call's future as its requests finish (continuous batching). Weight
reloads are exclusive: new requests wait while the engine drains, the reload runs, then they are
admitted — so every token of a sample has one weights version. Calls that return routing run in
routing phases, exclusive of the other calls but batched among themselves: on an idle engine the
prefix cache is emptied and the capture turned on, the routing calls waiting (and those arriving
while nothing else waits) run together, and each forward's routed ids are split per request and
position (cisjax.engines.vllm.routing_capture); a prompt prefix read from the prefix cache gets the rows of the request
of the phase that computed it.

Each reported logprob is that of the distribution actually sampled from (vLLM's
logprobs_mode="processed_logprobs": after temperature, top-k and top-p). Per-sample seeds are
derived as in the transformers backend (`sample_seed`), so a prompt resent alone samples exactly
as in its original batch; the two backends draw different random numbers, though, so the same
seed gives different samples on each.

The environment the engine needs (cisjax.rollout.engine_env) is applied, where unset, when a Backend is constructed,
before vLLM is first imported: VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process), VLLM_CPU_KVCACHE_SPACE
(GiB of KV cache on CPU; unset, vLLM takes ~11 GiB), TORCH_COMPILE_DISABLE=1, VLLM_USE_V2_MODEL_RUNNER=0 (the routing
capture reads the V1 model runner's token layout), and VLLM_TARGET_DEVICE=cpu with vLLM's CPU build.
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
import weakref
from concurrent import futures
from pathlib import Path

from cisjax.engines.vllm import results as vllm_results
from cisjax.engines.vllm import routing_capture
from cisjax.engines.vllm.platform import (
    MLA_ARCHITECTURES,
    attention_backends,
    check_device,
    choose_attention,
    cpu_has_amx,
    named_attention,
    native_rope,
    on_cpu,
    prepack_moe,
    request_attention,
)
from cisjax.engines.vllm.work import Call, Cancel, Exclusive, Stop, Work, run_exclusive
from cisjax.rollout import backend as backend_lib
from cisjax.rollout import engine_env, weights
from cisjax.rollout.backend import RequestError, sample_seed
from cisjax.rollout.params import SamplingParams

log = logging.getLogger("cisjax.serve.vllm")


class Backend(backend_lib.Backend):
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
        engine_env.apply()  # before vLLM is first imported (check_device imports it)
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
        self._owned_dir = self._owned_cleanup = None  # load_tensors' temp dir; its removal (a finalizer: also at exit)
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
        self._inbox: queue.SimpleQueue[Call | Exclusive | Cancel | Stop] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    def _start(self, weights_dir: Path):
        """A fresh engine on the model's config (and, when `weights_dir` is another export, its weights; on TPU the
        engine loads `weights_dir` itself, an HF directory with its config.json, as it has no in-place reload)."""
        import vllm  # lazy: vllm

        # vLLM's start runs full garbage collections (its loader, the engine core), each over every object the imports
        # of torch and vLLM made; those live as long as the process: frozen first, the collections skip them
        gc.collect()
        gc.freeze()
        options, why = self._attention_options()
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
            enable_chunked_prefill=not on_cpu(),
            **options,
        )
        # the backends the layers took (tpu-inference's runner is not torch's: not read there)
        self.attention = [] if self.platform == "tpu" else llm.collective_rpc(attention_backends)[0]
        log.info("attention: %s (%s)", ", ".join(self.attention) or "vLLM's", why)
        if self.architecture in MLA_ARCHITECTURES and on_cpu():
            log.info(
                "MLA on CPU: %s rotary embeddings switched to the torch-native path", llm.collective_rpc(native_rope)
            )
        if Path(weights_dir) != Path(self.model) and self.platform != "tpu":
            self._reload(llm, weights_dir)
        if self.platform == "tpu":
            self.moe_layers = 0  # no routing capture (see __init__)
        else:
            self.moe_layers = llm.collective_rpc(routing_capture.install, args=(False,))[0]  # and an empty store
        return llm

    def _attention_options(self) -> tuple[dict, str]:
        """The engine options with the attention backend cisjax requests (platform.choose_attention: CPU_MLA for
        an fp32 MLA model on a CPU with AMX tiles), unless they name one; and why, for the start-up log."""
        if named_attention(self.engine_options) is not None:
            return dict(self.engine_options), "set in the engine options"
        mla = self.architecture in MLA_ARCHITECTURES
        amx = self.platform == "cpu" and cpu_has_amx()
        choice = choose_attention(amx=amx, dtype=self.dtype, mla=mla, platform=self.platform)
        return request_attention(self.engine_options, choice.backend), choice.why

    @staticmethod
    def _reload(llm, weights_dir: Path) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        if on_cpu():  # the stale expert layout is the CPU MoE kernel's (prepack_moe)
            repacked = llm.collective_rpc(prepack_moe)
            log.info("reloaded %s; repacked %s fused-MoE layers", weights_dir, repacked)
        else:
            log.info("reloaded %s", weights_dir)
        llm.reset_prefix_cache()

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        work = Work()
        while True:
            block = work.idle()
            while True:  # take everything that arrived; wait only when there is nothing to do
                try:
                    msg = self._inbox.get(block=block, timeout=None)
                except queue.Empty:
                    break
                block = False
                if isinstance(msg, Stop):
                    err = RuntimeError("the server is shutting down")
                    self._fail([*work.admitted.values(), *work.held, *work.exclusive], err)
                    return
                self._receive(msg, work)
            try:
                self._advance(work)
            except Exception as err:  # the engine broke mid-step: fail what was in flight, restart it
                log.exception("vLLM engine step failed; restarting the engine")
                self._fail(work.admitted.values(), err)
                work.admitted.clear()
                work.phase = False  # the fresh engine has no capture installed
                try:
                    self._restart()
                except Exception:
                    log.exception("vLLM engine restart failed")

    def _receive(self, msg: Call | Exclusive | Cancel, work: Work) -> None:
        match msg:
            case Call(routing=True) if work.phase and not work.exclusive and not work.held:
                self._admit(msg, work.admitted)  # joins the phase running (its cache, its capture)
            case Call(routing=True) | Exclusive():
                work.exclusive.append(msg)
            case Call() if work.exclusive or work.phase:
                work.held.append(msg)
            case Call():
                self._admit(msg, work.admitted)
            case Cancel():
                self._cancel(msg.future, work)

    def _advance(self, work: Work) -> None:
        """End a routing phase that ran out of calls; start exclusive work on an idle engine (a reload, or a routing
        phase with the routing calls at the head of the queue), else admit the held calls; then step the engine."""
        if work.phase and not work.admitted:
            work.phase = False
            self.llm.collective_rpc(routing_capture.install, args=(False,))
        if work.exclusive and not work.admitted:
            if isinstance(work.exclusive[0], Call):
                work.phase = self._begin_routing_phase(work.exclusive)
                while work.exclusive and isinstance(work.exclusive[0], Call):
                    self._admit(work.exclusive.popleft(), work.admitted)
            else:
                run_exclusive(work.exclusive.popleft())
        elif work.held and not work.exclusive and not work.phase:
            while work.held:
                self._admit(work.held.popleft(), work.admitted)
        if work.admitted:
            for out in self.llm.llm_engine.step():
                if out.finished and out.request_id in work.admitted:
                    call = work.admitted.pop(out.request_id)
                    call.outputs[out.request_id] = out
                    if len(call.outputs) == len(call.requests):
                        self._resolve(call)

    def _begin_routing_phase(self, exclusive: collections.deque) -> bool:
        """The engine is idle: empty the prefix cache, so that every cached prefix a routing call reads was computed,
        and captured, in this phase; then capture on. On failure, the routing calls waiting fail (the phase does not
        start), other exclusive work stays queued."""
        try:
            if self.llm.llm_engine.has_unfinished_requests():  # the capture would mix in other requests' tokens
                raise RuntimeError("routing capture needs an idle engine, but requests are still running")
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("routing capture: vLLM did not reset its prefix cache")
            self.llm.collective_rpc(routing_capture.install, args=(True,))
        except Exception as err:  # noqa: BLE001
            while exclusive and isinstance(exclusive[0], Call):
                call = exclusive.popleft()
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(err)
            return False
        return True

    def _admit(self, call: Call, admitted: dict) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        call.version, call.started = self.version, time.monotonic()
        added = []
        try:
            for rid, prompt, sp in call.requests:
                call.internal[rid] = self.llm.llm_engine.add_request(rid, prompt, sp)  # the id the worker sees
                added.append(rid)
                admitted[rid] = call
        except Exception as err:
            for rid in added:
                admitted.pop(rid, None)
            if added:
                self.llm.llm_engine.abort_request(added, internal=False)  # our (external) ids
            call.future.set_exception(err)

    def _resolve(self, call: Call) -> None:
        try:
            outs = [call.outputs[rid] for rid, _, _ in call.requests]
            if call.routing:  # every position each request ran through the model: its prompt, all but its last token
                wanted = [
                    (call.internal[rid], len(prompt["prompt_token_ids"]) + len(out.outputs[0].token_ids) - 1)
                    for (rid, prompt, _), out in zip(call.requests, outs)
                ]
                call.captured = self.llm.collective_rpc(routing_capture.read, args=(wanted,))[0]
            call.future.set_result(call.finish(call, outs))
        except Exception as err:  # noqa: BLE001  (a conversion or capture error belongs to this call only)
            call.future.set_exception(err)

    def _cancel(self, future: futures.Future, work: Work) -> None:
        gone = [rid for rid, c in work.admitted.items() if c.future is future]
        for rid in gone:
            del work.admitted[rid]
        if gone:
            self.llm.llm_engine.abort_request(gone, internal=False)  # our (external) ids
        for c in list(work.held):
            if c.future is future:
                work.held.remove(c)
        future.cancel()

    @staticmethod
    def _fail(items, err: BaseException) -> None:
        """Fail the future of each call or exclusive work in `items` that is not done yet."""
        for item in {id(c): c for c in items}.values():
            if not item.future.done():
                item.future.set_exception(err)

    def _submit(self, requests: list, finish, routing: bool) -> futures.Future:
        future: futures.Future = futures.Future()
        self._inbox.put(Call(requests, finish, future, routing))
        return future

    def _exclusive(self, fn):
        future: futures.Future = futures.Future()
        self._inbox.put(Exclusive(fn, future))
        return future.result()

    def cancel(self, future: futures.Future) -> None:
        self._inbox.put(Cancel(future))

    # ------------------------------------------------------------------ generate and score
    def submit_generate(self, prompt_ids, prompt_id, params: SamplingParams) -> futures.Future:
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        common = dict(
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(params.stop_token_ids),
            ignore_eos=True,
            logprobs=params.logprobs,
            skip_special_tokens=False,
        )
        requests = []
        for j in range(params.n):
            if params.greedy:
                sampling = dict(n=1, temperature=0.0, **common)
            else:
                sampling = dict(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k or 0,
                    seed=sample_seed(seed, prompt_id, j),
                    **common,
                )
            requests.append((f"g{next(self._ids)}", *_request(prompt_ids, **sampling)))

        def finish(call: Call, outs: list) -> list:
            return vllm_results.samples(
                outs,
                params,
                len(prompt_ids),
                version=call.version,
                started=call.started,
                captured=call.captured if call.routing else None,
            )

        return self._submit(requests, finish, params.return_routing)

    def submit_score(self, prompt_ids, response_ids, temperature, top_k, routing) -> futures.Future:
        full = temperature != 1.0
        seq = list(prompt_ids) + list(response_ids)
        prompt, sp = _request(seq, max_tokens=1, temperature=0.0, prompt_logprobs=-1 if full else top_k)

        def finish(call: Call, outs: list) -> dict:
            captured = call.captured if routing else None
            response = list(response_ids)
            return vllm_results.scored(
                outs[0], len(prompt_ids), response, temperature, top_k, version=call.version, captured=captured
            )

        return self._submit([(f"s{next(self._ids)}", prompt, sp)], finish, routing)

    # ------------------------------------------------------------------ weights
    def update(self, kind: str, source, version: int) -> None:
        if kind == "directory":
            self.load_directory(source, version)
        else:
            self.load_tensors(source, version)

    def load_directory(self, path: Path, version: int, *, owned: bool = False) -> None:
        path = Path(path)
        weights.check_same_model(path, self.config_json)
        missing = sorted(weights.checkpoint_tensor_names(self.model) - weights.checkpoint_tensor_names(path))
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
        if self._owned_cleanup is not None:  # the previous stream's dir: removed, unless it is this one again
            self._owned_cleanup() if self._owned_dir != path else self._owned_cleanup.detach()
        self._owned_dir = path if owned else None
        self._owned_cleanup = weakref.finalize(self, shutil.rmtree, path, True) if owned else None
        self.weights_dir = path
        self.version = version

    def _restart(self) -> None:
        self._shutdown_engine()
        self.llm = self._start(self.weights_dir)

    def load_tensors(self, tensors: dict, version: int) -> None:
        tmp = weights.write_weights_dir(tensors, self.config_json, self.model)
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
        self._inbox.put(Stop())
        self._thread.join(timeout=60)
        self._shutdown_engine()
        if self._owned_cleanup is not None:
            self._owned_cleanup()


def _request(prompt_ids, **sampling) -> tuple:
    """(TokensPrompt, SamplingParams) of one engine request: token ids in, token ids out, only its final output."""
    from vllm import SamplingParams, TokensPrompt  # lazy: vllm
    from vllm.sampling_params import RequestOutputKind  # lazy: vllm

    sp = SamplingParams(detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY, **sampling)
    return TokensPrompt(prompt_token_ids=list(prompt_ids)), sp
