"""`cisjax bench rollout --replicas N`: N pinned replicas behind a RolloutFleet vs one, tokens/s and weight publish time."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import flax.nnx as nnx
import jax

from cisjax import errors
from cisjax import export as export_lib
from cisjax.bench import harness, serving, tiny_model, workload
from cisjax.bench.serving import Server, engine_env
from cisjax.models import hf_io
from cisjax.rollout import manifest as manifest_lib
from cisjax.rollout import placement
from cisjax.rollout.client import RolloutClient
from cisjax.rollout.fleet import RolloutFleet

TARGET_PER_REPLICA = 0.8  # fleet tokens/s >= 0.8 x N x one replica's (each replica on as many cores as the one)
TARGET_PUBLISH = 1.5  # export + reload to the N replicas <= 1.5 x export + reload to one (the reloads run in parallel)


def add_args(f: argparse._ActionsContainer) -> None:
    """--replicas and --replica-cpus (in cisjax bench rollout's "replicas" group)."""
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


def core_sets(replicas: int, spec: str = "") -> list[list[int]]:
    """Each replica's cores: `spec` ("0|1", "0-1|2-3") or, by default, one core each, the first `replicas` cores this
    process may use. UserError when there are too few."""
    if spec:
        return [list(p.cpus) for p in placement.plan(replicas, cpus=spec, gpus="none")]
    mine = placement.allowed_cpus()
    if replicas > len(mine):
        raise errors.UserError(
            f"--replicas {replicas} pins one core each, but this process may use {len(mine)} ({placement.format_ids(mine)})"
        )
    return [[c] for c in mine[:replicas]]


def bench(args) -> dict:
    """Replica 0 alone, N replicas behind a RolloutFleet and one replica on all their cores, started side by side from
    one export of a random model; `--repeats` interleaved rounds of the three on the same requests, each round followed
    by a weight publish to replica 0 alone and to all N."""
    n = args.replicas
    sets = core_sets(n, args.replica_cpus)
    wide = sorted({c for s in sets for c in s})
    env = engine_env(args.kv_cache_gib)
    res = dict(
        bench="rollout_replicas",
        config=harness.recorded(args),
        engine_env=env,
        replica_cores=[placement.format_ids(s) for s in sets],
        target_ratio=TARGET_PER_REPLICA * n,
        target_publish_ratio=TARGET_PUBLISH,
    )
    work = Path(tempfile.mkdtemp(prefix="cisjax-bench-replicas-"))
    servers: dict[str, Server] = {}
    clients: list = []
    try:
        hf = tiny_model.hf_config(args, max_positions=max(128, args.prompt_len + args.max_new_tokens))
        model = hf_io.init_model(hf, hf_io.model_config(hf), seed=args.seed)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.Param)))
        first = export_lib.export(model, hf, work / "initial", 0, dtype=args.dtype, keep=0)  # what every server loads
        res["bytes"] = sum(f.stat().st_size for f in first.iterdir() if f.is_file())
        root = work / "exports"
        root.mkdir()
        res["model"] = workload.model_info(hf, workload.MODEL_KEYS)
        prompts = workload.prompts(args, int(hf["vocab_size"]))
        res["requests"] = workload.requests(args, prompts)
        res["loadavg_before"] = os.getloadavg()
        # replica 0 alone is the baseline: the same process serves both candidates
        for name, cores in {**{f"replica{i}": c for i, c in enumerate(sets)}, "wide": wide}.items():
            servers[name] = _server(args, name, cores, first, root, env, work)
        for s in servers.values():
            s.wait()
        res["server_start_s"] = {k: s.start_s for k, s in servers.items()}
        one = RolloutClient(servers["replica0"].target, timeout_s=3600.0, retry_s=120.0)
        wide_client = RolloutClient(servers["wide"].target, timeout_s=3600.0, retry_s=120.0)
        fleet = RolloutFleet(
            [RolloutClient(servers[f"replica{i}"].target, timeout_s=3600.0) for i in range(n)], retry_s=120.0
        )
        clients += [one, wide_client, fleet]
        publish = _Publisher(model, hf, root, args.dtype, {"1": one, "n": fleet})
        times = _interleave(args, prompts, {"one": one, "fleet": fleet, "wide": wide_client}, publish)
        res["fleet_versions"] = [r.version for r in fleet.replicas]
        res["fleet_tokens_per_replica"] = [r.tokens for r in fleet.replicas]  # response tokens each served
        res["loadavg_after"] = os.getloadavg()
    except BaseException:
        serving.print_logs(servers)
        raise
    finally:
        for c in clients:
            c.close()
        res["server_exit_codes"] = {k: s.stop() for k, s in servers.items()}
        shutil.rmtree(work, ignore_errors=True)
    names = {
        "one": f"1 replica on core {res['replica_cores'][0]}",
        "fleet": f"{n} replicas (cores {' | '.join(res['replica_cores'])}) behind a RolloutFleet",
        "wide": f"1 replica on cores {placement.format_ids(wide)}",
    }
    res.update(_results(res, names, times, publish.times))
    return res


def _server(args, name: str, cores: list[int], first: Path, root: Path, env: dict, work: Path) -> Server:
    """A server pinned to `cores`, loading `first`, started (not yet waited for)."""
    place = placement.Placement(cpus=tuple(cores))
    return Server(
        "vllm",
        first,
        dtype=args.dtype,
        log_path=work / f"{name}.log",
        export_root=root,
        env={**env, **place.env()},
        timeout_s=args.server_timeout,
        wait=False,
        extra_args=place.args("vllm"),
    )


class _Publisher:
    """A publish as the trainer's (publish.mode=disk): export, then UpdateWeights naming it, to each target ("1":
    replica 0 alone, "n": all N through the fleet, in parallel); the same weights each time, new versions. `times`:
    export_<key> and reload_<key> seconds."""

    def __init__(self, model, hf: dict, root: Path, dtype: str, targets: dict):
        self.model, self.hf, self.root, self.dtype, self.targets = model, hf, root, dtype, targets
        self.version = 0
        self.times: dict[str, list[float]] = {f"{p}_{k}": [] for k in targets for p in ("export", "reload")}

    def __call__(self, rnd: int) -> None:
        """Round `rnd`'s publishes: to each target in turn, in the other order every other round."""
        for key, target in list(self.targets.items())[:: 1 if rnd % 2 == 0 else -1]:
            self.version += 1
            export_s, path = harness.timed(
                export_lib.export, self.model, self.hf, self.root, self.version, dtype=self.dtype, keep=2
            )
            self.times[f"export_{key}"].append(export_s)
            sums = manifest_lib.recorded_checksums(path)
            reload_s, got = harness.timed(target.update_weights, str(path), version=self.version, checksums=sums)
            self.times[f"reload_{key}"].append(reload_s)
            if got != self.version:
                raise RuntimeError(f"replicas report version {got} after loading version {self.version}")


def _interleave(args, prompts, generators: dict, publish: _Publisher) -> harness.Timings:
    """An untimed warm-up (first-call work, the prompts into each prefix cache), then `--repeats` rounds of each
    generator's call, each round followed by its publishes."""
    params, warm = workload.sampling(args)
    for client in generators.values():
        client.generate(prompts, warm)
    candidates = {k: (lambda c=c: c.generate(prompts, params)) for k, c in generators.items()}
    return harness.interleave(candidates, args.repeats, after_round=publish)


def _results(res: dict, names: dict, times: harness.Timings, pub: dict) -> dict:
    """Rows against replica 0 alone, the publish times and their ratio, and how many samples came out the same."""
    samples = {k: [[(s.response_ids, None) for s in per] for per in out] for k, out in times.last.items()}
    tokens = {k: workload.tokens(out) for k, out in samples.items()}
    rows = workload.throughput_rows(times, names, tokens, "one", paired_base=True)
    med = {k: harness.median(v) for k, v in pub.items()}
    p = dict(
        export_s=harness.median(pub["export_1"] + pub["export_n"]),
        reload_1_s=med["reload_1"],
        reload_n_s=med["reload_n"],
        publish_1_s=harness.median(e + r for e, r in zip(pub["export_1"], pub["reload_1"])),
        publish_n_s=harness.median(e + r for e, r in zip(pub["export_n"], pub["reload_n"])),
    )
    p["ratio"] = p["publish_n_s"] / p["publish_1_s"]
    p["reload_ratio"] = p["reload_n_s"] / p["reload_1_s"]
    ratio = next(r["ratio"] for r in rows if r["key"] == "fleet")
    return dict(
        rows=rows,
        times_s=times.wall_s,
        publish_s=pub,
        publish=p,
        ratio=ratio,
        ratio_wide=next(r["ratio"] for r in rows if r["key"] == "wide"),
        meets_target=ratio >= res["target_ratio"],
        meets_publish_target=p["ratio"] <= TARGET_PUBLISH,
        # the same per-sample seeds everywhere: how many samples came out the same (engines on other thread counts may
        # round differently, so this is reported, not required)
        **workload.same_samples(samples["one"], samples["fleet"]),
    )


def print_result(res: dict) -> None:
    c, p = res["config"], res["publish"]
    caption = (
        f"medians of {c['repeats']} interleaved rounds after a warm-up; load average {res['loadavg_before'][0]:.1f} "
        f"before, {res['loadavg_after'][0]:.1f} after (other jobs share the cores); same samples (same per-sample seeds) "
        f"1 replica vs fleet {res['identical_samples']}/{res['compared_samples']}"
    )
    title = f"rollout replicas: {workload.title(res)}"
    console = workload.print_table(title, res["rows"], "vs 1 replica", {}, caption)
    n = c["replicas"]
    console.print(
        f"weight publish ({res['bytes'] / 1e6:.1f} MB, disk export + UpdateWeights): to 1 replica {p['publish_1_s']:.3f}s "
        f"(export {p['export_s']:.3f}s + reload {p['reload_1_s']:.3f}s), to {n} {p['publish_n_s']:.3f}s (reload "
        f"{p['reload_n_s']:.3f}s): {p['ratio']:.2f}x; target <= {TARGET_PUBLISH:g}x: "
        f"{harness.verdict(res['meets_publish_target'])}"
    )
    console.print(
        f"{n} replicas / 1 replica tokens/s: {res['ratio']:.2f}x (1 replica on all {n} cores: {res['ratio_wide']:.2f}x); "
        f"target >= {res['target_ratio']:g}x: {harness.verdict(res['meets_target'])}"
    )


def check_args(args) -> None:
    if args.replicas < 2:
        raise errors.UserError("--replicas compares N >= 2 replicas with one")
    if args.model_dir:
        raise errors.UserError("--replicas exports the bench's own random model: --model-dir is not taken with it")
    core_sets(args.replicas, args.replica_cpus)  # enough cores, well-formed sets
