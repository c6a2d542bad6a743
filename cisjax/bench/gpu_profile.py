"""A profiler trace of one call (jax.profiler): the files it wrote, their bytes, and the device's top kernels."""

from __future__ import annotations

import collections
import gzip
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax

MAX_FILE_BYTES = 16 * 2**20  # what the GPU machine's tool brings back of one file
TOP = 10  # kernels (or host events) listed
# trace viewer lines that re-draw a device's kernels as XLA ops / modules / steps: counted once, from the streams
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework", "Source code", "TraceMe")


def capture(fn, out_dir, name: str, *, max_file_bytes: int = MAX_FILE_BYTES) -> dict:
    """One call of `fn()` (its result block_until_ready'd) under jax.profiler.trace: the files jax writes (one
    <host>.trace.json.gz, which Perfetto opens, and <host>.xplane.pb, TensorBoard's) moved flat into `out_dir` as
    NAME.trace.json.gz and NAME.xplane.pb (jax's plugins/profile/<run>/ folders are too deep for the GPU machine's
    tool to bring back; `name`: letters, digits, "_", "-"); the call's seconds, the files with their bytes (an
    .xplane.pb over `max_file_bytes` is deleted, saying so: the .trace.json.gz holds the same events), and the top
    kernels by total device time parsed from the .trace.json.gz; a trace without device events (the CPU backend)
    lists its top host events instead, saying so. Run fn once before: a first call's compile would fill the trace."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir))
    try:
        with jax.profiler.trace(str(tmp)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            call_s = time.perf_counter() - t0
        moved = []
        for p in sorted(q for q in tmp.rglob("*") if q.is_file()):
            dest = out_dir / f"{name}.{p.name.split('.', 1)[-1]}"
            dest = out_dir / f"{name}.{p.name}" if dest in moved or dest.exists() else dest  # a second host's
            shutil.move(p, dest)
            moved.append(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = dict(call_s=call_s, files=[], deleted=[])
    for p in moved:
        size = p.stat().st_size
        if p.name.endswith(".xplane.pb") and size > max_file_bytes:
            p.unlink()
            out["deleted"].append(dict(path=str(p), bytes=size, reason=f"over {max_file_bytes} bytes"))
            continue
        out["files"].append(dict(path=str(p), bytes=size, over_limit=size > max_file_bytes))
    out["total_bytes"] = sum(f["bytes"] for f in out["files"])
    traces = [Path(f["path"]) for f in out["files"] if f["path"].endswith(".trace.json.gz")]
    if not traces:
        return dict(out, note="no .trace.json.gz written")
    with gzip.open(traces[0], "rt") as fp:
        events = json.load(fp).get("traceEvents", [])
    return dict(out, **top_events(events))


def top_events(events: list, top: int = TOP) -> dict:
    """Chrome-trace events (a .trace.json.gz's traceEvents) summed by name: the device's kernels (complete events of
    the "/device:..." processes, on their stream lines when there are any), else the host's events, saying so."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_device = lambda e: procs.get(e["pid"], "").startswith("/device:")  # noqa: E731
    device = [e for e in complete if on_device(e)]
    line = lambda e: threads.get((e["pid"], e.get("tid")), "")  # noqa: E731
    streams = [e for e in device if "stream" in line(e).lower()]
    if streams:
        chosen, source = streams, "device stream lines"
    else:
        chosen = [e for e in device if not line(e).startswith(DERIVED_LINES)]
        source = "device lines"
    res = dict(device_events=len(device), host_events=len(complete) - len(device))
    if not chosen:
        chosen, source = [e for e in complete if not on_device(e)], "host"
        res["note"] = "no device events in the trace (e.g. the CPU backend): the top host events instead"
    by = collections.defaultdict(lambda: [0.0, 0])
    for e in chosen:
        by[e["name"]][0] += float(e["dur"])
        by[e["name"]][1] += 1
    total_us = sum(v[0] for v in by.values())
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    res.update(
        top_source=source,
        top_total_us=total_us,
        lines=sorted({line(e) for e in chosen}),
        top=[
            dict(name=n[:300], total_us=us, count=c, share=us / total_us if total_us else None) for n, (us, c) in ranked
        ],
    )
    return res
