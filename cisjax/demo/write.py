"""The demo's directory written: the task's files, the tokenizer and tiny model, the warm-up, warmup.json."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cisjax import errors
from cisjax.data import TRAIN_INSTRUCTION, PromptFormatter, load_problems
from cisjax.demo.model import write_random_model
from cisjax.demo.task import BOXED_FRACTION, make_task, response_text, split_heldout, write_jsonl
from cisjax.demo.tokenizer import CHARS, IM_END, SPECIALS, build_tokenizer, check_tokenizer
from cisjax.demo.warmup import warmup, warmup_config


@dataclass(frozen=True)
class Splits:
    """The task's rows by file: train, heldout (the RL phase's prompts), and heldout again as rl + test (both empty
    without a test part)."""

    train: list[dict]
    heldout: list[dict]
    rl: list[dict]
    test: list[dict]


@dataclass(frozen=True)
class ModelFacts:
    """What prepare reports of the model it wrote: its HF config and the lengths its prompts and responses take."""

    hf: dict  # the config.json fields (model_config)
    vocab: int  # tokens of the tokenizer
    prompt_tokens: int  # a held-out prompt's length
    response_tokens_max: int  # the longest target response, either closing style, with its <|im_end|>


def prepare(
    out,
    *,
    seed: int = 0,
    warmup_steps: int = 800,
    batch_size: int = 64,
    heldout: int = 512,
    test: int | None = None,
    eval_size: int = 256,
    boxed_fraction: float = BOXED_FRACTION,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    log=print,
) -> int:
    """Write `out`/data/{train,heldout,rl,test}.jsonl, `out`/model (tokenizer and tiny Qwen2-MoE, warmed up for
    `warmup_steps` steps unless 0) and `out`/warmup.json (the summary): `cisjax demo prepare`."""
    check_args(test, warmup_steps, batch_size, eval_size, boxed_fraction)
    cfg = warmup_config(config_file, overrides, warmup_steps)  # config errors before anything is written
    t0 = time.monotonic()
    out = Path(out)
    splits = write_task(out / "data", seed, heldout, heldout // 4 if test is None else test, log)
    model = write_model(out / "model", seed, splits.heldout, log)
    summary = dict(
        seed=seed,
        train_problems=len(splits.train),
        heldout_problems=len(splits.heldout),
        rl_problems=len(splits.rl),
        test_problems=len(splits.test),
        vocab=model.vocab,
        prompt_tokens=model.prompt_tokens,
        response_tokens_max=model.response_tokens_max,
        boxed_fraction=boxed_fraction,
        model=model.hf,
    )
    if warmup_steps:
        summary.update(
            warmup(
                out / "model",
                splits.train,
                splits.heldout,
                cfg,
                steps=warmup_steps,
                batch_size=batch_size,
                seed=seed,
                eval_size=eval_size,
                boxed_fraction=boxed_fraction,
                log=log,
            )
        )
    summary["total_s"] = time.monotonic() - t0
    (out / "warmup.json").write_text(json.dumps(summary, indent=1))
    log(f"[demo] prepared {out} in {summary['total_s']:.0f} s (summary: {out / 'warmup.json'})")
    return 0


def check_args(test: int | None, warmup_steps: int, batch_size: int, eval_size: int, boxed_fraction: float) -> None:
    """Raise a UserError naming the flag of a value out of range."""
    if test is not None and test < 0:
        raise errors.UserError(f"--test={test}: must be >= 0 (0 = no rl/test files)")
    if warmup_steps < 0 or batch_size < 1 or eval_size < 0:
        raise errors.UserError("--warmup-steps and --eval-size must be >= 0, --batch-size >= 1")
    if not 0.0 < boxed_fraction <= 1.0:
        raise errors.UserError(
            f"--boxed-fraction={boxed_fraction}: must lie in (0, 1] (0 would leave nothing to reward)"
        )


def write_task(data_dir: Path, seed: int, heldout: int, test: int, log) -> Splits:
    """The task's train and held-out files in `data_dir`, and with `test` > 0 the held-out ones again as rl.jsonl +
    test.jsonl; each read back as the RL loop reads it."""
    train_rows, held_rows = make_task(seed, heldout)
    write_jsonl(data_dir / "train.jsonl", train_rows)
    write_jsonl(data_dir / "heldout.jsonl", held_rows)
    rl_rows, test_rows = split_heldout(seed, heldout, test) if test else ([], [])
    names = ["train", "heldout"]
    if test:
        write_jsonl(data_dir / "rl.jsonl", rl_rows)
        write_jsonl(data_dir / "test.jsonl", test_rows)
        names += ["rl", "test"]
    for name in names:  # the RL loop's reader accepts them
        load_problems(data_dir, name)
    log(
        f"[demo] task: {len(train_rows)} train and {len(held_rows)} held-out problems (disjoint) in {data_dir}"
        + (f"; the held-out ones also as rl.jsonl ({len(rl_rows)}) + test.jsonl ({len(test_rows)})" if test else "")
    )
    return Splits(train_rows, held_rows, rl_rows, test_rows)


def write_model(model_dir: Path, seed: int, held_rows: Sequence[dict], log) -> ModelFacts:
    """The character tokenizer and a randomly initialised tiny Qwen2-MoE in `model_dir`, the tokenizer's round trip
    checked on a held-out prompt and response."""
    tokenizer = build_tokenizer()
    hf_kwargs = write_random_model(model_dir, tokenizer, seed)
    formatter = PromptFormatter(model_dir, instruction=TRAIN_INSTRUCTION)
    sample = held_rows[0]
    check_tokenizer(
        formatter.tokenizer,
        [formatter.text(sample["question"]) + response_text(sample) + IM_END, CHARS, "".join(SPECIALS)],
    )
    prompt_len = len(formatter.encode(sample["question"]))
    # the RL phase's max_new_tokens must cover the longest target response and its <|im_end|>
    response_max = max(
        len(formatter.tokenizer.encode(response_text(r, boxed), add_special_tokens=False)) + 1
        for r in held_rows
        for boxed in (True, False)
    )
    log(
        f"[demo] model: tiny Qwen2-MoE ({hf_kwargs['num_hidden_layers']} layers, hidden {hf_kwargs['hidden_size']}, "
        f"{hf_kwargs['num_experts']} experts top-{hf_kwargs['num_experts_per_tok']}), vocab {len(tokenizer)} "
        f"(characters), prompts of {prompt_len} tokens, target responses of at most {response_max}, in {model_dir}"
    )
    return ModelFacts(hf_kwargs, len(tokenizer), prompt_len, response_max)
