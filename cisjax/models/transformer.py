"""The decoder-only shell of every family: embedding, stacked and scanned pre-norm decoder blocks, norm, head."""

from __future__ import annotations

from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from cisjax import errors, sharding
from cisjax.models import cpu_bits, grad_sink, stacked
from cisjax.models.attention import Segments, cache_mask
from cisjax.models.layers import MLP, RMSNorm, param
from cisjax.models.moe import EXPERT_STACKS

# model.remat: what the backward pass keeps of each decoder layer's forward; the rest it recomputes from the layer's
# input. "minimal": the matmuls without dot batch dimensions (jax's dots_with_no_batch_dims_saveable), i.e. the
# projections; not the attention scores (batched over heads) nor the MoE kernels' outputs. "full": the input only.
REMAT_POLICIES = {
    "none": None,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


# A KV cache: per stack of layers (layer_runs), the arrays its attention keeps per token (attn.cache_shapes(): GQA's
# keys and values [n, B, K, S, H], heads-major, so that attention's batched matmuls read them in place; MLA's latent
# [n, B, S, C] and rotary key [n, B, S, 1, P]); n = the stack's layers, S = cache slots.
Cache = list[tuple[jax.Array, ...]]


class ModelOutput(NamedTuple):
    hidden_BxLxD: jax.Array  # after the final norm, before the unembedding
    # Routing capture: selected expert ids per MoE layer, [X, B, L, k] (X = number of MoE layers,
    # in layer order; see CausalLM.moe_layers), or None for dense models.
    expert_ids_XxBxLxK: jax.Array | None
    grad_acc: list | None = None  # the gradient sums passed through, one per stack (CausalLM.__call__'s grad_acc)


class DecoderLayer(nnx.Module):
    """The pre-norm residual block of every family: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)).

    `attn(x_BxLxD, positions_BxL, mask) -> y_BxLxD` is the family's attention (mask: attention.Segments); `mlp` is the family's MoE block,
    `mlp(x_BxLxD, replay_BxLxK) -> (y_BxLxD, expert_ids_BxLxK)`, on a MoE layer (replay: forced expert ids or None,
    see moe.MoE), and a dense SwiGLU MLP otherwise.
    """

    def __init__(self, cfg, attn: nnx.Module, mlp: nnx.Module, *, is_moe: bool):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.attn = attn
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.mlp = mlp
        self.is_moe = is_moe

    def attention_block(self, x_BxLxD, positions_BxL, mask):
        """The attention half's residual branch: attn(attn_norm(x))."""
        return self.attn(self.attn_norm(x_BxLxD), positions_BxL, mask)

    def mlp_block(self, x_BxLxD, replay_BxLxK=None):
        """The MLP half's residual branch, (mlp(mlp_norm(x)), the router's expert ids or None on a dense layer).
        replay_BxLxK (forced expert ids) applies to a MoE layer; a dense layer has no routing to replay."""
        if self.is_moe:
            return self.mlp(self.mlp_norm(x_BxLxD), replay_BxLxK)
        return self.mlp(self.mlp_norm(x_BxLxD)), None

    def __call__(self, x_BxLxD, positions_BxL, mask, replay_BxLxK=None):
        x_BxLxD = x_BxLxD + self.attention_block(x_BxLxD, positions_BxL, mask)
        y_BxLxD, ids = self.mlp_block(x_BxLxD, replay_BxLxK)
        return sharding.constrain(x_BxLxD + y_BxLxD, ("batch", "length", "act_embed")), ids

    def cached(self, x_BxLxD, positions_BxL, cache, index, mask_BxLxS, layer=None, repeat: int = 1):
        """The layer on L new tokens whose attention entries are written into `cache` at slots index..index+L-1,
        their queries attending over the first S' slots under mask_BxLxS' (attention.cache_mask; S' <= S) ->
        (x_BxLxD, expert ids or None, the updated cache). `cache`: this layer's arrays [B, S, ...]; or, with
        `layer`, its stack's [n, B, S, ...], of which this is layer `layer` (only the new entries are written).
        `repeat`: the cache holds that many rows per row of x (row b's entries go into rows b r .. b r + r - 1; a
        prefill at index 0 only, whose tokens attend over their own entries)."""
        h_BxLxD = self.attn_norm(x_BxLxD)
        q = self.attn.query(h_BxLxD)
        new = self.attn.kv(h_BxLxD, positions_BxL)
        seen = mask_BxLxS.shape[-1]
        axes = [1 + slot_axis(shape) for shape in self.attn.cache_shapes()]  # of a layer's arrays [B, ...]
        rows = new if repeat == 1 else tuple(jnp.repeat(n, repeat, axis=0) for n in new)
        cache = tuple(write_cache(c, n, index, a, layer) for c, n, a in zip(cache, rows, axes))
        if isinstance(index, int) and index == 0 and seen == x_BxLxD.shape[1]:
            # the new tokens see only one another: their own entries, as the cache holds them, not read back from it
            mine = tuple(jnp.moveaxis(n.astype(c.dtype), 1, a) for c, n, a in zip(cache, new, axes))
        else:
            if repeat != 1:
                raise ValueError(f"repeat={repeat}: a prefill at slot 0 only")
            if layer is not None and in_place(self.attn):
                mine = tuple(stacked.LayerOf(c, layer) for c in cache)  # the layer read in place (decode_attention)
            else:
                cache_j = cache
                if layer is not None:
                    cache_j = tuple(jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in cache)
                mine = tuple(jax.lax.slice_in_dim(c, 0, seen, axis=a) for c, a in zip(cache_j, axes))
        x_BxLxD = x_BxLxD + self.attn.attend(q, positions_BxL, mine, mask_BxLxS)
        y_BxLxD, ids = self.mlp_block(x_BxLxD)
        return sharding.constrain(x_BxLxD + y_BxLxD, ("batch", "length", "act_embed")), ids, cache


def in_place(attn) -> bool:
    """Whether a decode step hands `attn` its layer of the stack's cache in place (stacked.LayerOf, never sliced out:
    the carried form of run_stack_cached) rather than a copy: where attn's decode kernel reads it there
    (attn.reads_stacked_cache)."""
    reads = getattr(attn, "reads_stacked_cache", None)
    return reads is not None and reads()


def slot_axis(shape: tuple) -> int:
    """Where the slots go in a per-row cache shape of attn.cache_shapes() (its None)."""
    return shape.index(None)


def write_cache(cache, new_BxLx, index, axis: int, layer=None, dtype=None):
    """new_BxLx (a layer's entries of L new tokens, token-major: kv()'s) into a cache array of a layer ([B, ...], its
    slots on `axis`; or, with `layer`, its stack's [n, B, ...]) at slots index..index+L-1: `index` one for all rows
    (a slice update), or a [B] array, each row's own slot for L = 1 (a scatter of one entry per row: rows of a
    decode that entered at different steps). dtype: the cache's values' where it holds their bits already
    (cpu_bits.to_bits: the exact sampler's cache between its steps); it is written and returned as bits."""
    dtype = jnp.dtype(dtype or cache.dtype)
    held = cache.dtype != dtype  # already bits: no bitcast of the whole cache on the way in or out
    # on the CPU a bf16 cache is written as its bits (cpu_bits: else a convert of the whole cache at every step)
    cache, new_BxLx = cpu_bits.to_bits((cache, new_BxLx.astype(dtype)))
    lead = () if layer is None else (layer,)
    if jnp.ndim(index) == 1:  # the row and slot indices apart or side by side: the entries [B, ...] either way
        at = (*lead, jnp.arange(new_BxLx.shape[0])) + (slice(None),) * (axis - 1) + (index,)
        out = cache.at[at].set(new_BxLx[:, 0], indices_are_sorted=True, unique_indices=True)
    else:
        new = jnp.moveaxis(new_BxLx, 1, axis)
        start = [0] * new.ndim
        start[axis] = index
        if layer is None:
            out = jax.lax.dynamic_update_slice(cache, new, start)
        else:
            out = jax.lax.dynamic_update_slice(cache, new[None], [layer, *start])
    return out if held else cpu_bits.from_bits(out, dtype)


def decoder_layers(cfg, rngs: nnx.Rngs, *, attention, moe_block=None) -> list[DecoderLayer]:
    """cfg.num_hidden_layers blocks: `attention(cfg, rngs=rngs)` in each, `moe_block(cfg, rngs=rngs)` where
    cfg.is_moe_layer(i), a SwiGLU MLP of cfg.intermediate_size elsewhere."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = attention(cfg, rngs=rngs)
        is_moe = cfg.is_moe_layer(i)
        if is_moe:
            mlp = moe_block(cfg, rngs=rngs)
        else:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, param_dtype=cfg.param_dtype, dtype=cfg.dtype)
        layers.append(DecoderLayer(cfg, attn, mlp, is_moe=is_moe))
    return layers


def layer_runs(cfg) -> tuple[tuple[int, ...], ...]:
    """The decoder layers grouped into stacks: maximal runs of consecutive layers of one kind (MoE or dense), e.g.
    DeepSeek-V2's `first_k_dense_replace` dense layers then its MoE layers -> ((0,), (1, ..., 26)). Each run is stored
    as one stacked module (stack_layers) and run by one lax.scan."""
    runs: list[list[int]] = []
    for i in range(cfg.num_hidden_layers):
        if runs and cfg.is_moe_layer(runs[-1][-1]) == cfg.is_moe_layer(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return tuple(tuple(r) for r in runs)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """Layers of one kind as ONE DecoderLayer whose every parameter has a leading [n] axis, logical name "layers"
    (one buffer per parameter: the scan reads a layer's slice, the optimizer and the shardings see one array)."""
    graphdef, first = nnx.split(layers[0])
    states = [first]
    for layer in layers[1:]:
        g, state = nnx.split(layer)
        if g != graphdef:
            raise ValueError("stack_layers: layers of different structure cannot share a stack")
        states.append(state)

    def stack(*vs):
        axes = vs[0].get_metadata().get("axes")
        return vs[0].replace(jnp.stack([v[...] for v in vs]), axes=None if axes is None else ("layers", *axes))

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_var))


def stack_size(stack: DecoderLayer) -> int:
    """Layers held by a stack (the leading dim of its parameters)."""
    return jax.tree.leaves(nnx.state(stack, nnx.Param))[0].shape[0]


def layer_of(stack: DecoderLayer, j: int) -> DecoderLayer:
    """Layer j of a stack as a plain DecoderLayer (its parameters sliced; logical axes without "layers")."""
    graphdef, state = nnx.split(stack)

    def one(v):
        axes = v.get_metadata().get("axes")
        return v.replace(v[...][j], axes=None if axes is None else tuple(axes[1:]))

    return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=_is_var))


def run_stack(
    stack: DecoderLayer,
    x_BxLxD,
    positions_BxL,
    mask,
    *,
    remat: str = "none",
    scan: bool = True,
    replay_nxBxLxK=None,
    grad_acc=None,
    grad_key=None,
):
    """x through every layer of a stack -> (x_BxLxD, the routers' expert ids [n, B, L, k] or None), and with
    `grad_acc` the accumulator passed through: (x_BxLxD, ids, grad_acc).

    grad_acc: the train step's gradient sum of the stack's parameters (their tree, in the sum's dtype), carried
    through the layers with grad_sink.into_layer around each: differentiated with respect to it, each layer's
    gradient is added into it in place (train/step.py). grad_key: a bfloat16 sum's rounding key (grad_sink.Sums).

    replay_nxBxLxK: forced expert ids of each of the stack's n (MoE) layers, scanned along with the layers' params
    (so each layer's recompute under remat sees its own ids), or None.

    scan: one jax.lax.scan over the stack (one layer body to compile, whatever the depth); else a Python loop over
    its slices (one copy of the body per layer, as unscanned layers compile). remat: a jax.checkpoint policy around
    each layer's body (REMAT_POLICIES), a pure function of the layer's split state (nnx.remat's write-back fails on a
    model merged inside another transform's body, e.g. the rescoring's lax.map over micro-batches)."""
    graphdef, state = nnx.split(stack)

    def body(x_BxLxD, state_j, replay_j, positions_BxL, mask):
        return nnx.merge(graphdef, state_j)(x_BxLxD, positions_BxL, mask, replay_j)

    if remat != "none":
        # prevent_cse only matters outside scan (jax.checkpoint's documentation)
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
    n = stack_size(stack)
    if replay_nxBxLxK is not None and replay_nxBxLxK.shape[0] != n:
        raise ValueError(f"replayed routing of {replay_nxBxLxK.shape[0]} layers for a stack of {n}")
    if scan:
        # XLA:CPU runs a rolled scan ~10% slower (cisjax bench step: per-iteration dynamic slices of the stacked
        # weights and updates of the stacked gradients); CPU models are small, so there it is unrolled (the same
        # stacked parameters, one body per layer as unscanned). TPU/GPU programs stay rolled: one body to compile.
        unroll = sharding.current_platform() == "cpu"
        if grad_acc is None:
            return jax.lax.scan(
                lambda x, xs: body(x, *xs, positions_BxL, mask), x_BxLxD, (state, replay_nxBxLxK), unroll=unroll
            )

        def summing(carry, xs):
            x_BxLxD, acc = carry
            state_j, replay_j, j = xs
            state_j, acc = grad_sink.into_layer(state_j, acc, j, grad_key)
            x_BxLxD, ids_j = body(x_BxLxD, state_j, replay_j, positions_BxL, mask)
            return (x_BxLxD, acc), ids_j

        xs = (state, replay_nxBxLxK, jnp.arange(n))
        (x_BxLxD, grad_acc), ids = jax.lax.scan(summing, (x_BxLxD, grad_acc), xs, unroll=unroll)
        return x_BxLxD, ids, grad_acc
    ids = []
    for j in range(n):
        replay_j = None if replay_nxBxLxK is None else replay_nxBxLxK[j]
        state_j = jax.tree.map(lambda a, j=j: a[j], state)
        if grad_acc is not None:
            state_j, grad_acc = grad_sink.into_layer(state_j, grad_acc, j, grad_key)
        x_BxLxD, ids_j = body(x_BxLxD, state_j, replay_j, positions_BxL, mask)
        ids.append(ids_j)
    ids = None if ids[0] is None else jnp.stack(ids)
    return (x_BxLxD, ids) if grad_acc is None else (x_BxLxD, ids, grad_acc)


def run_stack_cached(
    stack: DecoderLayer, x_BxLxD, positions_BxL, cache, index, mask_BxLxS, *, carried=None, repeat: int = 1
):
    """x through every layer of a stack, each writing its new entries into `cache` (arrays [n, B, S, ...]; B x
    `repeat` rows: DecoderLayer.cached) and reading its own slots -> (x_BxLxD, expert ids [n, B, L, k] or None, the
    updated cache). Scanned as run_stack.

    Two forms of the same computation, by platform (`carried` forces one): on a TPU the layers' slices as the scan's
    inputs and the updated slices stacked as its outputs, which the rolled scan keeps in place; on a CPU (where the
    scan is unrolled and the stacked outputs would be a new cache) and a GPU the stack's cache carried whole, each
    layer writing its new entries into it. Measured (docs/results.md): the carried form held the sampler's
    temporaries at 1.6x the cache on XLA:CPU against 2.0x, and cost 4.5 GiB more per chip on a v5p (57.5 -> 62.0
    GiB, Qwen1.5-MoE). On a GPU the other form copied each layer's slices out of the stacked cache and back every
    step (a decode step of Qwen1.5-MoE's 4-layer cut at 256 rows on an H200: 12 of its 15.8 ms), and the carried
    form there hands the layer's cache and expert weights to the kernels that read them in place (stacked.LayerOf:
    in_place, moe.EXPERT_STACKS), none sliced out."""
    graphdef, state = nnx.split(stack)
    platform = sharding.current_platform()
    unrolled = platform == "cpu"
    if not ((unrolled or platform in sharding.GPU_PLATFORMS) if carried is None else carried):

        def body(x_BxLxD, xs):
            state_j, cache_j = xs
            layer = nnx.merge(graphdef, state_j)
            x_BxLxD, ids, cache_j = layer.cached(x_BxLxD, positions_BxL, cache_j, index, mask_BxLxS, repeat=repeat)
            return x_BxLxD, (ids, cache_j)

        x_BxLxD, (ids, cache) = jax.lax.scan(body, x_BxLxD, (state, cache), unroll=unrolled)
        return x_BxLxD, ids, cache

    whole = nnx.State({})  # the expert stacks read in place (GPU), beside the scanned slices of the rest
    if platform in sharding.GPU_PLATFORMS:
        graphdef, whole, state = nnx.split(stack, lambda path, _: path[-1] in EXPERT_STACKS, ...)

    def carried_body(carry, xs):
        x_BxLxD, cache = carry
        state_j, j = xs
        in_place_j = jax.tree.map(lambda v: v.replace(stacked.LayerOf(v[...], j)), whole, is_leaf=_is_var)
        layer = nnx.merge(graphdef, in_place_j, state_j) if jax.tree.leaves(whole) else nnx.merge(graphdef, state_j)
        x_BxLxD, ids, cache = layer.cached(x_BxLxD, positions_BxL, cache, index, mask_BxLxS, layer=j, repeat=repeat)
        return (x_BxLxD, cache), ids

    n = jax.tree.leaves(cache)[0].shape[0]
    (x_BxLxD, cache), ids = jax.lax.scan(carried_body, (x_BxLxD, cache), (state, jnp.arange(n)), unroll=unrolled)
    return x_BxLxD, ids, cache


class CausalLM(nnx.Module):
    """tokens -> hidden states; each family supplies its decoder layers, stored as stacks (layer_runs).

    A layer is called as `layer(x_BxLxD, positions_BxL, mask)` and returns
    `(x_BxLxD, expert_ids_BxLxK or None)`. Parameters of the layers live in `stacks[r]` with a leading "layers"
    axis; layer(i) gives layer i alone.
    """

    def __init__(self, cfg, layers: list, *, rngs: nnx.Rngs):
        if len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"{len(layers)} decoder layers for num_hidden_layers={cfg.num_hidden_layers}")
        self.cfg = cfg
        self.embed_VxD = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.param_dtype)
        self.stacks = nnx.List([stack_layers([layers[i] for i in run]) for run in layer_runs(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head_DxV = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer i alone (a copy of its slice of the stack)."""
        for r, run in enumerate(layer_runs(self.cfg)):
            if i in run:
                return layer_of(self.stacks[r], run.index(i))
        raise IndexError(f"layer {i} of a {self.cfg.num_hidden_layers}-layer model")

    def __call__(
        self,
        tokens_BxL: jax.Array,
        positions_BxL: jax.Array | None = None,
        segment_ids_BxL: jax.Array | None = None,
        replay_XxBxLxK: jax.Array | None = None,
        grad_acc=None,
    ) -> ModelOutput:
        """positions default to 0..L-1; segment_ids (0 = padding) default to one segment per row.
        Packed rows carry per-segment positions and distinct segment ids.

        replay_XxBxLxK: routing replay, the expert ids every MoE layer X (in moe_layers order) uses at each token
        instead of its router's choice (moe.MoE); the output's expert ids stay the routers' own.

        grad_acc: the train step's gradient sums (grad_sink.Sums: one per stack, run_stack's), passed through to the
        output's grad_acc, a list of the sums (the train step's in-place accumulation)."""
        b, l = tokens_BxL.shape
        x_moe = len(self.moe_layers)
        if replay_XxBxLxK is not None and replay_XxBxLxK.shape[:3] != (x_moe, b, l):
            raise errors.UserError(
                f"replayed routing {tuple(replay_XxBxLxK.shape)} for {x_moe} MoE layers and tokens {(b, l)}"
            )
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones((b, l), jnp.int32)
        mask = Segments(segment_ids_BxL)
        x_BxLxD = jnp.take(self.embed_VxD[...], tokens_BxL, axis=0).astype(self.cfg.dtype)
        x_BxLxD = sharding.constrain(x_BxLxD, ("batch", "length", "act_embed"))
        routing = []
        remat = self.cfg.remat
        if remat not in REMAT_POLICIES:
            raise errors.UserError(f"model.remat={remat!r}; one of {tuple(REMAT_POLICIES)}")
        first = 0  # the MoE layer index of the stack's first layer
        sums = []
        for r, (stack, run) in enumerate(zip(self.stacks, layer_runs(self.cfg))):
            replay = None
            if replay_XxBxLxK is not None and self.cfg.is_moe_layer(run[0]):
                replay = replay_XxBxLxK[first : first + len(run)]
            out = run_stack(
                stack,
                x_BxLxD,
                positions_BxL,
                mask,
                remat=remat,
                scan=self.cfg.scan_layers,
                replay_nxBxLxK=replay,
                grad_acc=None if grad_acc is None else grad_acc.trees[r],
                grad_key=None if grad_acc is None else grad_sink.fold(grad_acc.key, r),
            )
            x_BxLxD, ids = out[:2]
            if grad_acc is not None:
                sums.append(out[2])
            if ids is not None:
                routing.append(ids)
                first += len(run)
        hidden = self.norm(x_BxLxD)
        return ModelOutput(
            hidden, jnp.concatenate(routing) if routing else None, sums if grad_acc is not None else None
        )

    def init_cache(self, batch: int, slots: int, dtype=None) -> Cache:
        """An empty KV cache of `slots` positions for `batch` rows (zeros, the compute dtype unless given)."""
        dtype = dtype or self.cfg.dtype
        return [
            tuple(
                jnp.zeros((len(run), batch, *(slots if d is None else d for d in shape)), dtype)
                for shape in stack.attn.cache_shapes()
            )
            for stack, run in zip(self.stacks, layer_runs(self.cfg))
        ]

    def cache_slot_axes(self) -> list[tuple[int, ...]]:
        """Per stack, per cache array [n, B, ...] (init_cache's), the axis of its slots."""
        return [tuple(2 + slot_axis(shape) for shape in stack.attn.cache_shapes()) for stack in self.stacks]

    def decode_needs_phases(self) -> bool:
        """Whether the sampler's decode should bound the slots a step attends over (its phases): unless every
        layer's decode attention stops at each row's last written slot itself (attn.decode_needs_phases)."""
        return any(stack.attn.decode_needs_phases() for stack in self.stacks)

    def cached(self, tokens_BxL, positions_BxL, cache: Cache, index, valid_BxS, repeat: int = 1):
        """The forward of L new tokens per row written into `cache` at slots index..index+L-1 (one write index for
        all rows: left-pad the prompts; or, for L = 1, a [B] array: each row's own slot), attending to the slots
        valid_BxS marks (written and not padding; it must already mark the new tokens') -> (ModelOutput, the updated
        cache). Prefill: L = the padded prompt length at index 0; decode: L = 1 at the next slot. The same layers,
        weights and routers as __call__. `repeat`: a prefill into a cache of that many rows per row of tokens (each
        row's entries written into its `repeat` rows: the samples of a prompt)."""
        b, l = tokens_BxL.shape
        # a static index (the prefill's): attend over the slots up to the last new token only, not the whole cache
        seen = index + l if isinstance(index, int) else valid_BxS.shape[1]
        mask_BxLxS = cache_mask(valid_BxS[:, :seen], index, l)
        x_BxLxD = jnp.take(self.embed_VxD[...], tokens_BxL, axis=0).astype(self.cfg.dtype)
        x_BxLxD = sharding.constrain(x_BxLxD, ("batch", "length", "act_embed"))
        routing, out = [], []
        for stack, entries in zip(self.stacks, cache):
            x_BxLxD, ids, entries = run_stack_cached(
                stack, x_BxLxD, positions_BxL, entries, index, mask_BxLxS, repeat=repeat
            )
            out.append(entries)
            if ids is not None:
                routing.append(ids)
        hidden = self.norm(x_BxLxD)
        return ModelOutput(hidden, jnp.concatenate(routing) if routing else None), out

    def unembedding_DxV(self) -> jax.Array:
        """The output projection [D, V] (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_VxD[...].T
        return self.lm_head_DxV[...]

    def logits(self, hidden_BxLxD: jax.Array) -> jax.Array:
        """Full logits in fp32 — for tests and small inputs; training uses cisjax.logprobs (chunked)."""
        w = self.unembedding_DxV().astype(self.cfg.dtype)
        return jnp.einsum("bld,dv->blv", hidden_BxLxD.astype(self.cfg.dtype), w, preferred_element_type=jnp.float32)
