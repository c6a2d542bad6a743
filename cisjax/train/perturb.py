"""Controlled mismatch: the copy of the weights the rollout engine is sent, perturbed on purpose (a quantisation grid or seeded noise)."""

from __future__ import annotations

import dataclasses
import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from cisjax import errors
from cisjax import export as export_lib

__all__ = ["KINDS", "Perturbation", "perturb", "check", "export_copy"]

# none: the weights as they are | int8 / int4: symmetric integer grid, one scale per matrix (max |w| on the largest
# level) | fp8: float8_e4m3fn, one scale per matrix (max |w| on 448, e4m3's largest) | noise: w + scale x rms(w) x
# N(0, 1), one rms per matrix.
KINDS = ("none", "int8", "int4", "fp8", "noise")
_INT_LEVELS = {"int8": 127.0, "int4": 7.0}
_FP8_MAX = 448.0


def check(kind: str, scale: float) -> None:
    """A clear error for a bad setting (rollout.perturb, rollout.perturb_scale)."""
    if kind not in KINDS:
        raise errors.UserError(f"rollout.perturb={kind!r}; one of {KINDS}")
    if kind == "noise" and not float(scale) > 0:
        raise errors.UserError(f"rollout.perturb=noise needs rollout.perturb_scale > 0 (relative rms), got {scale}")
    if kind != "noise" and float(scale) != 0:
        raise errors.UserError(f"rollout.perturb_scale={scale} is only for rollout.perturb=noise (here {kind!r})")


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """A run's controlled mismatch (rollout.perturb, perturb_scale, perturb_seed): what perturb() and export_copy()
    take as keyword arguments (`**dataclasses.asdict(p)`)."""

    kind: str = "none"
    scale: float = 0.0
    seed: int = 0

    @property
    def on(self) -> bool:
        return self.kind != "none"


def _matrix(w, kind: str, scale: float, key):
    """One leaf: matrices (ndim >= 2, scaled per matrix over the last two axes, so each layer's and each expert's
    matrix of a stack is its own tensor, as in an HF checkpoint) are perturbed; vectors (norms, biases) are not."""
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        return w
    x = w.astype(jnp.float32)
    if kind == "noise":
        rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=(-2, -1), keepdims=True))
        out = x + scale * rms * jax.random.normal(key, x.shape, jnp.float32)
    else:
        amax = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
        top = _INT_LEVELS.get(kind, _FP8_MAX)
        s = jnp.where(amax > 0, amax / top, 1.0)
        if kind == "fp8":
            out = (x / s).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s
        else:
            out = jnp.clip(jnp.round(x / s), -top, top) * s
    return out.astype(w.dtype)


@functools.partial(jax.jit, static_argnames=("kind", "scale", "seed"))
def perturb(params, *, kind: str, scale: float = 0.0, seed: int = 0):
    """(perturbed params, relative rms of the change over every perturbed matrix: ||w' - w|| / ||w||).

    Deterministic: noise of leaf i comes from fold_in(PRNGKey(seed), i), the same for every version, so the engine's
    deviation is a fixed property of the run (like a kernel's), not fresh randomness per step. Shardings are kept."""
    leaves, treedef = jax.tree.flatten(params)
    base = jax.random.PRNGKey(seed)
    out = [_matrix(w, kind, scale, jax.random.fold_in(base, i)) for i, w in enumerate(leaves)]
    num = sum(jnp.sum(jnp.square(o.astype(jnp.float32) - w.astype(jnp.float32))) for o, w in zip(out, leaves))
    den = sum(jnp.sum(jnp.square(w.astype(jnp.float32))) for w in leaves if w.ndim >= 2)
    return jax.tree.unflatten(treedef, out), jnp.sqrt(num / jnp.maximum(den, 1e-30))


def export_copy(
    graphdef,
    params,
    hf_config: dict,
    root,
    *,
    kind: str,
    scale: float,
    seed: int,
    dtype,
    source: str,
    clear: bool = True,
):
    """(path, relative rms change): `params` perturbed and exported as the HF directory root/v000000, the model an
    engine starts on (the loop's version 0 under rollout.perturb, `cisjax mismatch measure --perturb`). `clear`
    removes an earlier copy first (only one process of a multi-process run does; the export is collective)."""
    sent, rel = perturb(params, kind=kind, scale=float(scale), seed=int(seed))
    if clear:
        shutil.rmtree(Path(root), ignore_errors=True)
    metadata = {"source": source, "perturb": kind, "scale": float(scale), "seed": int(seed), "rel_rms": float(rel)}
    path = export_lib.export((graphdef, sent), hf_config, Path(root), 0, dtype=dtype, keep=1, metadata=metadata)
    return path, float(rel)
