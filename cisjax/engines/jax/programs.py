"""The sampler's device programs: prefill of left-padded prompts, and decode slots that samples enter and leave (each
row at its own step; a row that ends frees its slot for the next sample), in a `lax.while_loop` of bounded steps."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from cisjax import runtime, sharding
from cisjax.engines.jax.sampling import draw, sampling_logprobs

STOP_SLOTS = 8  # stop token ids per request, padded (-1 matches no token)
# decode steps between two checks of the loop's end (whether any row is active): on a GPU each check of a while loop's
# condition is a device-to-host copy, so it is not paid at every token; a row that ends between checks writes nothing
STOP_EVERY = 4
# `whole` decodes in this many phases, each attending over the slots its steps can have written (the prompt's P and
# the phase's last step's): P + 5N/8 slots per step on average instead of P + N (each phase a loop of its own in the
# program)
PHASES = 4


class Prompts(NamedTuple):
    """Prefilled prompts: what a decode slot takes from its sample's prompt when the sample enters it."""

    # CausalLM.init_cache layout: per stack, arrays [layers, B, ...] of the prompts' P slots (or, prefill's n and
    # max_new, [layers, B n, ...] of P + max_new slots: the decode rows')
    cache: list
    valid_BxP: jax.Array  # the slots that are not padding
    logits_BxV: jax.Array  # fp32, after each prompt's last token: its samples' first distribution
    ids_XxBxK: jax.Array | None  # the routers' expert ids at the last prompt position (the first token's routing)
    # the routers' expert ids at every prompt slot, the slots minor (ids minor, a TPU pads k to 128 lanes: 32x at k = 4)
    prompt_ids_XxKxBxP: jax.Array | None


class Rows(NamedTuple):
    """Per sample: its prompt length and sampling parameters, traced (B: the samples, Q elsewhere in this module)."""

    prompt_len_B: jax.Array  # int32
    temperature_B: jax.Array  # float32
    top_k_B: jax.Array  # int32, 0 = off
    top_p_B: jax.Array  # float32, 1 = off
    greedy_B: jax.Array  # bool
    key_data_Bx2: jax.Array  # uint32: the sample's PRNG key (sampling.key_data)
    max_new_B: jax.Array  # int32: tokens this sample may produce (<= the program's N)
    stop_ids_BxT: jax.Array  # int32: the sample's stop tokens, padded with -1


class Slots(NamedTuple):
    """The decode's R rows: the sample each holds, how far it is, its cache and its next token's distribution."""

    cache: (
        list  # per stack, arrays [layers, R, ...] of P + N slots: the sample's prompt in the first P, then its tokens
    )
    valid_RxP: jax.Array  # the prompt slots that are not padding
    sample_R: jax.Array  # int32: the sample the row holds (Q: none yet)
    t_R: jax.Array  # int32: tokens the row's sample has drawn (its next token's slot is P + t)
    active_R: jax.Array  # bool: still drawing
    logits_RxV: jax.Array  # fp32: the distribution of the row's next token, before the sampling filters
    ids_XxRxK: jax.Array | None  # the routers' expert ids of the forward that gave logits_RxV


class Decoded(NamedTuple):
    """Per sample (Q of them), what its tokens came with. Buffers of several values per step hold the steps minor: a
    TPU lays an array out in tiles of 128 along its minor axis, so [Q, N, T] at T = 5 would take 25x its bytes."""

    tokens_BxN: jax.Array  # int32, 0 after a sample's end
    logprobs_BxN: jax.Array  # fp32, the sampling distribution's logprob of each token
    lengths_B: jax.Array  # int32, tokens produced (the stop token included)
    stopped_B: jax.Array  # bool: ended on a stop token (else on its length)
    top_ids_BxTxN: jax.Array | None  # the T most likely tokens of each step's distribution
    top_logprobs_BxTxN: jax.Array | None
    routing_XxKxBxN: jax.Array | None  # expert ids of the forward that produced each token
    # return_sampling_mask: the S most likely ids of each step's distribution, and how many tokens it kept (the
    # support is the first count of the S when count <= S; a larger count: ties past the top-k bound)
    support_ids_BxSxN: jax.Array | None = None
    support_counts_BxN: jax.Array | None = None


def _last_logits(model, hidden_BxD) -> jax.Array:
    w_DxV = model.unembedding_DxV().astype(model.cfg.dtype)
    return jnp.einsum("bd,dv->bv", hidden_BxD.astype(model.cfg.dtype), w_DxV, preferred_element_type=jnp.float32)


def prefill(model, tokens_BxP, valid_BxP, *, n: int = 1, max_new: int = 0) -> Prompts:
    """Left-padded prompts (one write index for all rows; positions from the pad mask) into a cache of their P slots;
    only the last position's logits are computed. With `n` and `max_new`: into the cache of their samples' decode
    rows instead (`whole`'s: n rows per prompt, sample i * n + j prompt i's j-th, of P + max_new slots), each
    layer's entries written into the rows as it computes them (no cache of the prompts beside the rows')."""
    positions_BxP = jnp.maximum(jnp.cumsum(valid_BxP.astype(jnp.int32), axis=1) - 1, 0)
    b, p = tokens_BxP.shape
    empty = model.init_cache(b * n, p + max_new)
    out, cache = model.cached(tokens_BxP, positions_BxP, empty, 0, valid_BxP, repeat=n)
    ids = out.expert_ids_XxBxLxK
    return Prompts(
        cache,
        valid_BxP,
        _last_logits(model, out.hidden_BxLxD[:, -1]),
        None if ids is None else ids[:, :, -1],
        None if ids is None else jnp.moveaxis(ids, 3, 1),
    )


def empty(model, prompts: Prompts, *, slots: int, samples: int, max_new: int, top_n: int = 0, mask_n: int = 0):
    """(Slots, Decoded): `slots` rows holding no sample, with caches of P + max_new slots; `outputs` for `samples`
    samples."""
    r, q, p = slots, samples, prompts.valid_BxP.shape[1]
    ids = prompts.ids_XxBxK
    dtype = jax.tree.leaves(prompts.cache)[0].dtype
    free = Slots(
        model.init_cache(r, p + max_new, dtype),
        jnp.zeros((r, p), bool),
        jnp.full((r,), q, jnp.int32),
        jnp.zeros((r,), jnp.int32),
        jnp.zeros((r,), bool),
        jnp.zeros((r, prompts.logits_BxV.shape[1]), jnp.float32),
        None if ids is None else jnp.zeros((ids.shape[0], r, ids.shape[2]), ids.dtype),
    )
    return free, outputs(prompts, samples=q, max_new=max_new, top_n=top_n, mask_n=mask_n)


def outputs(prompts: Prompts, *, samples: int, max_new: int, top_n: int = 0, mask_n: int = 0) -> Decoded:
    """Zeroed outputs for `samples` samples of up to max_new tokens (their routing, top-n and support buffers where
    asked and the model routes)."""
    q, ids = samples, prompts.ids_XxBxK
    mask_n = min(mask_n, prompts.logits_BxV.shape[1])  # a top_k of V or more cuts nothing

    def zeros(dtype, *shape, at=0):  # the samples (axis `at`) split over the mesh's batch shards, as their rows are
        return sharding.constrain(jnp.zeros(shape, dtype), [None] * at + ["batch"] + [None] * (len(shape) - at - 1))

    return Decoded(
        zeros(jnp.int32, q, max_new),
        zeros(jnp.float32, q, max_new),
        zeros(jnp.int32, q),
        zeros(bool, q),
        zeros(jnp.int32, q, top_n, max_new) if top_n else None,
        zeros(jnp.float32, q, top_n, max_new) if top_n else None,
        None if ids is None else zeros(ids.dtype, ids.shape[0], ids.shape[2], q, max_new, at=2),
        zeros(jnp.int32, q, mask_n, max_new) if mask_n else None,
        zeros(jnp.int32, q, max_new) if mask_n else None,
    )


def enter(model, slots: Slots, prompts: Prompts, rows: Rows, prompt_R, sample_R) -> Slots:
    """Samples into rows: row r takes sample sample_R[r] of prompt prompt_R[r] (its prompt's cache entries, mask and
    first distribution; its step at 0) where prompt_R[r] >= 0; the other rows are left as they are. Only the
    entering rows' prompt slots are written (a row's own tokens past them are masked by its step)."""
    enters_R = prompt_R >= 0
    src_R = jnp.maximum(prompt_R, 0)

    def take(old, new, axis):
        shape = [1] * old.ndim
        shape[axis] = -1
        return jnp.where(enters_R.reshape(shape), jnp.take(new, src_R, axis=axis), old)

    p = prompts.valid_BxP.shape[1]
    cache = [
        tuple(
            jax.lax.dynamic_update_slice_in_dim(c, take(jax.lax.slice_in_dim(c, 0, p, axis=a), n, 1), 0, axis=a)
            for c, n, a in zip(cs, ns, axes)
        )
        for cs, ns, axes in zip(slots.cache, prompts.cache, model.cache_slot_axes())
    ]
    sample_R = jnp.where(enters_R, sample_R, slots.sample_R)
    max_new_R = jnp.take(rows.max_new_B, jnp.minimum(sample_R, rows.max_new_B.shape[0] - 1))
    return Slots(
        cache,
        take(slots.valid_RxP, prompts.valid_BxP, 0),
        sample_R,
        jnp.where(enters_R, 0, slots.t_R),
        jnp.where(enters_R, max_new_R > 0, slots.active_R),
        take(slots.logits_RxV, prompts.logits_BxV, 0),
        None if slots.ids_XxRxK is None else take(slots.ids_XxRxK, prompts.ids_XxBxK, 1),
    )


def keep(slots: Slots, rows_R) -> Slots:
    """The rows `rows_R` (indices) alone, in that order: a smaller decode once fewer rows are active."""
    take = lambda a, axis: None if a is None else jnp.take(a, rows_R, axis=axis)  # noqa: E731
    return Slots(
        [tuple(take(c, 1) for c in cs) for cs in slots.cache],
        take(slots.valid_RxP, 0),
        take(slots.sample_R, 0),
        take(slots.t_R, 0),
        take(slots.active_R, 0),
        take(slots.logits_RxV, 0),
        take(slots.ids_XxRxK, 1),
    )


def decode(
    model, slots: Slots, out: Decoded, rows: Rows, *, steps: int, seen: int | None = None
) -> tuple[Slots, Decoded, jax.Array]:
    """Up to `steps` decode steps of every row (the loop ends early once no row is active, checked every STOP_EVERY
    steps) -> (Slots, Decoded, the steps run). The attention reads the first `seen` slots of the cache only (P <
    seen <= P + N; default all): every active row must stay below it, its step t < seen - P, for all `steps` (a
    free row's results are not read). A step draws each active row's token from its sample's sampling
    distribution (its key folded with the sample's own step: the draw does not depend on the row or on the other
    rows), records it in its sample's outputs at that step (with its logprob, and, as `out` has buffers for them, the
    distribution's best ids, the support, the routing), and feeds it back through the cache at the row's next slot.
    A sample ends on one of its stop tokens (kept, with its logprob) or at its max_new_B; its row is then free (its
    computations until a sample enters it are not read)."""
    q, n = out.tokens_BxN.shape
    r, p = slots.valid_RxP.shape
    seen = p + n if seen is None else seen
    if not p < seen <= p + n:
        raise ValueError(f"seen={seen} slots: not in ({p}, {p + n}]")
    top_n = 0 if out.top_ids_BxTxN is None else out.top_ids_BxTxN.shape[1]
    mask_n = 0 if out.support_ids_BxSxN is None else out.support_ids_BxSxN.shape[1]
    routed = slots.ids_XxRxK is not None

    class Carry(NamedTuple):
        i: jax.Array
        slots: Slots
        out: Decoded

    def body(c: Carry) -> Carry:
        s, o = c.slots, c.out
        row = jax.tree.map(lambda a: jnp.take(a, jnp.minimum(s.sample_R, q - 1), axis=0), rows)
        lp_RxV = sampling_logprobs(s.logits_RxV, row.temperature_B, row.top_k_B, row.top_p_B, row.greedy_B)
        keys_R = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(row.key_data_Bx2), s.t_R)
        tok_R = draw(keys_R, lp_RxV, row.greedy_B)
        lp_R = jnp.take_along_axis(lp_RxV, tok_R[:, None], axis=-1)[:, 0]
        on_R = s.active_R
        at_R = jnp.where(on_R, s.sample_R, q)  # an inactive row's writes fall outside the buffers: dropped
        t_R = jnp.minimum(s.t_R, n - 1)  # a row that ended at its N-th token stays at its last slot
        put = lambda buf, val: buf.at[at_R, t_R].set(val, mode="drop")  # noqa: E731
        put_many = lambda buf, val_RxT: buf.at[at_R, :, t_R].set(val_RxT, mode="drop")  # noqa: E731  [Q, T, N]
        stop_R = on_R & jnp.any(tok_R[:, None] == row.stop_ids_BxT, axis=-1)
        top = (None, None)
        if top_n:
            top_v, top_i = jax.lax.top_k(lp_RxV, top_n)
            top = (put_many(o.top_ids_BxTxN, top_i.astype(jnp.int32)), put_many(o.top_logprobs_BxTxN, top_v))
        support = (None, None)
        if mask_n:  # the support: the tokens the filters left finite (at most mask_n of them when top_k bounds it)
            _, mask_i = jax.lax.top_k(lp_RxV, mask_n)
            kept_R = jnp.sum(jnp.isfinite(lp_RxV), axis=-1).astype(jnp.int32)
            support = (put_many(o.support_ids_BxSxN, mask_i.astype(jnp.int32)), put(o.support_counts_BxN, kept_R))
        o = Decoded(
            put(o.tokens_BxN, tok_R),
            put(o.logprobs_BxN, lp_R),
            o.lengths_B.at[at_R].add(1, mode="drop"),
            o.stopped_B.at[at_R].set(stop_R, mode="drop"),
            *top,
            o.routing_XxKxBxN.at[:, :, at_R, t_R].set(jnp.moveaxis(s.ids_XxRxK, 2, 1), mode="drop") if routed else None,
            *support,
        )
        # the tokens back through the model at each row's slot p + t (a free row's too: its results are not read)
        valid_RxS = jnp.concatenate([s.valid_RxP, jnp.arange(seen - p)[None] <= t_R[:, None]], axis=1)
        positions_Rx1 = (row.prompt_len_B + t_R)[:, None]
        fwd, cache = model.cached(tok_R[:, None], positions_Rx1, s.cache, p + t_R, valid_RxS)
        ids = fwd.expert_ids_XxBxLxK
        s = Slots(
            cache,
            s.valid_RxP,
            s.sample_R,
            s.t_R + on_R.astype(jnp.int32),
            on_R & ~stop_R & (s.t_R + 1 < row.max_new_B),
            _last_logits(model, fwd.hidden_BxLxD[:, 0]),
            None if ids is None else ids[:, :, 0],
        )
        return Carry(c.i + 1, s, o)

    every = math.gcd(STOP_EVERY, steps)  # steps per iteration: never past `steps`

    def chunk(c: Carry) -> Carry:
        return jax.lax.fori_loop(0, every, lambda _, c: body(c), c) if every > 1 else body(c)

    final = jax.lax.while_loop(
        lambda c: (c.i < steps) & jnp.any(c.slots.active_R), chunk, Carry(jnp.int32(0), slots, out)
    )
    return final.slots, final.out, final.i


def traced(graphdef, fn, mesh=None, rules=None):
    """`fn(model, *args)` as `(params, *args) -> ...`, the model merged from `graphdef` and the params; with a `mesh`
    (and its logical `rules`), traced under them: the activations laid out as the trainer's."""

    def run(params, *args):
        with sharding.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
            model = nnx.merge(graphdef, params)
            with runtime.matmul_precision(model.cfg.dtype):  # fp32 on a GPU: no TF32
                return fn(model, *args)

    return run


def _rows_of(prompt_nxBx, axis: int, *, n: int, max_new: int) -> jax.Array:
    """A stack's cache array of the prompts' P slots [layers, B, ...] (slots on `axis`) -> the rows' [layers, B * n, ...]
    of P + max_new slots: each prompt's entries in its n rows' first P slots, zeros after. Padded then repeated, or
    repeated then padded, whichever leaves the smaller copy beside the cache (the padded prompts' B x (P + N) slots,
    or the repeated ones' B n x P). Built a layer at a time in a loop instead, the TPU compiler kept the loop's output
    apart from the decode's (a second cache: docs/results.md)."""
    p = prompt_nxBx.shape[axis]
    widths = [(0, max_new) if i == axis else (0, 0) for i in range(prompt_nxBx.ndim)]
    if n * p < p + max_new:
        return jnp.pad(jnp.repeat(prompt_nxBx, n, axis=1), widths)
    return jnp.repeat(jnp.pad(prompt_nxBx, widths), n, axis=1)


def prefill_into_rows(model) -> bool:
    """Whether `split_fns` prefills a step's prompts straight into their samples' rows (prefill's n and max_new),
    rather than into the prompts' cache that `whole` then copies into the rows (_rows_of). The copy holds a quarter
    of the rows' cache (at n = 4 samples and N = 2P new tokens) beside it; the straight prefill holds the whole
    rows' cache beside the prefill's activations. Compiled for v5p-16 (docs/results.md), the copy weighed more where
    a token's cache entries outweigh its hidden state (Qwen1.5-MoE: 4,096 values per layer against 2,048, 56.7 ->
    49.3 GiB per chip), the activations where they are lighter (Qwen3-30B-A3B: 1,024, 42.9 -> 45.4 GiB;
    DeepSeek-V2-Lite's latent and rotary key: 576, 20.0 -> 21.5 GiB): straight where they outweigh it."""
    values = max(
        sum(math.prod(d for d in shape if d is not None) for shape in stack.attn.cache_shapes())
        for stack in model.stacks
    )
    return values >= model.cfg.hidden_size


def phase_ends(max_new: int, phases: int = PHASES) -> list[int]:
    """The steps at which `whole`'s decode phases end: max_new split in `phases` parts, each a multiple of STOP_EVERY
    (fewer phases where the parts would repeat)."""
    every = math.gcd(STOP_EVERY, max_new)
    ends = {min(max_new, -(-max_new * k // (phases * every)) * every) for k in range(1, phases + 1)}
    return sorted(e for e in ends if e > 0)


def whole(
    model, prompts: Prompts, rows: Rows, *, n: int, max_new: int, top_n: int = 0, mask_n: int = 0, phases: int = PHASES
) -> Decoded:
    """Every prompt's n samples at once (sample i * n + j: prompt i's j-th), one row each, decoded to the end in
    `phases` phases (phase_ends): every row starts at step 0, so a phase ending at step e attends over the P + e
    slots its steps can have written (one phase where the model's decode attention needs no bound:
    CausalLM.decode_needs_phases). `prompts`: prefill's, into the rows (its n and max_new: the rows as `enter` would fill them) or into the prompts'
    cache (then copied into the rows in one piece, _rows_of: entering rows into empty ones would hold a gathered
    copy of their prompt slots beside the cache)."""
    b, p = prompts.valid_BxP.shape
    q = b * n
    first = prompts.cache[0][0]  # [layers, rows, ...] with its slots on the stack's first slot axis
    shape = (first.shape[1], first.shape[model.cache_slot_axes()[0][0]])
    if shape not in ((q, p + max_new), (b, p)):
        raise ValueError(f"a cache of {shape} (rows, slots) for {b} prompts of {p} slots, {n} samples, {max_new} new")
    ready = shape == (q, p + max_new)  # prefill(n, max_new)'s: the rows' (at n = 1 and max_new = 0 both hold)
    out = outputs(prompts, samples=q, max_new=max_new, top_n=top_n, mask_n=mask_n)
    rep = lambda a, axis: None if a is None else jnp.repeat(a, n, axis=axis)  # noqa: E731
    slots = Slots(
        prompts.cache
        if ready
        else [
            tuple(_rows_of(a, ax, n=n, max_new=max_new) for a, ax in zip(cs, axes))
            for cs, axes in zip(prompts.cache, model.cache_slot_axes())
        ],
        rep(prompts.valid_BxP, 0),
        jnp.arange(q, dtype=jnp.int32),
        jnp.zeros((q,), jnp.int32),
        rows.max_new_B > 0,
        rep(prompts.logits_BxV, 0),
        rep(prompts.ids_XxBxK, 1),
    )
    start = 0
    if not model.decode_needs_phases():  # a kernel that stops at each row's last slot: phases would only compile
        phases = 1
    for end in phase_ends(max_new, phases):
        slots, out, _ = decode(model, slots, out, rows, steps=end - start, seen=p + end)
        start = end
    return out


def split_fns(graphdef, *, n: int, max_new: int, top_n: int = 0, mask_n: int = 0, mesh=None, rules=None):
    """One batch's two programs, to jit: `(params, tokens_BxP, valid_BxP) -> Prompts` (the prefill: into the rows
    where prefill_into_rows) and `(params, Prompts, Rows) -> Decoded` (`whole`: every sample in a row of its own, to
    the end). Apart, each is timed alone."""

    def dec(model, prompts: Prompts, rows: Rows):
        return whole(model, prompts, rows, n=n, max_new=max_new, top_n=top_n, mask_n=mask_n)

    def pre(model, tokens_BxP, valid_BxP):
        if prefill_into_rows(model):
            return prefill(model, tokens_BxP, valid_BxP, n=n, max_new=max_new)
        return prefill(model, tokens_BxP, valid_BxP)

    return traced(graphdef, pre, mesh, rules), traced(graphdef, dec, mesh, rules)


def sample_fn(graphdef, *, n: int, max_new: int, top_n: int, mask_n: int = 0, mesh=None, rules=None):
    """One batch's whole program, `(params, tokens_BxP, valid_BxP, rows) -> (Decoded, the prompt's routing ids)`:
    split_fns' two in one (how `cisjax plan` compiles the sampler for a slice: one program's memory)."""
    pre_fn, dec_fn = split_fns(graphdef, n=n, max_new=max_new, top_n=top_n, mask_n=mask_n, mesh=mesh, rules=rules)

    def run(params, tokens_BxP, valid_BxP, rows: Rows):
        prompts = pre_fn(params, tokens_BxP, valid_BxP)
        return dec_fn(params, prompts, rows), prompts.prompt_ids_XxKxBxP

    return run


def abstract_inputs(batch: int, prompt_len: int, n: int) -> tuple:
    """(tokens_BxP, valid_BxP, Rows) as ShapeDtypeStructs: what a bucket's program takes besides the params."""
    r = batch * n
    row = lambda dt, *shape: jax.ShapeDtypeStruct((r, *shape), dt)  # noqa: E731
    rows = Rows(
        prompt_len_B=row(jnp.int32),
        temperature_B=row(jnp.float32),
        top_k_B=row(jnp.int32),
        top_p_B=row(jnp.float32),
        greedy_B=row(jnp.bool_),
        key_data_Bx2=row(jnp.uint32, 2),
        max_new_B=row(jnp.int32),
        stop_ids_BxT=row(jnp.int32, STOP_SLOTS),
    )
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    return tokens, jax.ShapeDtypeStruct((batch, prompt_len), jnp.bool_), rows
