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

from cisjax import logprobs as logprobs_lib
from cisjax import runtime, sharding
from cisjax.records import TrainBatch


class Output(NamedTuple):
    stats: logprobs_lib.TokenStats  # [B, T] fields; top-k [B, T, K] when asked for
    expert_ids_XxBxTxK: jax.Array | None  # routed experts of every MoE layer X (None for a dense model)


def make_forward(graphdef, mesh, rules, *, precision: str, temperature: float, chunk_size: int, top_k: int = 0):
    """`(params, tokens, positions, segments, targets) [B, T] -> Output`: the model's hidden states, then the chunked
    token_logprobs at `temperature` (never a [B, T, V] logits tensor). Refuses a model whose compute dtype is not the
    one `precision` asks for (runtime.check_compute_dtype)."""
    temperature, chunk_size, top_k = float(temperature), int(chunk_size), int(top_k)
    rules = dict(rules)

    def forward(params, tokens_BxT, positions_BxT, segments_BxT, targets_BxT) -> Output:
        with sharding.use_mesh(mesh, rules):
            model = nnx.merge(graphdef, params)
            runtime.check_compute_dtype(model, precision)
            out = model(tokens_BxT, positions_BxT, segments_BxT)
            stats = logprobs_lib.token_logprobs(
                out.hidden_BxLxD,
                model.unembedding_DxV(),
                targets_BxT,
                temperature=temperature,
                chunk_size=chunk_size,
                top_k=top_k,
            )
        return Output(stats, out.expert_ids_XxBxLxK)

    return forward


def round_params(params, dtype):
    """The params as an engine receives them: floating leaves rounded to `dtype` (and back to their own dtype)."""
    if dtype is None:
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dt).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def make_batch_logprobs(
    graphdef, mesh, rules, *, precision: str, temperature: float, chunk_size: int, params_shardings=None, round_to=None
):
    """Jitted `(params, TrainBatch [M, B, T]) -> logprobs_MxBxT` (fp32), one micro-batch at a time: the proximal
    rescoring at the start of a step and, with `round_to` (the published dtype) at temperature 1, the canary's
    trainer side. `params_shardings` defaults to the params' own."""
    forward = make_forward(graphdef, mesh, rules, precision=precision, temperature=temperature, chunk_size=chunk_size)
    bsh = sharding.batch_sharding(mesh, rules)

    def logprobs(params, batch: TrainBatch):
        params = round_params(params, round_to)

        def one(mb):
            out = forward(params, mb.tokens_MxBxT, mb.positions_MxBxT, mb.segment_ids_MxBxT, mb.targets_MxBxT)
            return out.stats.logprobs_N

        return lax.map(one, batch)

    in_sh = (params_shardings, TrainBatch(*([bsh] * len(TrainBatch._fields))))
    return jax.jit(logprobs, in_shardings=in_sh, out_shardings=bsh)


def make_scorer(graphdef, mesh, rules, *, precision: str, temperature: float, chunk_size: int, top_k: int = 0):
    """Jitted `(params, tokens, positions, segments, targets) [B, T] -> Output` over rows placed with
    sharding.place (rows over the "batch" mesh axes): `cisjax score` and the mismatch observatory."""
    return jax.jit(
        make_forward(
            graphdef, mesh, rules, precision=precision, temperature=temperature, chunk_size=chunk_size, top_k=top_k
        )
    )
