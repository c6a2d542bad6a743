"""What one decode step of the sampler must read from memory (it is memory-bound): the weights its rows touch and
the KV cache; against a device's bandwidth, the step's roofline."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import numpy as np


def param_counts(model) -> dict:
    """An (abstract) model's parameters as one decode step reads them: `shared` (read whatever the batch: attention,
    norms, routers, shared experts, the unembedding; not the embedding table, of which a step gathers a row per
    sample), `experts` (every layer's routed expert stacks), E and top-k."""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    experts, e, k = 0, 1, 0
    for stack in model.stacks:
        if stack.is_moe:
            moe = stack.mlp.moe
            experts += sum(int(np.prod(w.shape)) for w in (moe.wg_ExDxF, moe.wu_ExDxF, moe.wo_ExFxD))
            e, k = moe.wg_ExDxF.shape[1], moe.k
    embed = 0 if model.cfg.tie_word_embeddings else int(np.prod(model.embed_VxD.shape))
    return dict(total=total, shared=total - experts - embed, experts=experts, num_experts=e, top_k=k)


def kv_cache_bytes(model, rows: int, slots: int) -> int:
    """Bytes of the KV cache of `rows` samples and `slots` positions (model.init_cache's arrays; nothing allocated)."""
    cache = jax.eval_shape(lambda: model.init_cache(rows, slots))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def decode_bytes_per_step(
    *, shared_params: int, expert_params: int, num_experts: int, top_k: int, rows: int, kv_bytes: int, param_bytes=2
) -> dict:
    """The bytes one decode step must read from HBM (it is memory-bound): the shared parameters, the routed experts
    the step's rows touch (min(E, rows x k) of E per layer: at rows x k >= E every expert, an upper bound below), at
    `param_bytes` each, and the KV cache read (`kv_bytes`)."""
    touched = min(num_experts, rows * top_k)
    weights = param_bytes * (shared_params + expert_params * touched / num_experts)
    return dict(experts_touched=touched, param_bytes=weights, kv_bytes=kv_bytes, bytes=weights + kv_bytes)


def step_of(model, counts: dict, rows: int, slots: int, param_bytes: int = 2) -> dict:
    """decode_bytes_per_step of `model` (its param_counts `counts`): `rows` rows over `slots` cache slots, the weights
    at `param_bytes` each."""
    return decode_bytes_per_step(
        shared_params=counts["shared"],
        expert_params=counts["experts"],
        num_experts=counts["num_experts"],
        top_k=counts["top_k"],
        rows=rows,
        kv_bytes=kv_cache_bytes(model, rows, slots),
        param_bytes=param_bytes,
    )


def roofline_fraction(bytes_per_step: float, step_s: float, bandwidth: float) -> float:
    """The memory-bound roofline's time of a step (its bytes at the HBM bandwidth) over the measured step."""
    return bytes_per_step / bandwidth / step_s
