"""`cisjax bench rollout --replicas N`: N pinned replicas behind a RolloutFleet vs one, tokens/s and weight publish time."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from cisjax import errors
from cisjax.bench import tiny_model

TARGET_PER_REPLICA = 0.8  # fleet tokens/s >= 0.8 x N x one replica's (each replica on as many cores as the one)
TARGET_PUBLISH = 1.5  # export + reload to the N replicas <= 1.5 x export + reload to one (the reloads run in parallel)


def core_sets(replicas: int, spec: str = "") -> list[list[int]]:
    """Each replica's cores: `spec` ("0|1", "0-1|2-3") or, by default, one core each, the first `replicas` cores this
    process may use. UserError when there are too few."""
    from cisjax.rollout import placement

    if spec:
        return [list(p.cpus) for p in placement.plan(replicas, cpus=spec, gpus="none")]
    mine = placement.allowed_cpus()
    if replicas > len(mine):
        raise errors.UserError(
            f"--replicas {replicas} pins one core each, but this process may use {len(mine)} ({placement.format_ids(mine)})"
        )
    return [[c] for c in mine[:replicas]]


def bench(args) -> dict:
    import flax.nnx as nnx
    import jax

    from cisjax import export as export_lib
    from cisjax.bench.rollout import _prompts, _tokens
    from cisjax.bench.serving import Server, engine_env
    from cisjax.models import hf_io
    from cisjax.rollout import manifest as manifest_lib
    from cisjax.rollout import placement
    from cisjax.rollout.client import RolloutClient, SamplingParams
    from cisjax.rollout.fleet import RolloutFleet

    n = args.replicas
    sets = core_sets(n, args.replica_cpus)
    wide = sorted({c for s in sets for c in s})
    env = engine_env(args.kv_cache_gib)
    res = dict(
        bench="rollout_replicas",
        config={k: v for k, v in vars(args).items() if k != "json"},
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
        res["model"] = {k: hf.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_experts")}
        res["model"].update(num_experts_per_tok=hf.get("num_experts_per_tok"), vocab_size=hf["vocab_size"])
        prompts = _prompts(args, int(hf["vocab_size"]))
        res["requests"] = dict(
            prompts=len(prompts),
            samples=len(prompts) * args.n,
            prompt_tokens=sum(map(len, prompts)),
            new_tokens=len(prompts) * args.n * args.max_new_tokens,
        )
        res["loadavg_before"] = os.getloadavg()

        def start(name, cores):
            place = placement.Placement(cpus=tuple(cores))
            servers[name] = Server(
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

        for i, cores in enumerate(sets):  # replica 0 alone is the baseline: the same process serves both candidates
            start(f"replica{i}", cores)
        start("wide", wide)
        for s in servers.values():
            s.wait()
        res["server_start_s"] = {k: s.start_s for k, s in servers.items()}

        one = RolloutClient(servers["replica0"].target, timeout_s=3600.0, retry_s=120.0)
        wide_client = RolloutClient(servers["wide"].target, timeout_s=3600.0, retry_s=120.0)
        fleet = RolloutFleet(
            [RolloutClient(servers[f"replica{i}"].target, timeout_s=3600.0) for i in range(n)], retry_s=120.0
        )
        clients += [one, wide_client, fleet]
        names = {
            "one": f"1 replica on core {res['replica_cores'][0]}",
            "fleet": f"{n} replicas (cores {' | '.join(res['replica_cores'])}) behind a RolloutFleet",
            "wide": f"1 replica on cores {placement.format_ids(wide)}",
        }
        runs = {"one": one.generate, "fleet": fleet.generate, "wide": wide_client.generate}
        params = SamplingParams(
            n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed
        )
        warm = SamplingParams(
            n=args.n, temperature=args.temperature, max_new_tokens=min(2, args.max_new_tokens), seed=args.seed
        )
        for run in runs.values():  # untimed: first-call work, the prompts into each prefix cache
            run(prompts, warm)

        times = {k: [] for k in runs}
        tokens, outputs = {}, {}
        pub = {k: [] for k in ("export_1", "reload_1", "export_n", "reload_n")}
        version = 0
        for rnd in range(
            args.repeats
        ):  # interleaved, so that load drift on a shared machine hits every candidate alike
            for k, run in runs.items():
                t0 = time.perf_counter()
                out = run(prompts, params)
                times[k].append(time.perf_counter() - t0)
                tokens[k], outputs[k] = _tokens([[(s.response_ids, None) for s in per] for per in out]), out
            # a publish as the trainer's (publish.mode=disk): export, then UpdateWeights naming it, to replica 0 alone
            # and to all N through the fleet (in parallel), in turns first; same weights each time, new versions
            for key, target in (("1", one), ("n", fleet))[:: 1 if rnd % 2 == 0 else -1]:
                version += 1
                t0 = time.perf_counter()
                path = export_lib.export(model, hf, root, version, dtype=args.dtype, keep=2)
                pub[f"export_{key}"].append(time.perf_counter() - t0)
                sums = manifest_lib.recorded_checksums(path)
                t0 = time.perf_counter()
                got = target.update_weights(str(path), version=version, checksums=sums)
                pub[f"reload_{key}"].append(time.perf_counter() - t0)
                if got != version:
                    raise RuntimeError(f"replicas report version {got} after loading version {version}")
        res["fleet_versions"] = [r.version for r in fleet.replicas]
        res["fleet_tokens_per_replica"] = [r.tokens for r in fleet.replicas]  # response tokens each served
        res["loadavg_after"] = os.getloadavg()
    except BaseException:
        for name, s in servers.items():
            print(f"--- {name} server log (tail):\n{s.log_tail()}", flush=True)
        raise
    finally:
        for c in clients:
            c.close()
        res["server_exit_codes"] = {k: s.stop() for k, s in servers.items()}
        shutil.rmtree(work, ignore_errors=True)

    base_tps = tokens["one"] / statistics.median(times["one"])
    rows = []
    for k in runs:
        med = statistics.median(times[k])
        rows.append(
            dict(
                candidate=names[k],
                key=k,
                median_s=med,
                min_s=min(times[k]),
                tokens=tokens[k],
                tokens_per_s=tokens[k] / med,
                ratio=tokens[k] / med / base_tps,
                # paired: each round against the single replica's call of the same round
                ratio_paired=statistics.median(
                    (tokens[k] / t) / (tokens["one"] / b) for t, b in zip(times[k], times["one"])
                ),
            )
        )
    res["rows"] = rows
    res["times_s"] = times
    res["publish_s"] = pub
    med = {k: statistics.median(v) for k, v in pub.items()}
    res["publish"] = dict(
        export_s=statistics.median(pub["export_1"] + pub["export_n"]),
        reload_1_s=med["reload_1"],
        reload_n_s=med["reload_n"],
        publish_1_s=statistics.median(e + r for e, r in zip(pub["export_1"], pub["reload_1"])),
        publish_n_s=statistics.median(e + r for e, r in zip(pub["export_n"], pub["reload_n"])),
    )
    p = res["publish"]
    p["ratio"] = p["publish_n_s"] / p["publish_1_s"]
    p["reload_ratio"] = p["reload_n_s"] / p["reload_1_s"]
    res["ratio"] = next(r["ratio"] for r in rows if r["key"] == "fleet")
    res["ratio_wide"] = next(r["ratio"] for r in rows if r["key"] == "wide")
    res["meets_target"] = res["ratio"] >= res["target_ratio"]
    res["meets_publish_target"] = p["ratio"] <= TARGET_PUBLISH
    # the same per-sample seeds everywhere: how many samples came out the same (engines on other thread counts may
    # round differently, so this is reported, not required)
    pairs = [(x, y) for pa, pb in zip(outputs["one"], outputs["fleet"]) for x, y in zip(pa, pb)]
    res["identical_samples"] = sum(list(x.response_ids) == list(y.response_ids) for x, y in pairs)
    res["compared_samples"] = len(pairs)
    return res


def print_result(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m, r, c, p = res["model"], res["requests"], res["config"], res["publish"]
    arch = m["architectures"][0] if m.get("architectures") else "?"
    table = Table(
        title=(
            f"rollout replicas: random {arch} hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
            f"{m['num_experts']} experts top-{m['num_experts_per_tok']}, vocab {m['vocab_size']}, {c['dtype']}; "
            f"{r['prompts']} prompts x n={c['n']} x {c['max_new_tokens']} new tokens"
        ),
        caption_justify="left",
    )
    for col in ("candidate", "median s", "min s", "tokens", "tokens/s", "vs 1 replica", "paired"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for row in res["rows"]:
        table.add_row(
            row["candidate"],
            f"{row['median_s']:.3f}",
            f"{row['min_s']:.3f}",
            str(row["tokens"]),
            f"{row['tokens_per_s']:.0f}",
            f"{row['ratio']:.2f}x",
            f"{row['ratio_paired']:.2f}x",
        )
    table.caption = (
        f"medians of {c['repeats']} interleaved rounds after a warm-up; load average {res['loadavg_before'][0]:.1f} "
        f"before, {res['loadavg_after'][0]:.1f} after (other jobs share the cores); same samples (same per-sample seeds) "
        f"1 replica vs fleet {res['identical_samples']}/{res['compared_samples']}"
    )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)
    console.print(table)
    n = c["replicas"]
    ok = lambda b: "[green]met[/]" if b else "[red]NOT met[/]"  # noqa: E731
    console.print(
        f"weight publish ({res['bytes'] / 1e6:.1f} MB, disk export + UpdateWeights): to 1 replica {p['publish_1_s']:.3f}s "
        f"(export {p['export_s']:.3f}s + reload {p['reload_1_s']:.3f}s), to {n} {p['publish_n_s']:.3f}s (reload "
        f"{p['reload_n_s']:.3f}s): {p['ratio']:.2f}x; target <= {TARGET_PUBLISH:g}x: {ok(res['meets_publish_target'])}"
    )
    console.print(
        f"{n} replicas / 1 replica tokens/s: {res['ratio']:.2f}x (1 replica on all {n} cores: {res['ratio_wide']:.2f}x); "
        f"target >= {res['target_ratio']:g}x: {ok(res['meets_target'])}"
    )


def check_args(args) -> None:
    if args.replicas < 2:
        raise errors.UserError("--replicas compares N >= 2 replicas with one")
    if args.model_dir:
        raise errors.UserError("--replicas exports the bench's own random model: --model-dir is not taken with it")
    core_sets(args.replicas, args.replica_cpus)  # enough cores, well-formed sets
