"""The precision a run computes in, and the model runtime options (dtypes, MoE dispatch) it builds its model with."""

from __future__ import annotations

import jax.numpy as jnp

from cisjax import errors

PRECISIONS = ("bf16", "fp32", "fp16")


def resolve_precision(cfg) -> str:
    """The precision the step runs in: train.precision, except that correction.method=fp16 (the FP16 baseline: weight
    1, both engines in float16) forces "fp16" whatever train.precision says."""
    precision = cfg.train.precision
    if precision not in PRECISIONS:
        raise errors.UserError(f"train.precision={precision!r}; one of {PRECISIONS}")
    return "fp16" if cfg.correction.method == "fp16" else precision


def model_runtime(cfg) -> dict:
    """Runtime options to build or load the model with (hf_io.load(..., **model_runtime(cfg))): dtypes and the MoE
    dispatch (model.moe_impl, model.moe_tile) the rematerialisation policy (model.remat) and
    scanned layers (model.scan_layers).

    bf16: compute in model.dtype (bfloat16 by default); fp32: float32; fp16: float16. Parameters (master weights)
    and optimizer state stay in model.param_dtype (float32 by default) in every mode; the router in model.router_dtype.
    """
    precision = resolve_precision(cfg)
    dtype = {"bf16": cfg.model.dtype, "fp32": "float32", "fp16": "float16"}[precision]
    return dict(
        dtype=dtype,
        param_dtype=cfg.model.param_dtype,
        router_dtype=cfg.model.router_dtype,
        moe_impl=cfg.model.moe_impl,
        moe_tile=int(cfg.model.moe_tile) or None,
        remat=cfg.model.remat,
        scan_layers=bool(cfg.model.scan_layers),
    )


def check_compute_dtype(model, precision: str) -> None:
    """Refuse a model built for another compute dtype than `precision` asks for (bf16 takes model.dtype as it is)."""
    want = {"fp32": jnp.float32, "fp16": jnp.float16}.get(precision)
    have = jnp.dtype(model.cfg.dtype)
    if want is not None and have != jnp.dtype(want):
        raise ValueError(
            f"train.precision={precision} but the model computes in {have.name}: build it with "
            f"cisjax.runtime.model_runtime(cfg)"
        )


def precision_of(dtype) -> str:
    """The precision whose compute dtype is `dtype` (a model loaded in one dtype: cisjax score, cisjax mismatch)."""
    name = jnp.dtype(dtype).name
    return {"float32": "fp32", "float16": "fp16"}.get(name, "bf16")
