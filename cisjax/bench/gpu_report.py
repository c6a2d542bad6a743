"""The GPU check's verdicts against the GPU issues' targets and its printed tables, from the check's JSON alone."""

from __future__ import annotations

from rich.markup import escape

from cisjax.bench import gpu_parts, gpu_torch_generate, harness

# The GPU issues' acceptance figures. Issue 47 (MoE on Hopper): the default impl's MoE layer against the dense MLP of
# equal active FLOPs at 8,192 tokens (per shape) and at 16,384 (all three); the step at 8 x 2,048 tokens at least 40%
# MFU and 3x transformers' grouped_mm step. Issue 45 (the sampler): decode at batch 64 at least half the memory
# roofline and 3x transformers' generate. Issue 46 (this check): the loop learns, both loop paths run, the check fits.
# At --size small the same targets are read at the toy's shapes (the layer's first token count, the second step shape,
# the first sampler batch): the verdicts' plumbing is checked on a CPU, the figures mean nothing there.
LAYER_MAX = (  # per token count of gpu_parts.LAYER_TOKENS, in order
    {"qwen15_moe": 1.4, "deepseek_v2_lite": 1.4, "qwen3_30b_a3b": 1.6},
    {"qwen15_moe": 1.25, "deepseek_v2_lite": 1.25, "qwen3_30b_a3b": 1.25},
)
STEP_MFU_MIN, VS_TORCH_MIN = 0.40, 3.0
DECODE_ROOFLINE_MIN, DECODE_VS_TORCH_MIN = 0.50, 3.0


def _headline(size: str) -> dict:
    """The shapes the targets are read at: the step's (8 x 2,048), the sampler batch's (64 sequences), the layer's
    token counts."""
    prompts, n = gpu_torch_generate.WORKLOAD[size]["batches"][0]
    return dict(
        step=gpu_parts.STEP_TOKENS[size][1],
        batch=gpu_torch_generate.batch_key(prompts, n),
        layer=gpu_parts.LAYER_TOKENS[size],
    )


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _target(issue: int, name: str, goal: str, value, met, why: str | None = None) -> dict:
    verdict = "not measured" if met is None else ("met" if met else "missed")
    return dict(issue=issue, name=name, goal=goal, value=value, verdict=verdict, why=why)


def _absent(res: dict, section: str) -> str:
    """Why a section has no figures: deferred by the budget, not asked for, or how its part ended."""
    if section in res.get("deferred", {}):
        return f"deferred by the budget ({res['deferred'][section]})"
    sec = res["sections"].get(section)
    if sec is None:
        return "section not run (not in --only)"
    bad = [r["status"] for r in sec.get("runs", []) if r.get("status") != "ok"]
    return f"its part {bad[0]}" if bad else "not in its results"


def _loop_targets(res: dict) -> list[dict]:
    loop = res["sections"].get("loop")
    stages = (loop or {}).get("stages", {})
    out = []
    colo = stages.get("colocated", {})
    learn = colo.get("run", {}).get("learning", {})
    why = None if colo else _absent(res, "loop")
    if res.get("size") == "small":  # a few toy steps: the verdict belongs to the full size
        learn = dict(learn, met=None)
        why = "small size: the learning verdict belongs to the full size's 64 steps"
    elif colo and learn.get("met") is None:
        why = f"{colo.get('status')}; {colo.get('run', {}).get('steps', 0)} steps: fewer than two windows"
    value = None if learn.get("first") is None else f"{learn['first']:.3f} -> {learn['last']:.3f}"
    goal = f"last {learn.get('window', 16)} steps' reward >= first's + {learn.get('margin', 0.1)}"
    out.append(_target(46, "loop learns (colocated JAX sampler)", goal, value, learn.get("met"), why))
    for stage, name in (("colocated", "loop: cisjax train, colocated"), ("gpu_local", "loop: gpu_local.sh")):
        st = stages.get(stage)
        if st is None:
            out.append(_target(46, name, "runs end to end", None, None, _absent(res, "loop")))
            continue
        run = st.get("run", {})
        canary = run.get("canary", {}).get("checked", 0)
        ok = st.get("status") == "ok" and run.get("steps", 0) > 0 and (stage != "gpu_local" or canary > 0)
        value = f"{st.get('status')}: {run.get('steps', 0)} steps, {canary} canaries"
        out.append(_target(46, name, "runs end to end (publish and canary pass)", value, ok))
    out.append(_exact_target(res, stages.get("exact")))
    return out


def _exact_target(res: dict, st: dict | None) -> dict:
    """Issue 49 on the hardware: rollout.exact's run has every sampled token's q equal to the step's p, bit for bit,
    at every step (train/exact_frac 1.0)."""
    name, goal = "loop: rollout.exact, q == p", "train/exact_frac = 1 at every step"
    if st is None:
        return _target(49, name, goal, None, None, _absent(res, "loop"))
    run = st.get("run", {})
    fracs = [f for f in run.get("exact_frac", []) if f is not None]
    if st.get("status") != "ok" or not fracs:
        return _target(49, name, goal, None, None, f"{st.get('status')}; {len(fracs)} steps logged exact_frac")
    value = f"min {min(fracs):.6f} over {len(fracs)} steps, max |log k| {run.get('abs_logk_max')}"
    return _target(49, name, goal, value, all(f == 1.0 for f in fracs))


def _sampler_targets(res: dict) -> list[dict]:
    sam = res["sections"].get("sampler")
    jax_side = ((sam or {}).get("jax") or {}).get("batches", {})
    torch_side = ((sam or {}).get("torch") or {}).get("batches", {})
    batch = _headline(res.get("size", "full"))["batch"]
    row = jax_side.get(batch, {})
    frac = row.get("decode_roofline")
    why = None if sam else _absent(res, "sampler")
    if sam and frac is None:
        why = row.get("decode_roofline_omitted") or row.get("reason") or f"batch {batch} not measured"
    out = [
        _target(
            45, f"decode roofline at {batch} rows", f">= {DECODE_ROOFLINE_MIN:.0%} of the memory roofline",
            frac, None if frac is None else frac >= DECODE_ROOFLINE_MIN, why,
        )
    ]  # fmt: skip
    # end to end on both sides (prefill and decode of the same rows, prompt and new tokens)
    mine, theirs = row.get("generate_tokens_per_s"), torch_side.get(batch, {}).get("tokens_per_s")
    ratio = mine / theirs if mine and theirs else None
    why = None if ratio is not None else (why or "transformers' generate not measured at that batch")
    goal = f">= {DECODE_VS_TORCH_MIN}x transformers' generate (tokens/s)"
    met = None if ratio is None else ratio >= DECODE_VS_TORCH_MIN
    out.append(_target(45, f"sampler vs transformers at {batch} rows", goal, ratio, met, why))
    return out


def _kernel_targets(res: dict, default: str | None) -> list[dict]:
    secs = res["sections"]
    out = []
    ex = secs.get("exactness")
    ok = None if ex is None else ex.get("ok")
    value = None if ex is None else f"{len(ex.get('failures', []))} failures"
    why = _absent(res, "exactness") if ok is None else None
    out.append(_target(47, "exactness", "every kernel within its bound against float64", value, ok, why))
    shapes = secs.get("moe_layer", {}).get("shapes", {})
    head = _headline(res.get("size", "full"))
    for tokens, bounds in zip(head["layer"], LAYER_MAX):
        for shape, bound in bounds.items():
            unit = shapes.get(f"{shape}@{tokens}", {}).get("impls", {}).get(default, {})
            ratio = unit.get("moe", {}).get("ratio")
            why = None if ratio is not None else (unit.get("reason") or unit.get("error") or _absent(res, "moe_layer"))
            met = None if ratio is None else ratio <= bound
            out.append(_target(47, f"MoE layer {shape} at {tokens}", f"<= {bound}x the dense MLP", ratio, met, why))
    steps, torch = secs.get("train_step", {}), secs.get("torch_step", {})
    rows, seq = head["step"]
    key = f"{default}@{rows}x{seq}"
    head = steps.get(key, {}) if isinstance(steps.get(key), dict) else {}
    mfu = head.get("mfu")
    why = (
        None
        if mfu is not None
        else (head.get("mfu_omitted") or head.get("error") or head.get("reason") or _absent(res, "train_step"))
    )
    met = None if mfu is None else mfu >= STEP_MFU_MIN
    out.append(_target(47, f"train step MFU at {key}", f">= {STEP_MFU_MIN:.0%}", mfu, met, why))
    ref = torch.get(f"fastest@{rows}x{seq}", {})
    ratio = None
    if head.get("tokens_per_s") and isinstance(ref, dict) and ref.get("tokens_per_s"):
        ratio = head["tokens_per_s"] / ref["tokens_per_s"]
    why = None if ratio is not None else (why or ref.get("error") or _absent(res, "torch_step"))
    goal = f">= {VS_TORCH_MIN}x transformers' {ref.get('experts') or 'grouped_mm'} step"
    met = None if ratio is None else ratio >= VS_TORCH_MIN
    out.append(_target(47, f"train step vs transformers at {key}", goal, ratio, met, why))
    return out


def summary(res: dict) -> dict:
    """Every target of the GPU issues with met / missed / not measured (and why), the headline figures, the Hopper
    kernels' blocks, the budget: estimated against measured seconds per section."""
    secs, env = res["sections"], res.get("env", {})
    default = env.get("moe_default")
    ex = secs.get("exactness")
    out = dict(
        device_kind=env.get("device_kind"),
        exactness=dict(ok=None if ex is None else ex.get("ok"), failures=(ex or {}).get("failures", [])),
    )
    targets = _loop_targets(res) + _sampler_targets(res) + _kernel_targets(res, default)
    within = not res.get("deferred") and res.get("seconds", 0.0) <= res.get("budget_s", 0.0)
    value = (
        f"{res.get('seconds', 0.0):.0f} s of {res.get('budget_s', 0.0):.0f}; deferred: {list(res.get('deferred', {}))}"
    )
    targets.append(_target(46, "the check fits its budget", "every section run within BUDGET_S", value, within))
    out["targets"] = targets
    out["budget"] = {name: dict(estimate_s=s.get("estimate_s"), seconds=s.get("seconds")) for name, s in secs.items()}
    # the Hopper kernels' blocks in the MoE layer and train step sections: the sweep's, when it ran before them
    for name in ("moe_layer", "train_step"):
        tuned = secs.get(name, {}).get("tuned_blocks")
        out.setdefault("blocks", {})[name] = (
            f"the sweep's ({len(tuned)} {'entry' if len(tuned) == 1 else 'entries'})" if tuned else "as shipped"
        )
    if "tune" in secs:
        tune = secs["tune"]
        out["tune"] = dict(
            skipped=tune.get("skipped"),
            speedup_over_rule={
                k: (c.get("best") or {}).get("speedup_over_rule") for k, c in tune.get("calls", {}).items()
            },
            ws_speedup_over_rule={
                k: (c.get("best_ws") or {}).get("speedup_over_rule") for k, c in tune.get("calls", {}).items()
            },
            blocks_entries=tune.get("table", []),
            fused_speedup_over_jax={k: r.get("speedup_over_jax") for k, r in tune.get("fused", {}).items()},
        )
    return out


# ----------------------------------------------------------------------------- the tables


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
                f"{shape.get('shape', name)} ({shape['E']}, {shape['k']}, {shape['F']}) x {shape.get('tokens', '?')}",
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


# the train step tables: the live arrays before the compile (the state), the compiler's total on the device, the peak
STEP_COLUMNS = ("impl@rows x seq", "tokens", "median s", "tokens/s", "MFU", "state GiB", "compiled GiB", "peak GiB")
STEP_COLUMNS += ("first s", "status")


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
            _num((r.get("memory_split") or {}).get("live_before_gib"), ".1f"),
            _num(((r.get("memory_split") or {}).get("compiled_gib") or {}).get("total"), ".1f"),
            _num(r.get("peak_gib"), ".1f"),
            _num(r.get("first_call_s"), ".1f"),
            r["status"] if r["status"] != "skipped" else escape(f"skipped: {r.get('reason', '')[:40]}"),
        )


TUNE_COLUMNS = ("call", "rule", "rule ms", "TF/s", "best", "best ms", "TF/s", "x rule", "mgpu_ws TF/s")
TUNE_COLUMNS += ("tried / errors / disagree",)
TUNE_NOTE = (
    "blocks: (block_m, block_n, block_k, stages, grid_block_n); mgpu_ws: the best of ragged_ws's tiles (the JSON's "
    "best_ws) and its speed-up over the rule; bf16; moe_hopper.BLOCKS entries below"
)


FUSED_COLUMNS = ("call", "ms", "TF/s", "JAX's calls ms", "x JAX", "status")
FUSED_NOTE = (
    "swiglu_ws with routing weights, default tiles; JAX's calls: the rule's ms of what each replaces in mgpu's layer "
    "(gate_up: two forward gate/up calls; down_grad: dh's input-gradient call), this run's; bf16"
)


def _show_tune(console, tune: dict) -> None:
    """The sweep's tables: per call, the BLOCKS lines, and the fused calls against the JAX calls they replace."""
    if tune.get("skipped"):
        console.print(f"[yellow]tune: skipped[/] {escape(tune['skipped'])}")
        return
    console.print(harness.table("Hopper grouped-matmul block sweep", TUNE_COLUMNS, list(_tune_rows(tune)), TUNE_NOTE))
    for line in tune.get("table", []):
        console.print(escape(line), soft_wrap=True)
    if tune.get("fused"):
        rows = list(_fused_rows(tune["fused"]))
        console.print(harness.table("mgpu_ws's fused calls", FUSED_COLUMNS, rows, FUSED_NOTE))


def _fused_rows(fused: dict):
    for key, r in fused.items():
        yield (
            key,
            _num(r.get("ms"), ".3f"),
            _num(r.get("tflops"), ".0f"),
            _num(r.get("jax_ms"), ".3f"),
            _num(r.get("speedup_over_jax"), ".2f"),
            r["status"] if r["status"] != "skipped" else escape(f"skipped: {r.get('reason', '')}"),
        )


def _tune_rows(tune: dict):
    for key, c in tune.get("calls", {}).items():
        rule = c["candidates"][0] if c["candidates"] else {}
        best, ws = c.get("best") or {}, c.get("best_ws") or {}
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
            f"{ws['tflops']:.0f} ({ws['speedup_over_rule']:.2f}x)" if ws else "-",
            f"{len(tried)} / {sum(r.get('status') == 'error' for r in tried)} / {sum(r.get('agrees') is False for r in tried)}",
        )


def _loop_rows(loop: dict):
    for name, st in loop.get("stages", {}).items():
        run = st.get("run", {})
        learn, phases = run.get("learning", {}), run.get("phases", {})

        def med(phase, phases=phases):
            return _num(phases.get(phase, {}).get("median_s"), ".2f")

        rewards = "-" if learn.get("first") is None else f"{learn['first']:.2f} -> {learn['last']:.2f}"
        yield (
            name,
            st.get("status", "?") if st.get("status") != "skipped" else escape(f"skipped: {st.get('reason', '')}"),
            _num(st.get("seconds"), ".0f"),
            _num(run.get("steps"), "d"),
            rewards,
            med("generate"),
            med("train"),
            med("publish"),
            med("eval"),
            med("step"),
            _num(run.get("peak_gib"), ".2f"),
            _num(run.get("canary", {}).get("mean_abs_max"), ".3f"),
            _num(min((f for f in run.get("exact_frac", []) if f is not None), default=None), ".6f"),
        )


def _sampler_rows(sam: dict):
    torch_side = (sam.get("torch") or {}).get("batches", {})
    for batch, r in (sam.get("jax") or {}).get("batches", {}).items():
        theirs = torch_side.get(batch, {}).get("tokens_per_s")
        yield (
            batch,
            _num(r.get("prefill_tokens_per_s"), ",.0f"),
            _num(r.get("decode_tokens_per_s"), ",.0f"),
            _pct(r.get("decode_roofline")),
            _num(r.get("generate_tokens_per_s"), ",.0f"),
            _num(theirs, ",.0f"),
            _num(r.get("peak_gib"), ".1f"),
            r.get("status", "?"),
        )


def _target_rows(targets: list[dict]):
    colour = {"met": "green", "missed": "red", "not measured": "yellow"}
    for t in targets:
        v = t["value"]
        shown = f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else str(v))
        why = escape(str(t.get("why") or "")[:70])
        yield (f"#{t['issue']} {t['name']}", t["goal"], shown, f"[{colour[t['verdict']]}]{t['verdict']}[/]", why)


def show(res: dict) -> None:
    """The check as tables on the console, in the sections' order, then the targets and the budget."""
    console = harness.console(160)
    env, secs, s = res.get("env", {}), res["sections"], res["summary"]
    v = env.get("versions", {})
    console.print(
        f"GPU check ({res['size']}): {env.get('device_kind')} (compute capability {env.get('compute_capability')}), "
        f"{env.get('backend')} x {env.get('devices')}; jax {v.get('jax')}, torch {v.get('torch')}, transformers "
        f"{v.get('transformers')}; {res['seconds']:.0f} s of a {res['budget_s']:.0f} s budget"
    )
    if env.get("run", {}).get("status", "ok") != "ok":
        console.print(f"[red]the environment probe {env['run']['status']}[/]\n{escape(env['run'].get('log_tail', ''))}")
    if "loop" in secs:
        cols = ("stage", "status", "s", "steps", "reward", "gen s", "train s", "publish s", "eval s", "step s")
        cols += ("peak GiB", "canary |d|", "q == p (min)")
        note = "phases: median seconds over the steps after the first (which compiles); reward: first -> last window; "
        note += "q == p: the least train/exact_frac of a step (1 under rollout.exact)"
        console.print(harness.table("the RL loop on the device", cols, list(_loop_rows(secs["loop"])), note))
    if "sampler" in secs:
        cols = ("rows", "prefill tok/s", "decode tok/s", "decode roofline", "generate tok/s", "transformers tok/s")
        cols += ("peak GiB", "status")
        agree = (secs["sampler"].get("jax") or {}).get("agreement", {})
        note = "; ".join(
            f"{dt}: |log k| mean {a['mean_abs_log_k']:.2e} max {a['max_abs_log_k']:.2e}"
            for dt, a in agree.items()
            if a.get("mean_abs_log_k") is not None
        )
        console.print(harness.table("the JAX sampler", cols, list(_sampler_rows(secs["sampler"])), note or None))
    if "exactness" in secs:
        ex = secs["exactness"]
        note = (
            f"max |got - ref| / max |ref| of the output and every gradient against float64; bounds {ex.get('bounds')}"
        )
        rows = list(_exactness_rows(ex))
        console.print(harness.table("exactness", ("kernel", "fp32", "bf16"), rows, note))
    if "tune" in secs:
        _show_tune(console, secs["tune"])
    if "moe_layer" in secs:
        layer = secs["moe_layer"]
        title = f"MoE layer fwd+bwd, hidden {layer.get('hidden')}, bf16"
        cols = ("shape (E, k, F) x tokens", "impl", "dense ms", "dense TF/s", "moe ms", "moe TF/s", "x dense", "MFU")
        cols += ("status",)
        note = (
            f"MFU against {layer.get('peak_tflops')} TFLOP/s" if layer.get("peak_tflops") else layer.get("mfu_omitted")
        )
        note = f"{note}; Hopper kernel blocks: {s.get('blocks', {}).get('moe_layer', 'as shipped')}"
        console.print(harness.table(title, cols, list(_layer_rows(layer)), note))
    cols = STEP_COLUMNS
    for name in ("train_step", "torch_step"):
        if name in secs:
            note = (
                f"Hopper kernel blocks: {s.get('blocks', {}).get(name, 'as shipped')}" if name == "train_step" else None
            )
            console.print(harness.table(name.replace("_", " "), cols, list(_step_rows(secs[name])), note))
    cols = ("target", "goal", "value", "verdict", "why")
    console.print(harness.table("targets of the GPU issues", cols, list(_target_rows(s["targets"]))))
    budget = [
        (name, _num(b["estimate_s"], ".0f"), _num(b["seconds"], ".0f")) for name, b in s.get("budget", {}).items()
    ]
    console.print(harness.table("budget", ("section", "estimated s", "measured s"), budget))
    for name, sec in secs.items():
        rows = {k: v for k, v in sec.items() if isinstance(v, dict) and "@" in k}
        rows.update(
            {f"{shape} {impl}": r for shape, v in sec.get("shapes", {}).items() for impl, r in v["impls"].items()}
        )
        for key, r in rows.items():
            if r.get("status") in ("error", "oom"):
                console.print(f"[red]{name} {key}: {r['status']}:[/] {escape(r.get('error', '')[:300])}")
        for run in sec.get("runs", []):
            if run["status"] != "ok":
                console.print(f"[red]{name}: a part {run['status']}[/]\n{escape(run.get('log_tail', '')[-800:])}")
