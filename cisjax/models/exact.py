"""Batch-invariant ("exact") forward and KV-cache decode: a token's values do not depend on the other tokens, rows,
batch shape or sequence length, so the sampler's q and the trainer's p agree to the last bit (rollout.exact).

Why: on XLA:CPU a row's result depends on the shape of the op it is computed in. A [M, K] x [K, N] dot takes other
kernels (YNNPACK's tilings, Eigen, strength-reduced multiply-reduce at M = 1) by shape, and a reduction over the
minor axis is emitted differently for few rows and for many (measured: a row's fp32 result in a dot of M <= 48 rows
equals the same row's in M = 256 on 12-25% of its values). The decode (R rows, one query each, over a cache) and the
train step ([B, T] rows, T queries each) therefore compute every op in another order, and so do two train batches of
other shapes.

How: every per-token computation runs in ROW tiles of a fixed shape (`tiled`: a lax.map over [TILE, ...] tiles, one
loop body compiled the same in every program; its inputs and outputs behind optimization barriers, so that XLA
fuses nothing of the surrounding program into it). A tile's rows are independent: a row's result is the same
whatever the other rows of its tile are (measured on XLA:CPU: position in the tile and neighbours do not matter).
Attention is per query: each query attends over its row's keys laid out slot = position, over a fixed number of
slots `slots` (masked slots contribute exact zeros: exp(finfo.min - max) = 0), so the decode's cache and the
training forward's keys give the same reduction. The logprob is the trainer's formula, z_t - logsumexp(z).

The families' pieces: exact_attention (GQA and MLA), exact_moe (router, experts in expert tiles or per token, shared
experts), exact_head (the head and the one logprob formula, top-k / top-p renormalised over a [V] mask). Scope of the
prototype: Qwen2, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2; fp32 and bf16 compute; one unpacked sequence per row. Wired by
rollout.exact: cisjax.engines.jax.exact_engine samples with exact_step, cisjax.exact_forward gives the train step
exact_forward's value."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cisjax.models import cpu_bits, deepseek_v2, exact_attention, exact_head, exact_moe
from cisjax.models.transformer import CausalLM, layer_of, layer_runs, write_cache

TILE = 16  # rows per tile: every per-token op runs on [TILE, ...] tiles (the CPU decode's width step)
# rollout.exact's run constants, the same in the sampler and the train step: attention in key blocks of BLOCK slots
# (then the trainer's key length need not be the cache's); the MoE experts: moe_impl
BLOCK = 32
MIN_TRIPS = exact_head.MIN_TRIPS
# experts dense over each row tile while that is at most DENSE_MAX x the useful expert FLOPs (E / k) and each expert
# holds at most DENSE_MAX_WEIGHTS weights per matrix (hidden x moe_intermediate): where the experts are that small the
# expert tiles' fixed work (the sort, the gathers, the loop over small tiles) costs more than the dense experts' FLOPs.
# Measured on a CPU (docs/results.md): the demo's 8 experts top-2 of 64 x 32, dense's decode step 0.44x the tiles'
# time; the benches' 8 top-2 of 256 x 256, the tiles' forward 0.42x dense's. Qwen1.5-MoE's 60 top-4 (15x) and
# Qwen3-30B-A3B's 128 top-8 (16x) take tiles
DENSE_MAX = 4
DENSE_MAX_WEIGHTS = 8192


def moe_impl(model: CausalLM) -> str:
    """rollout.exact's MoE experts for `model`: "dense" (every expert on every token of a row tile, E / k times the
    useful FLOPs) while E / k <= DENSE_MAX and the experts are small (DENSE_MAX_WEIGHTS), else "tiles"
    (exact_moe.expert_tiles: expert tiles of EXPERT_TILE rows over all tokens, about the plain MoE's FLOPs, each
    expert's weights read once per tile); DeepSeek-V2's gathered per token ("gather"). Measured on XLA:CPU (the tests'
    flags), q == p through ExactEngine and the reference decode: dense and tiles for Qwen2-MoE and Qwen3-MoE in fp32
    and bf16; for DeepSeek-V2 tiles in bf16, in fp32 only in the reference decode (ExactEngine's prefill then differs
    by an ulp on most tokens, as "dense" did there)."""
    if isinstance(model.cfg, deepseek_v2.Config):
        return "gather"
    cfg = model.cfg
    experts, k = getattr(cfg, "num_experts", 0), getattr(cfg, "num_experts_per_tok", 1)
    weights = getattr(cfg, "hidden_size", 0) * getattr(cfg, "moe_intermediate_size", 0)
    return "dense" if experts <= DENSE_MAX * k and weights <= DENSE_MAX_WEIGHTS else "tiles"


def tiled(fn, *args, tile: int = TILE):
    """fn over fixed-shape row tiles: args [N, ...] (the same N) -> fn's outputs [N, ...], N padded with zero rows
    (their results dropped) to a multiple of `tile`, and to two tiles at least. One loop body of [tile, ...] shapes
    in every program: XLA inlines a loop of one trip into its program, where its optimised code computes otherwise
    (the rotary: some q and k an ulp off, so a lone request's q differed from p)."""
    n = args[0].shape[0]
    pad = max(-(-n // tile), MIN_TRIPS) * tile - n

    def chunks(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(-1, tile, *a.shape[1:])

    ins, outs = cpu_bits.dtypes_of(args), []

    def body(xs):
        xs = lax.optimization_barrier(cpu_bits.from_bits(xs, ins))  # nothing around fuses into the body
        out = lax.optimization_barrier(fn(*xs))
        outs.append(cpu_bits.dtypes_of(out))
        return cpu_bits.to_bits(out)  # bf16 tiles carried as bits (cpu_bits.to_bits: XLA:CPU's cost)

    out = cpu_bits.from_bits(lax.map(body, cpu_bits.to_bits(tuple(chunks(a) for a in args))), outs[0])
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:n], out)


def layers(model: CausalLM) -> list:
    """The model's decoder layers in order, each a plain DecoderLayer with its parameters sliced out of its stack
    (transformer.layer_of). A program that takes them as its inputs (exact_prefill's and exact_step's `layers`) copies
    no layer's weights out of the stacks: on a CPU that copy was a fifth of a decode step (the benches' model, fp32)."""
    return [layer_of(model.stacks[r], j) for r, run in enumerate(layer_runs(model.cfg)) for j in range(len(run))]


def _post(layer, moe_impl: str, x_TxD, o_TxQ):
    """The output projection, the residual, the MLP (or MoE) block and its residual, on a tile."""
    x_TxD = x_TxD + exact_attention.out(layer, o_TxQ)
    h_TxD = layer.mlp_norm(x_TxD)
    if layer.is_moe:
        return x_TxD + exact_moe.block(layer.mlp, h_TxD, moe_impl)
    return x_TxD + layer.mlp(h_TxD[:, None])[:, 0]


def _pre_moe(layer, x_TxD, o_TxQ):
    """impl "tiles", a tile's first part: _post's output projection and residual, the MLP norm and the router -> (x,
    h, routing weights [T, k], expert ids [T, k])."""
    x_TxD = x_TxD + exact_attention.out(layer, o_TxQ)
    h_TxD = layer.mlp_norm(x_TxD)
    w_TxK, ids_TxK = exact_moe.route_tile(layer.mlp.moe, h_TxD)
    return x_TxD, h_TxD, w_TxK, ids_TxK


def _post_moe(layer, x_TxD, h_TxD, y_TxKxD, w_TxK):
    """impl "tiles", a tile's last part: the routed experts' outputs y [T, k, D] combined, the shared experts, the
    residual."""
    y_TxD = exact_moe.combine(y_TxKxD, w_TxK, layer.mlp.moe.dtype)
    return x_TxD + exact_moe.with_shared(layer.mlp, h_TxD, y_TxD)


def _post_all(layer, moe_impl: str, x_NxD, o_NxQ):
    """_post over all N tokens in row tiles; a MoE layer under moe_impl "tiles": its routed experts in expert tiles
    over all N tokens (exact_moe.expert_tiles) between two row-tiled parts."""
    if not (layer.is_moe and moe_impl == "tiles"):
        return tiled(functools.partial(_post, layer, moe_impl), x_NxD, o_NxQ)
    x_NxD, h_NxD, w_NxK, ids_NxK = tiled(functools.partial(_pre_moe, layer), x_NxD, o_NxQ)
    y_NxKxD = exact_moe.expert_tiles(layer.mlp.moe, h_NxD, ids_NxK)
    return tiled(functools.partial(_post_moe, layer), x_NxD, h_NxD, y_NxKxD, w_NxK)


def _layout(e_NxE, b: int, t: int, slots: int, axis: int):
    """A layer's entries of the B x T tokens [B T, ...] as the cache lays them out: [B, ...per-row] with the slots
    (T of them, padded to `slots` with zeros) at per-row `axis`."""
    e = e_NxE.reshape(b, t, *e_NxE.shape[1:])
    e = jnp.pad(e, [(0, 0), (0, slots - t)] + [(0, 0)] * (e.ndim - 2))
    return jnp.moveaxis(e, 1, 1 + axis)


def _attend(layer, arrays, block, q_TxNxH, row_T, pos_T, shared: bool = False):
    """A tile's queries over their rows of `arrays` (a layer's [B, ...per-row]: the cache or the trainer's layout):
    over all slots at once (block None: exact_attention.attend) or in key blocks (exact_attention.attend_blocked;
    shared: every tile's queries in one row)."""
    if block is not None:
        return exact_attention.attend_blocked(layer, arrays, q_TxNxH, row_T, pos_T, block=block, shared=shared)
    arrays = cpu_bits.from_bits(arrays, (jnp.dtype(layer.attn.cfg.dtype),) * len(arrays))  # a cache held as bits
    slots = arrays[0].shape[1 + exact_attention.slot_axes(layer.attn)[0]]
    mask_TxS = jnp.arange(slots)[None] <= pos_T[:, None]
    return exact_attention.attend(layer, q_TxNxH, tuple(jnp.take(a, row_T, axis=0) for a in arrays), mask_TxS)


def exact_forward(
    model: CausalLM,
    tokens_BxT,
    positions_BxT,
    targets_BxT,
    *,
    slots: int,
    temperature: float = 1.0,
    support_BxTxS=None,
    moe_impl: str = "gather",
    block: int | None = None,
    layers_=None,
):
    """The trainer's side: logprobs [B, T] of targets, rows left-aligned (position = slot), each query attending over
    its row's slots up to its own (one sequence per row). `slots` >= T: the fixed key length of the decode's cache.
    support_BxTxS: each target's sampling support (ids, -1 padded; a target without any: no truncation), over which
    its logprob is renormalised (exact_head.renormalised). moe_impl: exact_moe's; block: attention in key blocks of
    that many slots (None: over all slots at once); the decode must use the same. layers_: as exact_prefill's."""
    b, t = tokens_BxT.shape
    if slots < t:
        raise ValueError(f"slots={slots} < T={t}")
    x = jnp.take(model.embed_VxD[...], tokens_BxT, axis=0).astype(model.cfg.dtype).reshape(b * t, -1)
    pos = positions_BxT.reshape(-1).astype(jnp.int32)
    row = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    shared = t % TILE == 0  # each tile is one row's consecutive positions
    for layer in layers_ or layers(model):
        q, entries = tiled(functools.partial(exact_attention.project, layer), x, pos)
        axes = exact_attention.slot_axes(layer.attn)
        lay = tuple(_layout(e, b, t, slots, a) for e, a in zip(entries, axes))
        o = tiled(functools.partial(_attend, layer, lay, block, shared=shared), q, row, pos)
        x = _post_all(layer, moe_impl, x, o)
    ids = None if support_BxTxS is None else support_BxTxS.reshape(b * t, -1).astype(jnp.int32)
    head = lambda x, tt, s=None: exact_head.train_tile(model, x, tt, s, temperature)  # noqa: E731
    lp = tiled(head, x, targets_BxT.reshape(-1), *(() if ids is None else (ids,)))
    return lp.reshape(b, t)


def init_cache(model: CausalLM, rows: int, slots: int):
    """Per layer, its attention's cache arrays [R, ...per-row] (attn.cache_shapes(), `slots` slots) in the compute
    dtype, held as bits (cpu_bits.to_bits: on the CPU a 16-bit cache stays uint16 between decode steps, else each
    step's program would bitcast the whole cache in and out): slot = position."""
    return [
        cpu_bits.to_bits(
            tuple(
                jnp.zeros((rows, *(slots if d is None else d for d in shape)), model.cfg.dtype)
                for shape in layer.attn.cache_shapes()
            )
        )
        for layer in layers(model)
    ]


def exact_prefill(
    model: CausalLM,
    tokens_RxP,
    plen_R,
    *,
    slots: int,
    temperature: float = 1.0,
    moe_impl: str = "gather",
    block: int | None = None,
    layers_: list | None = None,
):
    """The prompts [R, P] (left-aligned: slot = position) through the layers at once, as exact_forward lays them out
    -> (z [R, V] and logsumexp(z) [R] of each row's next token after its plen_R prompt tokens, the cache of `slots`
    slots, held as init_cache's). A row's slots past its prompt hold its padding's entries: the decode overwrites each before it reads it.
    Every per-token value is exact_step's (the same tiles): the samples' q do not depend on the prompts going in at
    once. layers_: `layers(model)` computed apart (the program's inputs), else sliced here."""
    r, p = tokens_RxP.shape
    x = jnp.take(model.embed_VxD[...], tokens_RxP, axis=0).astype(model.cfg.dtype).reshape(r * p, -1)
    pos = jnp.tile(jnp.arange(p, dtype=jnp.int32), r)
    row = jnp.repeat(jnp.arange(r, dtype=jnp.int32), p)
    cache = []
    for layer in layers_ or layers(model):
        q, entries = tiled(functools.partial(exact_attention.project, layer), x, pos)
        axes = exact_attention.slot_axes(layer.attn)
        lay = cpu_bits.to_bits(tuple(_layout(e, r, p, slots, a).astype(model.cfg.dtype) for e, a in zip(entries, axes)))
        cache.append(lay)
        o = tiled(functools.partial(_attend, layer, lay, block, shared=p % TILE == 0), q, row, pos)
        x = _post_all(layer, moe_impl, x, o)
    last_RxD = x.reshape(r, p, -1)[jnp.arange(r), plen_R - 1]
    z, lse = tiled(lambda x: exact_head.logits(model, x, temperature), last_RxD)
    return z, lse, cache


def exact_step(
    model: CausalLM,
    cache,
    tok_R,
    pos_R,
    *,
    temperature: float = 1.0,
    moe_impl: str = "gather",
    block: int | None = None,
    layers_: list | None = None,
):
    """One token per row at its position pos_R (its slot) through the cache (held as init_cache's) -> (z = logits /
    temperature [R, V] of the next token, logsumexp(z) [R], the cache). The sampled token's logprob is exact_head.renormalised of these (in its
    own tile: `logprob`), the formula and program of exact_forward's head. layers_: as exact_prefill's."""
    r = tok_R.shape[0]
    x = jnp.take(model.embed_VxD[...], tok_R, axis=0).astype(model.cfg.dtype)
    rows = jnp.arange(r, dtype=jnp.int32)
    new = []
    for layer, arrays in zip(layers_ or layers(model), cache):
        q, entries = tiled(functools.partial(exact_attention.project, layer), x, pos_R)
        axes = exact_attention.slot_axes(layer.attn)
        # each row's entry into its cache array at its own slot (the plain decode's per-row write; the cache held as
        # bits on the CPU stays bits)
        dt = model.cfg.dtype
        arrays = tuple(write_cache(c, e[:, None], pos_R, 1 + a, dtype=dt) for c, e, a in zip(arrays, entries, axes))
        new.append(arrays)
        o = tiled(functools.partial(_attend, layer, arrays, block), q, rows, pos_R)
        x = _post_all(layer, moe_impl, x, o)
    z, lse = tiled(lambda x: exact_head.logits(model, x, temperature), x)
    return z, lse, new


def logprob(z_RxV, lse_R, tok_R, keep_RxV, has_R):
    """The sampled tokens' q [R]: exact_head.renormalised in its own tile (the trainer's head runs it isolated)."""
    return tiled(exact_head.renormalised, z_RxV, lse_R, tok_R, keep_RxV, has_R)
