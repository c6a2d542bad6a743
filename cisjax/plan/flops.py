"""Analytic FLOP counts of a step, per layer kind, from the model's parameter shapes (the work the math needs)."""

from __future__ import annotations

import math

import flax.nnx as nnx
import jax
from jax.extend import core as jex_core

from cisjax.models import transformer

KINDS = ("attention", "mlp", "moe", "head")

# Forward matmuls cost 1 unit; the backward 2 (the input and the weight gradients). The head's chunked logprob
# recomputes its logits in the backward (cisjax.logprobs), one unit more.
TRAIN_FACTORS = {"attention": 3, "mlp": 3, "moe": 3, "head": 4}


def matmul_params(module, stacked: bool = False) -> int:
    """Elements of the module's weight matrices (parameters of rank >= 2; norms and biases are elementwise).
    stacked: the module is a stack of layers (transformer.stack_layers): per layer, the leading axis dropped."""
    lead = 1 if stacked else 0
    shapes = [x.shape[lead:] for x in jax.tree.leaves(nnx.state(module, nnx.Param))]
    return sum(math.prod(s) for s in shapes if len(s) >= 2)


def _stacks(model):
    """(stack, layers in it) for each stack of decoder layers."""
    return [(stack, transformer.stack_size(stack)) for stack in model.stacks]


def layer_counts(model) -> dict[str, int]:
    """How many of each layer kind the model holds (every layer has attention; its MLP is dense or MoE)."""
    moe = sum(n for stack, n in _stacks(model) if stack.is_moe)
    layers = model.cfg.num_hidden_layers
    return {"attention": layers, "mlp": layers - moe, "moe": moe, "head": 1}


def _routed_experts(moe) -> int:
    """Elements of one layer's routed expert stacks (wg, wu, wo: [n, E, ...])."""
    return sum(math.prod(w.shape[1:]) for w in (moe.wg_ExDxF, moe.wu_ExDxF, moe.wo_ExFxD))


def forward_flops(model, rows: int, seq_len: int) -> dict[str, float]:
    """Forward FLOPs of one [rows, seq_len] micro-batch over the whole mesh, per layer kind.

    A matmul with a [I, O] weight costs 2 I O per token. Attention: its projections (MLA's low-rank ones included)
    plus the causal core, which needs half of the [T, T] scores: rows * T^2 * heads * (qk width + v width). MoE:
    the router, the shared experts (and their gate) on every token, and k of the E routed experts' weights per token.
    Head: the unembedding, 2 D V per token. Embedding lookups are gathers (0 FLOPs). Padding tokens count: the
    program computes them.
    """
    n = rows * seq_len
    heads, qk, v = model.cfg.attention_dims()
    out = dict.fromkeys(KINDS, 0.0)
    for stack, layers in _stacks(model):
        attn = 2 * n * matmul_params(stack.attn, stacked=True) + rows * seq_len**2 * heads * (qk + v)
        out["attention"] += layers * attn
        if stack.is_moe:
            moe = stack.mlp.moe
            experts = _routed_experts(moe)
            num_experts = moe.wg_ExDxF.shape[1]
            out["moe"] += (
                layers * 2 * n * (matmul_params(stack.mlp, stacked=True) - experts + experts * moe.k / num_experts)
            )
        else:
            out["mlp"] += layers * 2 * n * matmul_params(stack.mlp, stacked=True)
    out["head"] = 2.0 * n * model.cfg.hidden_size * model.cfg.vocab_size
    return out


def train_flops(forward: dict[str, float], micro_batches: int) -> dict[str, float]:
    """The optimizer step: forward and backward of every micro-batch (TRAIN_FACTORS)."""
    return {k: micro_batches * TRAIN_FACTORS[k] * f for k, f in forward.items()}


def rescore_flops(forward: dict[str, float], micro_batches: int) -> dict[str, float]:
    """The proximal rescoring: the forward of every micro-batch."""
    return {k: micro_batches * f for k, f in forward.items()}


def active_params(model) -> int:
    """Parameters per token as model cards count them: all but the routed experts a token is not sent to
    (embedding and unembedding included)."""
    total = total_params(model)
    idle = 0
    for stack, layers in _stacks(model):
        if stack.is_moe:
            moe = stack.mlp.moe
            idle += layers * _routed_experts(moe) * (1 - moe.k / moe.wg_ExDxF.shape[1])
    return int(round(total - idle))


def total_params(model) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def jaxpr_flops(jaxpr) -> float:
    """The matmul FLOPs of a (traced, unpartitioned: all chips together) jaxpr: 2 x out elements x contracted size
    of every dot_general, a scan's body times its length (lax.map's loops counted whole, where XLA's cost_analysis
    counts a loop body once), a while loop's body once (its trip count is a value), a cond's largest branch, a
    custom_jvp / custom_vjp call's primal function only, a shard_map's body (one device's) times the devices of its
    manual axes."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name == "scan":
            total += params["length"] * jaxpr_flops(params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(jaxpr_flops(b.jaxpr) for b in params["branches"])
        elif name == "shard_map":
            mesh = params["mesh"]
            axes = params.get("newly_manual_axes", params.get("manual_axes", mesh.axis_names))
            total += math.prod(mesh.shape[a] for a in axes) * jaxpr_flops(
                getattr(params["jaxpr"], "jaxpr", params["jaxpr"])
            )
        elif name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
            fun = params.get("call_jaxpr") or params.get("fun_jaxpr")
            total += jaxpr_flops(getattr(fun, "jaxpr", fun))
        else:
            total += sum(jaxpr_flops(sub) for sub in jex_core.jaxprs_in_params(params))
    return total
