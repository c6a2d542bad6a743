"""`cisjax mismatch measure`: sample with the rollout engine, rescore the same tokens on the other engines, one measurement per engine pair."""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.mismatch import records

log = logging.getLogger(__name__)

# pair -> (side p, side q): p is the training side, q the inference side (records.py). In vllm-transformers the
# transformers engine is the paper's training engine (Appendix C.5), so it is p whatever the name's order.
PAIRS = {
    "xla-vllm": ("xla", "vllm"),
    "xla-transformers": ("xla", "transformers"),
    "vllm-transformers": ("transformers", "vllm"),
    "xla_bf16-xla_fp32": ("xla_bf16", "xla_fp32"),
    # routing replay: the trainer's forward on vLLM's expert ids of every position (--replay adds it beside xla-vllm)
    "xla_replay-vllm": ("xla_replay", "vllm"),
}
PROMPT_FORMATS = """prompts (--prompts, jsonl): {"prompt_ids": [...]} lines are used as they are; {"prompt": "text"} lines are
encoded as they are (no chat template); any other row is a problem of --kind (default dapo_math_17k, e.g. the
DAPO-Math-17k rows), formatted as the trainer formats them (the tokenizer's chat template and the training instruction)."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = (p.description or "") + "\n\n" + PROMPT_FORMATS
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--out", required=True, help="output directory: one measurement directory per pair (OUT/xla-vllm, ...)"
    )
    p.add_argument("--model", default=None, help="Hugging Face model directory: the weights every engine loads")
    p.add_argument("--prompts", default=None, help="jsonl of prompts (see above)")
    p.add_argument(
        "--kind", default="dapo_math_17k", help="row layout of problem rows (cisjax.data.KINDS; default dapo_math_17k)"
    )
    p.add_argument(
        "--num-prompts", type=int, default=0, help="use a seeded random sample of this many prompts (0 = all)"
    )
    p.add_argument(
        "--pairs", default="xla-vllm", help=f"comma-separated engine pairs: {', '.join(PAIRS)} (default xla-vllm)"
    )
    p.add_argument("--n", type=int, default=8, help="samples per prompt (temperature 1, top-p 1)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the sampling, the prompt sample and the probe positions"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="XLA rescoring dtype (float32 is the control)",
    )
    p.add_argument(
        "--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the servers started here"
    )
    p.add_argument("--topk", type=int, default=0, help="also store each side's top-K at the probed positions")
    p.add_argument(
        "--probe-positions",
        type=int,
        default=0,
        help="number of token positions (seeded sample) for --topk and --routing "
        "(0: routing at every token; --topk needs it)",
    )
    p.add_argument(
        "--routing", action="store_true", help="also store the routed expert ids of every MoE layer on both sides"
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="also rescore on the XLA side with vLLM's routing of every position replayed (an MoE model): the pair "
        "xla_replay-vllm, measured beside xla-vllm; its routing, with --routing, is the XLA routers' own choice",
    )
    p.add_argument(
        "--perturb",
        default="none",
        help="controlled mismatch (cisjax.train.perturb, as the trainer's rollout.perturb): the engines started here "
        "serve a perturbed copy of --model (none | int8 | int4 | fp8 | noise) while XLA rescores with --model itself",
    )
    p.add_argument("--perturb-scale", type=float, default=0.0, help="--perturb noise: the relative rms (e.g. 0.01)")
    p.add_argument("--perturb-seed", type=int, default=0, help="--perturb noise: its seed")
    p.add_argument(
        "--server", default=None, help="a running vLLM rollout server HOST:PORT (default: start one as a child)"
    )
    p.add_argument(
        "--transformers-server",
        default=None,
        help="a running transformers rollout server HOST:PORT (default: start one when a pair needs it)",
    )
    p.add_argument("--startup-s", type=float, default=900.0, help="seconds a child server may take to start")
    p.add_argument(
        "--dump",
        default=None,
        help="also (or only) read RUN_DIR/dumps/step_*.npz of a training run into OUT/train-dump",
    )
    p.add_argument(
        "--config",
        default=None,
        help="config file for the XLA side (default configs/base.py); --config.x=y overrides follow",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def parse_pairs(text: str) -> list[str]:
    pairs = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in pairs if s not in PAIRS]
    if unknown or not pairs:
        raise errors.UserError(f"unknown engine pair(s) {unknown or [text]}; known: {', '.join(PAIRS)}")
    return list(dict.fromkeys(pairs))


# ----------------------------------------------------------------------------- prompts


def _stop_ids(model_dir) -> list[int]:
    from cisjax.data import PromptFormatter

    try:
        return list(PromptFormatter(model_dir, chat_template=False).stop_token_ids)
    except Exception as err:  # noqa: BLE001  (no tokenizer: the responses run to --max-new-tokens)
        log.warning("no stop tokens (%s)", err)
        return []


def read_prompts(path, model_dir, *, kind: str, num: int, seed: int) -> list[list[int]]:
    """Prompt token ids from `path` (PROMPT_FORMATS), a seeded sample of `num` of them when num > 0."""
    from cisjax import data

    path = Path(path)
    if not path.is_file():
        raise errors.MissingInput(f"--prompts {path}: no such file")
    rows = data.read_jsonl(str(path))
    if not rows:
        raise errors.UserError(f"{path}: no prompts")
    if num > 0 and num < len(rows):
        pick = np.sort(np.random.default_rng(seed).choice(len(rows), num, replace=False))
        rows = [rows[i] for i in pick]
    first = rows[0] if isinstance(rows[0], dict) else {}
    if "prompt_ids" in first:
        out = []
        for i, r in enumerate(rows):
            ids = r.get("prompt_ids") if isinstance(r, dict) else None
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise errors.UserError(f"{path}: prompt {i + 1}: 'prompt_ids' must be a non-empty list of token ids")
            out.append(ids)
        return out
    if isinstance(first.get("prompt"), str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.fspath(model_dir))
        texts = [r.get("prompt") if isinstance(r, dict) else None for r in rows]
        bad = [i + 1 for i, t in enumerate(texts) if not isinstance(t, str) or not t]
        if bad:
            raise errors.UserError(f"{path}: prompt(s) {bad[:5]}: 'prompt' must be a non-empty string")
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    problems = data.problems_from_rows(rows, kind=kind, where=str(path))
    return data.PromptFormatter(model_dir, instruction=data.TRAIN_INSTRUCTION).encode_batch(problems)


# ----------------------------------------------------------------------------- engines


class Servers:
    """The rollout servers of the run: given addresses, or children started here (stopped by close())."""

    def __init__(self, args, model_dir: Path, out: Path, vocab_size: int):
        self.args, self.model_dir, self.out, self.vocab_size = args, model_dir, out, vocab_size
        self.children, self.clients, self.infos = [], {}, {}
        self._export_root = None

    def client(self, backend: str):
        from cisjax.rollout import launch
        from cisjax.rollout.client import RolloutClient

        if backend in self.clients:
            return self.clients[backend]
        target = self.args.server if backend == "vllm" else self.args.transformers_server
        if target:
            client = RolloutClient(target)
            client.wait_ready(self.args.startup_s)
        else:
            if self._export_root is None:
                self._export_root = tempfile.mkdtemp(prefix="cisjax-measure-")  # no weight updates: an empty root
            server = launch.ChildServer(
                backend=backend,
                model_dir=str(self.model_dir),
                export_root=self._export_root,
                dtype=self.args.engine_dtype,
                log_path=self.out / "servers" / f"{backend}.log",
                startup_s=self.args.startup_s,
                restart=True,
            )
            self.children.append(server)
            client = RolloutClient(server.target)
            server.wait_ready(client)
        info = client.info()
        where = target or "the child server"
        if info["engine"] and backend not in info["engine"].lower():
            raise errors.UserError(f"{where} runs the {info['engine']!r} engine, expected {backend}")
        if info["vocab_size"] != self.vocab_size:
            raise errors.UserError(
                f"{where} serves a model with vocab_size {info['vocab_size']} ({info['model']}), but --model "
                f"{self.model_dir} has {self.vocab_size}: not the same model"
            )
        self.clients[backend], self.infos[backend] = client, info
        return client

    def close(self):
        for c in self.clients.values():
            c.close()
        for s in self.children:
            s.stop()
        self.children = []
        if self._export_root:
            os.rmdir(self._export_root)
            self._export_root = None


def xla_scores(model_dir, dtype: str, items, probe_items, *, cfg, top_k: int, twice: bool, progress: bool) -> dict:
    """cisjax score's engine on `items` (and top-K on the truncated `probe_items`): logprobs, routing, timings."""
    import jax

    from cisjax import score as score_lib
    from cisjax import sharding
    from cisjax.models import hf_io

    rules = sharding.rules_from_config(cfg.sharding.rules.to_dict())
    mesh = sharding.make_mesh(cfg.mesh.to_dict())
    t0 = time.monotonic()
    model, mcfg, _ = hf_io.load(
        model_dir,
        mesh=mesh,
        rules=rules,
        dtype=dtype,
        param_dtype=dtype,
        router_dtype=cfg.model.router_dtype,
        moe_impl=cfg.model.moe_impl,
        moe_tile=cfg.model.moe_tile or None,
    )
    load_s = time.monotonic() - t0
    kw = dict(
        temperature=1.0,
        chunk_size=cfg.logprobs.chunk_size,
        row_tokens=cfg.score.row_tokens,
        rows_per_call=cfg.score.rows,
        progress=progress,
    )
    results, times = _score_passes(score_lib, model, items, mesh, rules, passes=2 if twice else 1, **kw)
    out = {"results": results[0], "load_s": load_s, "score_s": times, "devices": len(jax.devices())}
    if twice:
        a = np.concatenate([np.asarray(r["logprobs"], np.float64) for r in results[0]] or [np.zeros(0)])
        b = np.concatenate([np.asarray(r["logprobs"], np.float64) for r in results[1]] or [np.zeros(0)])
        out["control_rescore_max_abs_diff"] = float(np.max(np.abs(a - b))) if a.size else 0.0
    if top_k and probe_items:
        out["probe"] = score_lib.score_items(model, probe_items, mesh, rules, top_k=top_k, **kw)
    del model
    return out


def _score_passes(
    score_lib, model, items, mesh, rules, *, passes, temperature, chunk_size, row_tokens, rows_per_call, progress
):
    """cisjax score's Scorer (the trainer forward over packed rows), compiled once and run `passes` times over the
    same rows: (results of each pass, seconds of each pass). The first pass includes compilation; the later ones
    give the steady-state throughput."""
    del progress
    scorer = score_lib.Scorer(
        model,
        mesh,
        rules,
        temperature=temperature,
        chunk_size=chunk_size,
        top_k=0,
        row_tokens=row_tokens,
        rows_per_call=rows_per_call,
    )
    prepared = scorer.prepare(items)
    all_results, times = [], []
    for _ in range(passes):
        t0 = time.monotonic()
        outs = [scorer.run(rows) for rows in prepared]  # on the host: waits for the device
        times.append(time.monotonic() - t0)
        results: list = [None] * len(items)
        scorer.collect(items, prepared, outs, results)
        all_results.append([{k: r[k] for k in ("logprobs", "routing") if k in r} for r in results])
    return all_results, times


# ----------------------------------------------------------------------------- the measurement


def _flat(per_seq, n_tokens: int, what: str) -> np.ndarray:
    arr = np.concatenate([np.asarray(x, np.float64) for x in per_seq] or [np.zeros(0)])
    if arr.shape[0] != n_tokens:
        raise RuntimeError(f"{what}: {arr.shape[0]} logprobs for {n_tokens} response tokens")
    return arr


def _routing_array(per_seq, token_index: np.ndarray, n_tokens: int, what: str) -> np.ndarray:
    """[token][layer][k] lists of every sequence -> [L, T, k] at the token indices."""
    flat = [t for seq in per_seq for t in seq]
    if len(flat) != n_tokens:
        raise RuntimeError(f"{what}: routing of {len(flat)} tokens for {n_tokens} response tokens")
    arr = np.asarray([flat[i] for i in token_index], np.int32)  # [T, L, k]
    if arr.ndim != 3:
        arr = arr.reshape(len(token_index), 0, 0)
    return np.ascontiguousarray(np.transpose(arr, (1, 0, 2))).astype(
        np.int16 if arr.size == 0 or arr.max() < 32768 else np.int32
    )


def measure(args, overrides) -> list[Path]:
    from cisjax import config as config_lib
    from cisjax.rollout.client import SamplingParams
    from cisjax.rows import Seq
    from cisjax.train import perturb as perturb_lib

    pairs = parse_pairs(args.pairs)
    if args.model is None or args.prompts is None:
        raise errors.UserError("--model and --prompts are needed to measure engine pairs (or give only --dump)")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise errors.MissingInput(f"--model {model_dir}: not a Hugging Face model directory (no config.json)")
    if args.n < 1 or args.max_new_tokens < 1:
        raise errors.UserError("--n and --max-new-tokens must be >= 1")
    if args.topk and args.probe_positions <= 0:
        raise errors.UserError("--topk needs --probe-positions N > 0 (the positions whose top-K both sides report)")
    hf = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(hf["vocab_size"])
    prompts = read_prompts(args.prompts, model_dir, kind=args.kind, num=args.num_prompts, seed=args.seed)
    bad = [i for i, p in enumerate(prompts) if not all(0 <= t < vocab_size for t in p)]
    if bad:
        raise errors.UserError(f"prompt {bad[0]} has token ids outside the model's vocabulary [0, {vocab_size})")
    cfg = config_lib.load(args.config, list(overrides or []))
    perturb_lib.check(args.perturb, args.perturb_scale)
    if args.perturb != "none" and (args.server or args.transformers_server):
        raise errors.UserError("--perturb serves a perturbed copy from the servers started here: drop --server")
    if args.replay and "xla_replay-vllm" not in pairs:
        pairs.append("xla_replay-vllm")
    replay = "xla_replay-vllm" in pairs
    sides = {s for pair in pairs for s in PAIRS[pair]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    engine_dir, perturbed = model_dir, None
    if args.perturb != "none":
        engine_dir, perturbed = _perturbed_copy(model_dir, args, out / "engine_model")
    servers = Servers(args, engine_dir, out, vocab_size)
    try:
        # 1. sampling on vLLM: q of every token from the sampling step itself (paper C.5), and its routing
        vllm = servers.client("vllm")
        params = SamplingParams(
            n=args.n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=_stop_ids(model_dir),
            seed=args.seed,
            return_routing=(args.routing and "vllm" in sides) or replay,
        )
        t0 = time.monotonic()
        samples = [s for per_prompt in vllm.generate(prompts, params) for s in per_prompt]
        timings["generate_s"] = time.monotonic() - t0
        items = [Seq(list(s.prompt_ids), list(s.response_ids)) for s in samples]
        lengths = np.asarray([len(it.response_ids) for it in items], np.int64)
        n_tokens = int(lengths.sum())
        if n_tokens == 0:
            raise RuntimeError("the engine sampled no response tokens")
        token_id = np.concatenate([np.asarray(it.response_ids, np.int64) for it in items])
        if token_id.max() >= vocab_size or token_id.min() < 0:
            raise errors.UserError(
                f"the server sampled token id {int(token_id.max())} outside --model's vocabulary [0, {vocab_size}): not the same model"
            )
        seq_id = np.repeat(np.arange(len(items)), lengths)
        position = np.concatenate([np.arange(n) for n in lengths])
        logq_vllm = _flat([s.logprobs for s in samples], n_tokens, "vllm sampling")

        # the probed positions: a seeded sample of tokens; the top-K passes score each sequence up to its last probe
        rng = np.random.default_rng(args.seed + 1)
        n_probe = min(args.probe_positions, n_tokens)
        probes = np.sort(rng.choice(n_tokens, n_probe, replace=False)) if n_probe else np.zeros(0, np.int64)
        routing_index = probes if n_probe else np.arange(n_tokens)
        last_probe: dict[int, int] = {}
        for t in probes:
            last_probe[int(seq_id[t])] = max(last_probe.get(int(seq_id[t]), 0), int(position[t]))
        probe_seqs = sorted(last_probe)
        probe_items = (
            [Seq(items[s].prompt_ids, items[s].response_ids[: last_probe[s] + 1]) for s in probe_seqs]
            if args.topk
            else []
        )

        def probe_topk(per_probe_seq):
            """Top-K lists of the truncated probe sequences -> ids, logprobs [T, K] at `probes`."""
            ids, lps = [], []
            where = {s: j for j, s in enumerate(probe_seqs)}
            for t in probes:
                rec = per_probe_seq[where[int(seq_id[t])]]
                ids.append(rec["topk_ids"][int(position[t])])
                lps.append(rec["topk_logprobs"][int(position[t])])
            return np.asarray(ids, np.int64).reshape(n_probe, -1), np.asarray(lps, np.float32).reshape(n_probe, -1)

        side = {}  # side name -> {"logp": [N], "topk": (ids, lps) | None, "routing": [L, T, k] | None, "label": str}
        if "vllm" in sides:
            side["vllm"] = {
                "logp": logq_vllm,
                "label": f"vllm/{servers.infos['vllm']['dtype']} (sampling)",
                "topk": None,
                "routing": None,
            }
            if args.topk:
                t0 = time.monotonic()
                side["vllm"]["topk"] = probe_topk(
                    vllm.score([(it.prompt_ids, it.response_ids) for it in probe_items], logprobs=args.topk)
                )
                timings["vllm_topk_s"] = time.monotonic() - t0
            if args.routing:
                side["vllm"]["routing"] = _routing_array(
                    [[] if s.routing is None else s.routing for s in samples], routing_index, n_tokens, "vllm sampling"
                )
        if "transformers" in sides:
            hfc = servers.client("transformers")
            t0 = time.monotonic()
            res = hfc.score([(it.prompt_ids, it.response_ids) for it in items], routing=args.routing)
            timings["transformers_score_s"] = time.monotonic() - t0
            side["transformers"] = {
                "logp": _flat([r["logprobs"] for r in res], n_tokens, "transformers Score"),
                "label": f"transformers/{servers.infos['transformers']['dtype']} (Score)",
                "topk": None,
                "routing": None,
            }
            if args.topk:
                side["transformers"]["topk"] = probe_topk(
                    hfc.score([(it.prompt_ids, it.response_ids) for it in probe_items], logprobs=args.topk)
                )
            if args.routing:
                side["transformers"]["routing"] = _routing_array(
                    [r.get("routing", []) for r in res], routing_index, n_tokens, "transformers Score"
                )
        servers.close()  # the XLA side gets the machine to itself (and its memory)

        # 2. rescoring by the trainer (XLA), teacher forcing on the same ids and weights
        if replay:
            side["xla_replay"] = _replay_side(model_dir, samples, items, cfg, args, n_tokens, routing_index, timings)
        xla_dtypes = {"xla": args.dtype, "xla_bf16": "bfloat16", "xla_fp32": "float32"}
        scored: dict[str, dict] = {}
        control = {}
        for name in ("xla", "xla_bf16", "xla_fp32"):
            if name not in sides:
                continue
            dtype = xla_dtypes[name]
            if dtype not in scored:
                scored[dtype] = xla_scores(
                    model_dir,
                    dtype,
                    items,
                    probe_items,
                    cfg=cfg,
                    top_k=args.topk,
                    twice=True,
                    progress=not args.no_progress,
                )
                control[dtype] = scored[dtype]["control_rescore_max_abs_diff"]
                timings[f"xla_{dtype}_load_s"] = scored[dtype]["load_s"]
                timings[f"xla_{dtype}_score_s"] = scored[dtype]["score_s"][0]
                timings[f"xla_{dtype}_rescore_s"] = scored[dtype]["score_s"][1]
            r = scored[dtype]
            res = r["results"]
            side[name] = {
                "logp": _flat([x["logprobs"] for x in res], n_tokens, f"XLA {dtype}"),
                "label": f"xla/{dtype}",
                "topk": None,
                "routing": None,
            }
            if args.topk:
                side[name]["topk"] = probe_topk(r["probe"])
            if args.routing:
                if "routing" not in res[0]:
                    raise errors.UserError(
                        f"--routing: {model_dir} is not a mixture-of-experts model (the XLA model reports no routing)"
                    )
                side[name]["routing"] = _routing_array(
                    [x["routing"] for x in res], routing_index, n_tokens, f"XLA {dtype}"
                )
    finally:
        servers.close()

    # 3. one measurement per pair
    total_tokens = int(sum(len(it) for it in items))
    base_meta = {
        "model": str(model_dir.resolve()),
        "vocab_size": vocab_size,
        "architecture": (hf.get("architectures") or [None])[0],
        "n": args.n,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "prompts_file": str(args.prompts),
        "sequences": len(items),
        "tokens": n_tokens,
        # controlled mismatch: the engines served a perturbed copy of "model" (XLA rescored with "model" itself)
        "perturb": perturbed,
        "seed": args.seed,
        "probe_seed": args.seed + 1,
        "probe_positions": int(n_probe),
        "topk": args.topk,
        "xla_dtype": args.dtype,
        "engine_dtypes": {k: v["dtype"] for k, v in servers.infos.items()},
        "engines": servers.infos,
        "timings": {k: round(v, 3) for k, v in timings.items()},
        "finish_reasons": _count(s.finish_reason for s in samples),
    }
    for dtype, r in scored.items():
        best = r["score_s"][-1]  # the last pass runs compiled code: the steady-state throughput
        base_meta[f"xla_{dtype}_rescore_tokens_per_s"] = n_tokens / best
        base_meta[f"xla_{dtype}_rescore_all_tokens_per_s"] = (
            total_tokens / best
        )  # prompt + response, what a forward computes
        base_meta["xla_devices"] = r["devices"]
    written = []
    for pair in pairs:
        p_name, q_name = PAIRS[pair]
        p, q = side[p_name], side[q_name]
        logp = np.minimum(p["logp"], 0.0)  # float rounding can give +1e-7 for a certain token; a probability is <= 1
        logq = np.minimum(q["logp"], 0.0)
        k = np.exp(logp - logq)
        meta = dict(
            base_meta,
            pair=pair,
            side_p=p["label"],
            side_q=q["label"],
            mean_k=float(np.mean(k)),
            mean_abs_log_k=float(np.mean(np.abs(logp - logq))),
            max_abs_log_k=float(np.max(np.abs(logp - logq))),
        )
        if p_name == "xla_replay":
            # where the XLA routers' own top-k set differs from vLLM's (the routes replay overrode), per (token, layer)
            meta["routing_replay"] = True
            meta["router_flip_frac"] = p["router_flip_frac"]
        xla_dtype = xla_dtypes.get(p_name)
        meta["control_rescore_max_abs_diff"] = control[xla_dtype] if xla_dtype else None
        if xla_dtype:
            meta["control_rescore_dtype"] = xla_dtype
        tokens = {"logp": logp, "logq": logq, "seq_id": seq_id, "position": position, "token_id": token_id}
        topk = None
        if args.topk:
            topk = {
                "token_index": probes.astype(np.int64),
                "ids_p": p["topk"][0],
                "logp_p": p["topk"][1],
                "ids_q": q["topk"][0],
                "logp_q": q["topk"][1],
            }
        routing = None
        if args.routing:
            routing = {
                "token_index": routing_index.astype(np.int64),
                "experts_p": p["routing"],
                "experts_q": q["routing"],
            }
            meta["routing_agreement"] = (
                float(np.mean(np.sort(p["routing"], -1) == np.sort(q["routing"], -1))) if p["routing"].size else None
            )
        written.append(
            records.save(out / pair, records.Measurement(meta=meta, tokens=tokens, topk=topk, routing=routing))
        )
    return written


def _perturbed_copy(model_dir: Path, args, root: Path) -> tuple[Path, dict]:
    """--perturb: --model loaded by cisjax, perturbed (cisjax.train.perturb) and saved in its own dtype as root/v000000,
    the model directory the engines start on; with the settings and the relative rms change."""
    import flax.nnx as nnx

    from cisjax.models import hf_io
    from cisjax.train import perturb as perturb_lib

    model, _, hf = hf_io.load(model_dir)
    graphdef, params = nnx.split(model)
    kw = dict(kind=args.perturb, scale=args.perturb_scale, seed=args.perturb_seed)
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    path, rel = perturb_lib.export_copy(graphdef, params, hf, root, **kw, dtype=dtype, source="measure")
    info = dict(**kw, rel_rms=rel)
    log.info("--perturb: the engines serve %s (relative rms change %.3g)", path, rel)
    return path, info


def _replay_side(model_dir, samples, items, cfg, args, n_tokens, routing_index, timings) -> dict:
    """The XLA side with vLLM's routing replayed (cisjax.models.moe): the same items, each carrying the engine's expert
    ids of every position (the prompt's from the prefill). Its "routing" is the XLA routers' own choice, so N_flip in
    the report counts where replay overrode them."""
    from cisjax.rows import Seq

    replayed = []
    for i, (s, it) in enumerate(zip(samples, items)):
        if getattr(s, "routing", None) is None or getattr(s, "prompt_routing", None) is None:
            raise errors.UserError(f"--replay: the vLLM server returned no routing for sample {i} (an MoE model?)")
        ids = np.concatenate([np.asarray(s.prompt_routing), np.asarray(s.routing)])
        replayed.append(Seq(it.prompt_ids, it.response_ids, routing=ids))
    r = xla_scores(model_dir, args.dtype, replayed, [], cfg=cfg, top_k=0, twice=False, progress=not args.no_progress)
    timings[f"xla_replay_{args.dtype}_score_s"] = r["score_s"][0]
    res = r["results"]
    out = {
        "logp": _flat([x["logprobs"] for x in res], n_tokens, f"XLA {args.dtype} replay"),
        "label": f"xla/{args.dtype} + vLLM routing replayed",
        "topk": None,
        "routing": None,
    }
    if "routing" not in res[0]:
        raise errors.UserError(f"--replay: {model_dir} is not a mixture-of-experts model (no routing to replay)")
    own = _routing_array([x["routing"] for x in res], np.arange(n_tokens), n_tokens, "XLA replay")
    engine = _routing_array([s.routing for s in samples], np.arange(n_tokens), n_tokens, "vllm sampling")
    out["router_flip_frac"] = float(np.mean(np.any(np.sort(own, -1) != np.sort(engine, -1), axis=-1)))
    if args.routing:
        out["routing"] = own[:, routing_index]
    return out


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


# ----------------------------------------------------------------------------- the trainer's token dumps


def read_dumps(run_dir) -> records.Measurement:
    """RUN_DIR/dumps/step_*.npz (metrics.write_dump) as one measurement: p = the proximal (XLA) logprob, q = the sampling
    one; phase 0/1/2 = the step's tercile among the dumps; seq_id numbers the (step, batch row) pairs; position is the
    token's column in the trainer's batch row (the dump has no response-relative index); token_id is -1 (not dumped)."""
    import re

    run_dir = Path(run_dir)
    files = [
        f for f in (run_dir / "dumps").glob("step_*.npz") if re.fullmatch(r"step_\d+", f.stem)
    ]  # not the .tmp ones
    files.sort(key=lambda f: int(f.stem.split("_")[1]))
    if not files:
        raise errors.MissingInput(
            f"--dump {run_dir}: no dumps/step_*.npz there (the trainer writes them every run.dump_every steps)"
        )
    steps = [int(f.stem.split("_")[1]) for f in files]
    phase_of = {s: min(2, 3 * i // len(steps)) for i, s in enumerate(steps)}
    cols = {k: [] for k in ("logp", "logq", "seq_id", "position", "phase", "staleness")}
    next_seq = 0
    for f, step in zip(files, steps):
        with np.load(f) as z:
            for key in ("logp_infer", "logp_prox"):
                if key not in z.files:
                    raise errors.UserError(f"{f}: not a token dump (no {key!r})")
            n = z["logp_infer"].shape[0]
            rows = z["row"] if "row" in z.files else np.arange(n)
            uniq, inv = np.unique(rows, return_inverse=True)
            cols["seq_id"].append(next_seq + inv)
            next_seq += len(uniq)
            cols["logp"].append(z["logp_prox"].astype(np.float64))
            cols["logq"].append(z["logp_infer"].astype(np.float64))
            cols["position"].append(z["position"] if "position" in z.files else np.full(n, -1))
            cols["phase"].append(np.full(n, phase_of[step]))
            if "rollout_version" in z.files and "current_version" in z.files:
                cols["staleness"].append(z["current_version"] - z["rollout_version"])
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    n = cat["logp"].shape[0]
    logp, logq = np.minimum(cat["logp"], 0.0), np.minimum(cat["logq"], 0.0)
    meta = {
        "pair": "train-dump",
        "side_p": "xla (proximal)",
        "side_q": "vllm (sampling)",
        "run_dir": str(run_dir.resolve()),
        "steps": steps,
        "phase_steps": {
            name: [s for s in steps if phase_of[s] == i] for i, name in enumerate(("early", "middle", "late"))
        },
        "tokens": int(n),
        "mean_k": float(np.mean(np.exp(logp - logq))) if n else None,
        "staleness_mean": float(np.mean(cat["staleness"])) if cat["staleness"].size else None,
        "token_id": "not in the dumps: -1",
        "position": "column in the trainer's batch row",
    }
    tokens = {
        "logp": logp,
        "logq": logq,
        "seq_id": cat["seq_id"],
        "position": cat["position"],
        "token_id": np.full(n, -1),
        "phase": cat["phase"],
    }
    return records.Measurement(meta=meta, tokens=tokens)


def run(args: argparse.Namespace, overrides=()) -> int:
    if args.dump is None and args.prompts is None:
        raise errors.UserError(
            "give --prompts (and --model) to measure engine pairs, or --dump RUN_DIR to read a run's token dumps"
        )
    written = []
    if args.prompts is not None or args.model is not None:
        written += measure(args, overrides)
    elif overrides:
        raise errors.UserError(f"--dump alone takes no --config overrides: {list(overrides)}")
    if args.dump is not None:
        written.append(records.save(Path(args.out) / "train-dump", read_dumps(args.dump)))
    for d in written:
        m = records.load(d)
        print(f"{m.meta['pair']}: {m.n_tokens} tokens, mean k {m.meta.get('mean_k')} -> {d}")
    return 0
