"""Problems (GSM8K and the eval sets) from local files or the hub, chat-template prompts, and a resumable prompt stream."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cisjax import errors
from cisjax import tokenizer as tokenizer_lib
from cisjax.answers import last_boxed, normalize_reference

log = logging.getLogger(__name__)

__all__ = [
    "Problem",
    "KINDS",
    "TRAIN_INSTRUCTION",
    "EVAL_INSTRUCTION",
    "load_problems",
    "problems_from_rows",
    "PromptFormatter",
    "PromptStream",
    "epoch_order",
]

# The paper's prompts (Appendix C, "Prompts"): the user message is the problem, a line break, then the
# instruction. The evaluation box is typeset with a wider gap (`\\[4pt]`); both are joined with "\n" here.
TRAIN_INSTRUCTION = "Please put your final answer within \\boxed{}."
EVAL_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Problem:
    """One problem: a stable id, the question text, and the reference answer that rewards compare with."""

    id: str
    question: str
    answer: str


# ----------------------------------------------------------------------------- row formats


def _gsm8k(row, i, split):
    # openai/grade-school-math (and the hub's openai/gsm8k): the worked solution ends in "#### <final>"
    if "####" not in row["answer"]:
        raise ValueError("answer has no '#### <final answer>' line")
    return Problem(f"gsm8k/{split}/{i}", row["question"], normalize_reference(row["answer"]))


def _math500(row, i, split):
    return Problem(row.get("unique_id") or f"math500/{split}/{i}", row["problem"], row["answer"])


def _dapo(row, i, split):
    # verl layout: prompt = [{"role": "user", "content": ...}], the answer in reward_model.ground_truth
    # (extra_info.answer is empty in DAPO-Math-17k)
    user = [m["content"] for m in row["prompt"] if m.get("role") == "user"]
    if not user:
        raise ValueError("prompt has no user message")
    index = (row.get("extra_info") or {}).get("index", i)
    return Problem(f"dapo/{index}", user[-1], str(row["reward_model"]["ground_truth"]))


def _svamp(row, i, split):
    # as the Qwen2.5-Math harness: the body, ended by a full stop, then the question
    body = row["Body"].strip()
    body = body if body.endswith(".") else body + "."
    value = float(row["Answer"])
    answer = str(int(value)) if value.is_integer() else repr(value)
    return Problem(str(row.get("ID", f"svamp/{split}/{i}")), f"{body} {row['Question'].strip()}", answer)


def _minerva(row, i, split):
    # no answer field: the solution's (only) \boxed{} is the answer
    answer = last_boxed(row["solution"])
    if answer is None:
        raise ValueError("solution has no \\boxed{} answer")
    return Problem(f"minerva/{row.get('idx', i)}", row["problem"], answer)


def _olympiadbench(row, i, split):
    # final_answer is a list of strings like "$\frac{1}{2 n+2}$": drop the math delimiters. A multiple answer is
    # one string "$90^{\circ}$,$60^{\circ}$": its parts joined by ", " (a set, as math-verify reads it)
    answers = [
        re.sub(r"(?<!\\)\$", "", re.sub(r"\$\s*,\s*\$", ", ", a.strip().rstrip(".").strip())).strip()
        for a in row["final_answer"]
    ]
    question = row["question"] if not row.get("context") else f"{row['context']}\n{row['question']}"
    return Problem(f"olympiadbench/{row.get('id', i)}", question, ", ".join(answers))


# kind -> (row -> Problem). Local files and hub rows share these layouts.
KINDS: dict[str, Callable[[Mapping, int, str], Problem]] = {
    "gsm8k": _gsm8k,
    "math500": _math500,
    "dapo_math_17k": _dapo,
    "svamp": _svamp,
    "minerva_math": _minerva,
    "olympiadbench": _olympiadbench,
}


def problems_from_rows(
    rows: Sequence[Mapping], *, kind: str = "gsm8k", split: str = "train", where: str = "rows"
) -> list[Problem]:
    """Rows (dicts in one of the KINDS layouts) -> Problems; `where` names the source in errors."""
    if kind not in KINDS:
        raise errors.UserError(f"unknown data kind {kind!r}; known: {sorted(KINDS)}")
    to_problem = KINDS[kind]
    problems = []
    for i, row in enumerate(rows):
        try:
            problems.append(to_problem(row, i, split))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise errors.UserError(f"{where}: row {i + 1} is not a {kind} row: {detail}") from e
    if not problems:
        raise errors.UserError(f"{where}: no rows")
    return problems


# ----------------------------------------------------------------------------- sources


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a .jsonl file, blank lines skipped; ValueError naming the line that is not JSON."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise errors.UserError(f"{path}:{n}: not JSON: {e}") from e
    return rows


def _read_parquet(path: str) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # lazy: optional (only parquet sources need it)
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to .jsonl") from e
    return pq.read_table(path).to_pylist()


def _read_hub(spec: str, split: str) -> list[dict]:
    name, _, config = spec.partition(":")
    if not name:
        raise errors.UserError(f"hub source 'hf:{spec}' names no dataset; expected hf:<dataset>[:<config>]")
    try:
        import datasets  # lazy: optional (only hub sources need it)
    except ImportError as e:
        raise ImportError(
            f"source 'hf:{spec}' needs the Hugging Face `datasets` package (pip install datasets), or use a local .jsonl"
        ) from e
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # offline, unknown name or split: say which source failed
        raise RuntimeError(
            f"could not load 'hf:{spec}' split {split!r} from the Hugging Face hub (offline? use a local .jsonl path): {e}"
        ) from e
    return [dict(row) for row in ds]


def load_problems(source: str | os.PathLike, split: str = "train", *, kind: str = "gsm8k") -> list[Problem]:
    """Problems of one split, in file order.

    `source`: a .jsonl or .parquet file; a directory holding `{split}.jsonl` (or `{split}.parquet`), as the
    GSM8K repository's `data/` folder; or `hf:<dataset>[:<config>]` for the Hugging Face hub (needs
    `datasets`), e.g. `hf:openai/gsm8k:main`. `kind` names the row layout (see KINDS).
    """
    if kind not in KINDS:
        raise errors.UserError(f"unknown data kind {kind!r}; known: {sorted(KINDS)}")
    source = os.fspath(source)
    if source.startswith("hf:"):
        return problems_from_rows(_read_hub(source[3:], split), kind=kind, split=split, where=source)
    path = source
    if os.path.isdir(path):
        candidates = [os.path.join(path, f"{split}{ext}") for ext in (".jsonl", ".parquet")]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            raise errors.MissingInput(f"data directory {path} has no {split}.jsonl or {split}.parquet")
        path = found[0]
    if not os.path.isfile(path):
        raise errors.MissingInput(f"data source {source} is not a file, a directory, or hf:<dataset>")
    if path.endswith(".jsonl"):
        rows = read_jsonl(path)
    elif path.endswith(".parquet"):
        rows = _read_parquet(path)
    else:
        raise errors.UserError(f"data file {path}: expected a .jsonl or .parquet file")
    return problems_from_rows(rows, kind=kind, split=split, where=path)


# ----------------------------------------------------------------------------- prompts


class PromptFormatter:
    """Question -> prompt token ids: the question and the instruction as the one user message, through the
    tokenizer's chat template with the generation prompt (no system message of ours unless `system` is given,
    as Qwen2.5-Math's evaluation prompt does: a template that has a default one, as Qwen2.5's, adds it).
    `enable_thinking=False` is Qwen3's non-thinking mode, as in the paper; templates without the switch ignore it."""

    def __init__(
        self,
        tokenizer_dir: str | os.PathLike,
        instruction: str = TRAIN_INSTRUCTION,
        *,
        chat_template: bool = True,
        enable_thinking: bool = False,
        system: str = "",
    ):
        self.tokenizer = tokenizer_lib.load(tokenizer_dir)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise errors.UserError(
                f"tokenizer {tokenizer_dir} has no chat template; pass chat_template=False for a plain prompt"
            )
        self.instruction = instruction
        self.system = system
        self.chat_template = chat_template
        self.enable_thinking = enable_thinking
        self.stop_token_ids = self._stop_ids()

    def _stop_ids(self) -> tuple[int, ...]:
        # eos, plus ChatML's end of turn and end of text when the vocabulary has them: a base model's eos is
        # <|endoftext|> while its chat turns end with <|im_end|> (the models' generation_config lists both)
        ids = {self.tokenizer.eos_token_id}
        for token in ("<|im_end|>", "<|endoftext|>"):
            if token in self.tokenizer.get_vocab():
                ids.add(self.tokenizer.convert_tokens_to_ids(token))
        ids.discard(None)
        if not ids:
            raise errors.UserError("tokenizer has no eos token and no <|im_end|>/<|endoftext|>: cannot stop generation")
        return tuple(sorted(ids))

    def message(self, question: str) -> str:
        """The user message: question, a line break, the instruction."""
        if not isinstance(question, str) or not question.strip():
            raise errors.UserError(f"question must be a non-empty string, got {question!r}")
        return f"{question}\n{self.instruction}" if self.instruction else question

    def text(self, question: str) -> str:
        """The full prompt text the model sees."""
        message = self.message(question)
        if not self.chat_template:
            return f"{self.system}\n\n{message}" if self.system else message
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": message}
        ]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=self.enable_thinking
        )

    def encode(self, question: str) -> list[int]:
        """Prompt token ids. The template's text already holds its special tokens: add none."""
        return self.tokenizer.encode(self.text(question), add_special_tokens=False)

    def encode_batch(self, problems: Sequence[Problem]) -> list[list[int]]:
        return [self.encode(p.question) for p in problems]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Response ids -> text (end-of-turn tokens dropped by default)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def drop_long_prompts(problems: Sequence[Problem], formatter: PromptFormatter, max_tokens: int) -> list[Problem]:
    """The problems whose formatted prompt has at most `max_tokens` tokens (0 = all of them), in order; how many
    were dropped goes to the log. Bounding prompts bounds every batch row (prompt + rollout.max_new_tokens)."""
    if max_tokens <= 0:
        return list(problems)
    kept = [p for p in problems if len(formatter.encode(p.question)) <= max_tokens]
    if not kept:
        raise errors.UserError(
            f"data.max_prompt_tokens={max_tokens}: every one of the {len(problems)} prompts is longer"
        )
    if len(kept) < len(problems):
        log.warning(
            "data.max_prompt_tokens=%d: dropped %d of %d problems with longer prompts",
            max_tokens,
            len(problems) - len(kept),
            len(problems),
        )
    return kept


# ----------------------------------------------------------------------------- the stream


def _fingerprint(problems: Sequence[Problem]) -> str:
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.id, p.question, p.answer]).encode())
    return h.hexdigest()[:16]


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The permutation of range(n) for one epoch: indices sorted by a keyed hash of (seed, epoch, index).
    Unlike a numpy Generator stream, this order is the same on every machine and library version, so a
    checkpoint resumes onto the identical order anywhere."""
    key = f"{seed}:{epoch}:".encode()
    return sorted(range(n), key=lambda i: hashlib.blake2b(key + str(i).encode(), digest_size=8).digest())


class PromptStream:
    """Batches of problems over `epochs` passes, each pass in its own seed-derived order.

    With `drop_last` (default, as the paper's 87 steps = 3 x floor(7473 / 256)) the incomplete tail batch
    of each epoch is skipped; a different tail each epoch, since the order changes. `state()` is a small
    JSON-able dict for checkpoints; `restore(state)` continues with the identical order.
    """

    def __init__(self, problems: Sequence[Problem], *, batch_size: int, seed: int, epochs: int, drop_last: bool = True):
        if not problems:
            raise ValueError("PromptStream needs at least one problem")
        if batch_size < 1 or epochs < 1:
            raise errors.UserError(f"batch_size and epochs must be >= 1, got batch_size={batch_size}, epochs={epochs}")
        if drop_last and batch_size > len(problems):
            raise errors.UserError(f"batch_size {batch_size} > {len(problems)} problems: every batch would be dropped")
        self.problems = list(problems)
        self.batch_size, self.seed, self.epochs, self.drop_last = batch_size, int(seed), epochs, drop_last
        self.fingerprint = _fingerprint(self.problems)
        self.epoch, self.position = 0, 0  # the next batch starts at order(epoch)[position]
        self._order_epoch, self._order = -1, []

    @property
    def steps_per_epoch(self) -> int:
        n, b = len(self.problems), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order_epoch, self._order = epoch, epoch_order(len(self.problems), self.seed, epoch)
        return self._order

    def next_batch(self) -> list[Problem]:
        """The next batch; StopIteration after the last epoch."""
        n = len(self.problems)
        if not self.done and self.drop_last and self.position + self.batch_size > n:
            self.epoch, self.position = self.epoch + 1, 0  # the tail that does not fill a batch
        if self.done:
            raise StopIteration
        order = self._order_of(self.epoch)
        batch = [self.problems[i] for i in order[self.position : self.position + self.batch_size]]
        self.position += len(batch)
        if self.position >= n:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[Problem]]:
        return self

    def __next__(self) -> list[Problem]:
        return self.next_batch()

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "size": len(self.problems),
            "fingerprint": self.fingerprint,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state()`; the data set and seed must be the ones it was taken on."""
        missing = {"epoch", "position", "seed", "size", "fingerprint"} - set(state)
        if missing:
            raise ValueError(f"prompt stream state lacks {sorted(missing)}: {dict(state)}")
        if state["size"] != len(self.problems) or state["fingerprint"] != self.fingerprint:
            raise errors.UserError(
                f"prompt stream state is for another data set ({state['size']} problems, fingerprint {state['fingerprint']}); "
                f"this one has {len(self.problems)} problems, fingerprint {self.fingerprint}"
            )
        if int(state["seed"]) != self.seed:
            raise errors.UserError(
                f"prompt stream state has seed {state['seed']}, this stream seed {self.seed}: the order would differ"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.problems):
            raise ValueError(
                f"prompt stream state has epoch {epoch}, position {position}: out of range for {len(self.problems)} problems"
            )
        self.epoch, self.position = epoch, position
