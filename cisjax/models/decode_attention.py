"""Attention of a KV cache's new queries: one decode query per row over its written slots only (a Pallas Triton
kernel on a GPU, a Pallas Mosaic kernel on a TPU), else the einsum over every slot (attention.cache_attention)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from cisjax import sharding
from cisjax.models import gpu_decode, stacked
from cisjax.models.attention import cache_attention, check_impl, default_impl

# The GPU kernel (gpu_decode.py, as JAX's pallas.ops.gpu.decode_attention) splits each row's slots into parts of a
# power of two (at least MIN_SPLIT slots: Triton's blocks are powers of two), one program per (row, kv head, part),
# and walks each part in blocks of at most DECODE_BLOCK slots, from the row's first written slot to its last: a row
# reads only its live parts. SPLITS: the parts it aims at (flash decoding: a few rows still fill the GPU).
MIN_SPLIT = 16
DECODE_BLOCK = 128
SPLITS = 16
# The TPU kernel (_tpu_kernel): one program per (row, kv head, block of TPU_BLOCK slots at most); a block past a
# row's last written slot (or before its first) maps to the row's last (first) one, which the pipeline does not fetch
# again, and computes nothing. Its query heads pad to TPU_GROUP rows (a TPU tile's sublanes).
TPU_BLOCK = 512
TPU_GROUP = 8


def split_of(slots: int) -> int | None:
    """The part (slots, a power of two dividing `slots`) the kernel splits a row's slots into: about slots / SPLITS,
    at least MIN_SPLIT; None where no power of two of MIN_SPLIT or more divides `slots` (the einsum then)."""
    largest = slots & -slots
    if largest < MIN_SPLIT:
        return None
    aim = max(MIN_SPLIT, 1 << max(0, (slots // SPLITS).bit_length() - 1))
    return min(largest, aim)


def kernel_of(impl: str, dtype) -> str | None:
    """The decode kernel `impl` runs on the current platform in `dtype`: "triton" (asked, or "auto" on a GPU in bf16;
    in fp32 the einsum: Triton's dots multiply fp32 in TF32), "tpu" ("splash" asked), else None (the einsum). "auto"
    on a TPU is the einsum: compiled for v5p-16 (docs/results.md), the TPU kernel's operands (each layer's keys and
    values, sliced out of the stacked cache for the custom call) held 3.1 GiB more per chip for Qwen1.5-MoE's sampler
    than the einsum (Qwen3-30B-A3B's: the same). The shapes must fit the kernel as well (kernel_fits)."""
    if check_impl(impl) == "auto":
        impl = default_impl(sharding.current_platform(), dtype)
        return "triton" if impl == "triton" else None
    return {"triton": "triton", "splash": "tpu"}.get(impl)


def skips_phases(impl: str, dtype) -> bool:
    """Whether the sampler's decode phases (bounds on the slots a decode step attends over) would only add compiles
    under `impl` on the current platform in `dtype`: the GPU's kernel, which stops at each row's last slot. The TPU
    kernel keeps them: on a TPU the phases also hold the decode's temporaries lower (Qwen3-30B-A3B's 16-layer cut on
    v5p-16: 12.8 GiB per chip in one phase, 11.2 in four, the einsum 10.5: docs/results.md)."""
    return kernel_of(impl, dtype) == "triton"


def reads_stack(impl: str, dtype) -> bool:
    """Whether `impl`'s decode kernel on the current platform in `dtype` reads a layer of a stacked cache in place
    (stacked.LayerOf): the GPU's (Triton) kernel. The TPU kernel takes the layer's slots sliced out (the TPU keeps
    the scanned slices: run_stack_cached; its carried cache held 119.0 GiB per chip against 52.4 on v5p-16)."""
    return kernel_of(impl, dtype) == "triton"


def tpu_block(slots: int) -> int | None:
    """The TPU kernel's block of slots: the largest power of two up to TPU_BLOCK dividing `slots`, at least 16 (a
    bf16 tile's rows); None where there is none (the einsum)."""
    block = min(slots & -slots, TPU_BLOCK)
    return block if block >= 16 else None


def kernel_fits(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, impl: str, slots: int | None = None) -> bool:
    """Whether a decode kernel takes these: one query per row, a kernel for the platform (kernel_of), values as wide
    as the queries, and (Triton) a head width of a power of two and slots split_of divides, or (TPU) slots tpu_block
    divides. `slots`: those attended over (default all of the keys')."""
    l, h, s = q_BxLxNxH.shape[1], q_BxLxNxH.shape[3], slots or k_BxKxSxH.shape[2]
    kernel = kernel_of(impl, q_BxLxNxH.dtype)
    if l != 1 or v_BxKxSxV.shape[-1] != h or kernel is None:
        return False
    if kernel == "triton":
        return not h & (h - 1) and split_of(s) is not None
    return tpu_block(s) is not None


def interval(mask_BxLxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, one past the last) valid slot of each row's one query: a decode's mask is one interval per row (its
    left-padded prompt, then its own tokens up to the new one's). A row with none gets (0, S) (its result unread)."""
    m_BxS = mask_BxLxS[:, 0]
    s = m_BxS.shape[1]
    return jnp.argmax(m_BxS, axis=1).astype(jnp.int32), (s - jnp.argmax(m_BxS[:, ::-1], axis=1)).astype(jnp.int32)


def attend(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, mask_BxLxS, scale: float, impl: str = "auto") -> jax.Array:
    """Queries over a cache's heads-major keys and values under its [B, L, S] mask -> [B, L, N, V]: the decode
    kernel where kernel_fits (each row from its first valid slot to its last: the mask's interval), else
    cache_attention. The keys and values may be stacked.LayerOf (a layer of the stack's cache [n, B, K, S', H], of
    whose slots the mask's S come first): the GPU's kernel reads the layer in its stack; the others slice it out."""
    s = mask_BxLxS.shape[-1]
    if not kernel_fits(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, impl, s):
        k_BxKxSxH, v_BxKxSxV = (stacked.array(a)[:, :, :s] for a in (k_BxKxSxH, v_BxKxSxV))
        return cache_attention(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, mask_BxLxS, scale)
    start_B, end_B = interval(mask_BxLxS)
    if kernel_of(impl, q_BxLxNxH.dtype) == "triton":
        split = split_of(s)
        interpret = sharding.current_platform() not in sharding.GPU_PLATFORMS
        kernel = functools.partial(
            gpu_decode.attend, scale=scale, part=split, block=min(DECODE_BLOCK, split), slots=s, interpret=interpret
        )
        as_stack = lambda x: (x.stack, x.layer) if isinstance(x, stacked.LayerOf) else (x[None], 0)  # noqa: E731
        (k_stack, layer), (v_stack, v_layer) = as_stack(k_BxKxSxH), as_stack(v_BxKxSxV)
        if v_layer is not layer:  # keys and values of different layers (or one stacked, one not): each its own stack
            (k_stack, layer), (v_stack, _) = as_stack(stacked.array(k_BxKxSxH)), as_stack(stacked.array(v_BxKxSxV))
        args = (q_BxLxNxH, k_stack, v_stack, jnp.asarray(layer, jnp.int32), start_B, end_B)
    else:  # the TPU kernel on the layer's slots (given the stack and the layer, on v5p-16 it held 30 GiB more)
        kernel = functools.partial(_tpu_kernel, scale=scale, interpret=sharding.current_platform() != "tpu")
        args = (q_BxLxNxH, *(stacked.array(a)[:, :, :s] for a in (k_BxKxSxH, v_BxKxSxV)), start_B, end_B)
    ctx = sharding.active()
    if ctx is not None:  # GSPMD does not partition a Pallas kernel: each device its rows (and heads, where they split)
        mesh, rules = ctx
        q_spec = sharding.logical_to_spec(("batch", None, "act_heads", None), rules, mesh, q_BxLxNxH.shape)
        kv_spec = sharding.logical_to_spec(("batch", "act_heads", None, None), rules, mesh, k_BxKxSxH.shape)
        if kv_spec[1] != q_spec[2]:  # the query heads split but not the kv heads (or the other way): rows alone
            q_spec = PartitionSpec(q_spec[0], None, None, None)
            kv_spec = PartitionSpec(kv_spec[0], None, None, None)
        row_spec = PartitionSpec(q_spec[0])
        stacks = len(args) == 6  # the GPU kernel's: the stack's layers on every device, the layer index too
        cache_specs = (PartitionSpec(None, *kv_spec),) * 2 + (PartitionSpec(),) if stacks else (kv_spec,) * 2
        kernel = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(q_spec, *cache_specs, row_spec, row_spec),
            out_specs=q_spec,
            check_vma=False,
        )
    o_BxLxNxH = kernel(*args)
    return o_BxLxNxH.astype(v_BxKxSxV.dtype)


def _tpu_kernel(q_BxLxNxH, k_BxKxSxH, v_BxKxSxV, start_B, end_B, *, scale: float, interpret: bool):
    """Decode attention on a TPU: per (row, kv head), its query heads (padded to TPU_GROUP) over the cache's [S, H]
    blocks from the row's first valid slot's block to its last's, an online softmax in fp32 (scores, max, sum and
    output), the probabilities in the values' dtype for their matmul (as cache_attention). The rows' intervals are
    scalar-prefetched: the blocks' index maps clamp to them, so the pipeline fetches no block outside a row's."""
    b, _, n, h = q_BxLxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    gp = -(-g // TPU_GROUP) * TPU_GROUP
    block = tpu_block(s)
    q_BxKxGxH = q_BxLxNxH.reshape(b, kv, g, h)
    q_BxKxGxH = jnp.pad(q_BxKxGxH, ((0, 0), (0, 0), (0, gp - g), (0, 0)))

    def kv_block(r, k, j, start_ref, end_ref):  # the block j of row r, clamped into the row's blocks
        first, last = start_ref[r] // block, (end_ref[r] - 1) // block
        return r, k, jnp.minimum(jnp.maximum(j, first), last), 0

    def body(start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        r, j = pl.program_id(0), pl.program_id(2)
        lo, hi = start_ref[r], end_ref[r]

        @pl.when(j == 0)
        def _():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when((j >= lo // block) & (j <= (hi - 1) // block))
        def _():
            q_GxH = q_ref[...].astype(jnp.float32)
            k_TxH = k_ref[...].astype(jnp.float32)
            s_GxT = jax.lax.dot_general(
                q_GxH, k_TxH, (((1,), (1,)), ((), ())), precision="highest", preferred_element_type=jnp.float32
            )
            slot_GxT = j * block + jax.lax.broadcasted_iota(jnp.int32, s_GxT.shape, 1)
            s_GxT = jnp.where((slot_GxT >= lo) & (slot_GxT < hi), s_GxT * scale, jnp.finfo(jnp.float32).min)
            m_prev = m_ref[...][:, :1]
            m_next = jnp.maximum(m_prev, jnp.max(s_GxT, axis=1, keepdims=True))
            p_GxT = jnp.exp(s_GxT - m_next)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[...] = jnp.broadcast_to(
                alpha * l_ref[...][:, :1] + jnp.sum(p_GxT, axis=1, keepdims=True), l_ref.shape
            )
            m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
            p_GxT = p_GxT.astype(v_ref.dtype).astype(jnp.float32)  # rounded as cache_attention's probabilities
            pv_GxH = jax.lax.dot_general(
                p_GxT,
                v_ref[...].astype(jnp.float32),
                (((1,), (0,)), ((), ())),
                precision="highest",
                preferred_element_type=jnp.float32,
            )
            acc_ref[...] = alpha * acc_ref[...] + pv_GxH

        @pl.when(j == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...] / l_ref[...][:, :1]

    o_BxKxGxH = pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kv, s // block),
            in_specs=[
                pl.BlockSpec((None, None, gp, h), lambda r, k, j, *_: (r, k, 0, 0)),
                pl.BlockSpec((None, None, block, h), kv_block),
                pl.BlockSpec((None, None, block, h), kv_block),
            ],
            out_specs=pl.BlockSpec((None, None, gp, h), lambda r, k, j, *_: (r, k, 0, 0)),
            scratch_shapes=[pltpu.VMEM((gp, 128), jnp.float32)] * 2 + [pltpu.VMEM((gp, h), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct((b, kv, gp, h), jnp.float32),
        interpret=interpret,
        name="cisjax_decode_attention",
    )(start_B, end_B, q_BxKxGxH, k_BxKxSxH, v_BxKxSxV)
    return o_BxKxGxH[:, :, :g].reshape(b, 1, n, h)
