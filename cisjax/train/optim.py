"""The optimizer of a run: AdamW with global-norm clipping and a warm-up + decay learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear")


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


def make_optimizer(spec: OptimSpec) -> optax.GradientTransformation:
    """Global-norm clipping (grad_clip; 0 = off), then AdamW with make_schedule's learning rate.

    Weight decay is decoupled and applies to every parameter (norms and biases included).
    """
    adamw = optax.adamw(
        learning_rate=make_schedule(spec),
        b1=float(spec.b1),
        b2=float(spec.b2),
        eps=float(spec.eps),
        weight_decay=float(spec.weight_decay),
    )
    if spec.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(float(spec.grad_clip)), adamw)
    return adamw
