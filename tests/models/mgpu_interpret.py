"""Mosaic GPU's interpreter made to run JAX's Hopper grouped matmuls on CPU, for tests: what it lacks (jax 0.10.2)."""

import contextlib
import inspect

import jax
import numpy as np
from jax._src.interpreters import mlir
from jax._src.pallas.mosaic_gpu import core as mgpu_core
from jax._src.pallas.mosaic_gpu import helpers as mgpu_helpers
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
from jax._src.state.types import TransposeTransform
from jax.experimental.pallas import mosaic_gpu as plgpu

from cisjax.models import moe_hopper


def _split_transpose(transforms):
    """(the transforms without the trailing transposes of plgpu.transpose_ref, the permutation they make, or None)."""
    transforms = gpu_callbacks._remove_noop_transforms(transforms)
    perm = None
    while transforms and isinstance(transforms[-1], TransposeTransform):
        p = transforms[-1].permutation
        perm = p if perm is None else tuple(p[i] for i in perm)
        transforms = transforms[:-1]
    assert not any(isinstance(t, TransposeTransform) for t in transforms), transforms
    return jax.tree.map(int, transforms), perm


def _wgmma(
    *,
    token,
    device_id,
    grid_point_coords,
    thread_id,
    acc_allocation_key_as_array,
    acc_transforms,
    acc_dtype,
    a_allocation_key_as_array,
    a_transforms,
    b_allocation_key_as_array,
    b_transforms,
    source_info=None,
):
    """gpu_callbacks.wgmma (acc += a @ b on the simulated shared memory), also for an operand given transposed
    (plgpu.transpose_ref: the input gradient's W and the weight gradient's x), which jax 0.10.2's version cannot
    read (its to_range takes only indexing transforms)."""
    device_id, thread_id = int(device_id), int(thread_id)
    memory = gpu_callbacks._get_shared_memory()
    tid = memory.get_global_thread_id(device_id, thread_id)
    info = gpu_callbacks.interpret_utils.GPULoggingInfo(
        device_id=device_id,
        grid_point_coords=tuple(int(x) for x in grid_point_coords),
        thread_id=thread_id,
        source_info=source_info,
    )

    def read(key_array, transforms):
        transforms, perm = _split_transpose(transforms)
        key = gpu_callbacks.HostAllocationKey.from_array(key_array)
        value, _, _ = memory.get_buffer_content(
            key, gpu_callbacks.interpret_utils.to_range(transforms), tid, logging_info=info
        )
        assert value is not None
        return value if perm is None else np.transpose(value, perm)

    a, b = read(a_allocation_key_as_array, a_transforms), read(b_allocation_key_as_array, b_transforms)
    acc_transforms, perm = _split_transpose(acc_transforms)
    assert perm is None
    acc_range = gpu_callbacks.interpret_utils.to_range(acc_transforms)
    acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc, _, _ = memory.get_buffer_content(acc_key, acc_range, tid, logging_info=info)
    memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), tid, logging_info=info)
    return token


def _planar_snake(lin_idx, shape, minor_dim, tile_width):
    """plgpu.planar_snake where the minor dimension is whole tiles: the same order without the remainder tile's branch,
    whose width would be a constant 0 (XLA:CPU traps on a remainder by a constant 0, even in the branch not taken;
    a GPU does not). Any order of the tiles gives the same result."""
    minor = shape[minor_dim]
    if not isinstance(minor, int) or minor % tile_width:
        return mgpu_helpers.planar_snake(lin_idx, shape, minor_dim, tile_width)
    major_size = jax.numpy.int32(shape[1 - minor_dim])
    width = jax.numpy.int32(tile_width)
    tile = jax.lax.div(lin_idx, width * major_size)
    minor_i = tile * width + jax.lax.rem(lin_idx, width)
    major_in = jax.lax.rem(jax.lax.div(lin_idx, width), major_size)
    major_i = jax.lax.select(jax.lax.rem(tile, jax.numpy.int32(2)) == 0, major_in, major_size - 1 - major_in)
    return (minor_i, major_i) if minor_dim == 0 else (major_i, minor_i)


_LOWERED = []


def enable(monkeypatch) -> None:
    """Let moe_hopper run its kernels in Mosaic GPU's interpreter here (moe_hopper.INTERPRET) for one test: the
    transposed wgmma operand, layout_cast (a register-layout hint: the identity) on CPU, the snake order above."""
    if not _LOWERED:  # a lowering rule cannot be taken back; the identity is right wherever it applies
        mlir.register_lowering(mgpu_core.layout_cast_p, lambda ctx, x, **kw: [x], platform="cpu")
        _LOWERED.append(True)
    if "device_id" in inspect.signature(gpu_callbacks.wgmma).parameters:  # jax 0.10.2's; 0.11 reads transposes
        monkeypatch.setattr(gpu_callbacks, "wgmma", _wgmma)
    monkeypatch.setattr(plgpu, "planar_snake", _planar_snake)
    monkeypatch.setattr(moe_hopper, "INTERPRET", True)


@contextlib.contextmanager
def interpreted(**params):
    """Trace the Mosaic GPU kernels called inside in the interpreter with InterpretGPUParams(**params), e.g.
    detect_races=True (then gpu_callbacks.get_races().races_found says whether two threads raced)."""
    with force_gpu_interpret_mode(InterpretGPUParams(**params)):
        yield
