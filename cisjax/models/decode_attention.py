"""Attention of a KV cache's new queries: one decode query per row over its written slots only (JAX's Pallas Triton
decode kernel on a GPU), else the einsum over every slot (attention.cache_attention)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from cisjax import sharding
from cisjax.models.attention import cache_attention, check_impl, default_impl

# The kernel (jax.experimental.pallas.ops.gpu.decode_attention) splits each row's slots into parts of a power of two
# (at least MIN_SPLIT slots: Triton's blocks are powers of two), one program per (head block, part), and walks each
# part in blocks of at most DECODE_BLOCK slots, stopping at the row's last written slot: a row reads only its live
# parts. SPLITS: the parts it aims at (flash decoding: a few rows still fill the GPU).
MIN_SPLIT = 16
DECODE_BLOCK = 128
SPLITS = 16


def split_of(slots: int) -> int | None:
    """The part (slots, a power of two dividing `slots`) the kernel splits a row's slots into: about slots / SPLITS,
    at least MIN_SPLIT; None where no power of two of MIN_SPLIT or more divides `slots` (the einsum then)."""
    largest = slots & -slots
    if largest < MIN_SPLIT:
        return None
    aim = max(MIN_SPLIT, 1 << max(0, (slots // SPLITS).bit_length() - 1))
    return min(largest, aim)


def impl_reads_written_only(impl: str, dtype) -> bool:
    """Whether `impl` runs the decode kernel on the current platform in `dtype`: "triton", or "auto" on a GPU in bf16
    (in fp32 the einsum: Triton's dots multiply fp32 in TF32). The shapes must fit it as well (kernel_fits)."""
    if check_impl(impl) == "auto":
        impl = default_impl(sharding.current_platform(), dtype)
    return impl == "triton"


def kernel_fits(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, impl: str) -> bool:
    """Whether the decode kernel takes these: one query per row, the GPU's kernel ("triton": asked, or "auto" on a GPU
    in bf16), a head width of a power of two that the values share, slots split_of divides."""
    l, h = q_BxLxNxH.shape[1], q_BxLxNxH.shape[3]
    if l != 1 or v_BxKxSxV.shape[-1] != h or h & (h - 1) or split_of(k_BxKxSxH.shape[2]) is None:
        return False
    return impl_reads_written_only(impl, q_BxLxNxH.dtype)


def interval(mask_BxLxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, one past the last) valid slot of each row's one query: a decode's mask is one interval per row (its
    left-padded prompt, then its own tokens up to the new one's). A row with none gets (0, S) (its result unread)."""
    m_BxS = mask_BxLxS[:, 0]
    s = m_BxS.shape[1]
    return jnp.argmax(m_BxS, axis=1).astype(jnp.int32), (s - jnp.argmax(m_BxS[:, ::-1], axis=1)).astype(jnp.int32)


def attend(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, mask_BxLxS, scale: float, impl: str = "auto") -> jax.Array:
    """Queries over a cache's heads-major keys and values under its [B, L, S] mask -> [B, L, N, V]: the decode
    kernel where kernel_fits (each row from its first valid slot to its last: the mask's interval), else
    cache_attention."""
    if not kernel_fits(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, impl):
        return cache_attention(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, mask_BxLxS, scale)
    start_B, end_B = interval(mask_BxLxS)
    interpret = sharding.current_platform() not in sharding.GPU_PLATFORMS
    kernel = functools.partial(_kernel, scale=scale, interpret=interpret)
    ctx = sharding.active()
    if ctx is not None:  # GSPMD does not partition a Pallas kernel: each device its rows (and heads, where they split)
        mesh, rules = ctx
        q_spec = sharding.logical_to_spec(("batch", None, "act_heads", None), rules, mesh, q_BxLxNxH.shape)
        kv_spec = sharding.logical_to_spec(("batch", "act_heads", None, None), rules, mesh, k_BxKxSxH.shape)
        if kv_spec[1] != q_spec[2]:  # the query heads split but not the kv heads (or the other way): rows alone
            q_spec = PartitionSpec(q_spec[0], None, None, None)
            kv_spec = PartitionSpec(kv_spec[0], None, None, None)
        row_spec = PartitionSpec(q_spec[0])
        kernel = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec),
            out_specs=q_spec,
            check_vma=False,
        )
    o_BxLxNxH = kernel(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, start_B, end_B)
    return o_BxLxNxH.astype(v_BxKxSxV.dtype)


def _kernel(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, start_B, end_B, *, scale: float, interpret: bool):
    """JAX's decode kernel per (row, kv head) on its group of query heads, reading the cache as it lies (the kernel
    takes a head's [S, H] keys: the cache's heads-major layout needs no transpose)."""
    # jax 0.11 deprecates these modules (for tokamax, which the GPU machines here lack): imported where the kernel is
    # traced, as attention._triton does
    from jax.experimental.pallas.ops.gpu import decode_attention as gpu_decode  # lazy: deprecated in jax 0.11

    b, _, n, h = q_BxLxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    split = split_of(s)
    one = functools.partial(
        gpu_decode.decode_attn_unbatched,
        sm_scale=scale,
        block_h=16,
        block_k=min(DECODE_BLOCK, split),
        k_splits=s // split,
        num_warps=None,
        num_stages=2,
        grid=None,
        interpret=interpret,
        debug=False,
        return_residuals=False,
        normalize_output=True,
    )
    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))  # over the kv heads of a row
    q_BxKxGxH = q_BxLxNxH.reshape(b, kv, n // kv, h)
    o_BxKxGxH = jax.vmap(per_head)(q_BxKxGxH, k_BxKxSxH, v_BxKxSxV, start_B, end_B)
    return o_BxKxGxH.reshape(b, 1, n, h)
