"""cisjax.data: loaders on the fixture excerpts, clear errors, chat-template prompts on the real Qwen2.5 and Qwen3
tokenizers, and a reproducible, resumable prompt stream."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from cisjax.data import (
    TRAIN_INSTRUCTION,
    Problem,
    PromptFormatter,
    PromptStream,
    epoch_order,
    load_problems,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOKENIZERS = FIXTURES / "tokenizers"


# ----------------------------------------------------------------------------- loaders


def test_gsm8k_file_and_directory():
    train = load_problems(FIXTURES / "gsm8k" / "train.jsonl")
    assert len(train) == 20
    assert train[0].id == "gsm8k/train/0"
    assert train[0].question.startswith("Natalia sold clips to 48 of her friends in April")
    assert [p.answer for p in train[:3]] == ["72", "10", "5"]
    assert [p.answer for p in train[-2:]] == ["1080", "850000"]  # "#### 1,080", "#### 850,000"
    test = load_problems(FIXTURES / "gsm8k", "test")  # a directory holding {split}.jsonl
    assert len(test) == 20 and test[0].id == "gsm8k/test/0" and test[0].answer == "18"


@pytest.mark.parametrize(
    "kind, first_id, question_start, answer",
    [
        ("math500", "test/precalculus/807.json", "Convert the point $(0,3)$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("dapo_math_17k", "dapo/0", "In triangle $ABC$", "34"),
        (
            "svamp",
            "chal-777",
            "There are 87 oranges and 290 bananas in Philip's collection. If the bananas are organized into 2 groups and oranges are organized into 93 groups. How big",
            "145",
        ),
        ("minerva_math", "minerva/0", "Each of the two Magellan telescopes", "1.6"),
        ("olympiadbench", "olympiadbench/1606", "Xenia and Sergey play the following game.", "2"),
    ],
)
def test_eval_kinds(kind, first_id, question_start, answer):
    problems = load_problems(FIXTURES / "eval" / f"{kind}.jsonl", "test", kind=kind)
    assert problems[0].id == first_id
    assert problems[0].question.startswith(question_start)
    assert problems[0].answer == answer


def test_olympiadbench_strips_math_delimiters():
    assert (
        load_problems(FIXTURES / "eval" / "olympiadbench.jsonl", kind="olympiadbench")[1].answer == "\\frac{1}{2 n+2}"
    )


def test_olympiadbench_multiple_answers_in_one_string(tmp_path):
    # the shapes of OlympiadBench's final_answer for several answers (ids 2498, 1803, 2021 of the Qwen2.5-Math file)
    rows = [
        {"question": "q", "final_answer": [a]}
        for a in ("$90^{\\circ}$,$60^{\\circ}$", "$a=2$, $a=-6-4 \\sqrt{2}$", "$(-\\infty, 0) \\cup\\{1\\}$.", "$\\$5$")
    ]
    path = _write(tmp_path / "o.jsonl", [json.dumps(r) for r in rows])
    answers = [p.answer for p in load_problems(path, kind="olympiadbench")]
    assert answers == ["90^{\\circ}, 60^{\\circ}", "a=2, a=-6-4 \\sqrt{2}", "(-\\infty, 0) \\cup\\{1\\}", "\\$5"]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_loader_errors_name_the_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_problems(tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match="no dev.jsonl"):
        load_problems(tmp_path, "dev")
    bad_json = _write(tmp_path / "a.jsonl", ['{"question": "q", "answer": "#### 1"}', "{oops"])
    with pytest.raises(ValueError, match=r"a.jsonl:2: not JSON"):
        load_problems(bad_json)
    no_field = _write(tmp_path / "b.jsonl", ['{"question": "q"}'])
    with pytest.raises(ValueError, match=r"b.jsonl: row 1 is not a gsm8k row: missing field 'answer'"):
        load_problems(no_field)
    no_final = _write(tmp_path / "c.jsonl", ['{"question": "q", "answer": "42"}'])
    with pytest.raises(ValueError, match=r"row 1 .*####"):
        load_problems(no_final)
    with pytest.raises(ValueError, match="unknown data kind 'gsm9k'"):
        load_problems(no_final, kind="gsm9k")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        load_problems(_write(tmp_path / "d.csv", ["x"]))
    with pytest.raises(ValueError, match="no rows"):
        load_problems(_write(tmp_path / "e.jsonl", []))


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # None in sys.modules makes the import fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "train.parquet").write_bytes(b"")
    with pytest.raises(ImportError, match="needs pyarrow"):
        load_problems(tmp_path)


def test_hub_source(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        if name == "offline/set":
            raise ConnectionError("no network")
        return [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_problems("hf:openai/gsm8k:main", "test") == [Problem("gsm8k/test/0", "What is 2+2?", "4")]
    assert calls == [("openai/gsm8k", "main", "test")]
    with pytest.raises(RuntimeError, match="could not load 'hf:offline/set'.*no network"):
        load_problems("hf:offline/set")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs the Hugging Face `datasets` package"):
        load_problems("hf:openai/gsm8k:main")


# ----------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def qwen25():
    return PromptFormatter(TOKENIZERS / "qwen2.5-instruct")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # the fixtures store the shared Qwen BPE files once (tests/fixtures/README.md)
    d = tmp_path_factory.mktemp("qwen3")
    os.symlink(TOKENIZERS / "qwen3" / "tokenizer_config.json", d / "tokenizer_config.json")
    for name in ("vocab.json", "merges.txt"):
        os.symlink(TOKENIZERS / "qwen2.5-instruct" / name, d / name)
    return PromptFormatter(d)


QUESTION = "What is 1+1?"
MESSAGE = "What is 1+1?\nPlease put your final answer within \\boxed{}."


def test_instruction_is_the_papers():
    assert TRAIN_INSTRUCTION == "Please put your final answer within \\boxed{}."


def test_qwen25_chat_template(qwen25):
    assert qwen25.message(QUESTION) == MESSAGE
    assert qwen25.text(QUESTION) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{MESSAGE}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = qwen25.encode(QUESTION)
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> assistant \n
    hf = qwen25.tokenizer.apply_chat_template(
        [{"role": "user", "content": MESSAGE}], tokenize=True, add_generation_prompt=True
    )
    assert ids == list(hf["input_ids"])
    assert qwen25.stop_token_ids == (151643, 151645)  # <|endoftext|>, <|im_end|>


def test_qwen3_chat_template_thinking_off(qwen3):
    assert (
        qwen3.text(QUESTION) == f"<|im_start|>user\n{MESSAGE}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = qwen3.encode(QUESTION)
    assert ids[:3] == [151644, 872, 198]  # <|im_start|> user \n: no system message
    assert ids[-4:] == [151667, 271, 151668, 271]  # <think> \n\n </think> \n\n: the empty thought
    assert qwen3.stop_token_ids == (151643, 151645)
    assert qwen3.decode(qwen3.tokenizer.encode("\\boxed{2}<|im_end|>", add_special_tokens=False)) == "\\boxed{2}"


def test_system_message(qwen25):
    fmt = PromptFormatter(TOKENIZERS / "qwen2.5-instruct", instruction="", system="Reason, then box.")
    # the given system message replaces the template's default one; the user message is the bare question
    assert fmt.text(QUESTION) == (
        "<|im_start|>system\nReason, then box.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = PromptFormatter(TOKENIZERS / "qwen2.5-instruct", chat_template=False, system="Reason, then box.")
    assert plain.text(QUESTION) == f"Reason, then box.\n\n{MESSAGE}"


def test_plain_prompt_and_bad_question(qwen25):
    plain = PromptFormatter(TOKENIZERS / "qwen2.5-instruct", chat_template=False)
    assert plain.text(QUESTION) == MESSAGE
    assert plain.encode_batch([Problem("a", QUESTION, "2")]) == [
        qwen25.tokenizer.encode(MESSAGE, add_special_tokens=False)
    ]
    with pytest.raises(ValueError, match="non-empty string"):
        qwen25.encode("  ")


# ----------------------------------------------------------------------------- the stream


PROBLEMS = [Problem(f"p{i}", f"question {i}", str(i)) for i in range(20)]


def _ids(batches):
    return [[p.id for p in b] for b in batches]


def test_epoch_order_is_pinned():
    # a change of this order would silently change what resumed runs see: it is part of the checkpoint format
    assert epoch_order(8, seed=0, epoch=0) == [1, 3, 7, 6, 5, 4, 0, 2]
    assert sorted(epoch_order(100, seed=3, epoch=2)) == list(range(100))


def test_stream_epochs_and_drop_last():
    stream = PromptStream(PROBLEMS, batch_size=6, seed=1, epochs=3)
    assert (stream.steps_per_epoch, stream.total_steps) == (3, 9)
    batches = _ids(stream)
    assert len(batches) == 9 and all(len(b) == 6 for b in batches)
    epochs = [sum(batches[3 * e : 3 * e + 3], []) for e in range(3)]
    assert all(len(set(e)) == 18 for e in epochs)  # no repeats within an epoch; 2 dropped each time
    assert epochs[0] != epochs[1] != epochs[2]
    assert stream.done and stream.state()["epoch"] == 3
    with pytest.raises(StopIteration):
        stream.next_batch()
    assert _ids(PromptStream(PROBLEMS, batch_size=6, seed=1, epochs=3)) == batches  # same seed: same order
    assert _ids(PromptStream(PROBLEMS, batch_size=6, seed=2, epochs=3)) != batches
    keep = _ids(PromptStream(PROBLEMS, batch_size=6, seed=1, epochs=1, drop_last=False))
    assert [len(b) for b in keep] == [6, 6, 6, 2] and sorted(sum(keep, [])) == sorted(p.id for p in PROBLEMS)


@pytest.mark.parametrize("taken", [1, 2, 3, 4, 7])  # mid-epoch, at an epoch's end, in later epochs
def test_stream_resumes_with_the_identical_order(taken):
    full = _ids(PromptStream(PROBLEMS, batch_size=6, seed=5, epochs=3))
    first = PromptStream(PROBLEMS, batch_size=6, seed=5, epochs=3)
    head = _ids(first.next_batch() for _ in range(taken))
    state = json.loads(json.dumps(first.state()))  # as stored in a checkpoint
    resumed = PromptStream(PROBLEMS, batch_size=6, seed=5, epochs=3)
    resumed.restore(state)
    assert head + _ids(resumed) == full


def test_stream_restore_rejects_another_data_set_or_seed():
    stream = PromptStream(PROBLEMS, batch_size=4, seed=0, epochs=1)
    stream.next_batch()
    state = stream.state()
    with pytest.raises(ValueError, match="20 problems.*this one has 19"):
        PromptStream(PROBLEMS[:19], batch_size=4, seed=0, epochs=1).restore(state)
    edited = PROBLEMS[:-1] + [Problem("p19", "question 19", "nineteen")]
    with pytest.raises(ValueError, match="another data set"):
        PromptStream(edited, batch_size=4, seed=0, epochs=1).restore(state)
    with pytest.raises(ValueError, match="seed 0, this stream seed 1"):
        PromptStream(PROBLEMS, batch_size=4, seed=1, epochs=1).restore(state)
    with pytest.raises(ValueError, match="lacks"):
        stream.restore({"epoch": 0})
    with pytest.raises(ValueError, match="batch_size 30 > 20"):
        PromptStream(PROBLEMS, batch_size=30, seed=0, epochs=1)


def test_drop_long_prompts():
    from cisjax.data import Problem, PromptFormatter, drop_long_prompts

    fmt = PromptFormatter(TOKENIZERS / "qwen2.5-instruct")
    problems = [Problem(id=str(i), question="What is 2 + 2?" + " And more." * (40 * i), answer="4") for i in range(3)]
    lengths = [len(fmt.encode(p.question)) for p in problems]
    assert lengths[0] < lengths[1] < lengths[2]
    assert drop_long_prompts(problems, fmt, 0) == problems
    assert drop_long_prompts(problems, fmt, lengths[1]) == problems[:2]
    assert drop_long_prompts(problems, fmt, lengths[0]) == problems[:1]
    with pytest.raises(ValueError, match="every one of the 3 prompts is longer"):
        drop_long_prompts(problems, fmt, lengths[0] - 1)
