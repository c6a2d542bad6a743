"""`cisjax bench export --delta`: bytes and seconds per publish of consecutive trainer versions, delta against full
publishing, each to its own rollout server; the delta server killed mid-run comes back and gets the full set."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax

from cisjax import config as config_lib
from cisjax import sharding
from cisjax.bench import harness, serving, synthetic, tiny_model
from cisjax.bench.serving import Server, engine_env
from cisjax.models.padding import round_up
from cisjax.rollout.client import RolloutClient
from cisjax.train.build import build
from cisjax.train.publish import Publisher

ARMS = ("delta", "full")
TARGET_BYTES = 0.25  # a delta publish's bytes / the full set's, median over the steps after the first
FIELDS = ("bytes", "export_s", "reload_s", "canary_s")


def add_args(parser) -> None:
    """The flags of the delta bench (bench export's parser holds the model sizes, --dtype, --backend, --dir)."""
    g = parser.add_argument_group("--delta: consecutive trainer versions published whole and as deltas")
    g.add_argument(
        "--delta",
        action="store_true",
        help="bench publish.delta: --steps optimizer steps of the trainer, each version published to two servers, "
        "as a delta and whole",
    )
    g.add_argument("--steps", type=int, default=8, help="optimizer steps, one publish each (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate, constant (default: %(default)s)")
    g.add_argument(
        "--model",
        default=None,
        help="an HF model directory to train (e.g. the demo's, with its --lr 1e-4); default: the random model of the "
        "size flags",
    )
    g.add_argument("--mode", default="stream", choices=("stream", "disk"), help="publish.mode (default: %(default)s)")
    g.add_argument("--batch", type=int, default=4, help="rows per step (default: %(default)s)")
    g.add_argument("--seq", type=int, default=128, help="tokens per row (default: %(default)s)")
    g.add_argument(
        "--restart-at",
        type=int,
        default=None,
        help="the step before whose publish the delta server is killed (its watchdog restarts it on the initial "
        "weights); 0 = never (default: --steps // 2)",
    )


def bench(args) -> dict:
    """The model trained by the trainer's own step (AdamW at --lr, random-token batches with +-1 advantages); after
    each step its params published twice, in alternating order: as a delta (publish.delta) to one server and whole to
    another, the canary on both. Per step: bytes, seconds (export / reload / canary), the changed fraction and the
    servers sent the full set."""
    res = dict(bench="export --delta", config=harness.recorded(args), target_bytes=TARGET_BYTES)
    res["jax_backend"] = jax.default_backend()
    base_dir = Path(args.dir) if args.dir else None
    work = Path(tempfile.mkdtemp(prefix="cisjax-bench-delta-", dir=base_dir))
    servers: dict[str, Server] = {}
    try:
        model_dir = args.model or str(work / "model")
        if not args.model:
            tiny_model.save_random(args, model_dir, max_positions=max(args.seq, 128))
        run = build(_config(args), model_dir=model_dir, mesh=None, inputs=False)
        res["params"] = int(sum(x.size for x in jax.tree.leaves(run.state.params)))
        for arm in ARMS:
            (work / arm).mkdir()
            servers[arm] = Server(
                args.backend,
                model_dir,
                dtype=args.server_dtype or "float32",
                log_path=work / f"{arm}.log",
                export_root=work / arm,
                env=engine_env() if args.backend == "vllm" else None,
                timeout_s=args.server_timeout,
                restart=arm == "delta",
                wait=False,
            )
        for s in servers.values():
            s.wait()
        res["loadavg_before"] = os.getloadavg()
        res["steps"] = _steps(args, run, servers, work)
        res["loadavg_after"] = os.getloadavg()
    except BaseException:
        serving.print_logs(servers)
        raise
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    res.update(_summary(res["steps"]))
    return res


def _config(args):
    cfg = config_lib.load(None)
    cfg.train.lr, cfg.train.proximal, cfg.correction.method = float(args.lr), "step", "none"
    cfg.train.precision = "fp32"  # the canary's trainer side as the fp32 engines compute: |Δ| ~1e-6 when right
    cfg.publish.mode, cfg.publish.dtype, cfg.publish.canary.every = args.mode, args.dtype, 1
    return cfg


def _batch(args, run, vocab: int, seed: int):
    rows = round_up(args.batch, run.rows_multiple)  # a multiple of the batch shards
    host = synthetic.train_batch(1, rows, args.seq, vocab, seed)
    return sharding.place(host, run.mesh, run.rules, sharding.BATCH_AXES)


def _steps(args, run, servers: dict, work: Path) -> list[dict]:
    restart_at = args.steps // 2 if args.restart_at is None else args.restart_at
    vocab = int(run.hf_config["vocab_size"])
    clients = {arm: RolloutClient(s.target, timeout_s=3600.0, retry_s=120.0) for arm, s in servers.items()}
    pubs = {
        arm: Publisher.for_run(run, clients[arm], root=work / arm) if arm == "full" else _delta_publisher(run, c, work)
        for arm, c in clients.items()
    }
    state, rows = run.state, []
    try:
        for k in range(args.steps):
            state, _ = run.train_step(state, _batch(args, run, vocab, args.seed + k))
            jax.block_until_ready(state.params)
            restarted = False
            if restart_at and k == restart_at:
                restarted = _kill_and_wait(servers["delta"])
            row = {"step": k + 1, "restarted": restarted}
            for arm in ARMS if k % 2 == 0 else ARMS[::-1]:  # alternating: load drift hits both alike
                t0 = time.perf_counter()
                rep = pubs[arm].publish(state.params, k + 1)
                row[arm] = dict(
                    {f: getattr(rep, f) for f in FIELDS},
                    total_s=time.perf_counter() - t0,
                    canary_ok=bool(rep.canary is not None and rep.canary.ok),
                    canary_mean_abs=rep.canary.mean_abs if rep.canary is not None else None,
                    full_sends=rep.full_sends,
                    changed_fraction=rep.changed_fraction,
                )
            rows.append(row)
    finally:
        for c in clients.values():
            c.close()
    return rows


def _delta_publisher(run, client, work: Path) -> Publisher:
    spec = dataclasses.replace(run.spec.publish, delta=True)
    return Publisher(run.graphdef, run.hf_config, spec, client, run.mesh, run.rules, root=work / "delta")


def _kill_and_wait(server: Server, timeout_s: float = 600.0) -> bool:
    """SIGKILL the server; its watchdog starts it again on the initial weights. True once it serves."""
    restarts = server.restarts
    server.kill()
    deadline = time.monotonic() + timeout_s
    while server.restarts <= restarts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.target} was not restarted within {timeout_s:.0f} s")
        time.sleep(0.2)
    server.wait_ready()
    return True


def _summary(rows: list[dict]) -> dict:
    """Medians over the steps after the first (whole on both arms) and the restart step (whole on the delta arm)."""
    steady = [r for r in rows[1:] if not r["restarted"]]
    out = {}
    for arm in ARMS:
        for f in (*FIELDS, "total_s"):
            out[f"{arm}_{f}"] = harness.median(r[arm][f] for r in steady) if steady else float("nan")
    out["bytes_ratio"] = out["delta_bytes"] / out["full_bytes"] if steady else float("nan")
    out["time_ratio"] = out["delta_total_s"] / out["full_total_s"] if steady else float("nan")
    out["changed_fraction"] = harness.median(r["delta"]["changed_fraction"] for r in steady) if steady else float("nan")
    out["canary_all_ok"] = all(r[arm]["canary_ok"] for r in rows for arm in ARMS)
    out["full_sends"] = [r["delta"]["full_sends"] for r in rows]
    restart = [r for r in rows if r["restarted"]]
    out["restart_full_set"] = bool(restart) and all(r["delta"]["full_sends"] == 1 for r in restart)
    out["meets_target"] = bool(steady) and out["bytes_ratio"] <= TARGET_BYTES and out["canary_all_ok"]
    return out


def print_results(res: dict) -> None:
    console = harness.console()
    rows = []
    for r in res["steps"]:
        d, f = r["delta"], r["full"]
        rows.append(
            [
                str(r["step"]) + (" (restart)" if r["restarted"] else ""),
                f"{d['bytes'] / 1e6:.2f}",
                f"{f['bytes'] / 1e6:.2f}",
                "-" if d["changed_fraction"] is None else f"{d['changed_fraction']:.4f}",
                str(d["full_sends"]),
                f"{d['total_s']:.2f}",
                f"{f['total_s']:.2f}",
                f"{d['canary_mean_abs']:.1e} / {f['canary_mean_abs']:.1e}",
            ]
        )
    console.print(
        harness.table(
            f"publish.delta on {res['params'] / 1e6:.1f}M params, lr {res['config']['lr']:g}, "
            f"{res['config']['mode']} mode, {res['config']['backend']} servers",
            ["step", "delta MB", "full MB", "changed", "full sends", "delta s", "full s", "canary |Δ| d / f"],
            rows,
        )
    )
    console.print(
        f"steady steps (median): delta {res['delta_bytes'] / 1e6:.2f} MB vs full {res['full_bytes'] / 1e6:.2f} MB "
        f"= {res['bytes_ratio']:.3f}x (target <= {TARGET_BYTES}: {harness.verdict(res['meets_target'])}); publish "
        f"{res['delta_total_s']:.2f} s vs {res['full_total_s']:.2f} s = {res['time_ratio']:.2f}x (export "
        f"{res['delta_export_s']:.2f} / {res['full_export_s']:.2f} s, reload {res['delta_reload_s']:.2f} / "
        f"{res['full_reload_s']:.2f} s, canary {res['delta_canary_s']:.2f} / {res['full_canary_s']:.2f} s); changed "
        f"fraction {res['changed_fraction']:.4f}; canary passed on every publish: {res['canary_all_ok']}; the "
        f"restarted server got the full set: {res['restart_full_set']}"
    )


def check_args(args) -> None:
    if args.steps < 2 or args.batch < 1 or args.seq < 8:
        raise SystemExit("--delta needs --steps >= 2, --batch >= 1 and --seq >= 8")
    if args.backend == "none":
        raise SystemExit("--delta publishes to rollout servers: --backend vllm or transformers")
    if args.restart_at is not None and not 0 <= args.restart_at < args.steps:
        raise SystemExit("--restart-at: a step in [0, --steps) (0 = never)")
