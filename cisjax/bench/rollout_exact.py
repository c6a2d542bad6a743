"""`cisjax bench rollout --jax --exact`: the exact JAX sampler's tokens/s against the plain JAX sampler's, one run."""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path

from cisjax import errors
from cisjax.bench import harness, serving, workload
from cisjax.bench.serving import Server
from cisjax.rollout.client import RolloutClient

TARGET_RATIO = 0.5  # exact sampler tokens/s / the plain JAX sampler's, same requests (issue 49)
NAMES = {
    "jax": "plain JAX sampler (cisjax serve --backend jax), 1 client call",
    "exact": "exact JAX sampler (cisjax serve --backend jax --exact), 1 client call",
}


def check_args(args) -> None:
    """--exact: the two JAX samplers alone (no vLLM, no fleet, no TLS server)."""
    if not args.jax:
        raise errors.UserError("--exact times the exact JAX sampler against the plain one: give --jax with it")
    if args.replicas or args.tls:
        raise errors.UserError("--exact compares the two JAX samplers alone: not with --replicas or --tls")


def _call(target: str, prompts, params):
    """One Generate call with every prompt: [prompt][sample] -> (tokens, logprobs)."""
    with RolloutClient(target, timeout_s=3600.0, retry_s=120.0) as client:
        return [[(s.response_ids, s.logprobs) for s in per] for per in client.generate(prompts, params)]


def bench(args) -> dict:
    """Both samplers' servers started side by side on the same model and --dtype (the exact one holds the weights in
    fp32), a warm-up call each (it compiles their programs), then `--repeats` interleaved rounds on the same requests;
    the rows against the plain sampler."""
    res = dict(bench="rollout", mode="exact", config=harness.recorded(args), target_ratio=TARGET_RATIO)
    with tempfile.TemporaryDirectory(prefix="cisjax-bench-rollout-exact-") as tmp:
        tmp = Path(tmp)
        model_dir, hf = workload.model(args, tmp)
        prompts = workload.prompts(args, int(hf["vocab_size"]))
        max_model_len = int(hf.get("max_position_embeddings") or 4096)
        if max(map(len, prompts)) + args.max_new_tokens > max_model_len:
            raise errors.UserError(f"--prompt-len + --max-new-tokens exceed the model's context length {max_model_len}")
        res["model"] = workload.model_info(hf, workload.MODEL_KEYS)
        res["requests"] = workload.requests(args, prompts)
        res["loadavg_before"] = os.getloadavg()
        start = partial(Server, model_dir=model_dir, dtype=args.dtype, timeout_s=args.server_timeout, wait=False)
        servers = {
            "jax": start("jax", log_path=tmp / "jax_server.log"),
            "exact": start("jax", log_path=tmp / "exact_server.log", extra_args=("--exact",)),
        }
        try:
            for s in servers.values():
                s.wait()
            res["server_start_s"] = {k: s.start_s for k, s in servers.items()}
            params, _ = workload.sampling(args)
            runs = {k: partial(_call, s.target, prompts, params) for k, s in servers.items()}
            warm = {}
            for k, run in runs.items():  # untimed: the first call of a bucket compiles its programs
                warm[k] = harness.timed(run)[0]
            res["first_call_s"] = warm

            def cpu_s():  # CPU seconds of this process and both servers: less sensitive to other jobs
                server_s = [serving.proc_cpu_s(s.proc.pid) for s in servers.values()]
                return None if None in server_s else time.process_time() + sum(server_s)

            times = harness.interleave(runs, args.repeats, cpu_clock=cpu_s)
        except BaseException:
            serving.print_logs(servers)
            raise
        finally:
            res["loadavg_after"] = os.getloadavg()
            res["server_exit_codes"] = {k: s.stop() for k, s in servers.items()}
    res.update(_results(times))
    return res


def _results(times: harness.Timings) -> dict:
    """The rows against the plain sampler (with CPU seconds), the ratio of tokens/s and whether it meets the target."""
    tokens = {k: workload.tokens(out) for k, out in times.last.items()}
    rows = workload.throughput_rows(times, NAMES, tokens, "jax", paired_base=False)
    for row in rows:
        cpu = times.cpu_s[row["key"]]
        if cpu:
            row["cpu_s"] = harness.median(cpu)
            row["tokens_per_cpu_s"] = tokens[row["key"]] / row["cpu_s"]
    exact = next(r for r in rows if r["key"] == "exact")
    return dict(
        rows=rows,
        times_s=times.wall_s,
        ratio=exact["ratio"],
        ratio_paired=exact["ratio_paired"],
        meets_target=exact["ratio"] >= TARGET_RATIO,
        lengths={k: workload.lengths(out) for k, out in times.last.items()},
    )


def print_result(res: dict) -> None:
    c = res["config"]
    caption = (
        f"servers serving after {res['server_start_s']['jax']:.1f}s (plain) and {res['server_start_s']['exact']:.1f}s "
        f"(exact), side by side; first calls (compiling) {res['first_call_s']['jax']:.1f}s and "
        f"{res['first_call_s']['exact']:.1f}s; load average {res['loadavg_before'][0]:.1f} before, "
        f"{res['loadavg_after'][0]:.1f} after; medians of {c['repeats']} interleaved rounds; CPU s: this process + "
        "both servers'"
    )
    extra = {"CPU s": ("cpu_s", "{:.2f}"), "tokens/CPU-s": ("tokens_per_cpu_s", "{:.0f}")}
    console = workload.print_table(f"rollout exact: {workload.title(res)}", res["rows"], "vs plain", extra, caption)
    console.print(
        f"exact / plain JAX sampler tokens/s: {res['ratio']:.2f}x (median of paired ratios "
        f"{res['ratio_paired']:.2f}x); target >= {TARGET_RATIO:g}x: {harness.verdict(res['meets_target'])}"
    )
