"""The sampler's device programs: prefill of left-padded prompts, expansion to n samples per prompt, and a decode
`lax.while_loop` over the KV cache that stops when no row is active."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from cisjax import runtime, sharding
from cisjax.sampler.sampling import draw, sampling_logprobs

STOP_SLOTS = 8  # stop token ids per request, padded (-1 matches no token)
# decode steps between two checks of the loop's end (whether any row is active): on a GPU each check of a while loop's
# condition is a device-to-host copy, so it is not paid at every token; a row that ends between checks writes nothing
STOP_EVERY = 4


class Prefilled(NamedTuple):
    cache: list  # CausalLM.init_cache layout: per stack, arrays [layers, B, S, ...]
    valid_BxS: jax.Array  # the slots written and not padding
    logits_BxV: jax.Array  # fp32, after each row's last prompt token
    ids_XxBxK: jax.Array | None  # the routers' expert ids at the last prompt position (the first token's routing)
    prompt_ids_XxBxPxK: jax.Array | None  # the routers' expert ids at every prompt slot


class Rows(NamedTuple):
    """Per row (sample) of a decode: its prompt length and sampling parameters, traced."""

    prompt_len_B: jax.Array  # int32
    temperature_B: jax.Array  # float32
    top_k_B: jax.Array  # int32, 0 = off
    top_p_B: jax.Array  # float32, 1 = off
    greedy_B: jax.Array  # bool
    key_data_Bx2: jax.Array  # uint32: the row's PRNG key (sampling.key_data)
    max_new_B: jax.Array  # int32: tokens this row may produce (<= the program's N)
    stop_ids_BxT: jax.Array  # int32: the row's stop tokens, padded with -1


class Decoded(NamedTuple):
    tokens_BxN: jax.Array  # int32, 0 after a row's end
    logprobs_BxN: jax.Array  # fp32, the sampling distribution's logprob of each token
    lengths_B: jax.Array  # int32, tokens produced (the stop token included)
    stopped_B: jax.Array  # bool: ended on a stop token (else on its length)
    top_ids_BxNxT: jax.Array | None  # the T most likely tokens of each step's distribution
    top_logprobs_BxNxT: jax.Array | None
    routing_BxNxXxK: jax.Array | None  # expert ids of the forward that produced each token
    # return_sampling_mask: the S most likely ids of each step's distribution, and how many tokens it kept (the
    # support is the first count of the S when count <= S; a larger count: ties past the top-k bound)
    support_ids_BxNxS: jax.Array | None = None
    support_counts_BxN: jax.Array | None = None
    steps: jax.Array | None = None  # int32: the decode steps run (the loop's last t; a multiple of STOP_EVERY's)


def _last_logits(model, hidden_BxD) -> jax.Array:
    w_DxV = model.unembedding_DxV().astype(model.cfg.dtype)
    return jnp.einsum("bd,dv->bv", hidden_BxD.astype(model.cfg.dtype), w_DxV, preferred_element_type=jnp.float32)


def prefill(model, tokens_BxP, valid_BxP, slots: int) -> Prefilled:
    """Left-padded prompts (one write index for all rows; positions from the pad mask) into a fresh cache of
    `slots` positions; only the last position's logits are computed."""
    b, p = tokens_BxP.shape
    positions_BxP = jnp.maximum(jnp.cumsum(valid_BxP.astype(jnp.int32), axis=1) - 1, 0)
    valid_BxS = jnp.zeros((b, slots), bool).at[:, :p].set(valid_BxP)
    out, cache = model.cached(tokens_BxP, positions_BxP, model.init_cache(b, slots), 0, valid_BxS)
    ids = out.expert_ids_XxBxLxK
    return Prefilled(
        cache,
        valid_BxS,
        _last_logits(model, out.hidden_BxLxD[:, -1]),
        None if ids is None else ids[:, :, -1],
        ids,
    )


def expand(pre: Prefilled, n: int) -> Prefilled:
    """Each prompt's row repeated for its n samples, in order (rows 0..n-1 are prompt 0's): one prefill per prompt."""
    rep = lambda a, axis: None if a is None else jnp.repeat(a, n, axis=axis)  # noqa: E731
    return Prefilled(
        [tuple(rep(a, 1) for a in entries) for entries in pre.cache],
        rep(pre.valid_BxS, 0),
        rep(pre.logits_BxV, 0),
        rep(pre.ids_XxBxK, 1),
        rep(pre.prompt_ids_XxBxPxK, 1),
    )


def decode(
    model, pre: Prefilled, rows: Rows, *, max_new: int, top_n: int = 0, mask_n: int = 0, return_cache: bool = False
):
    """Up to `max_new` tokens per row: each step draws from the rows' sampling distributions, records the token and
    its logprob (and the `top_n` best of the distribution; with `mask_n`, the support: its `mask_n` best ids and the
    count of tokens it kept), and feeds the tokens back through the cache at the next slot. A row ends on one of its
    stop tokens (kept, with its logprob) or at its max_new_B; the loop ends when no row is active (checked every
    STOP_EVERY steps). The cache's slots: the prompt's P, then max_new. Returns the Decoded, and with
    `return_cache` (Decoded, the final cache): returned, a donated cache is updated in place (split_fns)."""
    b = pre.logits_BxV.shape[0]
    mask_n = min(mask_n, pre.logits_BxV.shape[1])  # a top_k of V or more cuts nothing
    p = pre.valid_BxS.shape[1] - max_new
    keys_B = jax.random.wrap_key_data(rows.key_data_Bx2)
    routed = pre.ids_XxBxK is not None
    x, k = (pre.ids_XxBxK.shape[0], pre.ids_XxBxK.shape[2]) if routed else (0, 0)

    class Carry(NamedTuple):
        t: jax.Array
        cache: list
        valid_BxS: jax.Array
        logits_BxV: jax.Array
        ids_XxBxK: jax.Array | None
        active_B: jax.Array
        out: Decoded

    init = Carry(
        jnp.int32(0),
        pre.cache,
        pre.valid_BxS,
        pre.logits_BxV,
        pre.ids_XxBxK,
        rows.max_new_B > 0,
        Decoded(
            jnp.zeros((b, max_new), jnp.int32),
            jnp.zeros((b, max_new), jnp.float32),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), bool),
            jnp.zeros((b, max_new, top_n), jnp.int32) if top_n else None,
            jnp.zeros((b, max_new, top_n), jnp.float32) if top_n else None,
            jnp.zeros((b, max_new, x, k), pre.ids_XxBxK.dtype) if routed else None,
            jnp.zeros((b, max_new, mask_n), jnp.int32) if mask_n else None,
            jnp.zeros((b, max_new), jnp.int32) if mask_n else None,
        ),
    )

    every = math.gcd(STOP_EVERY, max_new)  # steps per iteration: never past max_new

    def cond(c: Carry):
        return (c.t < max_new) & jnp.any(c.active_B)

    def steps(c: Carry) -> Carry:
        return jax.lax.fori_loop(0, every, lambda _, c: body(c), c) if every > 1 else body(c)

    def body(c: Carry) -> Carry:
        t, o = c.t, c.out
        lp_BxV = sampling_logprobs(c.logits_BxV, rows.temperature_B, rows.top_k_B, rows.top_p_B, rows.greedy_B)
        step_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, t)
        tok_B = draw(step_keys_B, lp_BxV, rows.greedy_B)
        lp_B = jnp.take_along_axis(lp_BxV, tok_B[:, None], axis=-1)[:, 0]
        on_B = c.active_B
        put = lambda buf, val: buf.at[:, t].set(jnp.where(on_B.reshape((b,) + (1,) * (val.ndim - 1)), val, buf[:, t]))  # noqa: E731
        stop_B = on_B & jnp.any(tok_B[:, None] == rows.stop_ids_BxT, axis=-1)
        top = (None, None)
        if top_n:
            top_v, top_i = jax.lax.top_k(lp_BxV, top_n)
            top = (put(o.top_ids_BxNxT, top_i.astype(jnp.int32)), put(o.top_logprobs_BxNxT, top_v))
        support = (None, None)
        if mask_n:  # the support: the tokens the filters left finite (at most mask_n of them when top_k bounds it)
            _, mask_i = jax.lax.top_k(lp_BxV, mask_n)
            kept_B = jnp.sum(jnp.isfinite(lp_BxV), axis=-1).astype(jnp.int32)
            support = (put(o.support_ids_BxNxS, mask_i.astype(jnp.int32)), put(o.support_counts_BxN, kept_B))
        out = Decoded(
            put(o.tokens_BxN, tok_B),
            put(o.logprobs_BxN, lp_B),
            o.lengths_B + on_B.astype(jnp.int32),
            o.stopped_B | stop_B,
            *top,
            put(o.routing_BxNxXxK, jnp.moveaxis(c.ids_XxBxK, 1, 0)) if routed else None,
            *support,
        )
        active_B = on_B & ~stop_B & (t + 1 < rows.max_new_B)
        # the tokens back through the model at slot p + t (a finished row's too: its results are not read)
        slot = p + t
        valid_BxS = c.valid_BxS.at[:, slot].set(True)
        positions_Bx1 = (rows.prompt_len_B + t)[:, None]
        fwd, cache = model.cached(tok_B[:, None], positions_Bx1, c.cache, slot, valid_BxS)
        ids = fwd.expert_ids_XxBxLxK
        return Carry(
            t + 1,
            cache,
            valid_BxS,
            _last_logits(model, fwd.hidden_BxLxD[:, 0]),
            None if ids is None else ids[:, :, 0],
            active_B,
            out,
        )

    final = jax.lax.while_loop(cond, steps, init)
    out = final.out._replace(steps=final.t)
    return (out, final.cache) if return_cache else out


def split_fns(graphdef, *, n: int, max_new: int, top_n: int = 0, mask_n: int = 0, mesh=None, rules=None):
    """A bucket's two programs, to jit: `(params, tokens_BxP, valid_BxP) -> Prefilled` (prefill into a cache of P +
    max_new slots, expanded to n samples per prompt) and `(params, cache, Prefilled, Rows) -> (Decoded, cache)` (the
    decode loop over the Prefilled with `cache` in place of its own: jitted with the cache donated, the loop writes
    it in place, as one program would; the returned cache is the written one). Apart, each is timed alone (the
    engine's prefill and decode figures). With a `mesh` (and its logical `rules`), traced under them, the
    activations laid out as the trainer's are."""

    def traced(fn):
        def run(params, *args):
            with sharding.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
                model = nnx.merge(graphdef, params)
                with runtime.matmul_precision(model.cfg.dtype):  # fp32 on a GPU: no TF32
                    return fn(model, *args)

        return run

    def pre(model, tokens_BxP, valid_BxP):
        return expand(prefill(model, tokens_BxP, valid_BxP, tokens_BxP.shape[1] + max_new), n)

    def dec(model, cache, pre: Prefilled, rows: Rows):
        pre = pre._replace(cache=cache)
        return decode(model, pre, rows, max_new=max_new, top_n=top_n, mask_n=mask_n, return_cache=True)

    return traced(pre), traced(dec)


def sample_fn(graphdef, *, n: int, max_new: int, top_n: int, mask_n: int = 0, mesh=None, rules=None):
    """One bucket's whole program, `(params, tokens_BxP, valid_BxP, rows) -> (Decoded, the prompt's routing ids)`:
    split_fns' two in one (how `cisjax plan` compiles the sampler for a slice: one program's memory)."""
    pre_fn, dec_fn = split_fns(graphdef, n=n, max_new=max_new, top_n=top_n, mask_n=mask_n, mesh=mesh, rules=rules)

    def run(params, tokens_BxP, valid_BxP, rows: Rows):
        pre = pre_fn(params, tokens_BxP, valid_BxP)
        return dec_fn(params, pre.cache, pre, rows)[0], pre.prompt_ids_XxBxPxK

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
