"""cisjax.evaluation.sets and prompts: --sets and --data parsed, the data layouts found, sizes checked against the full
sets, bad input named; the prompt styles."""

import json
from pathlib import Path

import pytest

from cisjax.evaluation import prompts
from cisjax.evaluation.sets import BENCHMARKS, load_set, locate, parse_data, parse_sets

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EVAL = FIXTURES / "eval"


def test_the_full_sizes_are_the_issues():
    assert {n: b.full_size for n, b in BENCHMARKS.items()} == {
        "gsm8k": 1319,
        "math500": 500,
        "svamp": 1000,
        "minerva": 272,
        "olympiadbench": 675,
    }
    assert {n for n, b in BENCHMARKS.items() if b.numeric} == {"gsm8k", "svamp"}


def test_parse_sets():
    assert parse_sets("gsm8k, MATH500,minerva_math,minerva") == ["gsm8k", "math500", "minerva"]
    with pytest.raises(ValueError, match="unknown eval set 'aime'.*gsm8k, math500, svamp, minerva, olympiadbench"):
        parse_sets("gsm8k,aime")
    with pytest.raises(ValueError, match="no eval sets"):
        parse_sets(" , ")


def test_parse_data():
    assert parse_data("data/dir") == ("data/dir", {})
    assert parse_data("hf") == ("hf", {})
    assert parse_data("d, gsm8k=a.jsonl ,minerva_math=hf:x/y:z@train") == (
        "d",
        {"gsm8k": "a.jsonl", "minerva": "hf:x/y:z@train"},
    )
    with pytest.raises(ValueError, match="unknown eval set 'aime'"):
        parse_data("aime=x.jsonl")
    with pytest.raises(ValueError, match="two default sources"):
        parse_data("a,b")
    with pytest.raises(ValueError, match="no source"):
        parse_data("gsm8k=")


def test_locate_layouts(tmp_path):
    # the test fixtures' layout: <dir>/<folder>.jsonl
    assert locate(BENCHMARKS["minerva"], str(EVAL), {}) == (str(EVAL / "minerva_math.jsonl"), "test")
    # shared data's layout: <dir>/<folder>/test.jsonl
    (tmp_path / "svamp").mkdir()
    (tmp_path / "svamp" / "test.jsonl").write_text((EVAL / "svamp.jsonl").read_text())
    assert locate(BENCHMARKS["svamp"], str(tmp_path), {}) == (str(tmp_path / "svamp" / "test.jsonl"), "test")
    # the hub: known defaults, a split after @, and the sets without a known default named
    assert locate(BENCHMARKS["gsm8k"], "hf", {}) == ("hf:openai/gsm8k:main", "test")
    assert locate(BENCHMARKS["olympiadbench"], None, {"olympiadbench": "hf:a/b:c@train"}) == ("hf:a/b:c", "train")
    assert locate(BENCHMARKS["gsm8k"], "hf:openai/gsm8k:main", {}) == ("hf:openai/gsm8k:main", "test")
    with pytest.raises(ValueError, match="eval set svamp: no default hub dataset"):
        locate(BENCHMARKS["svamp"], "hf", {})


def test_missing_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"eval set gsm8k: none of .*gsm8k/test.jsonl"):
        locate(BENCHMARKS["gsm8k"], str(EVAL), {})
    with pytest.raises(FileNotFoundError, match="eval set math500: data source .*nope.jsonl does not exist"):
        locate(BENCHMARKS["math500"], None, {"math500": str(tmp_path / "nope.jsonl")})
    with pytest.raises(FileNotFoundError, match="eval data directory .*missing does not exist"):
        locate(BENCHMARKS["math500"], str(tmp_path / "missing"), {})
    with pytest.raises(ValueError, match="eval set math500: no data source"):
        locate(BENCHMARKS["math500"], None, {})


def test_load_set_limit_and_size_note():
    s = load_set("math500", str(EVAL), {}, limit=2)
    assert [p.id for p in s.problems] == ["test/precalculus/807.json", "test/intermediate_algebra/1994.json"]
    assert (
        s.source_size == 3
        and s.size_note == f"{EVAL / 'math500.jsonl'} holds 3 problems; the full math500 test set has 500"
    )
    assert len(load_set("math500", str(EVAL), {}).problems) == 3


def test_a_file_of_the_full_size_has_no_note(tmp_path):
    rows = [{"Body": f"Tom has {i} apples.", "Question": "How many?", "Answer": float(i)} for i in range(1000)]
    (tmp_path / "svamp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = load_set("svamp", str(tmp_path), {}, limit=5)
    assert s.size_note == "" and s.source_size == 1000 and [p.answer for p in s.problems] == ["0", "1", "2", "3", "4"]


def test_a_row_without_an_answer_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"problem": "p", "answer": "1"}) + "\n" + json.dumps({"problem": "q", "answer": " "}) + "\n"
    )
    with pytest.raises(ValueError, match=r"eval set math500 \(.*m.jsonl\): problem math500/test/1 has no gold answer"):
        load_set("math500", None, {"math500": str(path)})
    path.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1 is not a math500 row: missing field 'answer'"):
        load_set("math500", None, {"math500": str(path)})


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The Qwen3 tokenizer, assembled from both fixture folders (tests/fixtures/README.md)."""
    import os

    d = tmp_path_factory.mktemp("qwen3")
    os.symlink(FIXTURES / "tokenizers" / "qwen3" / "tokenizer_config.json", d / "tokenizer_config.json")
    for f in ("vocab.json", "merges.txt"):
        os.symlink(FIXTURES / "tokenizers" / "qwen2.5-instruct" / f, d / f)
    return d


@pytest.mark.parametrize(
    "style, text",
    [
        ("train", "<|im_start|>user\nWhat is 1+1?\nPlease put your final answer within \\boxed{}.<|im_end|>\n"),
        (
            "paper-eval",
            "<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n",
        ),
        (
            "qwen25-math-cot",
            "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n",
        ),
    ],
)
def test_prompt_styles(qwen3_dir, style, text):
    fmt = prompts.formatter(style, qwen3_dir)
    assert (
        fmt.text("What is 1+1?") == text + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )  # Qwen3's template, thinking off


def test_unknown_prompt_style():
    with pytest.raises(ValueError, match="unknown prompt style 'cot'"):
        prompts.formatter("cot", FIXTURES / "tokenizers" / "qwen2.5-instruct")
