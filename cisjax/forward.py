"""The trainer forward, defined once: rows [B, T] -> per-token logprobs, entropy, optional top-k and expert routing.

The train step differentiates `make_forward`'s function; the proximal rescoring, the publish canary, `cisjax score`
and `cisjax mismatch` run it jitted (`make_batch_logprobs`, `make_scorer`), so each measures exactly what trains.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from cisjax import exact_forward, runtime, sharding
from cisjax import logprobs as logprobs_lib
from cisjax.records import TrainBatch


class Output(NamedTuple):
    stats: logprobs_lib.TokenStats  # [B, T] fields; top-k [B, T, K] when asked for
    # the routers' own experts of every MoE layer X (None for a dense model); under replay still the routers' choice
    expert_ids_XxBxTxK: jax.Array | None
    grad_acc: list | None = None  # the gradient sums the train step passed through the model (its in-place sum)


class Flips(NamedTuple):
    """Where the trainer's routers choose other experts than the replayed (rollout engine's) ones."""

    layers_BxT: jax.Array  # int32: MoE layers whose expert set differs, per valid position (0 on padding)
    per_layer_X: jax.Array  # int32: valid positions whose expert set differs, per MoE layer


def routing_flips(own_XxBxTxK, replayed_XxBxTxK, valid_BxT) -> Flips:
    """Flips of the (token, layer) pairs at valid positions: the sets of k experts differ (order within the k does
    not count: engines return them in their own order)."""
    own = jnp.sort(own_XxBxTxK.astype(jnp.int32), axis=-1)
    replayed = jnp.sort(replayed_XxBxTxK.astype(jnp.int32), axis=-1)
    differ_XxBxT = jnp.any(own != replayed, axis=-1) & valid_BxT[None]
    return Flips(jnp.sum(differ_XxBxT, axis=0, dtype=jnp.int32), jnp.sum(differ_XxBxT, axis=(1, 2), dtype=jnp.int32))


def chunk_tokens(chunk_size: int, mesh, rules) -> int:
    """Tokens per logprob chunk of the whole batch for `chunk_size` tokens per chunk on each device
    (logprobs.chunk_size): times the shards of the batch axis, over which every chunk's tokens are spread. Per device,
    a chunk's [tokens, vocab] logits then take the same memory on any mesh, and the unembedding, read once per chunk,
    serves as many tokens on each device. (A chunk counted over the whole batch left a v5p-16 chip 128 tokens per read
    of Qwen's 151,936 x 2048 unembedding: in the cost model the head took 4.4x its matmuls' time; docs/results.md.)"""
    return int(chunk_size) * sharding.axis_multiple(mesh, rules, "batch")


def make_forward(
    graphdef,
    mesh,
    rules,
    *,
    precision: str,
    temperature: float,
    chunk_size: int,
    top_k: int = 0,
    exact: bool = False,
):
    """`(params, tokens, positions, segments, targets[, routing[, support]]) [B, T] -> Output`: the model's hidden
    states, then the chunked token_logprobs at `temperature` (never a [B, T, V] logits tensor). `routing_BxTxXxK` (the
    rollout's expert ids per position and MoE layer) replays the engine's routing in every MoE layer.
    `support_BxTxS` (each target's sampling support, -1 padded) renormalises: the stats' logprobs_N is then log p
    over the support, log p(target) - log sum_{v in S} p(v), and support_logmass_N the subtracted log mass. Refuses
    a model whose compute dtype is not the one `precision` asks for (runtime.check_compute_dtype).
    `exact` (rollout.exact): logprobs_N is the exact path's value (exact_forward.exact_logprobs: bit for bit the exact
    sampler's q), differentiated as the plain forward; entropy, top-k and the gradient sums stay the plain forward's."""
    temperature, top_k = float(temperature), int(top_k)
    rules = sharding.freeze(rules)  # the caller's table (a run's spec.rules is already frozen)
    chunk = chunk_tokens(chunk_size, mesh, rules)

    def forward(
        params,
        tokens_BxT,
        positions_BxT,
        segments_BxT,
        targets_BxT,
        routing_BxTxXxK=None,
        support_BxTxS=None,
        grad_acc=None,
    ) -> Output:
        with sharding.use_mesh(mesh, rules):
            model = nnx.merge(graphdef, params)
            runtime.check_compute_dtype(model, precision)
            replay = None if routing_BxTxXxK is None else jnp.moveaxis(routing_BxTxXxK, 2, 0)
            with runtime.matmul_precision(model.cfg.dtype):  # fp32 on a GPU: no TF32
                out = model(tokens_BxT, positions_BxT, segments_BxT, replay, grad_acc=grad_acc)
                stats = logprobs_lib.token_logprobs(
                    out.hidden_BxLxD,
                    model.unembedding_DxV(),
                    targets_BxT,
                    temperature=temperature,
                    chunk_size=chunk,
                    top_k=top_k,
                    support=support_BxTxS,
                )
            if support_BxTxS is not None:  # mask replay: p renormalised over the engine's sampling support
                stats = stats._replace(logprobs_N=stats.logprobs_N - stats.support_logmass_N)
        return Output(stats, out.expert_ids_XxBxLxK, out.grad_acc)

    if exact:
        return exact_forward.exact_logprobs(graphdef, mesh, rules, forward, temperature=temperature)
    return forward


def on_micro_batch(forward, params, mb: TrainBatch, grad_acc=None) -> Output:
    """make_forward's `forward` on one micro-batch ([B, T] fields of a TrainBatch): its routing replayed and its
    sampling support renormalised over, where it has them; `grad_acc` passed through (the train step's sums)."""
    return forward(
        params,
        mb.tokens_MxBxT,
        mb.positions_MxBxT,
        mb.segment_ids_MxBxT,
        mb.targets_MxBxT,
        mb.routing_MxBxTxXxK,
        mb.support_MxBxTxS,
        grad_acc,
    )


def round_params(params, dtype):
    """The params as an engine receives them: floating leaves rounded to `dtype` (and back to their own dtype)."""
    if dtype is None:
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def make_batch_logprobs(
    graphdef,
    mesh,
    rules,
    *,
    precision: str,
    temperature: float,
    chunk_size: int,
    params_shardings=None,
    round_to=None,
    flips: bool = False,
    exact: bool = False,
):
    """Jitted `(params, TrainBatch [M, B, T]) -> logprobs_MxBxT` (fp32), one micro-batch at a time: the proximal
    rescoring at the start of a step and, with `round_to` (the published dtype) at temperature 1, the canary's
    trainer side. `params_shardings` defaults to the params' own. A batch with routing replays it; `flips` (such a
    batch only) returns `(logprobs_MxBxT, Flips)` with layers [M, B, T] and per_layer summed over micro-batches."""
    forward = make_forward(
        graphdef, mesh, rules, precision=precision, temperature=temperature, chunk_size=chunk_size, exact=exact
    )
    bsh = sharding.batch_sharding(mesh, rules)

    def logprobs(params, batch: TrainBatch):
        params = round_params(params, round_to)
        if flips and batch.routing_MxBxTxXxK is None:
            raise ValueError("routing flips need a batch with routing")

        def one(mb):
            out = on_micro_batch(forward, params, mb)
            if not flips:
                return out.stats.logprobs_N
            f = routing_flips(
                out.expert_ids_XxBxTxK, jnp.moveaxis(mb.routing_MxBxTxXxK, 2, 0), mb.segment_ids_MxBxT > 0
            )
            return out.stats.logprobs_N, f

        out = lax.map(one, batch)
        if not flips:
            return out
        logp, f = out
        return logp, Flips(f.layers_BxT, jnp.sum(f.per_layer_X, axis=0))

    in_sh = (params_shardings, TrainBatch(*([bsh] * len(TrainBatch._fields))))
    replicated = NamedSharding(mesh, PartitionSpec())
    out_sh = (bsh, Flips(bsh, replicated)) if flips else bsh
    return jax.jit(logprobs, in_shardings=in_sh, out_shardings=out_sh)


def make_scorer(graphdef, mesh, rules, *, precision: str, temperature: float, chunk_size: int, top_k: int = 0):
    """Jitted `(params, tokens, positions, segments, targets) [B, T] -> Output` over rows placed with
    sharding.place (rows over the "batch" mesh axes): `cisjax score` and the mismatch observatory."""
    return jax.jit(
        make_forward(
            graphdef, mesh, rules, precision=precision, temperature=temperature, chunk_size=chunk_size, top_k=top_k
        )
    )
