"""Attention cores: the einsum reference and flash kernels (splash on TPU, Pallas Triton on GPU), by the mesh's platform."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from cisjax import errors, sharding
from cisjax.models.padding import pad_axes, round_up

# auto: by the platform of the program's mesh (sharding.current_platform(), never the host's) and its compute dtype:
# splash on TPU, triton on GPU (einsum for float32 there: the Triton kernel multiplies float32 in TF32), einsum on
# CPU. einsum: the [B, K, G, L, S] scores in one piece (the reference; memory grows with L^2). splash: TPU splash
# attention (jax.experimental.pallas.ops.tpu.splash_attention), blocks above the causal diagonal skipped. triton: the
# Pallas Triton flash attention (jax.experimental.pallas.ops.gpu.attention.mha), for compute capability 8.0 and up.
# A kernel traced for a platform it is not built for runs in Pallas's interpreter (tests on CPU).
IMPLS = ("auto", "einsum", "splash", "triton")

SPLASH_BLOCK = 512  # splash's query/key block along the sequence (MaxText's default): L pads to a multiple of it
SPLASH_LANES = 128  # a TPU vector register's lanes: splash's head dims pad to a multiple of it
TRITON_BLOCK = 128  # the Triton kernel's forward block (its default); the backward's blocks are 32
# Heads padded wider than 128 (DeepSeek's MLA: q.k 192, padded to 256): the default 128-row blocks with two pipeline
# stages ask 328 KB of shared memory (XLA:GPU refuses: an H100 has 227 KB, an A100 163 KB); 64-row blocks in two
# stages ask 160 KB
TRITON_WIDE_BLOCK = 64
_PAD_SEGMENT = -1  # segment id of the positions a kernel pads on: they see only each other, never a real token


class Segments(NamedTuple):
    """The mask of a full-sequence pass, as its segment ids [B, L] (0 = padding): each token sees the tokens of its
    own segment up to itself (causal). Kernels take it as is; the einsum builds the [B, L, L] mask from it."""

    ids_BxL: jax.Array


def default_impl(platform: str, dtype) -> str:
    """What "auto" runs for a program on `platform` computing in `dtype`."""
    if platform == "tpu":
        return "splash"
    if platform in sharding.GPU_PLATFORMS:
        return "einsum" if jnp.dtype(dtype) == jnp.float32 else "triton"
    return "einsum"


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise errors.UserError(f"attention_impl {impl!r}; one of {IMPLS}")
    return impl


def attention_mask(segment_ids_BxL: jax.Array) -> jax.Array:
    """[B, L, L] bool: causal and same segment. Segment 0 is padding: it only sees padding, so
    real tokens never attend to it and no row is empty (no NaN)."""
    length = segment_ids_BxL.shape[1]
    causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))
    same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return same_BxLxL & causal_LxL[None]


def cache_mask(valid_BxS: jax.Array, index, length: int) -> jax.Array:
    """[B, L, S] bool for L new tokens written into a KV cache at slots index..index+L-1 (`index`: one for all rows,
    or a [B] array, each row's own): each sees the valid slots (written, not padding) up to its own. Every row sees
    at least itself once its own slot is valid."""
    slots_S = jnp.arange(valid_BxS.shape[1])
    query_BxL = jnp.reshape(index, (-1, 1)) + jnp.arange(length)[None]
    return valid_BxS[:, None, :] & (slots_S[None, None, :] <= query_BxL[:, :, None])


def einsum_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, mask_BxLxS, scale: float) -> jax.Array:
    """Grouped-query attention; scores and softmax in fp32, probabilities cast to the value dtype
    (as the HF eager path). Returns [B, L, N, V]. cache_attention's, over keys and values token-major."""
    k_BxKxSxH, v_BxKxSxV = (jnp.moveaxis(a, 2, 1) for a in (k_BxSxKxH, v_BxSxKxV))
    return cache_attention(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, mask_BxLxS, scale)


def cache_attention(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, mask_BxLxS, scale: float) -> jax.Array:
    """Grouped-query attention over heads-major keys and values (a KV cache's: transformer.Cache); scores and softmax
    in fp32, probabilities cast to the value dtype (as the HF eager path). The batched matmuls over (row, head) read
    them as they lie (a [B, S, K, H] cache would be transposed whole, per layer and step, first). Returns
    [B, L, N, V]."""
    b, l, n, h = q_BxLxNxH.shape
    kv = k_BxKxSxH.shape[1]
    q_BxLxKxGxH = q_BxLxNxH.reshape(b, l, kv, n // kv, h)
    s_BxKxGxLxS = jnp.einsum("blkgh,bksh->bkgls", q_BxLxKxGxH, k_BxKxSxH, preferred_element_type=jnp.float32)
    s_BxKxGxLxS = s_BxKxGxLxS * scale
    s_BxKxGxLxS = jnp.where(mask_BxLxS[:, None, None], s_BxKxGxLxS, jnp.finfo(jnp.float32).min)
    p_BxKxGxLxS = jax.nn.softmax(s_BxKxGxLxS, axis=-1).astype(v_BxKxSxV.dtype)
    # the values first: XLA:CPU then runs the (row, head)-batched matmuls of few query rows as its library's, not its
    # own loops (measured 1.6x faster on a decode step's shapes)
    o_BxLxKxGxV = jnp.einsum("bksv,bkgls->blkgv", v_BxKxSxV, p_BxKxGxLxS)
    return o_BxLxKxGxV.reshape(b, l, n, v_BxKxSxV.shape[-1])


def attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, mask, scale: float, impl: str = "auto") -> jax.Array:
    """Queries over keys and values under `mask` -> [B, L, N, V]. mask: Segments (a full-sequence pass: `impl` picks
    the core) or a [B, L, S] bool array (a KV-cache pass: the einsum)."""
    if not isinstance(mask, Segments):
        return einsum_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, mask, scale)
    platform = sharding.current_platform()
    impl = default_impl(platform, q_BxLxNxH.dtype) if check_impl(impl) == "auto" else impl
    if impl == "einsum":
        return einsum_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, attention_mask(mask.ids_BxL), scale)
    kernel = _splash if impl == "splash" else _triton
    interpret = platform not in (("tpu",) if impl == "splash" else sharding.GPU_PLATFORMS)
    local = lambda q, k, v, ids: kernel(q, k, v, ids, scale, interpret)  # noqa: E731
    return _on_each_device(local, q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, mask.ids_BxL)


# ----------------------------------------------------------------------------- kernels on each device's rows


def _on_each_device(kernel, q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, ids_BxL):
    """kernel on each device's rows and heads (shard_map over the active mesh; plain kernel without one): GSPMD does
    not partition a Pallas kernel. Rows split as "batch", heads as "act_heads" (the key/value heads too where the
    mesh divides them, else every device takes all of them and repeats them to its query heads); the sequence is
    whole on every device (a causal kernel needs the keys before its queries)."""
    ctx = sharding.active()
    if ctx is None:
        return kernel(q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, ids_BxL)
    mesh, rules = ctx
    q_spec = sharding.logical_to_spec(("batch", None, "act_heads", None), rules, mesh, q_BxLxNxH.shape)
    kv_spec = sharding.logical_to_spec(("batch", None, "act_heads", None), rules, mesh, k_BxSxKxH.shape)
    if q_spec[2] is not None and kv_spec[2] != q_spec[2]:  # the mesh splits the query heads but not the kv heads
        reps = q_BxLxNxH.shape[2] // k_BxSxKxH.shape[2]
        k_BxSxKxH, v_BxSxKxV = (jnp.repeat(a, reps, axis=2) for a in (k_BxSxKxH, v_BxSxKxV))
        kv_spec = q_spec
    ids_spec = PartitionSpec(q_spec[0], None)
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec), out_specs=q_spec, check_vma=False
    )(q_BxLxNxH, k_BxSxKxH, v_BxSxKxV, ids_BxL)


def _splash(q_BxLxNxH, k_BxLxKxH, v_BxLxKxV, ids_BxL, scale: float, interpret: bool):
    """TPU splash attention, causal and by segment: the sequence padded to its block, head dims to the TPU's lanes
    (zeros: no score or output changes), q pre-scaled (splash has no scale), one kernel vmapped over the rows."""
    b, l, n, h = q_BxLxNxH.shape
    vdim = v_BxLxKxV.shape[-1]
    block = min(SPLASH_BLOCK, round_up(l, SPLASH_LANES))
    lp, hp, vp = round_up(l, block), round_up(h, SPLASH_LANES), round_up(vdim, SPLASH_LANES)
    q = (q_BxLxNxH.astype(jnp.float32) * scale).astype(q_BxLxNxH.dtype)
    q_BxNxLxH = pad_axes(q, {1: lp, 3: hp}).transpose(0, 2, 1, 3)
    k_BxKxLxH = pad_axes(k_BxLxKxH, {1: lp, 3: hp}).transpose(0, 2, 1, 3)
    v_BxKxLxV = pad_axes(v_BxLxKxV, {1: lp, 3: vp}).transpose(0, 2, 1, 3)
    ids = pad_axes(ids_BxL.astype(jnp.int32), {1: lp}, _PAD_SEGMENT)
    blocks = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((lp, lp))] * n)
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=blocks, interpret=interpret)
    segments = splash.SegmentIds(q=ids, kv=ids)
    o_BxNxLxV = jax.vmap(kernel)(q_BxNxLxH, k_BxKxLxH, v_BxKxLxV, segment_ids=segments)
    return o_BxNxLxV.transpose(0, 2, 1, 3)[:, :l, :, :vdim].astype(v_BxLxKxV.dtype)


def triton_block(head_dim: int) -> int:
    """The Triton kernel's forward block (query and key rows) for a head width: TRITON_BLOCK, or TRITON_WIDE_BLOCK
    where the width pads past 128 (the kernel pads it to a power of two)."""
    return TRITON_BLOCK if 1 << (head_dim - 1).bit_length() <= 128 else TRITON_WIDE_BLOCK


def _triton(q_BxLxNxH, k_BxLxKxH, v_BxLxKxV, ids_BxL, scale: float, interpret: bool):
    """The Pallas Triton flash attention, causal and by segment: it takes one head width for q, k and v and as many
    key/value heads as query heads, so the values pad to the query width (zeros, sliced off after) and grouped heads
    repeat; the sequence pads to its block."""
    b, l, n, h = q_BxLxNxH.shape
    kv, vdim = k_BxLxKxH.shape[2], v_BxLxKxV.shape[-1]
    if vdim > h:
        raise errors.UserError(f"attention_impl=triton: value heads wider than query heads ({vdim} > {h})")
    block = triton_block(h)
    lp = round_up(l, block)
    k_BxLxNxH, v_BxLxNxH = (jnp.repeat(a, n // kv, axis=2) if kv != n else a for a in (k_BxLxKxH, v_BxLxKxV))
    q, k, v = (pad_axes(a, {1: lp}) for a in (q_BxLxNxH, k_BxLxNxH, pad_axes(v_BxLxNxH, {3: h})))
    ids = pad_axes(ids_BxL.astype(jnp.int32), {1: lp}, _PAD_SEGMENT)
    # jax 0.11 deprecates this module (for tokamax, which the GPU machines here lack): imported where the kernel is
    # traced, so that its warning, and one day its removal, reach only programs that run it
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # lazy: deprecated in jax 0.11

    blocks = dataclasses.replace(gpu_attention.BlockSizes.get_default(), block_q=block, block_k=block)
    o_BxLxNxH = gpu_attention.mha(q, k, v, ids, sm_scale=scale, causal=True, block_sizes=blocks, interpret=interpret)
    return o_BxLxNxH[:, :l, :, :vdim].astype(v_BxLxKxV.dtype)


# ----------------------------------------------------------------------------- what the kernels compute


def kernel_flops(impl: str, rows: int, seq_len: int, heads: int, qk: int, v: int, *, backward: bool) -> float:
    """FLOPs a flash kernel computes on [rows, seq_len] tokens with `heads` query heads of q.k width `qk` and value
    width `v` (XLA's cost model counts its custom call as nothing; the einsum's work XLA counts itself: 0 here).
    Both kernels skip the blocks above the causal diagonal and compute those on it whole, at their padded widths.
    Forward: s = q.k and o = p.v per block. Backward (both kernels): a dk/dv pass (s again, dp = do.v, dv, dk) and a
    dq pass (s again, dp again, dq): the recomputation a flash backward trades for never holding the scores."""
    if impl == "splash":
        block = min(SPLASH_BLOCK, round_up(seq_len, SPLASH_LANES))
        fwd_block = bwd_block = block
        padded = round_up(seq_len, block)
        qk, v = round_up(qk, SPLASH_LANES), round_up(v, SPLASH_LANES)
    elif impl == "triton":
        fwd_block, bwd_block = triton_block(qk), 32
        padded = round_up(seq_len, fwd_block)
        qk = v = 1 << (qk - 1).bit_length()  # one head width, padded to a power of two inside the kernel
    else:
        return 0.0

    def causal_pairs(block: int) -> int:  # (query, key) pairs in the blocks on or below the diagonal
        n = padded // block
        return n * (n + 1) // 2 * block * block

    flops = 2 * causal_pairs(fwd_block) * (qk + v)
    if backward:
        flops += 2 * causal_pairs(bwd_block) * ((2 * qk + 2 * v) + (2 * qk + v))
    return float(rows * heads * flops)
