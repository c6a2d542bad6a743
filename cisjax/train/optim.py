"""The optimizer of a run: AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from cisjax.rounding import round_to_bf16

SCHEDULES = ("constant", "cosine", "linear")
STATE_DTYPES = ("float32", "bfloat16")  # train.optimizer_state_dtype: AdamW's two moments
GRAD_SUM_DTYPES = ("float32", "bfloat16")  # train.grad_sum_dtype: the step's gradient sum over micro-batches
_ROUNDING_SEED = 0x5EED  # the stochastic rounding's random bits: a function of the update count and the leaf alone
_MASTER_SEED = 0xB16  # the bf16 master weights' rounding (apply_updates): another stream than the moments'


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """A run's optimizer fields (train.lr ... train.final_lr_ratio of configs/base.py), validated with the config."""

    lr: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
    grad_clip: float  # 0 = off
    schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    total_steps: int = 1000
    final_lr_ratio: float = 0.0
    optimizer_state_dtype: str = "float32"  # float32 | bfloat16 (stochastically rounded; see scale_by_adam_bf16)
    offload_optimizer: bool = False  # the moments in host memory, updated a layer at a time (cisjax.train.offload)
    grad_sum_dtype: str = "float32"  # float32 | bfloat16 (each addition stochastically rounded; train/step.py)


def make_schedule(spec: OptimSpec):
    """count (updates applied so far) -> learning rate: linear warm-up, then constant / cosine / linear decay.

    Warm-up is lr * (count + 1) / warmup_steps for count < warmup_steps (the first update is not wasted at lr 0);
    the decay runs from lr at count = warmup_steps to lr * final_lr_ratio at count = total_steps and stays there.
    """
    lr, warmup, total = float(spec.lr), int(spec.warmup_steps), int(spec.total_steps)
    kind, final = spec.schedule, float(spec.final_lr_ratio)
    if kind not in SCHEDULES:  # argument guards; the config's own rules are train.validate's
        raise ValueError(f"schedule {kind!r}; one of {SCHEDULES}")
    if kind != "constant" and total <= warmup:
        raise ValueError(f"a {kind} schedule needs total_steps ({total}) > warmup_steps ({warmup})")

    def schedule(count):
        c = jnp.asarray(count, jnp.float32)
        factor = jnp.minimum(1.0, (c + 1.0) / warmup) if warmup else jnp.ones((), jnp.float32)
        if kind != "constant":
            t = jnp.clip((c - warmup) / (total - warmup), 0.0, 1.0)
            shape = 0.5 * (1.0 + jnp.cos(math.pi * t)) if kind == "cosine" else 1.0 - t
            factor = factor * (final + (1.0 - final) * shape)
        return lr * factor

    return schedule


def init_view(params):
    """What the optimizer's state is initialised from: the params with bf16 leaves seen as fp32, so that the moments
    take train.optimizer_state_dtype's dtype (optax's AdamW would give bf16 master weights bf16 moments, rounded to
    nearest). Arrays or ShapeDtypeStructs."""

    def view(x):
        if jnp.dtype(x.dtype) != jnp.bfloat16:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=getattr(x, "sharding", None))
        return x.astype(jnp.float32)

    return jax.tree.map(view, params)


def apply_updates(params, updates, count, salt=None):
    """optax.apply_updates, except that bfloat16 params (bf16 master weights: model.param_dtype=bfloat16) take
    p + u computed in fp32 and stored by stochastic rounding (round_to_bf16), whose expected value is p + u: rounding
    to nearest would drop every update under half of bf16's gap (2^-9 of |p|), which at RL learning rates is most of
    them. The random bits are a function of `count` (the step), the leaf's position and `salt` (one per layer when the
    update runs a layer at a time)."""
    leaves, treedef = jax.tree.flatten(params)
    if not any(jnp.dtype(p.dtype) == jnp.bfloat16 for p in leaves):
        return optax.apply_updates(params, updates)  # fp32 master weights: optax's update, the program unchanged
    key = jax.random.fold_in(jax.random.key(_MASTER_SEED), count)
    if salt is not None:
        key = jax.random.fold_in(key, salt)
    out = []
    for i, (p, u) in enumerate(zip(leaves, treedef.flatten_up_to(updates))):
        if jnp.dtype(p.dtype) == jnp.bfloat16:
            out.append(round_to_bf16(p.astype(jnp.float32) + u.astype(jnp.float32), jax.random.fold_in(key, i)))
        else:
            out.append(optax.apply_updates(p, u))
    return treedef.unflatten(out)


def scale_by_adam_bf16(b1: float, b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """optax.scale_by_adam with both moments stored in bfloat16 (half of fp32 Adam's 8 bytes per parameter).

    Each update reads the moments into fp32, computes the new moments and the update in fp32 (the update is fp32
    Adam's, from the stored moments), and stores the moments by stochastic rounding (round_to_bf16). Rounding to
    nearest would stall the second moment: with b2 = 0.999 a step changes nu by ~0.1%, under bfloat16's half-gap
    (2^-9 = 0.2%), so nu would only ever rise; stochastic rounding keeps the stored moments unbiased. The random bits
    are a function of the update count and the leaf's position (reproducible, and the same after a resume), and of
    `rounding_salt` when the update is called on a part of the tree (cisjax.train.offload: one call per layer, each
    with its own salt, so that the layers do not share random bits)."""

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, jnp.bfloat16)  # noqa: E731
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def update(updates, state, params=None, *, rounding_salt=None, **extra_args):
        del params, extra_args
        count = optax.safe_increment(state.count)
        leaves, treedef = jax.tree.flatten(updates)
        key = jax.random.fold_in(jax.random.key(_ROUNDING_SEED), count)
        if rounding_salt is not None:
            key = jax.random.fold_in(key, rounding_salt)
        c = count.astype(jnp.float32)
        mu_debias, nu_debias = 1.0 - b1**c, 1.0 - b2**c  # the bias corrections, one per update
        mus, nus, outs = [], [], []
        for i, (g, mu, nu) in enumerate(zip(leaves, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu))):
            g32 = g.astype(jnp.float32)
            mu32 = b1 * mu.astype(jnp.float32) + (1.0 - b1) * g32
            nu32 = b2 * nu.astype(jnp.float32) + (1.0 - b2) * jnp.square(g32)
            mu_hat, nu_hat = mu32 / mu_debias, nu32 / nu_debias
            outs.append((mu_hat / (jnp.sqrt(nu_hat) + eps)).astype(g.dtype))
            mus.append(round_to_bf16(mu32, jax.random.fold_in(key, 2 * i)))
            nus.append(round_to_bf16(nu32, jax.random.fold_in(key, 2 * i + 1)))
        new = optax.ScaleByAdamState(count=count, mu=treedef.unflatten(mus), nu=treedef.unflatten(nus))
        return treedef.unflatten(outs), new

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(spec: OptimSpec) -> optax.GradientTransformation:
    """Global-norm clipping (grad_clip; 0 = off), then AdamW with make_schedule's learning rate, its moments in
    spec.optimizer_state_dtype (bfloat16: scale_by_adam_bf16; master weights stay the params' dtype).

    Weight decay is decoupled and applies to every parameter (norms and biases included). The state is
    (clip's, AdamW's) with clipping, AdamW's alone without (make_parts: the two parts).
    """
    clip, adamw = make_parts(spec)
    return adamw if clip is None else optax.chain(clip, adamw)


def make_parts(spec: OptimSpec) -> tuple[optax.GradientTransformation | None, optax.GradientTransformationExtraArgs]:
    """(the global-norm clipping or None, AdamW): make_optimizer's chain in its two parts. Clipping needs the whole
    gradient; AdamW is elementwise, so it may be applied to a part of the tree at a time (cisjax.train.offload)."""
    if spec.optimizer_state_dtype not in STATE_DTYPES:
        raise ValueError(f"optimizer_state_dtype {spec.optimizer_state_dtype!r}; one of {STATE_DTYPES}")
    if spec.optimizer_state_dtype == "float32":
        adamw = optax.adamw(
            learning_rate=make_schedule(spec),
            b1=float(spec.b1),
            b2=float(spec.b2),
            eps=float(spec.eps),
            weight_decay=float(spec.weight_decay),
        )
    else:  # optax.adamw's chain with the bf16 moments
        adamw = optax.chain(
            scale_by_adam_bf16(float(spec.b1), float(spec.b2), float(spec.eps)),
            optax.add_decayed_weights(float(spec.weight_decay)),
            optax.scale_by_learning_rate(make_schedule(spec)),
        )
    return (optax.clip_by_global_norm(float(spec.grad_clip)) if spec.grad_clip > 0 else None), adamw
