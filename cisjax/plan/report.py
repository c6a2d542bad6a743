"""A plan's report on the console: the headline, the HBM table, the FLOP tables, the row search, warnings and notes."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table


def gib(x) -> str:
    return "—" if x is None else f"{x / 2**30:.1f}"


def fmt_compiled(c, usable) -> str:
    """One compiled program in a log line: its bytes per chip against `usable`, or the compiler's refusal."""
    if not c.ok:
        need = f": its temporaries alone need {gib(c.oom_temporaries)} GiB" if c.oom_temporaries else ""
        return f"does not fit (the compiler refused{need}) in {c.seconds:.0f} s"
    total = c.memory["total"]
    flops = f"; XLA {c.flops / 1e12:.3g} TFLOP per chip{' (loop bodies once)' if c.has_loops else ''}"
    flops += f", jaxpr matmuls {c.jaxpr_flops / 1e12:.3g} TFLOP all chips" if c.jaxpr_flops else ""
    fit = "fits" if total <= usable else "does NOT fit"
    return f"{gib(total)} GiB per chip of {gib(usable)} ({fit}) in {c.seconds:.0f} s{flops}"


def console_log(msg: str) -> None:
    """A timestamped progress line on stderr."""
    Console(stderr=True, highlight=False).print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")


def print_report(report: dict) -> None:
    console = Console(highlight=False)
    if not console.is_terminal:  # a log file: wide enough for the tables, not cut at 80 columns
        console = Console(highlight=False, width=150)
    _print_headline(console, report)
    console.print(_memory_table(report["programs"]))
    for program, f in report.get("flops", {}).items():
        console.print(_flops_table(program, f, report["roofline"][f"{program}_s"]))
        mfu = report["roofline"].get(f"{program}_mfu_estimate")
        if mfu is not None:
            console.print(
                f"{program}: MFU estimate {100 * mfu:.1f}% (analytic FLOPs / (chips x peak x roofline time); "
                "from the compiler's cost model, not a measurement)"
            )
    if "sampler" in report:
        sp = report["sampler"]
        console.print(
            f"sampler: {sp['batch']} prompts x {sp['n']} samples, prompt {sp['prompt_len']} + {sp['new_tokens']} new "
            f"tokens (the bucket of one step's rollouts); KV cache {gib(sp['kv_cache_bytes'])} GiB over all chips"
        )
    if "offload" in report:
        o = report["offload"]
        console.print(
            f"optimizer offload: {gib(o['host_bytes_per_chip'])} GiB of host memory per chip, "
            f"{gib(o['host_bytes_per_process'])} GiB per process ({o['chips_per_process']} chips; {o['host_memory']}); "
            f"{gib(o['transfer_bytes_per_step'])} GiB over the host link per step per chip, {o['transfer_s']:.2f} s at "
            f"{o['host_link_bytes_per_s'] / 1e9:.0f} GB/s ({o['host_link_source']})"
        )
    est = report.get("estimate") or {}
    if est.get("train_step_s") is not None:
        rescore = f", rescore {est['rescore_s']:.2f} s" if est.get("rescore_s") is not None else ""
        console.print(
            f"estimated step: train step {est['train_step_s']:.2f} s{rescore} (roofline"
            f"{' + the offload round trip' if est['offload_transfer_s'] else ''}; not a measurement)"
        )
    if "search" in report:
        s = report["search"]
        if s.get("kind") == "options":
            _print_options(console, s)
        else:
            tried = ", ".join(f"{t['rows']}{'✓' if t['fits'] else '✗'}" for t in s["tried"])
            console.print(
                f"largest rows per micro-batch that fit: [bold]{s['best_rows']}[/bold] (tried {tried}) {s['note']}"
            )
    for w in report.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {w}")
    for note in report["notes"]:
        console.print(f"[dim]{note}[/dim]")


def _print_options(console: Console, s: dict) -> None:
    """--search options: each set of options tried, its memory, fit and estimated step; the smallest that fits."""
    table = Table(title="memory options (cisjax plan --search options)")
    for col in ("options", "total GiB", "host GiB", "fits", "train step s"):
        table.add_column(col, justify="left" if col == "options" else "right")
    for t in s["tried"]:
        est = t["estimate"]["train_step_s"]
        table.add_row(
            ", ".join(f"{k}={v}" for k, v in t["options"].items()) or "(the config)",
            "—" if t["total_bytes"] is None else gib(t["total_bytes"]),
            gib(t["host_bytes"]) if t["host_bytes"] else "—",
            "yes" if t["fits"] else "no",
            "—" if est is None else f"{est:.2f}",
        )
    console.print(table)
    best = s["best"]
    if best is None:
        console.print(f"[red]{s.get('note', 'no set of the options fits')}[/red]")
    else:
        console.print(
            "smallest set that fits: [bold]"
            + (", ".join(f"--config.{k}={v}" for k, v in best.items()) or "none needed")
            + "[/bold]"
        )


def _print_headline(console: Console, report: dict) -> None:
    """The model on the target, the parameters per chip, the train batch."""
    tg, mo, sh = report["target"], report["model"], report["shape"]
    console.print(
        f"[bold]{mo['architecture']}[/bold] ({mo['layers']} layers, {mo['total_params'] / 1e9:.2f}B parameters, "
        f"{mo['active_params'] / 1e9:.2f}B active; {mo['dtype']} compute, {mo['param_dtype']} master weights, "
        f"MoE dispatch {mo['moe_impl_resolved']}, attention {mo['attention_impl_resolved']}) on [bold]{tg['name']}[/bold]: {tg['chips']} x {tg['chip']} "
        f"({tg['usable_gib_per_chip']:.2f} GiB usable per chip, {tg['peak_tflops_per_chip']:.0f} TFLOP/s bf16), "
        f"mesh {report['mesh']}"
    )
    pp = report.get("params_per_chip")
    if pp:
        console.print(
            f"parameters per chip: {gib(pp['all_bytes'])} GiB, of which the routed-expert stacks "
            f"{gib(pp['expert_stacks_bytes'])} GiB (of {gib(pp['expert_stacks_total_bytes'])} GiB in all); the "
            f"expert stacks each chip computes with, all MoE layers: {gib(pp['expert_stacks_compute_bytes'])} GiB"
        )
    console.print(
        f"train batch: {sh['micro_batches']} micro-batches x {sh['rows']} rows x {sh['seq_len']} tokens "
        f"({sh['samples_per_step']} samples per step; the logprob head in {sh['head_chunks']} chunks of "
        f"{sh['head_chunk_tokens']} tokens)"
    )


_MEMORY_COLUMNS = (
    "program",
    "arguments",
    "temporaries",
    "outputs",
    "aliased",
    "total",
    "usable",
    "reserve",
    "resident",
    "fits",
    "margin",
    "compile s",
    "roofline s",
)


def _memory_table(programs: dict) -> Table:
    """HBM per chip of each compiled program, its fit and margin."""
    table = Table(title="HBM per chip (GiB)")
    for col in _MEMORY_COLUMNS:
        table.add_column(col, justify="left" if col == "program" else "right")
    for name, p in programs.items():
        mem = p.get("memory") or {}
        fits = "[green]yes[/green]" if p["fits"] else "[red]no[/red]"
        if p.get("error"):
            fits += f" (refused: temporaries {gib(p['oom_temporaries'])})" if p.get("oom_temporaries") else " (refused)"
        roof = p.get("roofline_s")
        table.add_row(
            name,
            *(gib(mem.get(k)) for k in ("arguments", "temporaries", "outputs", "aliased")),
            gib(p["total_bytes"]),
            gib(p["usable_bytes"]),
            gib(p.get("reserve_bytes", 0)),
            gib(p.get("resident_bytes", 0)),
            fits,
            gib(p["margin_bytes"]),
            f"{p['seconds']:.0f}",
            "—" if roof is None else f"{roof:.3f}",
        )
    return table


def _flops_table(program: str, f: dict, roofline_s: float) -> Table:
    """FLOPs per chip per step of one program, per layer kind: analytic, XLA's, their ratio, the roofline."""
    table = Table(title=f"{program}: FLOPs per chip per step (TFLOP)")
    for col in ("kind", "layers", "x per step", "analytic", "XLA", "XLA / analytic", "roofline s"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind, r in f["kinds"].items():
        if not r["count"]:
            continue
        xla = r["xla_flops_per_chip"]
        table.add_row(
            kind,
            str(r["count"]),
            str(r["times_per_step"]),
            f"{r['analytic_flops_per_chip'] / 1e12:.2f}",
            "—" if xla is None else f"{xla / 1e12:.2f}",
            "—" if r["ratio"] is None else f"{r['ratio']:.2f}",
            "—" if r["roofline_s"] is None else f"{r['roofline_s']:.3f}",
        )
    table.add_row(
        "total",
        "",
        "",
        f"{f['analytic_flops_per_chip'] / 1e12:.2f}",
        f"{f['xla_flops_per_chip'] / 1e12:.2f}",
        f"{f['xla_flops_per_chip'] / f['analytic_flops_per_chip']:.2f}" if f["analytic_flops_per_chip"] else "—",
        f"{roofline_s:.3f}",
    )
    return table
