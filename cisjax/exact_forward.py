"""rollout.exact's trainer forward: the plain forward's outputs with its logprobs replaced by the exact path's value."""

from __future__ import annotations

import jax
from jax import lax

from cisjax import exact_rows
from cisjax.models import exact


def exact_value(graphdef, mesh, rules, temperature: float, params, tokens_BxT, positions_BxT, targets_BxT, support):
    """exact.exact_forward's logprobs [B, T] (fp32) of the targets: keys in exact.BLOCK blocks over T rounded up to a
    block, experts exact.moe_impl, renormalised over the support ids where a row has them: the exact sampler's q. On a
    mesh each device computes its own rows with the weights gathered whole (exact_rows), as the sampler does (one GSPMD
    program over the sharded weights computes other bits than the sampler's: tests/test_exact_rows.py)."""
    t = tokens_BxT.shape[1]

    def value(w, tokens_BxT, positions_BxT, targets_BxT, *support):
        return exact.exact_forward(
            w.model,
            tokens_BxT,
            positions_BxT,
            targets_BxT,
            slots=-(-t // exact.BLOCK) * exact.BLOCK,
            temperature=temperature,
            support_BxTxS=support[0] if support else None,
            moe_impl=exact.moe_impl(w.model),
            block=exact.BLOCK,
            layers_=w.layers,
        )

    rows = (tokens_BxT, positions_BxT, targets_BxT) + (() if support is None else (support,))
    return exact_rows.apply(value, graphdef, (), mesh, rules, params, None, rows)


def exact_logprobs(graphdef, mesh, rules, plain, *, temperature: float):
    """forward.make_forward's `forward` signature: `plain`'s Output with stats.logprobs_N the exact value, bit for bit
    (the plain forward's own logprobs differ in the last bits), and the VJP of `plain` in (params, grad_acc): the
    gradient of the same function, through the model's fast forward and its in-place gradient sums (the exact pieces'
    own backward costs 4.5-53x it on the demo model, measured). No routing replay: both sides route alike."""

    @jax.custom_vjp
    def run(params, grad_acc, tokens_BxT, positions_BxT, segments_BxT, targets_BxT, support):
        out, _ = fwd(params, grad_acc, tokens_BxT, positions_BxT, segments_BxT, targets_BxT, support)
        return out

    def fwd(params, grad_acc, tokens_BxT, positions_BxT, segments_BxT, targets_BxT, support):
        call = lambda p, g: plain(  # noqa: E731
            p, tokens_BxT, positions_BxT, segments_BxT, targets_BxT, None, support, grad_acc=g
        )
        out, vjp = jax.vjp(call, params, grad_acc)
        lp = exact_value(graphdef, mesh, rules, temperature, params, tokens_BxT, positions_BxT, targets_BxT, support)
        stats = out.stats._replace(logprobs_N=lax.stop_gradient(lp).astype(out.stats.logprobs_N.dtype))
        return out._replace(stats=stats), vjp

    def bwd(vjp, g_out):
        g_params, g_acc = vjp(g_out)
        return g_params, g_acc, None, None, None, None, None

    run.defvjp(fwd, bwd)

    def forward(
        params,
        tokens_BxT,
        positions_BxT,
        segments_BxT,
        targets_BxT,
        routing_BxTxXxK=None,
        support_BxTxS=None,
        grad_acc=None,
    ):
        if routing_BxTxXxK is not None:
            raise ValueError("rollout.exact: no routing replay (both sides route alike)")
        return run(params, grad_acc, tokens_BxT, positions_BxT, segments_BxT, targets_BxT, support_BxTxS)

    return forward
