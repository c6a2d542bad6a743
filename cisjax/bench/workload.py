"""The rollout benches' workload and results: random token-id prompts, the sampling parameters, what was asked for, and
tokens/s rows against a baseline."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from rich.console import Console

from cisjax.bench import harness, tiny_model
from cisjax.rollout.params import SamplingParams

# the flags of the workload that must be positive
COUNT_FLAGS = ("prompts", "prompt_len", "n", "max_new_tokens")
# the config.json fields a rollout bench records (its table's title reads them)
MODEL_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size")


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """--prompts random token-id prompts (seeded by --seed), their lengths drawn from [--prompt-len / 2, --prompt-len]."""
    rng = np.random.default_rng(args.seed)
    lo = max(1, args.prompt_len // 2)
    return [rng.integers(0, vocab, int(rng.integers(lo, args.prompt_len + 1))).tolist() for _ in range(args.prompts)]


def add_lengths(group: argparse._ActionsContainer) -> None:
    """--lengths: every sample at --max-new-tokens, or lengths that vary from sample to sample (stop tokens)."""
    group.add_argument(
        "--lengths",
        default="fixed",
        choices=("fixed", "varied"),
        help="fixed: EOS is ignored, every sample has --max-new-tokens; varied: the random model's last "
        f"{tiny_model.STOP_TOKENS} tokens are stop tokens, likelier than the rest, so samples end after about half "
        "of --max-new-tokens on average, from a few tokens to all of them (RL's responses; a batch's rows end at "
        "different steps) (default: %(default)s)",
    )


def stop_ids(args: argparse.Namespace) -> list[int]:
    """The stop tokens of --lengths varied (none for fixed): the vocabulary's last tiny_model.STOP_TOKENS."""
    if getattr(args, "lengths", "fixed") == "fixed":
        return []
    return list(range(args.vocab - tiny_model.STOP_TOKENS, args.vocab))


def stop_hazard(args: argparse.Namespace) -> float:
    """The chance per token of a stop token that --lengths varied builds the random model for: a mean length of half
    --max-new-tokens."""
    return 2.0 / args.max_new_tokens


def sampling(args: argparse.Namespace) -> tuple[SamplingParams, SamplingParams]:
    """(the timed calls' sampling parameters, the untimed warm-up's: the same with at most 2 new tokens)."""
    stops = stop_ids(args)
    timed = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop_token_ids=stops,
    )
    warm = dataclasses.replace(timed, max_new_tokens=min(2, args.max_new_tokens))
    return timed, warm


def requests(args: argparse.Namespace, prompt_ids: list[list[int]]) -> dict:
    """What one call asks for: prompts, samples, prompt tokens and new tokens (at most, with stop tokens)."""
    return dict(
        prompts=len(prompt_ids),
        samples=len(prompt_ids) * args.n,
        prompt_tokens=sum(map(len, prompt_ids)),
        new_tokens=len(prompt_ids) * args.n * args.max_new_tokens,
        stop_token_ids=stop_ids(args),
    )


def model(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict]:
    """(the model directory, its config.json): --model-dir, else a random model saved under `tmp` in --dtype, long
    enough for the workload (its stop tokens likelier with --lengths varied)."""
    if args.model_dir:
        model_dir = Path(args.model_dir)
        return model_dir, json.loads((model_dir / "config.json").read_text())
    hf = tiny_model.save_random(
        args,
        tmp / "model",
        max_positions=max(128, args.prompt_len + args.max_new_tokens),
        dtype=args.dtype,
        stop_hazard=stop_hazard(args) if args.lengths == "varied" else 0.0,
    )
    return tmp / "model", hf


def model_info(hf: dict, keys: tuple[str, ...]) -> dict:
    """The named fields of the model's config.json."""
    return {k: hf.get(k) for k in keys}


def title(res: dict) -> str:
    """'random <arch> hidden ..., <dtype>; N prompts x n=S x M new tokens' of a rollout bench's results."""
    m, r, c = res["model"], res["requests"], res["config"]
    arch = m["architectures"][0] if m.get("architectures") else "?"
    return (
        f"random {arch} hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_experts']} experts "
        f"top-{m['num_experts_per_tok']}, vocab {m['vocab_size']}, {c['dtype']}; "
        f"{r['prompts']} prompts x n={c['n']} x "
        + (
            f"up to {c['max_new_tokens']} new tokens (stop tokens)"
            if r.get("stop_token_ids")
            else f"{c['max_new_tokens']} new tokens"
        )
    )


def tokens(samples_per_prompt) -> int:
    """Generated tokens of [prompt][sample] -> (token ids, ...)."""
    return sum(len(t) for per_prompt in samples_per_prompt for t, _ in per_prompt)


def lengths(samples_per_prompt) -> dict:
    """The samples' numbers of new tokens, of [prompt][sample] -> (token ids, ...): mean, min, max."""
    n = [len(t) for per_prompt in samples_per_prompt for t, _ in per_prompt]
    return dict(mean=sum(n) / len(n), min=min(n), max=max(n))


def same_samples(a, b) -> dict:
    """How many samples of two [prompt][sample] -> (token ids, ...) results are the same token for token, of how many
    compared (the same per-sample seeds on both sides)."""
    pairs = [(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)]
    return dict(identical_samples=sum(list(x[0]) == list(y[0]) for x, y in pairs), compared_samples=len(pairs))


def throughput_rows(
    times: harness.Timings, names: dict[str, str], token_counts: dict[str, int], base: str, *, paired_base: bool
) -> list[dict]:
    """A row per candidate: median and min seconds, tokens/s and its ratio to `base`'s, and the paired ratio (each
    round against base's call of the same round; for base itself too with paired_base)."""
    base_tps = token_counts[base] / times.median(base)
    rows = []
    for k in times.wall_s:
        med = times.median(k)
        row = dict(
            candidate=names[k],
            key=k,
            median_s=med,
            min_s=times.min(k),
            tokens=token_counts[k],
            tokens_per_s=token_counts[k] / med,
            ratio=token_counts[k] / med / base_tps,
        )
        if paired_base or k != base:
            row["ratio_paired"] = token_counts[k] / token_counts[base] * times.paired(base, k)
        rows.append(row)
    return rows


def print_table(title: str, rows: list[dict], base_label: str, extra: dict, caption: str) -> Console:
    """The rows as a table, printed: candidate, median s, min s, tokens, tokens/s, the ratio to the baseline, paired,
    and `extra` columns (name -> (row key, format)), blank where a row lacks the key. Returns the console."""

    def cell(row, key, fmt):
        return fmt.format(row[key]) if key in row else ""

    columns = ("candidate", "median s", "min s", "tokens", "tokens/s", base_label, "paired", *extra)
    cells = [
        (
            row["candidate"],
            f"{row['median_s']:.3f}",
            f"{row['min_s']:.3f}",
            str(row["tokens"]),
            f"{row['tokens_per_s']:.0f}",
            f"{row['ratio']:.2f}x",
            cell(row, "ratio_paired", "{:.2f}x"),
            *(cell(row, key, fmt) for key, fmt in extra.values()),
        )
        for row in rows
    ]
    console = harness.console(150)
    console.print(harness.table(title, columns, cells, caption))
    return console
