"""The GRPO optimizer step: a pure `(state, batch) -> (state, metrics)`, jitted once over the mesh with donation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import forward, sharding
from cisjax import runtime as runtime_lib
from cisjax.models import grad_sink
from cisjax.records import TrainBatch
from cisjax.rl import corrections
from cisjax.rl import loss as loss_lib
from cisjax.train import offload as offload_lib
from cisjax.train import optim
from cisjax.train.state import TrainState

PROXIMAL = ("rescore", "step")  # train.proximal


@dataclass(frozen=True)
class StepSpec:
    """What the step and the proximal rescoring take from the run config (cisjax.train.spec builds it)."""

    runtime: runtime_lib.Runtime  # the precision (the model was built with the same Runtime)
    temperature: float  # logprobs.temperature: p at the sampling temperature
    chunk_size: int  # logprobs.chunk_size: tokens per logsumexp chunk on each device (forward.chunk_tokens)
    correction: corrections.CorrectionSpec
    loss: loss_lib.LossSpec
    optim: optim.OptimSpec
    loss_scale: float = 1.0  # fp16 precision's static loss scale (train.loss_scale); 1 in the other precisions
    # train.proximal: "rescore" = p_prox from the batch (the rescoring pass before the step fills it); "step" = p_prox
    # is the step's own forward, stop-gradient (the step's params are the proximal policy when it takes one optimizer
    # step per rollout batch): no rescoring program, and the step returns p_prox (and the routing flips) itself
    proximal: str = "step"
    # rollout.exact: the forward's logprobs are the exact path's (cisjax.models.exact), its gradient the plain one's
    exact: bool = False

    def forward_kwargs(self) -> dict:
        """The step's forward (forward.make_forward / make_batch_logprobs): precision, temperature, chunking, exact."""
        return dict(
            precision=self.runtime.precision,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            exact=self.exact,
        )


class StepOutputs(NamedTuple):
    """What a train.proximal=step step computed on the way that the rescoring would have (None otherwise)."""

    prox_logprobs_MxBxT: jax.Array | None  # fp32 p_prox of every token: the step's own forward
    flips: forward.Flips | None  # routing replay: where the routers' own choice differs from the replayed one


@dataclass
class TrainStep:
    """The jitted step; call it as `step(state, batch) -> (state, metrics)`, or `step.with_outputs(state, batch) ->
    (state, metrics, StepOutputs)`."""

    jitted: Callable  # the jax.jit of the pure step (state donated): (state, batch) -> (state, metrics, StepOutputs)
    traces: int = 0  # how many times the step was traced (1 for any number of calls with the same shapes)

    def __call__(self, state: TrainState, batch: TrainBatch):
        state, metrics, _ = self.jitted(state, batch)
        return state, metrics

    def with_outputs(self, state: TrainState, batch: TrainBatch):
        return self.jitted(state, batch)


def make_rescore(graphdef, spec: StepSpec, mesh, rules, params_shardings=None, flips: bool = False):
    """The proximal rescoring, jitted: `(params, batch) -> logprobs_MxBxT` through the step's own forward (same
    precision, temperature and chunking, the batch's routing replayed; forward.make_batch_logprobs); with `flips`,
    `(logprobs_MxBxT, forward.Flips)`: where the routers' own choice differs from the replayed routing."""
    return forward.make_batch_logprobs(
        graphdef, mesh, rules, params_shardings=params_shardings, flips=flips, **spec.forward_kwargs()
    )


def make_loss_fn(graphdef, spec: StepSpec, mesh, rules):
    """`loss(params, micro_batch, denominator[, grad_acc]) -> (loss * spec.loss_scale, aux)`, differentiable in
    params: one micro-batch ([B, T] fields of a TrainBatch) through the forward, the chunked logprobs, the correction
    weights and the policy loss. `denominator` is loss_denominator of the whole step's mask. aux: loss (unscaled),
    entropy_sum and tokens over valid tokens, corr and loss_metrics dicts, and `grad_acc` (the per-stack gradient sums
    passed through the layers, differentiable in them: accumulate_grads) when given."""
    method, corr_kw, loss_kw = spec.correction.method, spec.correction.hparams(), spec.loss.kwargs()
    scale = float(spec.loss_scale)
    fwd = forward.make_forward(graphdef, mesh, rules, **spec.forward_kwargs())

    own_prox = spec.proximal == "step"

    def loss_fn(params, mb: TrainBatch, denominator, grad_acc=None):
        # fields of one micro-batch: [B, T] (the _MxBxT names are the step's batch, scanned over M)
        # routing replayed, and under truncated sampling p renormalised over each token's sampling support
        out = forward.on_micro_batch(fwd, params, mb, grad_acc)
        logp_BxT, entropy_BxT = out.stats.logprobs_N, out.stats.entropy_N
        mask_BxT = mb.loss_mask_MxBxT
        # p_prox: the step's own logprobs, stop-gradient (train.proximal=step), else the rescoring's in the batch
        prox_BxT = lax.stop_gradient(logp_BxT.astype(jnp.float32)) if own_prox else mb.prox_logprobs_MxBxT
        weights_BxT, corr_metrics = corrections.correction_weights(
            method, prox_BxT, mb.infer_logprobs_MxBxT, mask_BxT, **corr_kw
        )
        loss, loss_metrics = loss_lib.policy_loss(
            logp_BxT,
            prox_BxT,
            weights_BxT,
            mb.advantages_MxBxT,
            mask_BxT,
            denominator=denominator,
            **loss_kw,
        )
        entropy_sum = jnp.sum(jnp.where(mask_BxT, lax.stop_gradient(entropy_BxT), 0.0))
        # tokens whose p (this forward's, fp32) equals the engine's q bit for bit (all of them under rollout.exact)
        same_BxT = lax.stop_gradient(logp_BxT.astype(jnp.float32)) == mb.infer_logprobs_MxBxT
        aux = dict(
            loss=loss,
            entropy_sum=entropy_sum,
            exact_sum=jnp.sum((mask_BxT & same_BxT).astype(jnp.float32)),
            tokens=jnp.sum(mask_BxT.astype(jnp.float32)),
            corr=corr_metrics,
            loss_metrics=loss_metrics,
        )
        if grad_acc is not None:
            aux["grad_acc"] = out.grad_acc
        if own_prox:  # what the rescoring would have returned: p_prox and, under replay, the routing flips
            aux["prox_BxT"] = prox_BxT
            if mb.routing_MxBxTxXxK is not None and out.expert_ids_XxBxTxK is not None:
                aux["flips"] = forward.routing_flips(
                    lax.stop_gradient(out.expert_ids_XxBxTxK),
                    jnp.moveaxis(mb.routing_MxBxTxXxK, 2, 0),
                    mb.segment_ids_MxBxT > 0,
                )
        return loss.astype(jnp.float32) * scale, aux

    return loss_fn


_SUM_SEED = 0x6AD5  # a bfloat16 gradient sum's rounding (train.grad_sum_dtype): a stream of its own
_STACKS = jax.tree_util.DictKey("stacks")  # the model's stacked layers in its param tree (CausalLM.stacks)


def accumulate_grads(loss_fn, params, acc, mb, denominator, key=None):
    """(acc + the gradient of loss_fn(params, mb, denominator), aux): one micro-batch's gradient added into the
    running sum `acc` (params' tree, in the sum's dtype: fp32, or bfloat16 with `key`, the raw key data of its
    stochastic rounding, grad_sink.add).

    The stacked layers' gradients are added in place: the sums of each stack ride through the layers' scan with the
    forward (CausalLM's grad_acc) and the loss is differentiated with respect to them, its cotangent seeded with the
    sums so far, so each layer's gradient lands in the carried sum as the backward reaches it. Differentiating the
    stacked weights instead would build their whole gradient, a buffer the size of the sum, beside it. The other
    parameters (embeddings, final norm, head) are differentiated as such and added. Equal to acc + grad to the sum's
    rounding (the same additions)."""
    stacked = lambda path: path[0] == _STACKS  # noqa: E731
    sums = [acc["stacks"][r] for r in range(len(acc["stacks"]))]
    stacks_key, rest_key = grad_sink.fold(key, 0), grad_sink.fold(key, 1)

    def micro(p, sums):
        # the stacks' weights enter as constants: their gradient is taken through the sums, not built as such
        p = jax.tree_util.tree_map_with_path(lambda path, x: lax.stop_gradient(x) if stacked(path) else x, p)
        loss, aux = loss_fn(p, mb, denominator, grad_acc=grad_sink.Sums(sums, stacks_key))
        return (loss, aux.pop("grad_acc")), aux

    (loss, _), pullback, aux = jax.vjp(micro, params, sums, has_aux=True)
    grads, sums = pullback((jnp.ones_like(loss), sums))
    summed = {
        (jax.tree_util.DictKey(r), *path): leaf
        for r, tree in enumerate(sums)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    leaves, treedef = jax.tree_util.tree_flatten_with_path(acc)
    grad_leaves = treedef.flatten_up_to(grads)
    new = [
        summed[path[1:]] if stacked(path) else grad_sink.add(a, g, grad_sink.fold(rest_key, i))
        for i, ((path, a), g) in enumerate(zip(leaves, grad_leaves))
    ]
    return treedef.unflatten(new), aux


def make_train_step(graphdef, tx, spec: StepSpec, mesh, rules, state_shardings) -> TrainStep:
    """The jitted optimizer step `(state, batch) -> (state, metrics)`; `state` is donated.

    batch: a TrainBatch of [M, B, T] arrays (sharding.place(batch, mesh, rules, sharding.BATCH_AXES) puts host arrays
    where the step wants them). One step:
      1. the loss denominator from the whole step's mask (global token mean across micro-batches and devices);
      2. lax.scan over the M micro-batches: forward, chunked logprobs and entropy, correction weights from the
         proximal (p) and inference (q) logprobs, the policy loss; gradients summed in train.grad_sum_dtype (fp32,
         or bf16 by stochastic rounding), the stacked layers' in place (accumulate_grads);
      3. fp16 precision: the loss is multiplied by train.loss_scale before differentiation and the summed gradient
         divided by it (a static scale);
      4. in every precision, a non-finite gradient norm or loss skips the update: params and optimizer state are
         returned bitwise unchanged, skipped_steps is incremented and metrics["skipped"] is 1; step always increments.

    metrics (replicated fp32 scalars): loss, grad_norm (before clipping), clip_frac, entropy (mean over valid
    tokens), exact_frac (the valid tokens whose p equals q bit for bit: 1 under rollout.exact, on-policy), lr (the learning rate of this update), tokens, skipped, and every correction and loss metric combined
    over micro-batches (token-weighted means; keys ending "_max" by max).

    outputs (with_outputs): under spec.proximal="step", p_prox of every token [M, B, T] (the step's own forward,
    stop-gradient: what the rescoring would give, to float rounding) and, for a batch with routing, the Flips; None
    fields under "rescore" (the batch carries p_prox).

    spec: correction.method picks the operator (low/high None = the method's default); "gspo" switches the loss to
    the sequence surrogate; "fp16" has weight 1 and forces precision fp16 (runtime.make_runtime). The model's
    compute dtype comes from the graphdef (build it with spec.runtime.model_kwargs()); the step refuses fp32/fp16
    precision on a model built for another compute dtype.
    """
    micro_loss = make_loss_fn(graphdef, spec, mesh, rules)
    scale = float(spec.loss_scale)
    aggregation = spec.loss.aggregation
    schedule = optim.make_schedule(spec.optim)
    param_sh = state_shardings.params
    bsh = sharding.batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, P())
    platform = sharding.mesh_platform(mesh)
    offload = bool(spec.optim.offload_optimizer)
    parts = optim.make_parts(spec.optim)  # tx's two parts: the offloaded update applies AdamW a layer at a time
    sum_dtype = jnp.dtype(spec.optim.grad_sum_dtype)
    bf16 = sum_dtype == jnp.bfloat16
    sum_key = jax.random.key(_SUM_SEED)

    def step(state: TrainState, batch: TrainBatch):
        out.traces += 1
        denominator = loss_lib.loss_denominator(batch.loss_mask_MxBxT, aggregation)
        params = state.params

        def body(acc, xs):
            mb, m = xs
            # a bfloat16 sum's rounding bits: a function of the step, the micro-batch, the stack, layer and leaf
            key = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(sum_key, state.step), m)) if bf16 else None
            with runtime_lib.matmul_precision(spec.runtime.dtype, platform):  # the backward's kernels too
                acc, aux = accumulate_grads(micro_loss, params, acc, mb, denominator, key)
            return lax.with_sharding_constraint(acc, param_sh), aux

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, sum_dtype), params)
        micro_batches = jnp.arange(batch.tokens_MxBxT.shape[0])
        grads, aux = lax.scan(body, lax.with_sharding_constraint(zeros, param_sh), (batch, micro_batches))
        if scale != 1.0:
            grads = jax.tree.map(lambda g: g / scale, grads)
        loss = jnp.sum(aux["loss"])
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))  # fp32, before clipping
        # the update from the sum, whatever the params' dtype (bf16 master weights: optim.apply_updates rounds it)
        ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        # Where the gradient is not finite the update below is garbage, and is discarded leaf by leaf.
        if offload:  # the moments in host memory, brought to the device a layer at a time
            new_params, opt_state = offload_lib.update(
                parts, grads, state.opt_state, params, ok, state_shardings.opt_state, state.step
            )
        else:
            updates, opt_state = tx.update(grads, state.opt_state, params)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            new_params = jax.tree.map(keep, optim.apply_updates(params, updates, state.step), params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        new_state = state._replace(
            step=state.step + 1,
            params=new_params,
            opt_state=opt_state,
            skipped_steps=state.skipped_steps + (~ok).astype(state.skipped_steps.dtype),
        )

        tokens = jnp.sum(aux["tokens"])
        # scan stacked every micro-batch's metrics along axis 0; the two dicts share only the counts tokens/seqs
        metrics = dict(corrections.combine_metrics(aux["corr"]))
        metrics.update(corrections.combine_metrics(aux["loss_metrics"]))
        metrics.update(
            loss=loss,
            grad_norm=grad_norm,
            entropy=jnp.sum(aux["entropy_sum"]) / jnp.maximum(tokens, 1.0),
            exact_frac=jnp.sum(aux["exact_sum"]) / jnp.maximum(tokens, 1.0),
            tokens=tokens,
            lr=schedule(state.step - state.skipped_steps),  # optax's count: the updates applied so far
            skipped=(~ok).astype(jnp.float32),
        )
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        flips = aux.get("flips")
        if flips is not None:  # layers [M, B, T]; per_layer summed over micro-batches, as the rescoring's
            flips = forward.Flips(flips.layers_BxT, jnp.sum(flips.per_layer_X, axis=0))
        return new_state, metrics, StepOutputs(aux.get("prox_BxT"), flips)

    batch_sh = TrainBatch(*([bsh] * len(TrainBatch._fields)))
    jitted = jax.jit(  # the StepOutputs' shardings (None: no constraint) follow the batch's
        step,
        in_shardings=(state_shardings, batch_sh),
        out_shardings=(state_shardings, replicated, None),
        donate_argnums=0,
    )

    out = TrainStep(jitted)
    return out
