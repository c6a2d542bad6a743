"""Achieved FLOP/s of a timed program, and its MFU against the device's documented peak (or why there is none)."""

from __future__ import annotations

import jax

from cisjax.plan import hardware


def device_kind(device=None) -> str:
    """jax's kind of `device` (default: the first device), e.g. "NVIDIA H100 80GB HBM3", "TPU v5", "cpu"."""
    return (device or jax.devices()[0]).device_kind


def peak(kind: str, dtype: str) -> dict:
    """The peak FLOP/s MFU divides by, {"peak_tflops", "peak_source"}; or {"mfu_omitted": why} for a device kind or
    dtype with no documented peak (hardware.DEVICE_PEAKS)."""
    entry = hardware.device_peak(kind)
    if entry is None:
        return dict(mfu_omitted=f"no documented peak for device kind {kind!r} (cisjax.plan.hardware.DEVICE_PEAKS)")
    flops = entry.flops(dtype)
    if flops is None:
        return dict(mfu_omitted=f"{kind}: no documented {dtype} peak ({entry.source})")
    return dict(peak_tflops=flops / 1e12, peak_source=entry.source)


def utilization(flops: float, seconds: float, ref: dict) -> dict:
    """{"tflops": achieved TFLOP/s, "mfu": fraction of the peak or None} of `flops` done in `seconds`; `ref` is
    peak()'s answer."""
    tflops = flops / seconds / 1e12
    return dict(tflops=tflops, mfu=tflops / ref["peak_tflops"] if "peak_tflops" in ref else None)


def describe(ref: dict) -> str:
    """One line: the peak used and its source, or why MFU is omitted."""
    if "peak_tflops" in ref:
        return f"MFU against {ref['peak_tflops']:.1f} TFLOP/s ({ref['peak_source']})"
    return f"MFU omitted: {ref['mfu_omitted']}"
