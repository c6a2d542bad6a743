"""The precision a run computes in, and the model runtime options (dtypes, MoE dispatch) it builds its model with."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from cisjax import sharding

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
    attention_impl: str = "auto"
    remat: str = "none"
    scan_layers: bool = True

    def model_kwargs(self) -> dict:
        """hf_io.load(..., **runtime.model_kwargs()) / hf_io.model_config(hf, **...): dtypes, the MoE dispatch (moe_impl,
        moe_tile) and the attention core (attention_impl), the rematerialisation policy and scanned layers."""
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
    attention_impl: str = "auto",
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
        attention_impl=attention_impl,
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


def matmul_precision(dtype, platform: str | None = None):
    """The context a program computing in `dtype` is traced under. float32 on a GPU means full float32: JAX's default
    there multiplies float32 inputs in TF32 (a 10-bit mantissa: 3e-4 relative error measured on an H200), so
    jax.default_matmul_precision("highest"); elsewhere a null context (bf16 inputs have no TF32; CPU multiplies float32
    in float32; TPU keeps its default). `platform`: the program's (default sharding.current_platform(), the active
    mesh's, never the host's)."""
    platform = platform or sharding.current_platform()
    if jnp.dtype(dtype) == jnp.float32 and platform in sharding.GPU_PLATFORMS:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()
