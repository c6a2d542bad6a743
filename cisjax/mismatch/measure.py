"""`cisjax mismatch measure`'s library: sample on one engine (vLLM or the JAX sampler), rescore those tokens on the
other engines, write each pair."""

from __future__ import annotations

from pathlib import Path

from cisjax import errors
from cisjax import score as score_lib
from cisjax.mismatch import engines, exact_side, prompts, records, scoring, sides, write
from cisjax.mismatch import sample as sample_lib
from cisjax.mismatch import spec as spec_lib
from cisjax.mismatch.spec import ENGINES, PAIRS, MeasureSpec


def _engine_sides(servers: engines.Servers, prompt_ids, spec: MeasureSpec, vocab_size: int):
    """1. Sampling on spec.sampler (q of every token from the sampling step itself, paper C.5, and its routing), the
    probes, and the inference engines' sides, the others' by Score: (Sampled, Probes, {side name: Side})."""
    wanted = spec.sides
    sampled = sample_lib.sample(
        servers.client(spec.sampler),
        prompt_ids,
        n=spec.n,
        max_new_tokens=spec.max_new_tokens,
        stop_ids=prompts.stop_ids(spec.model),
        seed=spec.seed,
        routing=(spec.routing and spec.sampler in wanted) or "xla_replay" in wanted,
        vocab_size=vocab_size,
        engine=spec.sampler,
        top_k=spec.top_k,
        top_p=spec.top_p,
    )
    probes = sample_lib.choose_probes(sampled, spec.probe_positions, seed=spec.seed + 1, topk=bool(spec.topk))
    out = {}
    for engine in ENGINES:
        if engine in wanted:
            side = sides.sampling_side if engine == spec.sampler else sides.score_side
            out[engine] = side(engine, servers.client(engine), servers.infos[engine], sampled, probes, spec)
    return sampled, probes, out


def _xla_sides(sampled, probes, spec: MeasureSpec, score_spec: score_lib.ScoreSpec, vocab_size: int):
    """2. Rescoring by the trainer (XLA), teacher forcing on the same ids and weights, once per dtype the XLA sides
    need: ([XlaScores of each dtype], {side name: Side})."""
    wanted = spec.sides
    if spec.exact:  # the one pair xla-jax (spec.check_exact): the exact forward's value
        return [], {"xla": exact_side.exact_side(sampled, spec.model, spec.dtype)}
    out = {}
    if "xla_replay" in wanted:
        out["xla_replay"] = sides.replay_side(sampled, probes, spec, score_spec)
    scored: dict[str, scoring.XlaScores] = {}
    for name in ("xla", "xla_bf16", "xla_fp32"):
        if name not in wanted:
            continue
        dtype = spec.xla_dtype(name)
        if dtype not in scored:
            scored[dtype] = scoring.xla_scores(
                spec.model,
                dtype,
                sampled.items,
                probes.items,
                score_spec,
                top_k=spec.topk,
                twice=True,
                progress=spec.progress,
                # truncated sampling: the best 2 x top_k of every token, a margin over the support (within top_k)
                support_k=min(2 * spec.top_k, vocab_size) if spec.truncates else 0,
            )
        out[name] = sides.xla_side(scored[dtype], sampled, probes, spec)
    return list(scored.values()), out


def measure(spec: MeasureSpec, score_spec: score_lib.ScoreSpec) -> list[Path]:
    """Sample spec.n responses per prompt on spec.sampler, score the same tokens on every side the pairs need and write
    one measurement directory per pair into spec.out (records.py); the directories written."""
    hf = spec_lib.check(spec)
    vocab_size = int(hf["vocab_size"])
    prompt_ids = prompts.read_prompts(spec.prompts, spec.model, kind=spec.kind, num=spec.num_prompts, seed=spec.seed)
    bad = [i for i, p in enumerate(prompt_ids) if not all(0 <= t < vocab_size for t in p)]
    if bad:
        raise errors.UserError(f"prompt {bad[0]} has token ids outside the model's vocabulary [0, {vocab_size})")
    spec.out.mkdir(parents=True, exist_ok=True)
    engine_dir, perturbed = spec.model, None
    if spec.perturb != "none":
        engine_dir, perturbed = engines.perturbed_copy(
            spec.model, spec.out / "engine_model", kind=spec.perturb, scale=spec.perturb_scale, seed=spec.perturb_seed
        )
    servers = engines.Servers(spec, engine_dir, vocab_size)
    try:
        sampled, probes, by_name = _engine_sides(servers, prompt_ids, spec, vocab_size)
        servers.close()  # the XLA side gets the machine to itself (and its memory)
        xla, xla_by_name = _xla_sides(sampled, probes, spec, score_spec, vocab_size)
    finally:
        servers.close()
    by_name.update(xla_by_name)
    timings = {"generate_s": sampled.generate_s}
    for side in by_name.values():
        timings.update(side.timings)
    for scores in xla:
        timings.update(scores.timings)
    meta = write.run_meta(
        spec,
        hf,
        len(prompt_ids),
        sampled,
        probes,
        engines=servers.infos,
        timings=timings,
        perturbed=perturbed,
        xla=xla,
    )
    written = []
    for pair in spec.measured_pairs:
        p_name, q_name = PAIRS[pair]
        m = write.pair_measurement(pair, by_name[p_name], by_name[q_name], meta, sampled, probes, spec)
        written.append(records.save(spec.out / pair, m))
    return written
