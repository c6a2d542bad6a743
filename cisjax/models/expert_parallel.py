"""Expert parallelism: each chip holds E/ep experts; tokens reach them by ragged all-to-all or gather."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from cisjax import sharding
from cisjax.models.routing import sort_by_expert, through_sorted

# How tokens reach the experts' shards under expert parallelism: "a2a" (ragged all-to-all of the assignments),
# "gather" (all-gather the tokens, reduce-scatter the outputs), or "auto" (plan's rule). A module
# knob, not an argument: moe_ffn's signature is the model's; tests set it to run both exchanges on one mesh.
EXCHANGE = "auto"


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def plan(w_shape, k: int) -> dict | None:
    """The mesh axes of expert parallelism for expert stacks of `w_shape` [E, D, F], or None (no active mesh, or the
    rules put E on no mesh axis of size > 1: then the dispatch is unchanged). The rules table says where E goes, as
    it does for the weights themselves, so model code never names a mesh axis.

    exchange: a ragged all-to-all sends each chip ~N*k*(ep-1)/ep of its rows and gets as many back; all-gather +
    reduce-scatter moves N*(ep-1) rows each way. So "a2a" when ep > k, else "gather" (also whenever the rows are
    not split over the expert axes: each chip already holds every token, and only a psum of the outputs is needed).
    """
    ctx = sharding.active()
    if ctx is None:
        return None
    mesh, rules = ctx
    e_spec, _, f_spec = sharding.logical_to_spec(("expert", None, "expert_mlp"), rules, mesh, w_shape)
    e_axes = _axes(e_spec)
    if not e_axes:
        return None
    ep = math.prod(mesh.shape[a] for a in e_axes)
    exchange = EXCHANGE
    if exchange == "auto":
        exchange = "a2a" if ep > k else "gather"
    return dict(mesh=mesh, rules=rules, e_axes=e_axes, f_spec=f_spec, ep=ep, exchange=exchange)


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """jax.lax.ragged_all_to_all; on CPU (whose XLA has no such op) the same semantics from a dense all_to_all: each
    slice padded to the operand's rows, sent, and scattered into `output` at the offsets its sender chose. Tests run
    this form; TPU and GPU programs the native op."""
    if sharding.current_platform() != "cpu":
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    m = operand.shape[0]
    s = input_offsets.shape[0]
    t_M = jnp.arange(m)
    # [S, M] rows of each slice (the padding rows read row 0 and are dropped on arrival)
    src_SxM = jnp.where(t_M < send_sizes[:, None], input_offsets[:, None] + t_M, 0)
    got = jax.lax.all_to_all(operand[src_SxM], axis_name, 0, 0, tiled=True)
    at_S = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst_SxM = jnp.where(t_M < recv_sizes[:, None], at_S[:, None] + t_M, output.shape[0])  # out of range: dropped
    return output.at[dst_SxM.reshape(s * m)].set(got.reshape(s * m, *operand.shape[1:]), mode="drop")


def ffn(ep, rows_fn, x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK):
    """moe_ffn expert-parallel (`ep`: plan's dict): each chip holds E/ep experts (the stacks split over ep["e_axes"],
    and over the "expert_mlp" axes in F with the outputs summed, as moe._on_each_device), under shard_map;
    rows_fn(rows, wg, wu, wo, group sizes) runs a chip's experts on rows sorted by them.

    "a2a": each chip sorts its (token, slot) assignments by expert and sends every expert's rows to the chip owning
    it with one ragged all-to-all, one slice per expert, placed so that the receiver's buffer is already grouped by
    its local experts (expert-major, sender-minor): rows_fn runs on it, a second ragged all-to-all (the first one's
    offsets mirrored) returns each row to its sender, which un-sorts and combines with the routing weights.
    "gather": every chip gathers the tokens of the chips it shares experts with, runs its own experts' assignments and
    the outputs are reduce-scattered back.

    Dropless: the receive buffer holds the worst case, every assignment of the ep chips (ep * N_local * k rows), as
    MaxText's dropless ragged all-to-all does. The group sizes are the real ones, so the tiled kernel and megablox
    (grid over the groups' tiles) work on the rows received, not on the buffer; XLA's and Pallas's static cost
    estimates count the buffer.
    """
    mesh, e_axes, ep_size = ep["mesh"], ep["e_axes"], ep["ep"]
    rows_spec = sharding.logical_to_spec(("batch", None), ep["rules"], mesh, x_NxD.shape)
    row_axes = set(_axes(rows_spec[0]))
    split = tuple(a for a in e_axes if a in row_axes)  # expert axes the tokens are split over
    rest = tuple(a for a in e_axes if a not in row_axes)  # and those they are replicated over
    exchange = ep["exchange"] if split == e_axes else "gather"
    f_axes = tuple(a for a in _axes(ep["f_spec"]) if a not in row_axes)
    f_spec = f_axes[0] if len(f_axes) == 1 else (f_axes or None)
    e_spec = e_axes[0] if len(e_axes) == 1 else e_axes
    up, down = PartitionSpec(e_spec, None, f_spec), PartitionSpec(e_spec, f_spec, None)
    k = ids_NxK.shape[1]
    e = wg_ExDxF.shape[0]
    e_loc = e // ep_size

    def a2a(x_NxD, wg, wu, wo, ids_NxK, w_NxK):
        n, d = x_NxD.shape
        me = jax.lax.axis_index(e_axes)
        order_R, counts_E = sort_by_expert(ids_NxK, e)
        # counts of every chip: c[i, j, l] = rows chip i sends to local expert l of chip j
        c_PxPxL = jax.lax.all_gather(counts_E, e_axes).reshape(ep_size, ep_size, e_loc)
        per_expert_PxL = c_PxPxL.sum(0)  # rows each chip's local experts receive
        group_start_PxL = _exclusive_cumsum(per_expert_PxL)  # receiver buffers: expert-major ...
        before_PxPxL = _exclusive_cumsum(c_PxPxL, axis=0)  # ... then by sender
        out_off_E = (group_start_PxL + before_PxPxL[me]).reshape(e)
        recv_PxL = c_PxPxL[:, me]  # from each sender, for each of my experts
        buf_rows = ep_size * n * k  # the worst case: every assignment of every chip comes here
        # back: my slice (sender i, expert l) sits at group_start[me, l] + before[i, me, l]; it goes to where sender i
        # took it from, its own exclusive cumsum over the global experts
        sent_at_PxE = _exclusive_cumsum(c_PxPxL.reshape(ep_size, e))

        def exchange(xs_RxD):
            xb_BxD = ragged_all_to_all(
                xs_RxD,
                jnp.zeros((buf_rows, d), x_NxD.dtype),
                _exclusive_cumsum(counts_E),
                counts_E,
                out_off_E,
                recv_PxL.reshape(e),
                e_axes,
            )
            yb_BxD = rows_fn(xb_BxD, wg, wu, wo, per_expert_PxL[me])
            return ragged_all_to_all(
                yb_BxD,
                jnp.zeros_like(xs_RxD),
                (group_start_PxL[me][None, :] + before_PxPxL[:, me]).reshape(e),
                recv_PxL.reshape(e),
                jax.lax.dynamic_slice_in_dim(sent_at_PxE, me * e_loc, e_loc, axis=1).reshape(e),
                counts_E,
                e_axes,
            )

        return through_sorted(exchange, x_NxD, order_R, w_NxK)

    def gather(x_NxD, wg, wu, wo, ids_NxK, w_NxK):
        if split:
            x_NxD, ids_NxK, w_NxK = (jax.lax.all_gather(a, split, tiled=True) for a in (x_NxD, ids_NxK, w_NxK))
        first = jax.lax.axis_index(e_axes) * e_loc
        local_R = ids_NxK.reshape(-1) - first
        # assignments to other chips' experts sort last, into no group
        key_R = jnp.where((local_R >= 0) & (local_R < e_loc), local_R, e_loc)
        order_R = jnp.argsort(key_R, stable=True).astype(jnp.int32)
        sizes_L = jnp.bincount(key_R, length=e_loc + 1)[:e_loc].astype(jnp.int32)
        y_NxD = through_sorted(lambda xs_RxD: rows_fn(xs_RxD, wg, wu, wo, sizes_L), x_NxD, order_R, w_NxK)
        if split:
            y_NxD = jax.lax.psum_scatter(y_NxD, split, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y_NxD, rest) if rest else y_NxD

    body = a2a if exchange == "a2a" else gather

    def local(*args):
        y = body(*args)
        return jax.lax.psum(y, f_axes) if f_axes else y

    rows = PartitionSpec(rows_spec[0], None)
    # check_vma off: megablox's pallas_call does not declare how its outputs vary over the mesh axes
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, up, up, down, rows, rows), out_specs=rows, check_vma=False)(
        x_NxD, wg_ExDxF, wu_ExDxF, wo_ExFxD, ids_NxK, w_NxK
    )
