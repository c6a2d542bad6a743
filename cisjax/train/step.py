"""The GRPO optimizer step: a pure `(state, batch) -> (state, metrics)` jitted once over the mesh, and its optimizer."""

from __future__ import annotations

import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import errors
from cisjax import logprobs as logprobs_lib
from cisjax import sharding
from cisjax.records import TrainBatch
from cisjax.train.state import TrainState

PRECISIONS = ("bf16", "fp32", "fp16")
SCHEDULES = ("constant", "cosine", "linear")
# Logical names of every [M, B, T] field of a TrainBatch: micro-batches replicated, rows split like activations.
BATCH_AXES = (None, "batch", "length")


# ----------------------------------------------------------------------------- optimizer


def make_schedule(train_cfg):
    """count (updates applied so far) -> learning rate: linear warm-up, then constant / cosine / linear decay.

    Warm-up is lr * (count + 1) / warmup_steps for count < warmup_steps (the first update is not wasted at lr 0);
    the decay runs from lr at count = warmup_steps to lr * final_lr_ratio at count = total_steps and stays there.
    """
    lr, warmup, total = float(train_cfg.lr), int(train_cfg.warmup_steps), int(train_cfg.total_steps)
    kind, final = train_cfg.schedule, float(train_cfg.final_lr_ratio)
    if kind not in SCHEDULES:
        raise errors.UserError(f"train.schedule={kind!r}; one of {SCHEDULES}")
    if warmup < 0 or lr < 0:
        raise errors.UserError(f"train.warmup_steps={warmup} and train.lr={lr} must be non-negative")
    if kind != "constant" and total <= warmup:
        raise errors.UserError(f"train.schedule={kind} needs train.total_steps ({total}) > train.warmup_steps ({warmup})")
    if not 0.0 <= final <= 1.0:
        raise errors.UserError(f"train.final_lr_ratio={final} must lie in [0, 1]")

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        factor = jnp.minimum(1.0, (c + 1.0) / warmup) if warmup else jnp.ones((), jnp.float32)
        if kind != "constant":
            t = jnp.clip((c - warmup) / (total - warmup), 0.0, 1.0)
            shape = 0.5 * (1.0 + jnp.cos(math.pi * t)) if kind == "cosine" else 1.0 - t
            factor = factor * (final + (1.0 - final) * shape)
        return lr * factor

    return schedule


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """Global-norm clipping (train.grad_clip; 0 = off), then AdamW with make_schedule's learning rate.

    Weight decay is decoupled and applies to every parameter (norms and biases included).
    """
    if train_cfg.grad_clip < 0:
        raise errors.UserError(f"train.grad_clip={train_cfg.grad_clip} must be >= 0 (0 = off)")
    adamw = optax.adamw(
        learning_rate=make_schedule(train_cfg), b1=float(train_cfg.b1), b2=float(train_cfg.b2), eps=float(train_cfg.eps),
        weight_decay=float(train_cfg.weight_decay),
    )
    if train_cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(float(train_cfg.grad_clip)), adamw)
    return adamw


# ----------------------------------------------------------------------------- precision


def resolve_precision(cfg) -> str:
    """The precision the step runs in: train.precision, except that correction.method=fp16 (the FP16 baseline: weight
    1, both engines in float16) forces "fp16" whatever train.precision says."""
    precision = cfg.train.precision
    if precision not in PRECISIONS:
        raise errors.UserError(f"train.precision={precision!r}; one of {PRECISIONS}")
    return "fp16" if cfg.correction.method == "fp16" else precision


def model_runtime(cfg) -> dict:
    """Runtime options to build or load the model with (hf_io.load(..., **model_runtime(cfg))): dtypes and the MoE
    dispatch (model.moe_impl, model.moe_tile).

    bf16: compute in model.dtype (bfloat16 by default); fp32: float32; fp16: float16. Parameters (master weights)
    and optimizer state stay in model.param_dtype (float32 by default) in every mode; the router in model.router_dtype.
    """
    precision = resolve_precision(cfg)
    dtype = {"bf16": cfg.model.dtype, "fp32": "float32", "fp16": "float16"}[precision]
    return dict(dtype=dtype, param_dtype=cfg.model.param_dtype, router_dtype=cfg.model.router_dtype,
                moe_impl=cfg.model.moe_impl, moe_tile=int(cfg.model.moe_tile) or None)


def _check_compute_dtype(model, precision: str) -> None:
    want = {"fp32": jnp.float32, "fp16": jnp.float16}.get(precision)
    have = jnp.dtype(model.cfg.dtype)
    if want is not None and have != jnp.dtype(want):
        raise ValueError(f"train.precision={precision} but the model computes in {have.name}: build it with "
                         f"cisjax.train.step.model_runtime(cfg)")


# ----------------------------------------------------------------------------- placement


def batch_sharding(mesh, rules) -> NamedSharding:
    """Sharding of every [M, B, T] field of a TrainBatch: M replicated, B over the "batch" mesh axes.

    B must be divisible by the product of the mesh axes "batch" maps to (data x fsdp x expert by default).
    """
    return sharding.named_sharding(BATCH_AXES, rules, mesh)


def batch_rows_multiple(mesh, rules) -> int:
    """Rows of a batch must split evenly over the mesh axes the logical "batch" axis maps to: their product."""
    spec = batch_sharding(mesh, rules).spec
    axes = spec[1] if len(spec) > 1 else None
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes]))


def place_batch(batch: TrainBatch, mesh, rules) -> TrainBatch:
    """Global arrays of a host batch (numpy or jax), every process holding the same full batch (multi-process safe)."""
    target = batch_sharding(mesh, rules)

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, target, lambda index: x[index])

    return TrainBatch(*(one(x) for x in batch))


# ----------------------------------------------------------------------------- the forward shared by step and rescoring


def _forward_fn(graphdef, cfg, mesh, rules):
    """(params, tokens, positions, segments, targets) [B, T] -> (logprobs, entropy) [B, T] fp32 at the sampling
    temperature, through the chunked token_logprobs (never a [B, T, V] logits tensor)."""
    temperature, chunk_size = float(cfg.logprobs.temperature), int(cfg.logprobs.chunk_size)
    precision = resolve_precision(cfg)

    def forward(params, tokens, positions, segment_ids, targets):
        with sharding.use_mesh(mesh, rules):
            model = nnx.merge(graphdef, params)
            _check_compute_dtype(model, precision)
            out = model(tokens, positions, segment_ids)
            stats = logprobs_lib.token_logprobs(
                out.hidden_BxLxD, model.unembedding_DxV(), targets, temperature=temperature, chunk_size=chunk_size
            )
        return stats.logprobs_N, stats.entropy_N

    return forward


def make_logprobs_fn(graphdef, cfg, mesh, rules, params_shardings=None):
    """Jitted `(params, batch) -> logprobs_MxBxT` (fp32): the proximal rescoring at the start of a step, with the
    step's own forward (same precision, temperature and chunking). `params_shardings` defaults to the params' own."""
    forward = _forward_fn(graphdef, cfg, mesh, rules)
    bsh = batch_sharding(mesh, rules)

    def logprobs(params, batch: TrainBatch):
        def one(mb):
            lp, _ = forward(params, mb.tokens_MxBxT, mb.positions_MxBxT, mb.segment_ids_MxBxT, mb.targets_MxBxT)
            return lp

        return lax.map(one, batch)

    in_sh = (params_shardings, TrainBatch(*([bsh] * len(TrainBatch._fields))))
    return jax.jit(logprobs, in_shardings=in_sh, out_shardings=bsh)


# ----------------------------------------------------------------------------- the train step


def correction_kwargs(cfg) -> dict:
    c = cfg.correction
    bound = lambda x: None if x is None else float(x)  # noqa: E731  (None = the method's default; 0 is a bound)
    return dict(lam=float(c.lam), kappa=float(c.kappa), cap=float(c.cap), low=bound(c.low), high=bound(c.high),
                threshold=float(c.threshold))


def _loss_kwargs(cfg) -> dict:
    lc = cfg.loss
    return dict(aggregation=lc.aggregation, clip_low=float(lc.clip_low), clip_high=float(lc.clip_high),
                gspo=cfg.correction.method == "gspo", gspo_clip_low=float(lc.gspo_clip_low),
                gspo_clip_high=float(lc.gspo_clip_high))


def make_loss_fn(graphdef, cfg, mesh, rules):
    """`loss(params, micro_batch, denominator) -> (loss * loss_scale, aux)`, differentiable in params: one micro-batch
    ([B, T] fields of a TrainBatch) through the forward, the chunked logprobs, the correction weights and the policy
    loss. `denominator` is loss_denominator of the whole step's mask. `.loss_scale` is train.loss_scale under fp16
    precision, else 1. aux: loss (unscaled), entropy_sum and tokens over valid tokens, corr and loss_metrics dicts."""
    from cisjax.rl import corrections
    from cisjax.rl import loss as loss_lib

    if cfg.loss.kl_coef:
        raise errors.UserError("loss.kl_coef > 0 needs reference-policy logprobs, which TrainBatch does not carry")
    scale = float(cfg.train.loss_scale) if resolve_precision(cfg) == "fp16" else 1.0
    if not scale > 0:
        raise errors.UserError(f"train.loss_scale={scale} must be positive")
    method = cfg.correction.method
    corr_kw, loss_kw = correction_kwargs(cfg), _loss_kwargs(cfg)
    forward = _forward_fn(graphdef, cfg, mesh, rules)

    def loss_fn(params, mb: TrainBatch, denominator):
        # fields of one micro-batch: [B, T] (the _MxBxT names are the step's batch, scanned over M)
        logp_BxT, entropy_BxT = forward(params, mb.tokens_MxBxT, mb.positions_MxBxT, mb.segment_ids_MxBxT, mb.targets_MxBxT)
        mask_BxT = mb.loss_mask_MxBxT
        weights_BxT, corr_metrics = corrections.correction_weights(
            method, mb.prox_logprobs_MxBxT, mb.infer_logprobs_MxBxT, mask_BxT, **corr_kw)
        loss, loss_metrics = loss_lib.policy_loss(
            logp_BxT, mb.prox_logprobs_MxBxT, weights_BxT, mb.advantages_MxBxT, mask_BxT, denominator=denominator, **loss_kw)
        entropy_sum = jnp.sum(jnp.where(mask_BxT, lax.stop_gradient(entropy_BxT), 0.0))
        aux = dict(loss=loss, entropy_sum=entropy_sum, tokens=jnp.sum(mask_BxT.astype(jnp.float32)), corr=corr_metrics,
                   loss_metrics=loss_metrics)
        return loss.astype(jnp.float32) * scale, aux

    loss_fn.loss_scale = scale
    return loss_fn


def make_train_step(graphdef, tx, cfg, mesh, rules, state_shardings):
    """The jitted optimizer step `(state, batch) -> (state, metrics)`; `state` is donated.

    batch: a TrainBatch of [M, B, T] arrays (place_batch puts host arrays where the step wants them). One step:
      1. the loss denominator from the whole step's mask (global token mean across micro-batches and devices);
      2. lax.scan over the M micro-batches: forward, chunked logprobs and entropy, correction weights from the
         proximal (p) and inference (q) logprobs, the policy loss; gradients summed in fp32;
      3. fp16 precision: the loss is multiplied by train.loss_scale before differentiation and the summed gradient
         divided by it (a static scale);
      4. in every precision, a non-finite gradient norm or loss skips the update: params and optimizer state are
         returned bitwise unchanged, skipped_steps is incremented and metrics["skipped"] is 1; step always increments.

    metrics (replicated fp32 scalars): loss, grad_norm (before clipping), clip_frac, entropy (mean over valid
    tokens), lr (the learning rate of this update), tokens, skipped, and every correction and loss metric combined
    over micro-batches (token-weighted means; keys ending "_max" by max).

    Config: correction.method picks the operator (low/high None = the method's default); "gspo" switches the loss to
    the sequence surrogate; "fp16" has weight 1 and forces precision fp16 (resolve_precision). The model's compute
    dtype comes from the graphdef (build it with model_runtime(cfg)); the step refuses fp32/fp16 precision on a model
    built for another compute dtype.
    """
    from cisjax.rl import corrections
    from cisjax.rl import loss as loss_lib

    micro_loss = make_loss_fn(graphdef, cfg, mesh, rules)
    scale = micro_loss.loss_scale
    aggregation = cfg.loss.aggregation
    schedule = make_schedule(cfg.train)
    param_sh = state_shardings.params
    bsh = batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, P())

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: TrainBatch):
        run.traces += 1
        denominator = loss_lib.loss_denominator(batch.loss_mask_MxBxT, aggregation)
        params = state.params

        def body(acc, mb):
            g, aux = grad_fn(params, mb, denominator)
            acc = jax.tree.map(lambda a, gi: a + gi.astype(jnp.float32), acc, g)
            return lax.with_sharding_constraint(acc, param_sh), aux

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grads, aux = lax.scan(body, lax.with_sharding_constraint(zeros, param_sh), batch)
        if scale != 1.0:
            grads = jax.tree.map(lambda g: g / scale, grads)
        loss = jnp.sum(aux["loss"])
        grad_norm = optax.tree.norm(grads)  # fp32, before clipping
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        ok = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        # Where the gradient is not finite the update below is garbage, and is discarded leaf by leaf.
        updates, opt_state = tx.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        new_state = state._replace(
            step=state.step + 1,
            params=jax.tree.map(keep, new_params, params),
            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
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
            tokens=tokens,
            lr=schedule(state.step - state.skipped_steps),  # optax's count: the updates applied so far
            skipped=(~ok).astype(jnp.float32),
        )
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return new_state, metrics

    batch_sh = TrainBatch(*([bsh] * len(TrainBatch._fields)))
    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sh), out_shardings=(state_shardings, replicated),
                     donate_argnums=0)

    def run(state: TrainState, batch: TrainBatch):
        return jitted(state, batch)

    run.traces = 0  # how many times the step was traced (1 for any number of calls with the same shapes)
    run.jitted = jitted
    run.batch_sharding = bsh
    return run
