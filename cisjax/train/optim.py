"""The optimizer of a run: AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from cisjax import errors

SCHEDULES = ("constant", "cosine", "linear")


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
        raise errors.UserError(
            f"train.schedule={kind} needs train.total_steps ({total}) > train.warmup_steps ({warmup})"
        )
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
        learning_rate=make_schedule(train_cfg),
        b1=float(train_cfg.b1),
        b2=float(train_cfg.b2),
        eps=float(train_cfg.eps),
        weight_decay=float(train_cfg.weight_decay),
    )
    if train_cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(float(train_cfg.grad_clip)), adamw)
    return adamw
