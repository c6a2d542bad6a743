"""The GPU check's block sweep: each Mosaic GPU grouped-matmul call of the MoE layer table's shapes timed per block
configuration, JAX's kernels' best per (kernel, K, N) printed as moe_hopper.BLOCKS entries, ragged_ws's beside, and
swiglu_ws's fused calls against the JAX calls they replace."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cisjax.bench import gpu_parts
from cisjax.models import moe_hopper, ragged_ws, swiglu_ws
from cisjax.models.moe_hopper import Blocks
from cisjax.models.padding import round_up
from cisjax.models.ragged_ws import Tiles

# Candidates per kernel after the rule's own choice (moe_hopper.blocks, measured first: the baseline every other is
# timed and checked against): one knob of the measured configuration at a time, then a few pairs. Drawn from the
# space JAX's own sweeps search (ragged_dot_mgpu.main: tiles of 64 / 128 / 192, K steps of 64, 2-6 stages, N bands
# of 1-16). Every one compiles for sm_90a at the MoE layer table's shapes (deviceless, jax 0.10.2 and 0.11.2:
# docs/results.md), so each fits the 227 KiB of shared memory (6 stages of 128 x 256 tiles would not: refused at
# compile). A configuration the kernel or the GPU refuses is recorded as an error and the sweep goes on.
CANDIDATES = {
    "ragged_dot": (
        Blocks(128, 128, 64, 4, 1),
        Blocks(128, 128, 64, 4, 4),
        Blocks(128, 128, 64, 2, 2),
        Blocks(128, 128, 64, 6, 2),
        Blocks(128, 256, 64, 3, 2),
        Blocks(128, 192, 64, 4, 2),
        Blocks(64, 128, 64, 4, 2),
        Blocks(128, 64, 64, 4, 2),
        Blocks(128, 128, 128, 2, 2),
        Blocks(128, 128, 64, 5, 8),
        Blocks(64, 256, 64, 4, 2),  # half the rows computed past a group's end (each boundary costs a tile), wider
    ),
    "transposed": (
        Blocks(128, 128, 64, 4, 2),
        Blocks(64, 128, 64, 4, 1),
        Blocks(128, 64, 128, 4, 1),
        Blocks(128, 128, 64, 2, 1),
        Blocks(128, 128, 64, 6, 1),
        Blocks(128, 256, 64, 3, 1),
        Blocks(128, 192, 64, 4, 1),
        Blocks(64, 256, 64, 4, 1),
        Blocks(128, 128, 128, 3, 1),
        Blocks(128, 128, 64, 4, 4),
    ),
}
CANDIDATES["ragged_dot_t"] = CANDIDATES["ragged_dot"]
# The same calls on cisjax's warp-specialized kernels (moe_impl "mgpu_ws", ragged_ws.py), timed right after the rule
# and checked against its output: the defaults (ragged_ws.Tiles()), 64-row tasks, 64-column warpgroup halves with 4
# stages (fits: 160 KiB), 2 stages (every even K step count chains). Each compiles for sm_90a at the paper shapes.
WS_CANDIDATES = {
    "ragged_dot": (Tiles(), Tiles(block_m=64), Tiles(block_n=64, stages=4), Tiles(stages=2)),
    "transposed": (Tiles(), Tiles(block_m=64), Tiles(block_n=64, stages=4)),
}
WS_CANDIDATES["ragged_dot_t"] = WS_CANDIDATES["ragged_dot"]
# mgpu_ws's fused calls (swiglu_ws, with routing weights), timed once each right after the rules' round, against the
# rule's time of the JAX calls each replaces in mgpu's layer: gate/up with the SwiGLU (K = D, N = 2F) two forward
# calls of D x F; dh with the dSwiGLU and the weights' gradient (K = D, N = F) the input-gradient call of D x F
FUSED = {"gate_up": (("ragged_dot", 2),), "down_grad": (("ragged_dot_t", 1),)}
# Calls per timing round and rounds (the median round counts): rounds of back-to-back calls, so the host's dispatch
# overlaps the device's work and a sub-millisecond kernel is timed, not the launch.
CALLS = {"full": 20, "small": 1}
ROUNDS = {"full": 3, "small": 1}
# A candidate agrees with the baseline when max |got - baseline| / max |baseline| is within this: both round the
# same fp32 sums to bf16 once (a differently ordered sum may round one unit of 2^-8 the other way), so two units.
AGREE = 2 * 2.0**-8


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call of a SwiGLU MoE layer: `kernel` (moe_hopper.KERNELS) with the call's K and N, on `rows` sorted
    rows (padded as mgpu_swiglu pads them) whose groups have `sizes`; `shape` names the layer shape it came from."""

    kernel: str
    k: int
    n: int
    rows: int
    sizes: tuple[int, ...]
    shape: str

    @property
    def key(self) -> str:
        return f"{self.kernel} {self.k}x{self.n}"

    @property
    def flops(self) -> float:
        """The useful FLOPs: 2 x (rows in groups) x K x N."""
        return 2.0 * sum(self.sizes) * self.k * self.n


def group_sizes(tokens: int, experts: int, k: int, seed: int) -> tuple[int, ...]:
    """Rows per expert when each of `tokens` tokens picks `k` distinct experts uniformly at random (a router near
    balance, as a trained one is kept by its balancing loss)."""
    rng = np.random.default_rng(seed)
    picks = np.argpartition(rng.random((tokens, experts)), k, axis=1)[:, :k]
    return tuple(int(c) for c in np.bincount(picks.ravel(), minlength=experts))


def calls(size: str) -> list[Call]:
    """The six kernel calls of each MoE layer shape (forward gate/up and down, their input and weight gradients),
    one per (kernel, K, N): a later shape with the same key (DeepSeek-V2-Lite's 2048 x 1408 after Qwen1.5-MoE's) is
    not timed again, since BLOCKS is keyed by (kernel, K, N)."""
    spec = gpu_parts.MOE_LAYER[size]
    d, out, seen = spec["hidden"], [], set()
    for i, (name, (e, k, f)) in enumerate(spec["shapes"].items()):
        sizes = group_sizes(spec["tokens"], e, k, seed=i)
        rows = round_up(sum(sizes), moe_hopper.ROW_ALIGN)
        for kernel, kk, n in (
            ("ragged_dot", d, f),  # gate and up: x @ W[D, F]
            ("ragged_dot", f, d),  # down: h @ W[F, D]
            ("ragged_dot_t", f, d),  # dx of gate and up: dy[R, F] @ W[D, F]^T
            ("ragged_dot_t", d, f),  # dh of down: dy[R, D] @ W[F, D]^T
            ("transposed", d, f),  # dW of gate and up
            ("transposed", f, d),  # dW of down
        ):
            c = Call(kernel, kk, n, rows, sizes, name)
            if c.key not in seen:
                seen.add(c.key)
                out.append(c)
    return out


def fused_calls(size: str) -> list[Call]:
    """swiglu_ws's two fused calls per (D, F) of the MoE layer table's shapes (the first shape's groups): gate_up
    (its N the 2F of g and u) and down_grad (its N = F)."""
    spec = gpu_parts.MOE_LAYER[size]
    d, out, seen = spec["hidden"], [], set()
    for i, (name, (e, k, f)) in enumerate(spec["shapes"].items()):
        if f in seen:
            continue
        seen.add(f)
        sizes = group_sizes(spec["tokens"], e, k, seed=i)
        rows = round_up(sum(sizes), moe_hopper.ROW_ALIGN)
        out += [Call("gate_up", d, 2 * f, rows, sizes, name), Call("down_grad", d, f, rows, sizes, name)]
    return out


def _fused_program(c: Call, interpret: bool):
    """A fused call with its shapes padded as mgpu_swiglu pads them (F to swiglu_ws.padded_width) and its default
    tiles, jitted: f(*operands) -> its outputs."""
    sms = moe_hopper.INTERPRET_SMS if interpret else jax.devices()[0].core_count
    tiles = swiglu_ws.tiles_for(c.rows, len(c.sizes))
    fn = swiglu_ws.gate_up if c.kernel == "gate_up" else swiglu_ws.down_grad

    def f(*operands):
        with ragged_ws.interpreted(interpret):
            return fn(*operands, sms=sms, tiles=tiles)

    return jax.jit(f)


def _fused_operands(c: Call, seed: int):
    """Random bf16 operands of a fused call (rows past the groups zero) and fp32 routing weights in (0, 1]."""
    rng = np.random.default_rng(seed)
    g, used, d = len(c.sizes), sum(c.sizes), c.k
    f = swiglu_ws.padded_width(c.n // 2 if c.kernel == "gate_up" else c.n)
    rows = np.zeros((c.rows, d), np.float32)
    rows[:used] = rng.standard_normal((used, d))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, c.rows), jnp.float32)
    sizes = jnp.asarray(c.sizes, jnp.int32)
    if c.kernel == "gate_up":
        wgu = rng.standard_normal((g, d, 2 * f)) / np.sqrt(d)
        return jnp.asarray(rows, jnp.bfloat16), jnp.asarray(wgu, jnp.bfloat16), sizes, weights
    wo, gu = rng.standard_normal((g, f, d)) / np.sqrt(d), rng.standard_normal((c.rows, 2 * f))
    return (*(jnp.asarray(a, jnp.bfloat16) for a in (rows, wo, gu)), sizes, weights)


def _fused(res: dict, size: str, deadline: float, interpret: bool) -> None:
    """Time each fused call (within the deadline) into res["fused"][key]: its row (measure's), the rule's ms of the
    JAX calls it replaces (this run's, FUSED) and the speed-up over them."""
    res.setdefault("fused", {})
    for i, c in enumerate(fused_calls(size)):
        if time.time() > deadline:
            res["fused"][c.key] = dict(status="skipped", reason="time box")
            continue
        row, _ = _timed(c, _fused_program(c, interpret), _fused_operands(c, seed=i), size)
        f = c.n // 2 if c.kernel == "gate_up" else c.n
        rules = [
            (res["calls"].get(f"{kernel} {c.k}x{f}", {}).get("candidates") or [{}])[0] for kernel, _ in FUSED[c.kernel]
        ]
        if row["status"] == "ok" and all(r.get("status") == "ok" for r in rules):
            row["jax_ms"] = sum(r["ms"] * n for r, (_, n) in zip(rules, FUSED[c.kernel]))
            row["speedup_over_jax"] = row["jax_ms"] / row["ms"]
        res["fused"][c.key] = row


def _operands(c: Call, dtype, seed: int):
    """Random operands of a call in `dtype`: (lhs, rhs, group sizes); rows past the groups zero (finite)."""
    rng = np.random.default_rng(seed)
    g, used = len(c.sizes), sum(c.sizes)
    lhs = np.zeros((c.rows, c.k), np.float32)
    lhs[:used] = rng.standard_normal((used, c.k))
    if c.kernel == "transposed":  # x [R, K] and dy [R, N]
        rhs = np.zeros((c.rows, c.n), np.float32)
        rhs[:used] = rng.standard_normal((used, c.n))
    else:  # W [G, K, N], or [G, N, K] read transposed
        rhs = rng.standard_normal((g, c.n, c.k) if c.kernel == "ragged_dot_t" else (g, c.k, c.n)) / np.sqrt(c.k)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(c.sizes, jnp.int32)


def program(c: Call, config: Blocks | Tiles, interpret: bool):
    """The call on moe_hopper's padded kernels with `config` (ragged_ws's for a Tiles), jitted: f(lhs, rhs, sizes)
    -> the output (rows past the groups zeroed: the kernels leave them unwritten)."""

    def f(lhs, rhs, sizes):
        if isinstance(config, Tiles):
            sms = moe_hopper.INTERPRET_SMS if interpret else jax.devices()[0].core_count
            with ragged_ws.interpreted(interpret):
                if c.kernel == "transposed":
                    return ragged_ws.transposed_ragged_dot(lhs, rhs, sizes, sms=sms, tiles=config)
                kw = dict(transpose_rhs=c.kernel == "ragged_dot_t", sms=sms, tiles=config)
                out = ragged_ws.ragged_dot(lhs, rhs, sizes, **kw)
            return jnp.where((jnp.arange(out.shape[0]) < jnp.sum(sizes))[:, None], out, 0)
        if c.kernel == "transposed":
            return moe_hopper.transposed_ragged_dot(lhs, rhs, sizes, interpret=interpret, sms=None, config=config)
        out = moe_hopper.ragged_dot(
            lhs, rhs, sizes, transpose_rhs=c.kernel == "ragged_dot_t", interpret=interpret, config=config
        )
        return jnp.where((jnp.arange(out.shape[0]) < jnp.sum(sizes))[:, None], out, 0)

    return jax.jit(f)


def measure(c: Call, config: Blocks | Tiles, operands, size: str, interpret: bool) -> tuple[dict, jax.Array | None]:
    """One candidate: (its row, its output). Compile time, then ROUNDS rounds of CALLS back-to-back calls: ms per
    call (the median round), TFLOP/s. A configuration that fails to compile or run is a row with its error. Its
    `kernels`: "jax" (moe_hopper's Blocks) or "ws" (ragged_ws's Tiles)."""
    row, out = _timed(c, program(c, config, interpret), operands, size)
    return dict(blocks=dataclasses.astuple(config), kernels="ws" if isinstance(config, Tiles) else "jax", **row), out


def _timed(c: Call, jitted, operands, size: str) -> tuple[dict, jax.Array | None]:
    """measure's timing of one jitted call: compile seconds, then ms per call (the median round) and TFLOP/s; an
    error as a row."""
    row = {}
    try:
        t0 = time.perf_counter()
        compiled = jitted.lower(*operands).compile()
        row["compile_s"] = time.perf_counter() - t0
        out = jax.block_until_ready(compiled(*operands))
        per_call = []
        for _ in range(ROUNDS[size]):
            t0 = time.perf_counter()
            for _ in range(CALLS[size]):
                out = compiled(*operands)
            jax.block_until_ready(out)
            per_call.append((time.perf_counter() - t0) / CALLS[size])
        seconds = float(np.median(per_call))
        row.update(status="ok", ms=seconds * 1e3, tflops=c.flops / seconds / 1e12)
        return row, out
    except Exception as err:  # noqa: BLE001  (a configuration the kernel refuses: recorded, the sweep goes on)
        row.update(status="error", error=f"{type(err).__name__}: {err}"[:500])
        return row, None


@jax.jit
def _max_rel(got, ref):
    """gpu_exact.max_rel on the device, in fp32 (one scalar comes back, not two outputs of up to 173M elements to
    widen to float64 on the host per candidate): max |got - ref| / max |ref|, or max |got| where ref is all zeros."""
    got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
    err, scale = jnp.max(jnp.abs(got - ref)), jnp.max(jnp.abs(ref))
    return jnp.where(scale > 0, err / jnp.where(scale > 0, scale, 1.0), err)


def table_line(entry: dict, best: dict, rule: dict, device_kind: str) -> str:
    """The BLOCKS entry of a call's best configuration (`entry`: the call's record in the result), as Python with
    what it was measured at."""
    b = ", ".join(str(x) for x in best["blocks"])
    return (
        f'("{entry["kernel"]}", {entry["k"]}, {entry["n"]}): Blocks({b}),  # {best["ms"]:.3f} ms = '
        f"{best['tflops']:.0f} TFLOP/s (the rule: {rule['ms']:.3f} ms), {entry['rows_in_groups']:,} rows in "
        f"{entry['groups']} groups, {device_kind}"
    )


def run(size: str, deadline: float, save, interpret: bool | None = None) -> dict:
    """The sweep: every call's rule configuration first, then the candidates round by round across the calls (a
    time box that cuts the sweep leaves each call with as many candidates tried as the others, give or take one).
    Each candidate is checked against the rule's output (AGREE); the best agreeing one per call, its speed-up over
    the rule, and the BLOCKS lines. On a device that is no Hopper GPU (and not `interpret`: tests) it says so."""
    interpret = moe_hopper.INTERPRET if interpret is None else interpret
    cc = moe_hopper.compute_capability()
    kind = jax.devices()[0].device_kind
    if not interpret and (cc is None or cc[0] != 9):
        return dict(skipped=f"needs a GPU of compute capability 9.x (Mosaic GPU); this is {kind} (cc {cc})")
    todo = calls(size)
    res = dict(device_kind=kind, dtype="bfloat16", tokens=gpu_parts.MOE_LAYER[size]["tokens"], calls={})
    state = {}
    for i, c in enumerate(todo):
        rule = moe_hopper.blocks(c.kernel, c.rows, len(c.sizes), c.k, c.n)
        ops = _operands(c, jnp.bfloat16, seed=i)
        queue = [rule, *WS_CANDIDATES[c.kernel]] + [b for b in CANDIDATES[c.kernel] if b != rule]
        state[c.key] = dict(call=c, ops=ops, queue=queue, ref=None)
        res["calls"][c.key] = dict(
            kernel=c.kernel, k=c.k, n=c.n, rows=c.rows, groups=len(c.sizes), rows_in_groups=sum(c.sizes),
            shape=c.shape, rule=dataclasses.astuple(rule), candidates=[],
        )  # fmt: skip
    last_s, depth = 0.0, max(len(s["queue"]) for s in state.values())
    for step in range(depth):
        for key, s in state.items():
            if step >= len(s["queue"]):
                continue
            entry = res["calls"][key]
            if time.time() + last_s > deadline:
                entry["candidates"].append(
                    dict(blocks=dataclasses.astuple(s["queue"][step]), status="skipped", reason="time box")
                )
                continue
            t0 = time.time()
            row, out = measure(s["call"], s["queue"][step], s["ops"], size, interpret)
            if step == 0:
                s["ref"] = out
            if out is not None and s["ref"] is not None:
                row["max_rel_to_rule"] = float(_max_rel(out, s["ref"]))
                row["agrees"] = row["max_rel_to_rule"] <= AGREE
            entry["candidates"].append(row)
            last_s = time.time() - t0
        if step == 0:
            _fused(res, size, deadline, interpret)
        _conclude(res)
        save(res)
    return res


def tuned_blocks(res: dict) -> dict[str, list[int]]:
    """The sweep's result (`run`'s) as moe_hopper.BLOCKS entries to apply: {"kernel K N": blocks} for each call whose
    best agreeing candidate is not the rule's own choice ({} for a sweep that did not run or found nothing better).
    JSON-shaped: the GPU check passes it to the sections after the sweep, each in its own process."""
    out = {}
    for entry in res.get("calls", {}).values():
        best = entry.get("best")
        if best and list(best["blocks"]) != list(entry["rule"]):
            out[f"{entry['kernel']} {entry['k']} {entry['n']}"] = list(best["blocks"])
    return out


def apply_blocks(tuned: dict[str, list[int]]) -> None:
    """Put `tuned_blocks`' entries into moe_hopper.BLOCKS (this process's), so that moe_hopper.blocks chooses them."""
    for key, b in tuned.items():
        kernel, k, n = key.split()
        if kernel not in moe_hopper.KERNELS:
            raise ValueError(f"unknown kernel {kernel!r} in tuned blocks; one of {moe_hopper.KERNELS}")
        moe_hopper.BLOCKS[(kernel, int(k), int(n))] = Blocks(*(int(x) for x in b))


def _conclude(res: dict) -> None:
    """Each call's best agreeing candidate so far of JAX's kernels (`best`) and of ragged_ws's (`best_ws`), each's
    speed-up over the rule (JAX's kernels with moe_hopper.blocks' choice), and the BLOCKS lines (JAX's kernels)."""
    res["table"] = []
    for entry in res["calls"].values():
        ok = [r for r in entry["candidates"] if r.get("status") == "ok" and r.get("agrees", True)]
        rule = entry["candidates"][0] if entry["candidates"] else {}
        if not ok or rule.get("status") != "ok":
            entry["best"] = entry["best_ws"] = None
            continue
        ws = [r for r in ok if r.get("kernels") == "ws"]
        best_ws = min(ws, key=lambda r: r["ms"]) if ws else None
        entry["best_ws"] = best_ws and dict(best_ws, speedup_over_rule=rule["ms"] / best_ws["ms"])
        best = min((r for r in ok if r.get("kernels") != "ws"), key=lambda r: r["ms"])
        entry["best"] = dict(best, speedup_over_rule=rule["ms"] / best["ms"])
        if best["blocks"] != rule["blocks"]:
            res["table"].append(table_line(entry, best, rule, res["device_kind"]))
