"""FLOPs and roofline per layer kind: the loop-free one-layer programs scaled to the step, against the analytic count."""

from __future__ import annotations

from cisjax.plan import flops as flops_lib
from cisjax.plan.programs import Compiled


def layer_costs_report(progs, target, shape, log) -> dict:
    """Per layer kind: XLA's FLOPs and bytes (loop-free programs) scaled to the step, the analytic count, their
    ratio, and the roofline time; the train step's and the rescoring's roofline and the MFU estimate."""
    m, b, t = shape["micro_batches"], shape["rows"], shape["seq_len"]
    chips, chip = target.chips, target.chip
    counts = flops_lib.layer_counts(progs.model)
    forward = flops_lib.forward_flops(progs.model, b, t)
    analytic = {"train_step": flops_lib.train_flops(forward, m), "rescore": flops_lib.rescore_flops(forward, m)}
    parts = {}
    for backward, program in ((False, "rescore"), (True, "train_step")):
        log(f"compiling one-layer programs ({'forward + backward' if backward else 'forward'}) ...")
        kinds = progs.layer_parts(b, t, backward=backward)
        kinds["head"] = progs.head_part(b, t, backward=backward)
        parts[program] = kinds
    # the step's head: its forward loop, then its backward loop
    parts["train_step"]["head"] = _sum_programs("head_fwd_bwd", parts["rescore"]["head"], parts["train_step"]["head"])
    log("compiling the optimizer update ...")
    optimizer = progs.optimizer_part()

    out = {"flops": {}, "roofline": {}, "layer_programs": {}}
    for program, kinds in parts.items():
        rows = {}
        total_s = 0.0
        for kind, c in kinds.items():
            times = m * (shape["head_chunks"] if kind == "head" else counts[kind])
            rows[kind] = _kind_row(c, counts[kind], times, analytic[program][kind] / chips, chip)
            total_s += rows[kind]["roofline_s"] or 0.0
            out["layer_programs"][f"{program}/{kind}"] = c.as_dict()
            if c.has_loops:
                out.setdefault("warnings", []).append(f"{c.name} holds a loop: its cost figures undercount")
        if program == "train_step":
            rows["optimizer"] = _optimizer_row(optimizer, chip)
            total_s += rows["optimizer"]["roofline_s"] or 0.0
            out["layer_programs"]["train_step/optimizer"] = optimizer.as_dict()
        ana_total = sum(analytic[program].values()) / chips
        out["flops"][program] = dict(
            kinds=rows,
            analytic_flops_per_chip=ana_total,
            xla_flops_per_chip=sum(r["xla_flops_per_chip"] or 0.0 for r in rows.values()),
        )
        out["roofline"][f"{program}_s"] = total_s
        out["roofline"][f"{program}_mfu_estimate"] = ana_total / (chip.peak_flops * total_s) if total_s else None
    return out


def roofline(c: Compiled, chip) -> float:
    """Seconds at the chip's peak FLOP/s or HBM bandwidth, whichever binds; parts run one after the other."""
    if c.parts:
        return sum(roofline(x, chip) for x in c.parts)
    return max(c.flops / chip.peak_flops, c.bytes / chip.hbm_bandwidth)


def _kind_row(c: Compiled, count: int, times: int, analytic: float, chip) -> dict:
    """One row of a FLOP table: a layer kind's program run `times` per step, against `analytic` FLOPs per chip."""
    xla = c.flops * times if c.ok else None
    return dict(
        count=count,
        times_per_step=times,
        analytic_flops_per_chip=analytic,
        xla_flops_per_chip=xla,
        ratio=(xla / analytic) if xla is not None and analytic else None,
        roofline_s=roofline(c, chip) * times if c.ok else None,
        bytes_per_chip=c.bytes * times if c.ok else None,
    )


def _optimizer_row(c: Compiled, chip) -> dict:
    """The AdamW update's row: once per step, XLA's figures alone (no analytic count)."""
    return dict(
        count=1,
        times_per_step=1,
        analytic_flops_per_chip=0.0,
        xla_flops_per_chip=c.flops,
        ratio=None,
        roofline_s=roofline(c, chip) if c.ok else None,
        bytes_per_chip=c.bytes,
    )


def _sum_programs(name, a, b):
    """Two programs run one after the other, as one row: costs added, the roofline of each added."""
    if not (a.ok and b.ok):
        return a if not a.ok else b
    return Compiled(
        name,
        a.seconds + b.seconds,
        flops=a.flops + b.flops,
        bytes=a.bytes + b.bytes,
        has_loops=a.has_loops or b.has_loops,
        parts=[a, b],
    )
