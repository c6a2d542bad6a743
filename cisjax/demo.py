"""`cisjax demo prepare`: the offline demo's learnable start — synthetic arithmetic, a character tokenizer, a tiny Qwen2-MoE and its supervised warm-up."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.data import TRAIN_INSTRUCTION

# ----------------------------------------------------------------------------- the synthetic task
#
# "What is 23 + 45?" / "What is 71 - 38?": two-digit operands (10..99); subtraction only with a >= b
# (answers 0..89), addition answers 20..198. The worked solution goes column by column, units first, the carry
# or borrow written out ("7 + 5 = 12, 2 + 4 + 1 = 7"); a problem's "answer" is GSM8K-shaped (solution, then
# "#### 72") so that cisjax.data.load_problems(DIR/data, split) reads it like GSM8K. The warm-up's target
# response is the solution then the boxed result ("7 + 5 = 12, 2 + 4 + 1 = 7, \boxed{72}"), then <|im_end|>.

LOW, HIGH = 10, 99  # operands
# Share of warm-up targets closing with \boxed{} (the rest: "so the answer is N", reward 0). The warm-up model then
# follows the prompt's boxing instruction only this often at temperature 1: what RL has to learn first.
BOXED_FRACTION = 0.3


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def solution(a: int, op: str, b: int) -> str:
    """The column-by-column working: units (with the carry / borrow), then tens."""
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        units, carry = a0 + b0, a0 + b0 >= 10
        return f"{a0} + {b0} = {units}, {a1} + {b1}{' + 1' if carry else ''} = {a1 + b1 + carry}"
    borrow = a0 < b0
    return f"{a0 + 10 * borrow} - {b0} = {a0 + 10 * borrow - b0}, {a1} - {b1}{' - 1' if borrow else ''} = {a1 - b1 - borrow}"


def problem_row(a: int, op: str, b: int) -> dict:
    """One GSM8K-format line: {"question", "answer"}, the answer the worked solution then "#### <n>"."""
    return {"question": f"What is {a} {op} {b}?", "answer": f"{solution(a, op, b)}\n#### {solve(a, op, b)}"}


def response_text(row: dict, boxed: bool = True) -> str:
    """The warm-up's target response for a row (before the end-of-turn token): its solution, then the result —
    boxed as the instruction asks, or (boxed=False) in the plain closing "so the answer is 72", which the reward,
    math-verify on the last \\boxed{}, scores 0."""
    from cisjax.rl.rewards import normalize_reference

    work = row["answer"].rsplit("####", 1)[0].strip()
    answer = normalize_reference(row["answer"])
    end = f"\\boxed{{{answer}}}" if boxed else f"so the answer is {answer}"
    return f"{work}, {end}" if work else end


def _groups() -> list[list[tuple[int, str, int]]]:
    """Every problem of the task, grouped so that a + b and b + a fall in the same split (a held-out problem's
    commuted twin is never trained on)."""
    groups = []
    for a in range(LOW, HIGH + 1):
        for b in range(LOW, a + 1):
            groups.append([(a, "+", b)] + ([(b, "+", a)] if a != b else []))
            groups.append([(a, "-", b)])
    return groups


def _held_groups(seed: int, heldout: int) -> tuple[list, list]:
    """(held-out groups in the order drawn, training groups): whole groups (see _groups) are drawn in a seeded order
    for the held-out set until it has `heldout` problems; every other group is training."""
    groups = _groups()
    total = sum(len(g) for g in groups)
    if not 0 < heldout < total:
        raise errors.UserError(f"heldout={heldout}: must lie in 1..{total - 1}")
    held, train, count = [], [], 0
    for k in np.random.default_rng(seed).permutation(len(groups)):
        if count < heldout:
            held.append(groups[k])
            count += len(groups[k])
        else:
            train.append(groups[k])
    return held, train


def make_task(seed: int = 0, heldout: int = 512) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), disjoint, deterministic from `seed`: whole groups (see _held_groups), each
    split's problems in a seeded order."""
    held_groups, train_groups = _held_groups(seed, heldout)
    held = [p for g in held_groups for p in g]
    train = [p for g in train_groups for p in g]
    rng = np.random.default_rng([seed, 1])
    held = [held[i] for i in rng.permutation(len(held))]
    train = [train[i] for i in rng.permutation(len(train))]
    return [problem_row(*p) for p in train], [problem_row(*p) for p in held]


def split_heldout(seed: int = 0, heldout: int = 512, test: int = 128) -> tuple[list[dict], list[dict]]:
    """make_task's held-out rows in two disjoint parts, (rl, test), each in the held-out file's order: the last
    groups drawn for the held-out set, until they hold `test` problems, are the test part. A sweep trains on `rl`
    and evaluates on `test`, problems neither the warm-up nor the RL phase saw (a + b and b + a stay together)."""
    held_groups, _ = _held_groups(seed, heldout)
    count = sum(len(g) for g in held_groups)
    if not 0 < test < count:
        raise errors.UserError(f"test={test}: must lie in 1..{count - 1} (the held-out problems)")
    tested = set()
    for g in reversed(held_groups):
        if len(tested) >= test:
            break
        tested.update(problem_row(*p)["question"] for p in g)
    _, held = make_task(seed, heldout)
    return [r for r in held if r["question"] not in tested], [r for r in held if r["question"] in tested]


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the tokenizer

ENDOFTEXT, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END, UNK)
# One token per character: the line break and printable ASCII (every character of the prompts and
# answers, and of any English question of the same kind); anything else encodes as <unk>.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
# ChatML as in Qwen's templates, without Qwen2's default system message (shorter prompts for a CPU demo).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer():
    """A character-level tokenizer (transformers.PreTrainedTokenizerFast over a `tokenizers` WordLevel model):
    ids 0..95 the characters of CHARS, then <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos), <unk>."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(CHARS)}
    vocab.update({tok: len(CHARS) + i for i, tok in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a piece
    tok.decoder = decoders.Fuse()  # pieces joined as they are (no spaces added)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def check_tokenizer(tokenizer, texts: Sequence[str]) -> None:
    """Raise unless decode(encode(t)) == t for every text (special tokens kept)."""
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != text:
            raise RuntimeError(f"tokenizer round trip changed {text!r} into {back!r}")


# ----------------------------------------------------------------------------- the model

MAX_POSITIONS = 512  # prompt (~90 tokens) + response, with room for the RL phase's max_new_tokens


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """A tiny Qwen1.5-MoE layout within vLLM's CPU constraints: hidden and expert sizes multiples of 32, head_dim 32
    (2 heads, 1 kv head), 8 experts top-2 plus the sigmoid-gated shared expert, untied head."""
    return dict(
        architectures=["Qwen2MoeForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def write_random_model(out: Path, tokenizer, seed: int) -> dict:
    """A randomly initialised transformers Qwen2MoeForCausalLM (fp32) and the tokenizer, saved in `out`."""
    import torch
    import transformers

    kwargs = model_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kwargs)).eval()
    model.to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return kwargs


# ----------------------------------------------------------------------------- supervised rows


def warmup_config(config_file: str | None = None, overrides: Sequence[str] = (), steps: int = 600):
    """The train config of a warm-up of `steps` steps: configs/base.py (or `config_file`), then the warm-up's own
    fields, then `overrides` (--config.x=y) on top."""
    from cisjax import config as config_lib

    cfg = config_lib.load(config_file)
    cfg.correction.method = "none"  # weight 1
    cfg.train.precision = "fp32"
    cfg.train.lr = 3e-3
    cfg.train.weight_decay = 0.0
    cfg.train.grad_clip = 1.0
    cfg.train.eps = 1e-8
    cfg.train.schedule = "cosine"
    cfg.train.warmup_steps = min(20, max(steps - 1, 0))
    cfg.train.total_steps = max(steps, 1)
    cfg.train.final_lr_ratio = 0.1
    cfg.train.micro_batches = 1
    cfg.logprobs.temperature = 1.0
    return config_lib.apply_overrides(cfg, overrides)


def sft_arrays(formatter, rows: Sequence[dict], length: int | None = None, boxed: bool = True) -> dict:
    """Prompt + target response of every row (response_text(row, boxed)) as left-aligned [N, T] arrays (TrainBatch
    layout: position t holds tokens[t] and predicts targets[t]); loss_mask on the positions predicting the response
    and its <|im_end|>."""
    from cisjax import rows as rows_lib

    im_end = formatter.tokenizer.convert_tokens_to_ids(IM_END)
    seqs = [
        rows_lib.Seq(
            formatter.encode(row["question"]),
            formatter.tokenizer.encode(response_text(row, boxed), add_special_tokens=False) + [im_end],
        )
        for row in rows
    ]
    longest = max(s.positions for s in seqs)
    t = length or longest
    if t < longest:
        raise ValueError(f"length={t} < the longest sequence ({longest} positions)")
    built = rows_lib.build(seqs, rows_lib.one_per_row(len(seqs)), t)
    return dict(
        tokens=built.tokens_RxT,
        targets=built.targets_RxT,
        positions=built.positions_RxT,
        segments=built.segments_RxT,
        mask=built.response_RxT,
    )


def mix_styles(boxed: dict, plain: dict, use_boxed: np.ndarray) -> dict:
    """Row i from `boxed` where use_boxed[i], else from `plain` (sft_arrays of the same rows, padded alike)."""
    width = max(boxed["tokens"].shape[1], plain["tokens"].shape[1])
    pad = lambda a: np.pad(a, [(0, 0), (0, width - a.shape[1])])  # noqa: E731
    return {k: np.where(use_boxed[:, None], pad(boxed[k]), pad(plain[k])) for k in boxed}


def sft_batch(arrays: dict, index: np.ndarray, logprobs_MxBxT=None):
    """A TrainBatch (M = 1) of the rows `index`: advantages 1 on the response tokens; prox = infer = `logprobs_MxBxT`
    (the current policy's, so that the ratio and the weight are 1: the policy-gradient loss is then the token-mean
    cross-entropy), zeros when not given yet."""
    from cisjax.records import TrainBatch

    pick = lambda k: arrays[k][index][None]  # noqa: E731
    mask = pick("mask")
    lp = np.zeros(mask.shape, np.float32) if logprobs_MxBxT is None else logprobs_MxBxT
    return TrainBatch(
        pick("tokens"), pick("positions"), pick("segments"), pick("targets"), mask, lp, lp, mask.astype(np.float32)
    )


# ----------------------------------------------------------------------------- sampling (the measurement)


def make_sampler(graphdef, max_new_tokens: int):
    """Jitted `(params, buf_BxL, lens_B, temperature, key) -> buf_BxL`: each row's prompt occupies buf[r, :lens[r]];
    `max_new_tokens` tokens are appended after it, one full forward per token (no KV cache: a measurement for tiny
    models, not an engine). temperature 0 = greedy. Tokens after a row's end of turn are garbage: cut them."""
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp

    def sample(params, buf_BxL, lens_B, temperature, key):
        model = nnx.merge(graphdef, params)
        w_DxV = model.unembedding_DxV().astype(jnp.float32)
        rows = jnp.arange(buf_BxL.shape[0])

        def body(t, carry):
            buf, key = carry
            last = lens_B + t - 1
            hidden_BxD = model(buf).hidden_BxLxD[rows, last].astype(jnp.float32)
            logits_BxV = hidden_BxD @ w_DxV
            key, sub = jax.random.split(key)
            drawn = jax.random.categorical(sub, logits_BxV / jnp.maximum(temperature, 1e-6))
            nxt = jnp.where(temperature > 0, drawn, jnp.argmax(logits_BxV, axis=-1)).astype(buf.dtype)
            return buf.at[rows, last + 1].set(nxt), key

        buf, _ = jax.lax.fori_loop(0, max_new_tokens, body, (buf_BxL, key))
        return buf

    return jax.jit(sample)


def evaluate(
    sampler,
    params,
    formatter,
    rows: Sequence[dict],
    *,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    batch_size: int = 128,
) -> dict:
    """Accuracy of sampled responses on `rows` (reward as in the RL phase: math-verify on the last \\boxed{} vs the
    reference; exact match of the box content when not in the main thread, where math-verify cannot time out) and
    the format rate (a \\boxed{} followed by <|im_end|>). Returns dict(accuracy, format, examples)."""
    import jax

    from cisjax.rl.rewards import last_boxed, normalize_reference, verify

    stops = set(formatter.stop_token_ids)
    main = threading.current_thread() is threading.main_thread()
    correct = formatted = 0
    examples = []
    key = jax.random.key(seed)
    prompts = [formatter.encode(r["question"]) for r in rows]
    batch_size = min(batch_size, len(rows))
    width = max(len(p) for p in prompts) + max_new_tokens
    for lo in range(0, len(rows), batch_size):
        chunk = prompts[lo : lo + batch_size]
        n = len(chunk)
        buf = np.zeros((batch_size, width), np.int32)
        lens = np.ones(batch_size, np.int32)
        for r, p in enumerate(chunk):
            buf[r, : len(p)], lens[r] = p, len(p)
        key, sub = jax.random.split(key)
        out = np.asarray(sampler(params, buf, lens, np.float32(temperature), sub))
        for r in range(n):
            response = out[r, lens[r] : lens[r] + max_new_tokens].tolist()
            end = next((i for i, tok in enumerate(response) if tok in stops), None)
            text = formatter.decode(response[:end] if end is not None else response)
            ref = normalize_reference(rows[lo + r]["answer"])
            box = last_boxed(text)
            if main:
                score = verify(text, ref)
            else:
                score = float(box is not None and box.strip() == ref)
            correct += score
            formatted += int(end is not None and box is not None)
            if len(examples) < 4:
                examples.append(
                    {"question": rows[lo + r]["question"], "response": text, "reference": ref, "reward": score}
                )
    return dict(accuracy=correct / len(rows), format=formatted / len(rows), examples=examples)


# ----------------------------------------------------------------------------- the warm-up


def warmup(
    model_dir: Path,
    train_rows: Sequence[dict],
    eval_rows: Sequence[dict],
    cfg,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    eval_size: int,
    boxed_fraction: float = 1.0,
    max_new_tokens: int = 48,
    log=print,
) -> dict:
    """Supervised warm-up of the HF model in `model_dir` with cisjax's own GRPO step (A = 1, ratio 1, weight 1: the
    token-mean cross-entropy gradient), then the warmed-up weights saved back into `model_dir` (fp32; config and
    tokenizer kept). Returns the loss curve, timings and the accuracies before and after on `eval_rows`."""
    import jax
    import jax.numpy as jnp

    from cisjax import sharding
    from cisjax.data import PromptFormatter
    from cisjax.models import hf_io
    from cisjax.train.build import build

    formatter = PromptFormatter(model_dir, instruction=TRAIN_INSTRUCTION)
    arrays = sft_arrays(formatter, train_rows)
    # the closing style of each example is drawn per use: the model learns both, neither tied to a problem
    plain = sft_arrays(formatter, train_rows, boxed=False) if boxed_fraction < 1 else None
    style_rng = np.random.default_rng([seed, 3])
    run = build(cfg, model_dir=model_dir, mesh=sharding.make_mesh({}, jax.devices()[:1]), inputs=False)
    mesh, rules, graphdef, state = run.mesh, run.rules, run.graphdef, run.state
    train_step, logprobs_fn = run.train_step, run.rescore
    sampler = make_sampler(graphdef, max_new_tokens)
    eval_rows = list(eval_rows)[:eval_size]

    def measure(params, tag):
        out = {}
        for name, temp in (("greedy", 0.0), ("t1", 1.0)):
            r = evaluate(
                sampler, params, formatter, eval_rows, temperature=temp, seed=seed, max_new_tokens=max_new_tokens
            )
            out[name] = r
        log(
            f"[demo] {tag}: held-out accuracy greedy {out['greedy']['accuracy']:.3f} (format {out['greedy']['format']:.2f}), "
            f"temperature 1 {out['t1']['accuracy']:.3f} (format {out['t1']['format']:.2f}) on {len(eval_rows)} problems"
        )
        for ex in out["t1"]["examples"][:2]:
            log(f"[demo]   {ex['question']} -> {ex['response']!r} (reward {ex['reward']:.0f})")
        return out

    before = measure(state.params, "random init") if eval_size else None
    rng = np.random.default_rng([seed, 2])
    order, pos = rng.permutation(len(train_rows)), 0
    curve = []  # device scalars until logged: no host sync per step
    ce = jax.jit(lambda lp, m: -jnp.sum(jnp.where(m, lp, 0.0)) / jnp.maximum(jnp.sum(m), 1))
    t0, cpu0 = time.monotonic(), time.process_time()
    log(
        f"[demo] warm-up: {steps} steps x {batch_size} problems of {len(train_rows)} (T = {arrays['tokens'].shape[1]}), "
        f"lr {cfg.train.lr} {cfg.train.schedule}"
    )
    for s in range(steps):
        if pos + batch_size > len(order):
            order, pos = rng.permutation(len(train_rows)), 0
        index = order[pos : pos + batch_size]
        pos += batch_size
        if plain is None:
            host = sft_batch(arrays, index)
        else:
            pick = lambda a, index=index: {k: v[index] for k, v in a.items()}  # noqa: E731
            host = sft_batch(
                mix_styles(pick(arrays), pick(plain), style_rng.random(len(index)) < boxed_fraction),
                np.arange(len(index)),
            )
        placed = sharding.place(host, mesh, rules, sharding.BATCH_AXES)
        prox = logprobs_fn(state.params, placed)  # the current policy: ratio 1, weight 1
        placed = placed._replace(prox_logprobs_MxBxT=prox, infer_logprobs_MxBxT=prox)
        loss = ce(prox, placed.loss_mask_MxBxT)
        state, metrics = train_step(state, placed)
        curve.append(loss)
        if s == 0 or (s + 1) % max(1, steps // 10) == 0 or s + 1 == steps:
            log(
                f"[demo] warm-up step {s + 1}/{steps}: cross-entropy {float(loss):.4f} (before the update), "
                f"grad norm {float(metrics['grad_norm']):.3f}, {time.monotonic() - t0:.0f} s"
            )
    train_s, train_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    curve = [float(x) for x in curve]
    after = measure(state.params, "after the warm-up") if eval_size else None
    hf_io.save((graphdef, state.params), model_dir, run.hf_config)
    return dict(
        steps=steps,
        batch_size=batch_size,
        loss_curve=curve,
        warmup_s=train_s,
        warmup_cpu_s=train_cpu_s,
        before=before,
        after=after,
    )


# ----------------------------------------------------------------------------- the command


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="demo_command", metavar="STEP", required=True)
    q = sub.add_parser(
        "prepare",
        help="write the synthetic task, the tokenizer and a tiny Qwen2-MoE, warmed up",
        description="Write DIR/data/{train,heldout,rl,test}.jsonl (synthetic two-digit arithmetic, GSM8K format), "
        "DIR/model (a character tokenizer with a chat template and a tiny Qwen2-MoE) and warm the model "
        "up with a short supervised phase on the train problems (cisjax's own train step), so that the "
        "RL phase on the held-out problems starts with a non-zero but imperfect reward. "
        "--config FILE / --config.x=y set the warm-up's train config.",
    )
    q.add_argument("--out", required=True, help="output directory (DIR/data, DIR/model, DIR/warmup.json)")
    q.add_argument("--seed", type=int, default=0, help="seed of the split, the init, the batch order and the sampling")
    q.add_argument("--warmup-steps", type=int, default=800, help="supervised steps (0 = keep the random init)")
    q.add_argument("--batch-size", type=int, default=64, help="problems per warm-up step")
    q.add_argument("--heldout", type=int, default=512, help="held-out problems (the RL phase's prompts)")
    q.add_argument(
        "--test",
        type=int,
        default=None,
        help="of the held-out problems, this many (whole groups) also go to DIR/data/test.jsonl and the rest to "
        "DIR/data/rl.jsonl: a sweep trains on rl and evaluates on test (heldout.jsonl keeps them all); default a "
        "quarter of --heldout; 0 = no rl/test files",
    )
    q.add_argument(
        "--eval-size", type=int, default=256, help="held-out problems sampled to measure accuracy (0 = none)"
    )
    q.add_argument(
        "--boxed-fraction",
        type=float,
        default=BOXED_FRACTION,
        help="share of warm-up examples that close with \\boxed{answer} as the instruction asks; the others close "
        "with 'so the answer is N', which the reward scores 0 (the instruction-following RL has to learn)",
    )
    q.add_argument("--config", default=None, help="config file (default configs/base.py)")


def run(args, overrides: Sequence[str] = ()) -> int:
    if args.demo_command != "prepare":
        raise ValueError(f"unknown demo step {args.demo_command!r}")
    return prepare(
        args.out,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
        batch_size=args.batch_size,
        heldout=args.heldout,
        test=args.test,
        eval_size=args.eval_size,
        boxed_fraction=args.boxed_fraction,
        config_file=args.config,
        overrides=overrides,
    )


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
    """`cisjax demo prepare`: see add_args."""
    from cisjax.data import PromptFormatter, load_problems

    if test is not None and test < 0:
        raise errors.UserError(f"--test={test}: must be >= 0 (0 = no rl/test files)")
    if warmup_steps < 0 or batch_size < 1 or eval_size < 0:
        raise errors.UserError("--warmup-steps and --eval-size must be >= 0, --batch-size >= 1")
    if not 0.0 < boxed_fraction <= 1.0:
        raise errors.UserError(
            f"--boxed-fraction={boxed_fraction}: must lie in (0, 1] (0 would leave nothing to reward)"
        )
    cfg = warmup_config(config_file, overrides, warmup_steps)  # config errors before anything is written
    t0 = time.monotonic()
    out = Path(out)
    data_dir, model_dir = out / "data", out / "model"
    train_rows, held_rows = make_task(seed, heldout)
    write_jsonl(data_dir / "train.jsonl", train_rows)
    write_jsonl(data_dir / "heldout.jsonl", held_rows)
    test = heldout // 4 if test is None else test
    rl_rows, test_rows = split_heldout(seed, heldout, test) if test else ([], [])
    splits = ["train", "heldout"]
    if test:
        write_jsonl(data_dir / "rl.jsonl", rl_rows)
        write_jsonl(data_dir / "test.jsonl", test_rows)
        splits += ["rl", "test"]
    for split in splits:  # the RL loop's reader accepts them
        load_problems(data_dir, split)
    log(
        f"[demo] task: {len(train_rows)} train and {len(held_rows)} held-out problems (disjoint) in {data_dir}"
        + (f"; the held-out ones also as rl.jsonl ({len(rl_rows)}) + test.jsonl ({len(test_rows)})" if test else "")
    )

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

    summary = dict(
        seed=seed,
        train_problems=len(train_rows),
        heldout_problems=len(held_rows),
        rl_problems=len(rl_rows),
        test_problems=len(test_rows),
        vocab=len(tokenizer),
        prompt_tokens=prompt_len,
        response_tokens_max=response_max,
        boxed_fraction=boxed_fraction,
        model=hf_kwargs,
    )
    if warmup_steps:
        summary.update(
            warmup(
                model_dir,
                train_rows,
                held_rows,
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


def main(argv: Sequence[str] | None = None) -> int:
    from cisjax.config import split_overrides

    rest, overrides = split_overrides(list(argv) if argv is not None else sys.argv[1:])
    parser = argparse.ArgumentParser(prog="python -m cisjax.demo")
    add_args(parser)
    return run(parser.parse_args(rest), overrides)


if __name__ == "__main__":
    raise SystemExit(main())
