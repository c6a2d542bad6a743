"""The Hopper MoE dispatch ("mgpu"): SwiGLU experts on JAX's Mosaic GPU grouped matmuls, blocks chosen per shape."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp

from cisjax import sharding
from cisjax.models import ragged_ws, swiglu_ws
from cisjax.models.gpu_grouped import triton_swiglu
from cisjax.models.padding import pad_axes, round_up

ROW_ALIGN = 128  # mgpu_swiglu pads the rows once to a multiple of every row block the kernels use (64 or 128)
# "SMs" of the persistent grids in Mosaic GPU's interpreter (each CTA costs there; JAX's forward: 132, fixed)
INTERPRET_SMS = 2
# mgpu_ws's persistent grids where neither the mesh nor JAX's default device says its SMs (a GPU program traced on a
# CPU host without a mesh): an H100's. Only the grid's size: any count computes the same
DEFAULT_SMS = 132
# Off a GPU, "mgpu" runs the kernels in Mosaic GPU's interpreter only once tests set this: jax 0.10.2's interpreter
# lacks what the backward kernels use (a transposed wgmma operand, layout_cast), which tests/models/mgpu_interpret.py
# supplies. Otherwise moe_ffn refuses "mgpu" off a GPU. A module knob, as expert_parallel.EXCHANGE.
INTERPRET = False
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)  # what the kernels multiply (wgmma); float32 runs the Triton kernels


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One configuration of a Mosaic GPU grouped-matmul kernel: its keyword arguments."""

    block_m: int  # tile rows (the weight gradient: rows of dW, the weight's K)
    block_n: int  # tile columns
    block_k: int  # contraction step (the weight gradient: rows of x and dy per step)
    max_concurrent_steps: int  # pipeline stages in shared memory
    grid_block_n: int  # N tiles per band of the tiles' order (a planar snake: L2 reuse)


# The kernel calls a configuration is chosen for: "ragged_dot" the forward (x @ W), "ragged_dot_t" the input gradient
# (dy @ W^T: the same kernel reading W transposed), "transposed" the weight gradient (x^T @ dy per group).
KERNELS = ("ragged_dot", "ragged_dot_t", "transposed")
# Configurations measured on one H200 (bf16, jax 0.11.2; docs/results.md), by (kernel, K, N) of the call (the input
# gradient of x @ W[K, N] is a "ragged_dot_t" call with (N, K); the weight gradient's K, N are dW's), for groups of at
# least 128 rows on average (where they were measured); every other shape takes `blocks`' rule. The GPU check's
# "tune" section (cisjax.bench.gpu_tune) times candidates per call and prints the entries to put here.
BLOCKS = {
    # 32,768 rows in 60 groups x 2,048 x 1,408 (Qwen1.5-MoE's gate/up projection): 0.449 ms = 421 TFLOP/s, the best
    # of four configurations tried (a dense matmul of equal FLOPs: 702 TFLOP/s)
    ("ragged_dot", 2048, 1408): Blocks(128, 128, 64, 4, 2),
}


def blocks(kernel: str, rows: int, groups: int, k: int, n: int) -> Blocks:
    """The configuration of one call of `kernel` (one of KERNELS) on `rows` sorted rows in `groups` groups, K = k,
    N = n: BLOCKS' entry where there is one and the groups average 128 rows or more, else the rule.

    The rule generalises the measured one: tiles of 128 x 128 (64 along a dimension 128 does not divide; the
    forward's tiles 64 rows high when the groups average under 128 rows, since a group's last tile computes rows of
    the next and drops them), K steps of 64 (128 bytes of bf16: the kernels' swizzle), 4 pipeline stages, N bands of
    2 tiles in the forward and 1 in the weight gradient (its 420 TFLOP/s at the shape above is the best of
    (128, 128, 64), (64, 128, 64) and (128, 64, 128), each with 4 stages and bands of 1; which one was not recorded,
    so it has no entry: the rule takes the first)."""
    big = rows >= 128 * groups
    hit = BLOCKS.get((kernel, k, n))
    if hit is not None and big:
        return hit

    def tile(dim: int) -> int:
        return 128 if dim % 128 == 0 else 64

    if kernel in ("ragged_dot", "ragged_dot_t"):
        return Blocks(128 if big else 64, tile(n), 64, 4, 2)
    if kernel == "transposed":
        return Blocks(tile(k), tile(n), 64, 4, 1)
    raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the GPU the program being traced runs on: the active mesh's devices (sharding.use_mesh, so
    cisjax plan's deviceless targets say theirs), else JAX's default device; None for a device that is no CUDA GPU."""
    ctx = sharding.active()
    device = ctx[0].devices.flat[0] if ctx is not None else jax.devices()[0]
    cc = getattr(device, "compute_capability", None)  # "9.0" (a string in jax 0.10 and 0.11)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def _kernels():
    """(ragged_dot, transposed_ragged_dot): JAX's Mosaic GPU kernels (the same signatures in jax 0.10.2 to 0.11.2)."""
    # Mosaic GPU locates its runtime library (the CUDA plugin's) when first imported: after cisjax plan adds the plugin
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # lazy: mosaic_gpu

    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


class _JaxSeeing:
    """The jax module, but jax.devices() = `devices`. The weight-gradient kernel sizes its grid by
    jax.devices()[0].core_count, the host's default device: a CPU host compiling for a GPU mesh (cisjax plan) or
    running the interpreter has none, and kernels follow the mesh, never the host."""

    def __init__(self, devices):
        self._devices = list(devices)

    def __getattr__(self, name):
        return getattr(jax, name)

    def devices(self, backend=None):
        return self._devices


def _seeing(fn, sms: int | None):
    """fn, a function of a kernel module, run with jax.devices()[0].core_count = sms (fn itself when sms is None or
    what the host's default device says)."""
    if sms is None or getattr(jax.devices()[0], "core_count", None) == sms:
        return fn
    device = types.SimpleNamespace(core_count=sms)
    g = types.FunctionType(fn.__code__, {**fn.__globals__, "jax": _JaxSeeing([device])}, fn.__name__, fn.__defaults__)
    g.__kwdefaults__ = fn.__kwdefaults__
    return g


def _sms() -> int | None:
    """The SMs of the GPU the program being traced runs on (the active mesh's devices: cisjax plan's targets say
    theirs); None without a mesh (the kernel asks JAX's default device itself). Taken when the forward is traced:
    the backward runs after the mesh's context has closed."""
    ctx = sharding.active()
    return None if ctx is None else getattr(ctx[0].devices.flat[0], "core_count", None)


def ragged_dot(lhs_RxK, rhs, sizes_G, *, transpose_rhs: bool, interpret: bool, config: Blocks | None = None):
    """out[r] = lhs[r] @ rhs[group(r)], rhs [G, K, N] (transpose_rhs: given [G, N, K], multiplied transposed), on
    JAX's Hopper kernel with `config` (None: `blocks`' choice). Rows, K and N are padded with zeros to whole blocks
    (the kernel needs K % block_k; whole row and N blocks keep every copy in bounds) and sliced back; rows past the
    groups come out unwritten."""
    r, k = lhs_RxK.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    b = config or blocks("ragged_dot_t" if transpose_rhs else "ragged_dot", r, g, k, n)
    rp, kp, np_ = round_up(r, b.block_m), round_up(k, b.block_k), round_up(n, b.block_n)
    lhs_PxK = pad_axes(lhs_RxK, {0: rp, 1: kp})
    rhs = pad_axes(rhs, {1: np_, 2: kp} if transpose_rhs else {1: kp, 2: np_})
    kernel, _ = _kernels()
    with ragged_ws.interpreted(interpret):
        out_PxN = kernel(lhs_PxK, rhs, group_sizes=sizes_G, transpose_rhs=transpose_rhs, **dataclasses.asdict(b))
    return out_PxN[:r, :n]


def transposed_ragged_dot(x_RxK, dy_RxN, sizes_G, *, interpret: bool, sms: int | None, config: Blocks | None = None):
    """dW[g] = x[rows of g]^T @ dy[rows of g], [G, K, N], on JAX's Hopper weight-gradient kernel with `config` (None:
    `blocks`' choice; an empty group gets zeros). K and N are padded to whole blocks (the kernel needs them), the rows
    to whole K steps (every copy in bounds; padding rows in no group), and sliced back. Rows in no group must be
    finite, in x and dy: a step shared with another group zeroes their x by multiplying it by 0."""
    r, k = x_RxK.shape
    n = dy_RxN.shape[1]
    g = sizes_G.shape[0]
    b = config or blocks("transposed", r, g, k, n)
    rp, kp, np_ = round_up(r, b.block_k), round_up(k, b.block_m), round_up(n, b.block_n)
    _, transposed = _kernels()
    with ragged_ws.interpreted(interpret):
        out_GxKxN = _seeing(transposed, INTERPRET_SMS if interpret else sms)(
            pad_axes(x_RxK, {0: rp, 1: kp}),
            pad_axes(dy_RxN, {0: rp, 1: np_}),
            group_sizes=sizes_G,
            **dataclasses.asdict(b),
        )
    return out_GxKxN[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(x_RxK, w_GxKxN, sizes_G, interpret: bool = False, sms: int | None = None):
    """Grouped matmul on rows sorted by group: out[r] = x[r] @ W[group(r)] on JAX's Hopper kernels, x and W of one
    16-bit float dtype, sum(sizes) <= rows. Backward: the input gradient is the same kernel with W transposed inside,
    the weight gradient the transposed ragged dot; both visit only the groups' rows. Rows past the groups come out
    unwritten (out and dx) and must hold finite values (x and the cotangent: see transposed_ragged_dot).
    interpret: Mosaic GPU's interpreter (CPU tests); on a GPU of compute capability 9.x the kernels. sms: the GPU's
    SM count, which sizes the weight-gradient kernel's grid (_sms; None: the kernel asks JAX's default device)."""
    out_RxN = ragged_dot(x_RxK, w_GxKxN, sizes_G, transpose_rhs=False, interpret=interpret)
    # XLA's GPU compiler (jax 0.11) moves a custom call whose output a dynamic-update-slice stores (a scan's residual:
    # a layer stack without remat) into that store and, where the output is read elsewhere too, launches the kernel a
    # second time for those readers (openxla/xla#45799); behind the barrier the store sees no kernel to move
    return jax.lax.optimization_barrier(out_RxN)


def _gmm_fwd(x_RxK, w_GxKxN, sizes_G, interpret, sms):
    return gmm(x_RxK, w_GxKxN, sizes_G, interpret, sms), (x_RxK, w_GxKxN, sizes_G)


def _gmm_bwd(interpret, sms, res, dout_RxN):
    x_RxK, w_GxKxN, sizes_G = res
    dx_RxK = ragged_dot(dout_RxN, w_GxKxN, sizes_G, transpose_rhs=True, interpret=interpret)
    dw_GxKxN = transposed_ragged_dot(x_RxK, dout_RxN, sizes_G, interpret=interpret, sms=sms)
    return dx_RxK.astype(x_RxK.dtype), dw_GxKxN.astype(w_GxKxN.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)


def mgpu_swiglu(
    xs_RxD,
    wg_ExDxF,
    wu_ExDxF,
    wo_ExFxD,
    sizes_E,
    interpret: bool,
    full_groups: bool = False,
    kernels: str = "jax",
    weights_R=None,
):
    """SwiGLU experts on expert-sorted rows with the Hopper grouped matmuls (moe_ffn's "mgpu"), in the rows' dtype
    (the weights are cast to it: the kernels take one dtype). The rows are padded once to a multiple of ROW_ALIGN
    (zeros in no group), so no kernel call pads them again. The gate and up rows past the groups (that padding, an
    expert-parallel buffer's tail: rows the kernels leave unwritten) are zeroed (a select) before anything multiplies
    them, so neither they nor their cotangents (the select's: zero) can carry a NaN into a weight gradient. Output
    rows past the groups are unspecified (moe_ffn masks them).

    kernels: "jax" (JAX's Mosaic GPU kernels: moe_ffn's "mgpu") or "ws" (cisjax's warp-specialized ones with gate
    and up in one launch and the SwiGLU and its gradient in their epilogues, swiglu_ws.swiglu: "mgpu_ws"; its h
    rows past the groups are zeroed instead of gate's and up's).

    weights_R: each row's routing weight ([R]; None: unweighted), its output multiplied by it: in the kernels'
    epilogues with "ws" (h times the weight; the weight's gradient <dy, y> = <dh', h> summed in the dh kernel), else
    after them (fp32, rounded once).

    full_groups: the caller knows every row is in a group (sum(sizes) = rows: moe_ffn's dispatch without an
    expert-parallel buffer, routing.sort_by_expert); with rows a multiple of ROW_ALIGN no row is then left unwritten
    and the selects are skipped (under a layer scan they would also store their [rows, F] mask for the backward).

    float32 runs gpu_grouped.triton_swiglu instead: wgmma multiplies float32 in TF32 and the Mosaic kernels take no
    precision, while an fp32 program must compute in full fp32 (cisjax.runtime.matmul_precision); the Triton kernels
    multiply at HIGHEST (their weight gradient loads only its groups' rows, masked: no select there to skip)."""
    if jnp.dtype(xs_RxD.dtype) not in KERNEL_DTYPES:
        return _weighted(triton_swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, interpret), weights_R)
    r = xs_RxD.shape[0]
    p = round_up(max(r, 1), ROW_ALIGN)
    xs_PxD = pad_axes(xs_RxD, {0: p})
    wg_ExDxF, wu_ExDxF, wo_ExFxD = (w.astype(xs_RxD.dtype) for w in (wg_ExDxF, wu_ExDxF, wo_ExFxD))
    sms = _sms()
    if kernels == "ws":  # its grids are sized here: the SMs the mesh's GPU has (the interpreter's few), else JAX's
        w_P = None if weights_R is None else pad_axes(weights_R, {0: p})
        return _ws_swiglu(xs_PxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, w_P, interpret, full_groups and p == r, sms)[
            :r
        ]
    g_PxF, u_PxF = (gmm(xs_PxD, w, sizes_E, interpret, sms) for w in (wg_ExDxF, wu_ExDxF))
    if not (full_groups and p == r):
        valid_Px1 = (jnp.arange(p) < jnp.sum(sizes_E))[:, None]
        g_PxF, u_PxF = (jnp.where(valid_Px1, a, 0) for a in (g_PxF, u_PxF))
    return _weighted(gmm(jax.nn.silu(g_PxF) * u_PxF, wo_ExFxD, sizes_E, interpret, sms)[:r], weights_R)


def _weighted(out_RxD, weights_R):
    """Each row of out times its routing weight (fp32, rounded once); out itself without weights."""
    if weights_R is None:
        return out_RxD
    return (out_RxD.astype(jnp.float32) * weights_R.astype(jnp.float32)[:, None]).astype(out_RxD.dtype)


def _ws_swiglu(xs_PxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, w_P, interpret: bool, full_groups: bool, sms):
    """mgpu_swiglu on swiglu_ws's fused kernels: D padded to whole 64 and F to swiglu_ws.padded_width (zeros: copies
    fused with the weights' cast; none at the paper shapes), the output sliced back."""
    sms = INTERPRET_SMS if interpret else sms or getattr(jax.devices()[0], "core_count", None) or DEFAULT_SMS
    d, f = xs_PxD.shape[1], wg_ExDxF.shape[2]
    dp, fp = round_up(d, 64), swiglu_ws.padded_width(f)
    wg_ExDxF, wu_ExDxF = (pad_axes(w, {1: dp, 2: fp}) for w in (wg_ExDxF, wu_ExDxF))
    wo_ExFxD = pad_axes(wo_ExFxD, {1: fp, 2: dp})
    out_PxD = swiglu_ws.swiglu(
        pad_axes(xs_PxD, {1: dp}), wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, w_P, interpret, sms, full_groups
    )
    return out_PxD[:, :d]


def kernel_flops(assignments: int, groups: int, d: int, f: int, *, backward: bool) -> float:
    """An upper bound of the FLOPs the Mosaic kernels compute for one SwiGLU over `assignments` expert-sorted rows in
    `groups` groups, hidden d, expert width f (cisjax plan: plgpu.kernel carries no cost estimate, so XLA's cost
    model sees nothing). Every matmul of the three (gate, up, down) runs over the rows padded to 128, plus one tile of
    128 rows per group boundary (a tile shared by two groups is computed for each); the backward takes dx (three more
    ragged_dots) and dW (three transposed ones) over the same rows."""
    rows = round_up(assignments, 128) + max(groups - 1, 0) * 128
    forward = 3 * 2.0 * rows * d * f
    return forward * (3 if backward else 1)
