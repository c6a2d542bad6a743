"""Mixture-of-Experts: the routed SwiGLU experts' module and moe_ffn, the dropless dispatch to one impl per platform."""

from __future__ import annotations

import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from cisjax import errors, sharding
from cisjax.models import expert_parallel, moe_hopper, stacked
from cisjax.models.gpu_grouped import triton_swiglu
from cisjax.models.layers import param
from cisjax.models.moe_tiled import choose_tile, tiled_ffn, tiled_rows
from cisjax.models.moe_tpu import megablox_swiglu
from cisjax.models.routing import replay_weights, route, sort_by_expert, through_sorted, through_sorted_weighted

IMPLS = ("auto", "tiled", "gmm", "triton", "mgpu", "mgpu_ws", "ragged", "dense")
# the Hopper impls and moe_hopper.mgpu_swiglu's kernels for each: JAX's Mosaic GPU kernels, cisjax's ragged_ws.py
HOPPER_KERNELS = {"mgpu": "jax", "mgpu_ws": "ws"}
MGPU_MIN_ROWS = 64  # the Hopper kernels' smallest row tile (moe_hopper.blocks): "auto" takes "triton" below it
# MoE's expert weights: a GPU decode hands them over as stacked.LayerOf (transformer.run_stack_cached), which the
# Triton grouped matmuls read in place; every other impl slices its layer out
EXPERT_STACKS = ("wg_ExDxF", "wu_ExDxF", "wo_ExFxD")


def default_impl(
    platform: str | None = None, capability: tuple[int, int] | None = None, rows_per_expert: float | None = None
) -> str:
    """The dispatch for `platform` (default: the platform of the program being traced, see
    sharding.current_platform, so a CPU host compiling for a TPU mesh gets the TPU path).

    TPU: "gmm", megablox's grouped-matmul kernels, forward and both gradients (XLA's ragged_dot lowers its weight
    gradient to masked dense work over every expert, E times the FLOPs; its row tile follows the rows per expert).
    GPU: "mgpu_ws" on compute capability 9.x (Hopper: cisjax's warp-specialized Mosaic GPU kernels, swiglu_ws.py;
    "mgpu", JAX's, stays the fallback by name), else "triton", cisjax's
    grouped matmuls in Pallas's Triton backend (gpu_grouped.py); `capability` (major, minor) defaults to that of the
    traced program's devices (moe_hopper.compute_capability: the mesh's, never the host's), cisjax plan passes its
    target's. With `rows_per_expert` (a device's rows x k / E) under MGPU_MIN_ROWS, "triton" on Hopper too: a decode
    step's few rows per expert would each fill one of the Hopper kernels' row tiles of 64 or more, where Triton's row
    blocks follow the mean group size (16 at least). CPU: "tiled" (ragged_dot lowers to E-fold masked dense work
    there)."""
    platform = platform or sharding.current_platform()
    if platform in sharding.GPU_PLATFORMS:
        capability = capability or moe_hopper.compute_capability()
        few = rows_per_expert is not None and rows_per_expert < MGPU_MIN_ROWS
        return "mgpu_ws" if capability is not None and capability[0] == 9 and not few else "triton"
    return {"cpu": "tiled", "tpu": "gmm"}.get(platform, "ragged")


def device_rows_per_expert(n: int, k: int, e: int) -> float:
    """A device's mean rows per expert for n tokens of k experts each over E: the tokens split over the active mesh's
    batch shards (all of them without a mesh)."""
    ctx = sharding.active()
    shards = sharding.axis_multiple(ctx[0], ctx[1], "batch") if ctx is not None else 1
    return n / shards * k / e


def _ragged_swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E):
    """SwiGLU experts on expert-sorted rows with XLA's ragged_dot."""
    h_RxF = jax.nn.silu(jax.lax.ragged_dot(xs_RxD, wg_ExDxF, sizes_E)) * jax.lax.ragged_dot(xs_RxD, wu_ExDxF, sizes_E)
    return jax.lax.ragged_dot(h_RxF, wo_ExFxD, sizes_E)


def _sorted_ffn(swiglu, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """Sort the assignments by expert (routing.sort_by_expert), run swiglu(rows, wg, wu, wo, group sizes) on the sorted
    rows (every one in a group), un-sort and sum each token's k outputs, weighted (routing.through_sorted: gathers
    both ways)."""
    order_R, sizes_E = sort_by_expert(ids_NxK, wg_ExDxF.shape[0])
    return through_sorted(lambda xs_RxD: swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E), x_NxD, order_R, w_NxK)


def _weighted_sorted_ffn(swiglu, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """_sorted_ffn with the routing weights given to swiglu (its weights_R: the sorted rows' weights), which returns
    the weighted rows: each token's k of them summed unweighted (routing.through_sorted_weighted)."""
    order_R, sizes_E = sort_by_expert(ids_NxK, wg_ExDxF.shape[0])

    def experts(xs_RxD, w_R):
        return swiglu(xs_RxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E, weights_R=w_R)

    return through_sorted_weighted(experts, x_NxD, order_R, w_NxK)


def _on_each_device(ffn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """ffn on each device's own rows (shard_map over the active mesh; plain ffn without one): GSPMD does not
    partition a Pallas kernel. Rows split as "batch"; the expert weights are gathered except along the mesh axes of
    "expert_mlp", over which each device holds a slice of F and the outputs are summed (SwiGLU is elementwise in F).
    Used where the rules put E on no mesh axis; where they do, moe_ffn runs expert_parallel.ffn instead."""
    ctx = sharding.active()
    if ctx is None:
        return ffn(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
    mesh, rules = ctx
    rows = sharding.logical_to_spec(("batch", None), rules, mesh, x_NxD.shape)
    row_axes = {a for a in jax.tree.leaves(tuple(rows)) if a is not None}
    (f_axes,) = sharding.logical_to_spec(("expert_mlp",), rules, mesh, wg_ExDxF.shape[2:])
    f_axes = tuple(a for a in ((f_axes,) if isinstance(f_axes, str) else f_axes or ()) if a not in row_axes)
    f_spec = f_axes[0] if len(f_axes) == 1 else (f_axes or None)
    up, down = PartitionSpec(None, None, f_spec), PartitionSpec(None, f_spec, None)
    if isinstance(wg_ExDxF, stacked.LayerOf):  # each device its slice of F of every layer; the layer index on all
        up, down = (stacked.LayerOf(PartitionSpec(None, *p), PartitionSpec(), wg_ExDxF.dtype) for p in (up, down))

    def local(x, wg, wu, wo, ids, w):
        y = ffn(x, wg, wu, wo, ids, w)
        return jax.lax.psum(y, f_axes) if f_axes else y

    # check_vma off: megablox's pallas_call does not declare how its outputs vary over the mesh axes
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, up, up, down, rows, rows), out_specs=rows, check_vma=False)(
        x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK
    )


def _masked_rows(swiglu, xs_BxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E):
    """swiglu on expert-sorted rows whose groups may end before the buffer does: the kernels (megablox, Triton, Mosaic
    GPU) visit only the groups' tiles and leave the other rows of their outputs unwritten, forward (y) and backward
    (dx): both are masked (a select on the way in masks dx, on the way out y)."""
    valid_Bx1 = (jnp.arange(xs_BxD.shape[0]) < jnp.sum(sizes_E))[:, None]
    ys_BxD = swiglu(jnp.where(valid_Bx1, xs_BxD, 0), wg_ExDxF, wu_ExDxF, wo_ExFxD, sizes_E)
    return jnp.where(valid_Bx1, ys_BxD, 0)


def _check_mgpu(impl: str, interpret: bool) -> None:
    """Refuse "mgpu" / "mgpu_ws" where their kernels cannot run: a GPU of another compute capability than 9.x, or off
    a GPU unless tests enabled the interpreter (moe_hopper.INTERPRET)."""
    if interpret and not moe_hopper.INTERPRET:
        raise errors.UserError(
            f"moe impl {impl!r} runs on NVIDIA GPUs of compute capability 9.x (Hopper); here use 'tiled'"
        )
    capability = None if interpret else moe_hopper.compute_capability()
    if capability is not None and capability[0] != 9:
        raise errors.UserError(
            f"moe impl {impl!r} needs compute capability 9.x (Hopper), this GPU has {capability}: use 'triton'"
        )


def moe_ffn(
    x_NxD: jax.Array,
    wg_ExDxF: jax.Array,
    wu_ExDxF: jax.Array,
    wo_ExFxD: jax.Array,
    ids_NxK: jax.Array,
    w_NxK: jax.Array,
    *,
    impl: str = "auto",
    tile: int | None = None,
) -> jax.Array:
    """sum_k w[n,k] * expert_{ids[n,k]}(x[n]) with SwiGLU experts; dropless, every assignment exact.

    Weights are applied in the compute dtype (as the HF reference casts them to the logits dtype).
    impl: "tiled" (loops of row tiles, the CPU path; `tile` is the largest tile height, default choose_tile, see
    moe_tiled.py), "gmm" (megablox's TPU kernels on each device's rows; Pallas's interpreter off TPU, for tests),
    "triton" (gpu_grouped.py's Triton grouped matmuls on each device's rows; Pallas's interpreter off GPU, for tests),
    "mgpu" (moe_hopper.py: JAX's Mosaic GPU kernels for compute capability 9.x, on each device's rows; Mosaic GPU's
    interpreter off GPU, for tests), "mgpu_ws" (the same with cisjax's warp-specialized persistent kernels,
    ragged_ws.py), "ragged" (XLA's ragged_dot), "dense" (every expert on every token: the
    reference), "auto" (default_impl). On an active mesh whose rules split E (the "expert" logical axis) over mesh
    axes of size > 1, every impl but dense runs expert-parallel (expert_parallel.py: tokens travel to the chips that
    hold their experts); dense is left to GSPMD.
    """
    x_NxD, ids_NxK, w_NxK = map(jnp.asarray, (x_NxD, ids_NxK, w_NxK))
    n, e, k = x_NxD.shape[0], wg_ExDxF.shape[0], ids_NxK.shape[1]
    if impl == "auto":
        impl = default_impl(rows_per_expert=device_rows_per_expert(n, k, e))
    if impl not in IMPLS:
        raise errors.UserError(f"unknown moe impl {impl!r}; one of {IMPLS}")
    w_NxK = w_NxK.astype(x_NxD.dtype)
    weights = (wg_ExDxF, wu_ExDxF, wo_ExFxD)
    if impl != "triton" or expert_parallel.plan(wg_ExDxF.shape, k) is not None:  # a stacked.LayerOf sliced out
        weights = tuple(jnp.asarray(stacked.array(w)) for w in weights)
    wg_ExDxF, wu_ExDxF, wo_ExFxD = weights

    if impl == "dense":  # every expert on every token: a reference, E/k times the FLOPs
        g_ExNxF = jnp.einsum("nd,edf->enf", x_NxD, wg_ExDxF)
        u_ExNxF = jnp.einsum("nd,edf->enf", x_NxD, wu_ExDxF)
        y_ExNxD = jnp.einsum("enf,efd->end", jax.nn.silu(g_ExNxF) * u_ExNxF, wo_ExFxD)
        comb_NxE = jnp.zeros((n, e), x_NxD.dtype).at[jnp.arange(n)[:, None], ids_NxK].add(w_NxK)
        return jnp.einsum("end,ne->nd", y_ExNxD, comb_NxE)

    platform = sharding.current_platform()
    if impl == "gmm":
        if platform in sharding.GPU_PLATFORMS:
            raise errors.UserError("moe impl 'gmm' is megablox's TPU kernel; on GPU use 'mgpu' or 'triton'")
        swiglu = functools.partial(megablox_swiglu, interpret=platform != "tpu")  # the interpreter: CPU tests
    if impl in ("triton", "mgpu", "mgpu_ws"):
        if platform == "tpu":
            raise errors.UserError(f"moe impl {impl!r} is a GPU kernel; on TPU use 'gmm'")
        interpret = platform not in sharding.GPU_PLATFORMS  # the interpreter: CPU tests
        swiglu = functools.partial(triton_swiglu, interpret=interpret)
        if impl != "triton":
            _check_mgpu(impl, interpret)
            swiglu = functools.partial(moe_hopper.mgpu_swiglu, interpret=interpret, kernels=HOPPER_KERNELS[impl])
    ep = expert_parallel.plan(wg_ExDxF.shape, k)
    if ep is not None:
        rows_fn = {
            "gmm": lambda *a: _masked_rows(swiglu, *a),
            "triton": lambda *a: _masked_rows(swiglu, *a),
            **{hopper: lambda *a: _masked_rows(swiglu, *a) for hopper in HOPPER_KERNELS},
            "ragged": _ragged_swiglu,  # rows past the groups come out zero
            "tiled": functools.partial(tiled_rows, tile=tile or choose_tile(n * k // ep["ep"], e // ep["ep"])),
        }[impl]
        return expert_parallel.ffn(ep, rows_fn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
    if impl in ("gmm", "triton", "mgpu", "mgpu_ws"):
        if impl in HOPPER_KERNELS:  # every sorted row in a group (routing.sort_by_expert): no validity select needed
            swiglu = functools.partial(swiglu, full_groups=True)
        if impl == "mgpu_ws":  # the routing weights applied, and their gradient taken, in the kernels
            ffn = functools.partial(_weighted_sorted_ffn, swiglu)
            return _on_each_device(ffn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
        return _on_each_device(
            functools.partial(_sorted_ffn, swiglu), x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK
        )
    if impl == "ragged":
        return _sorted_ffn(_ragged_swiglu, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK)
    return tiled_ffn(x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK, tile)


def _weights(v: nnx.Variable):
    """An expert stack's value: its array, or a stacked.LayerOf as a GPU decode hands it over (not sliced out)."""
    value = v.get_value()
    return value if isinstance(value, stacked.LayerOf) else v[...]


class MoE(nnx.Module):
    """Router + routed SwiGLU experts (shared experts live in the family files)."""

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        num_experts: int,
        k: int,
        *,
        rngs: nnx.Rngs,
        param_dtype,
        dtype,
        method: str = "greedy",
        n_group: int | None = None,
        topk_group: int | None = None,
        norm_topk_prob: bool = False,
        scaling: float = 1.0,
        router_dtype=jnp.float32,
        impl: str = "auto",
        tile: int | None = None,
    ):
        self.k, self.dtype, self.router_dtype = k, dtype, router_dtype
        # a tuple, not a dict: static attributes must be hashable for jax.jit(static graphdef)
        self.route_kw = tuple(
            dict(
                method=method, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob, scaling=scaling
            ).items()
        )
        self.impl, self.tile = impl, tile
        self.router_DxE = param(rngs, (d_model, num_experts), ("embed", "router_experts"), param_dtype)
        self.wg_ExDxF = param(rngs, (num_experts, d_model, d_expert), ("expert", "embed", "expert_mlp"), param_dtype)
        self.wu_ExDxF = param(rngs, (num_experts, d_model, d_expert), ("expert", "embed", "expert_mlp"), param_dtype)
        self.wo_ExFxD = param(rngs, (num_experts, d_expert, d_model), ("expert", "expert_mlp", "embed"), param_dtype)

    def __call__(self, x_BxLxD: jax.Array, replay_BxLxK: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Returns (y [B, L, D], the router's own top-k expert ids [B, L, k]).

        replay_BxLxK: expert ids to use instead of the router's choice (routing replay: the rollout engine's ids,
        any integer dtype); the gate weights are then replay_weights at those ids. The returned ids are still the
        router's own, so a caller can count where they differ."""
        b, l, d = x_BxLxD.shape
        x_NxD = x_BxLxD.reshape(b * l, d).astype(self.dtype)
        logits_NxE = jnp.einsum(
            "nd,de->ne", x_NxD.astype(self.router_dtype), self.router_DxE[...].astype(self.router_dtype)
        )
        route_kw = dict(self.route_kw)
        w_NxK, ids_NxK = route(logits_NxE, k=self.k, **route_kw)
        own_NxK = ids_NxK
        if replay_BxLxK is not None:
            if replay_BxLxK.shape != (b, l, self.k):
                raise ValueError(f"replayed routing {replay_BxLxK.shape} for tokens {(b, l)} and k={self.k}")
            ids_NxK = replay_BxLxK.reshape(b * l, self.k).astype(jnp.int32)
            w_NxK = replay_weights(
                logits_NxE, ids_NxK, norm_topk_prob=route_kw["norm_topk_prob"], scaling=route_kw["scaling"]
            )
        wg, wu, wo = (_weights(getattr(self, name)) for name in EXPERT_STACKS)
        y_NxD = moe_ffn(
            x_NxD,
            wg.astype(self.dtype),
            wu.astype(self.dtype),
            wo.astype(self.dtype),
            ids_NxK,
            w_NxK,
            impl=self.impl,
            tile=self.tile,
        )
        y_BxLxD = sharding.constrain(y_NxD.reshape(b, l, d), ("batch", "length", "act_embed"))
        return y_BxLxD, own_NxK.reshape(b, l, self.k)
