"""The GPU check's verdicts against issue 26's targets and its printed tables, from the check's JSON alone."""

from __future__ import annotations

from rich.markup import escape

from cisjax.bench import harness

# Issue 26's acceptance: the default MoE impl's layer at most 1.5x the dense MLP of equal active FLOPs at every paper
# shape; the train step of the cut at 8,192 tokens at least 40% MFU and 3x transformers' grouped_mm step.
TARGETS = dict(moe_ratio_max=1.5, step_mfu_min=0.40, vs_torch_min=3.0)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def summary(res: dict) -> dict:
    """The headline figures and whether each target is met (None where the check did not measure it)."""
    secs, env = res["sections"], res.get("env", {})
    ex = secs.get("exactness")
    out = dict(
        targets=TARGETS,
        device_kind=env.get("device_kind"),
        exactness=dict(ok=None if ex is None else bool(ex.get("ok", False)), failures=(ex or {}).get("failures", [])),
    )
    default = env.get("moe_default")
    layer = {}
    for name, shape in secs.get("moe_layer", {}).get("shapes", {}).items():
        row = shape["impls"].get(default, {})
        ratio = row.get("moe", {}).get("ratio")
        layer[name] = dict(impl=default, ratio=ratio, met=None if ratio is None else ratio <= TARGETS["moe_ratio_max"])
    out["moe_layer"] = layer
    # the Hopper kernels' blocks in the MoE layer and train step sections: the sweep's, when it ran before them
    for name in ("moe_layer", "train_step"):
        tuned = secs.get(name, {}).get("tuned_blocks")
        out.setdefault("blocks", {})[name] = (
            f"the sweep's ({len(tuned)} {'entry' if len(tuned) == 1 else 'entries'})" if tuned else "as shipped"
        )
    steps, torch = secs.get("train_step", {}), secs.get("torch_step", {})
    first = [k for k in steps if k.startswith(f"{default}@")]
    head = steps.get(first[0], {}) if first else {}
    mfu = head.get("mfu")
    fastest = next((v for k, v in torch.items() if k.startswith("fastest@") and isinstance(v, dict)), {})
    speedup = None
    if head.get("tokens_per_s") and fastest.get("tokens_per_s") and head.get("tokens") == fastest.get("tokens"):
        speedup = head["tokens_per_s"] / fastest["tokens_per_s"]
    out["train_step"] = dict(
        impl=default,
        tokens=head.get("tokens"),
        mfu=mfu,
        mfu_met=None if mfu is None else mfu >= TARGETS["step_mfu_min"],
        vs_torch=speedup,
        torch_experts=fastest.get("experts"),
        vs_torch_met=None if speedup is None else speedup >= TARGETS["vs_torch_min"],
        fits={k: v.get("status") for k, v in steps.items() if isinstance(v, dict) and k.startswith(f"{default}@")},
    )
    if "tune" in secs:
        tune = secs["tune"]
        out["tune"] = dict(
            skipped=tune.get("skipped"),
            speedup_over_rule={
                k: (c.get("best") or {}).get("speedup_over_rule") for k, c in tune.get("calls", {}).items()
            },
            blocks_entries=tune.get("table", []),
        )
    return out


def _exactness_rows(ex: dict):
    for kind in ("moe", "attention"):
        for impl, row in ex.get(kind, {}).items():
            cells = [f"{kind} {impl}"]
            for dtype in ("float32", "bfloat16"):
                r = row.get(dtype, {})
                if "worst" in r:
                    verdict = "ok" if r["ok"] else "[red]FAIL[/]"
                    cells.append(f"{r['worst']:.2e} {verdict}")
                else:
                    cells.append(escape(str(r.get("skipped") or r.get("error") or "-")[:60]))
            yield cells


def _layer_rows(layer: dict):
    for name, shape in layer.get("shapes", {}).items():
        for impl, row in shape["impls"].items():
            m, d = row.get("moe", {}), row.get("dense_mlp", {})
            yield (
                f"{name} ({shape['E']}, {shape['k']}, {shape['F']})",
                impl,
                _num(d.get("ms"), ".2f"),
                _num(d.get("tflops"), ".3g"),
                _num(m.get("ms"), ".2f"),
                _num(m.get("tflops"), ".3g"),
                _num(m.get("ratio"), ".2f"),
                _pct(m.get("mfu")),
                row.get("status", "?")
                if row.get("status") != "skipped"
                else escape(f"skipped: {row.get('reason', '')[:40]}"),
            )


def _step_rows(steps: dict):
    for key, r in steps.items():
        if not isinstance(r, dict) or "status" not in r:
            continue
        yield (
            key,
            _num(r.get("tokens") or (r.get("rows", 0) * r.get("seq", 0)), "d"),
            _num(r.get("median_s"), ".3f"),
            _num(r.get("tokens_per_s"), ",.0f"),
            _pct(r.get("mfu")),
            _num(r.get("peak_gib"), ".1f"),
            _num(r.get("first_call_s"), ".1f"),
            r["status"] if r["status"] != "skipped" else escape(f"skipped: {r.get('reason', '')[:40]}"),
        )


def _tune_rows(tune: dict):
    for key, c in tune.get("calls", {}).items():
        rule = c["candidates"][0] if c["candidates"] else {}
        best = c.get("best") or {}
        tried = [r for r in c["candidates"] if r.get("status") != "skipped"]
        yield (
            f"{key} ({c['rows_in_groups']:,} rows, {c['groups']} groups)",
            str(tuple(c["rule"])),
            _num(rule.get("ms"), ".3f"),
            _num(rule.get("tflops"), ".0f"),
            str(tuple(best["blocks"])) if best else "-",
            _num(best.get("ms"), ".3f"),
            _num(best.get("tflops"), ".0f"),
            _num(best.get("speedup_over_rule"), ".2f"),
            f"{len(tried)} / {sum(r.get('status') == 'error' for r in tried)} / {sum(r.get('agrees') is False for r in tried)}",
        )


def show(res: dict) -> None:
    """The check as tables on the console: exactness, the block sweep, the MoE layer, the train step (JAX, torch), the
    verdicts (the sections' order)."""
    console = harness.console(150)
    env, secs, s = res.get("env", {}), res["sections"], res["summary"]
    v = env.get("versions", {})
    console.print(
        f"GPU check ({res['size']}): {env.get('device_kind')} (compute capability {env.get('compute_capability')}), "
        f"{env.get('backend')} x {env.get('devices')}; jax {v.get('jax')}, torch {v.get('torch')}, transformers "
        f"{v.get('transformers')}; {res['seconds']:.0f} s of a {res['budget_s']:.0f} s budget"
    )
    if env.get("run", {}).get("status", "ok") != "ok":
        console.print(f"[red]the environment probe {env['run']['status']}[/]\n{escape(env['run'].get('log_tail', ''))}")
    if "exactness" in secs:
        ex = secs["exactness"]
        note = (
            f"max |got - ref| / max |ref| of the output and every gradient against float64; bounds {ex.get('bounds')}"
        )
        rows = list(_exactness_rows(ex))
        console.print(harness.table("exactness", ("kernel", "fp32", "bf16"), rows, note))
    if "tune" in secs:
        tune = secs["tune"]
        if tune.get("skipped"):
            console.print(f"[yellow]tune: skipped[/] {escape(tune['skipped'])}")
        else:
            cols = ("call", "rule", "rule ms", "TF/s", "best", "best ms", "TF/s", "x rule", "tried / errors / disagree")
            note = "blocks: (block_m, block_n, block_k, stages, grid_block_n); bf16; moe_hopper.BLOCKS entries below"
            console.print(harness.table("Hopper grouped-matmul block sweep", cols, list(_tune_rows(tune)), note))
            for line in tune.get("table", []):
                console.print(escape(line), soft_wrap=True)
    if "moe_layer" in secs:
        layer = secs["moe_layer"]
        title = f"MoE layer fwd+bwd, {layer.get('tokens')} tokens, hidden {layer.get('hidden')}, bf16"
        cols = ("shape (E, k, F)", "impl", "dense ms", "dense TF/s", "moe ms", "moe TF/s", "x dense", "MFU", "status")
        note = (
            f"MFU against {layer.get('peak_tflops')} TFLOP/s" if layer.get("peak_tflops") else layer.get("mfu_omitted")
        )
        note = f"{note}; Hopper kernel blocks: {s.get('blocks', {}).get('moe_layer', 'as shipped')}"
        console.print(harness.table(title, cols, list(_layer_rows(layer)), note))
    cols = ("impl@rows x seq", "tokens", "median s", "tokens/s", "MFU", "peak GiB", "first s", "status")
    for name in ("train_step", "torch_step"):
        if name in secs:
            note = (
                f"Hopper kernel blocks: {s.get('blocks', {}).get(name, 'as shipped')}" if name == "train_step" else None
            )
            console.print(harness.table(name.replace("_", " "), cols, list(_step_rows(secs[name])), note))
    t = s["train_step"]
    console.print(
        f"targets: exactness {s['exactness']['ok']}; MoE layer <= {TARGETS['moe_ratio_max']}x dense: "
        f"{ {k: (None if r['ratio'] is None else round(r['ratio'], 2), r['met']) for k, r in s['moe_layer'].items()} }; "
        f"step MFU {_pct(t['mfu'])} (>= {TARGETS['step_mfu_min']:.0%}: {t['mfu_met']}); vs torch {t['torch_experts']} "
        f"{_num(t['vs_torch'], '.2f')}x (>= {TARGETS['vs_torch_min']}x: {t['vs_torch_met']}); fits: {t['fits']}"
    )
    for name, sec in secs.items():
        rows = {k: v for k, v in sec.items() if isinstance(v, dict) and "@" in k}
        rows.update(
            {f"{shape} {impl}": r for shape, v in sec.get("shapes", {}).items() for impl, r in v["impls"].items()}
        )
        for key, r in rows.items():
            if r.get("status") in ("error", "oom"):
                console.print(f"[red]{name} {key}: {r['status']}:[/] {escape(r.get('error', '')[:300])}")
        for part in sec.get("skipped_parts", []):
            console.print(f"[yellow]{name}: skipped[/] {escape(str(part['plan']))}: {part['reason']}")
        for run in sec.get("runs", []):
            if run["status"] != "ok":
                console.print(f"[red]{name}: a part {run['status']}[/]\n{escape(run.get('log_tail', '')[-800:])}")
