"""The precision a run computes in, and the model runtime options (dtypes, MoE dispatch) it builds its model with."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

PRECISIONS = ("bf16", "fp32", "fp16")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How the trainer's model computes (built by cisjax.train.spec from model.* and train.precision).

    precision: bf16 computes in model.dtype (bfloat16 by default), fp32 in float32, fp16 in float16; correction.method
    fp16 (the FP16 baseline: weight 1, both engines in float16) forces fp16 whatever train.precision says. Parameters
    (master weights) and optimizer state stay in param_dtype in every mode; the router computes in router_dtype."""

    precision: str
    dtype: str  # the compute dtype the precision implies
    param_dtype: str = "float32"
    router_dtype: str = "float32"
    moe_impl: str = "auto"
    moe_tile: int | None = None  # None: chosen from the shapes
    remat: str = "none"
    scan_layers: bool = True

    def model_kwargs(self) -> dict:
        """hf_io.load(..., **runtime.model_kwargs()) / hf_io.model_config(hf, **...): dtypes and the MoE dispatch (moe_impl,
        moe_tile), the rematerialisation policy and scanned layers."""
        out = dataclasses.asdict(self)
        del out["precision"]
        return out


def make_runtime(
    precision: str,
    *,
    method: str = "",
    dtype: str = "bfloat16",
    param_dtype: str = "float32",
    router_dtype: str = "float32",
    moe_impl: str = "auto",
    moe_tile: int = 0,
    remat: str = "none",
    scan_layers: bool = True,
) -> Runtime:
    """The Runtime of train.precision = `precision` with model.dtype = `dtype` (the bf16 compute dtype) and the other
    model.* options; correction.method = "fp16" forces fp16. moe_tile 0 = chosen from the shapes."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; one of {PRECISIONS}")
    precision = "fp16" if method == "fp16" else precision
    return Runtime(
        precision=precision,
        dtype={"bf16": dtype, "fp32": "float32", "fp16": "float16"}[precision],
        param_dtype=param_dtype,
        router_dtype=router_dtype,
        moe_impl=moe_impl,
        moe_tile=int(moe_tile) or None,
        remat=remat,
        scan_layers=bool(scan_layers),
    )


def check_compute_dtype(model, precision: str) -> None:
    """Refuse a model built for another compute dtype than `precision` asks for (bf16 takes model.dtype as it is)."""
    want = {"fp32": jnp.float32, "fp16": jnp.float16}.get(precision)
    have = jnp.dtype(model.cfg.dtype)
    if want is not None and have != jnp.dtype(want):
        raise ValueError(
            f"train.precision={precision} but the model computes in {have.name}: build it with the run's "
            f"cisjax.runtime.Runtime (spec.runtime.model_kwargs())"
        )


def precision_of(dtype) -> str:
    """The precision whose compute dtype is `dtype` (a model loaded in one dtype: cisjax score, cisjax mismatch)."""
    name = jnp.dtype(dtype).name
    return {"float32": "fp32", "float16": "fp16"}.get(name, "bf16")
