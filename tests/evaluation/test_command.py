"""`cisjax eval` end to end on the demo's tiny MoE: the real vLLM engine as the embedded server child (one start for
the module), the five sets from the test fixtures with --limit; the outputs checked against each other. A running
server (--server: the transformers engine, cheap) and the errors on bad input."""

import json
import os
import shutil
from pathlib import Path

import pytest

from cisjax import cli
from cisjax.evaluation import answers
from cisjax.evaluation.served import check_vocabulary
from cisjax.evaluation.sets import BENCHMARKS
from cisjax.rollout import engine_env
from tests.support import servers

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): cisjax eval on the real vLLM engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DATA = f"{FIXTURES / 'eval'},gsm8k={FIXTURES / 'gsm8k' / 'test.jsonl'}"


@pytest.fixture(autouse=True)
def vllm_env(monkeypatch):
    for k, v in engine_env.defaults().items():  # the engine's defaults, whatever the caller's environment says
        monkeypatch.setenv(k, v)


def _read(out):
    doc = json.loads((out / "results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return doc, samples, (out / "report.md").read_text()


@pytest.mark.skipif(
    os.environ.get("CISJAX_SKIP_VLLM") == "1", reason="CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine"
)
def test_eval_on_the_demo_model_with_vllm(prepared, tmp_path, capsys):
    import vllm  # noqa: F401  (a broken install must fail, not skip)

    out = tmp_path / "out"
    argv = [
        "eval",
        "--model",
        str(prepared / "model"),
        "--data",
        DATA,
        "--limit",
        "2",
        "--max-new-tokens",
        "24",
        "--out",
        str(out),
        "--no-progress",
        "--dtype",
        "float32",
    ]
    assert cli.main(argv) == 0
    doc, samples, report = _read(out)
    names = ["gsm8k", "math500", "svamp", "minerva", "olympiadbench"]
    assert list(doc["sets"]) == names and doc["average"]["sets"] == names
    assert (
        doc["engine"]["engine"] == "vllm"
        and doc["engine"]["vocab_size"] == 100
        and doc["engine"]["server"] == "embedded"
    )
    assert doc["sampling"]["greedy"] and doc["sampling"]["n"] == 1 and doc["sampling"]["max_new_tokens"] == 24
    assert doc["prompt"]["style"] == "train" and doc["limit"] == 2 and doc["problems"] == 10
    assert doc["problems_per_s"] > 0 and doc["elapsed_s"] >= doc["eval_s"] > 0
    # one line per problem and sample, in set order; each line's answer, rule and grade follow from its response
    assert [s["set"] for s in samples] == [n for n in names for _ in range(2)]
    for s in samples:
        assert set(s) == {
            "set",
            "id",
            "sample",
            "prompt",
            "response",
            "answer",
            "rule",
            "gold",
            "correct",
            "graded_by",
            "finish_reason",
            "response_tokens",
            "version",
        }
        if s["finish_reason"] == "prompt_too_long":  # the demo's 512-token context: an OlympiadBench question is longer
            assert s["response"] == "" and not s["correct"]
            continue
        assert s["finish_reason"] in ("stop", "length") and 1 <= s["response_tokens"] <= 24 and s["version"] == 0
        found = answers.extract(s["response"])
        assert (s["answer"], s["rule"]) == (found.answer, found.rule)
        assert s["prompt"].startswith("<|im_start|>user\n") and s["prompt"].endswith(
            "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
        )
        if s["rule"] == "none":
            assert s["graded_by"] == "no_answer" and not s["correct"]
    # each set's figures are those of its samples
    for name in names:
        mine = [s for s in samples if s["set"] == name]
        r = doc["sets"][name]
        assert r["count"] == 2 and r["samples"] == 2
        assert r["accuracy"] == sum(s["correct"] for s in mine) / 2
        assert r["answered"] == sum(s["rule"] != "none" for s in mine) / 2
        assert r["truncated"] == sum(s["finish_reason"] == "length" for s in mine) / 2
        assert r["mean_response_tokens"] == sum(s["response_tokens"] for s in mine) / 2
        assert r["full_size"] == BENCHMARKS[name].full_size and r["source_size"] < r["full_size"] and r["size_note"]
        assert f"| {name} | 2 | {100 * r['accuracy']:.1f} |" in report
    assert doc["average"]["accuracy"] == sum(doc["sets"][n]["accuracy"] for n in names) / 5
    assert "the full svamp test set has 1000" in report
    assert "cisjax eval:" in capsys.readouterr().out
    assert (out / "rollout_server.log").is_file()


@pytest.fixture(scope="module")
def hf_server(prepared):
    """A running `cisjax serve` on the transformers engine (starts in seconds), for the --server path."""
    port = servers.free_port()
    proc = servers.start("transformers", prepared / "model", port)
    try:
        servers.wait_serving(proc, f"127.0.0.1:{port}", timeout=180)
        yield f"127.0.0.1:{port}"
    finally:
        servers.stop(proc)


def test_eval_against_a_running_server_and_sampled_pass_at_k(prepared, hf_server, tmp_path):
    out = tmp_path / "out"
    argv = [
        "eval",
        "--model",
        str(prepared / "model"),
        "--server",
        hf_server,
        "--sets",
        "svamp",
        "--data",
        DATA,
        "--n",
        "3",
        "--temperature",
        "1.0",
        "--seed",
        "5",
        "--max-new-tokens",
        "8",
        "--prompt",
        "qwen25-math-cot",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    doc, samples, report = _read(out)
    r = doc["sets"]["svamp"]
    assert doc["engine"]["engine"] == "transformers" and doc["engine"]["server"] == hf_server
    assert r["count"] == 2 and r["samples"] == 6 and [s["sample"] for s in samples] == [0, 1, 2, 0, 1, 2]
    correct = [sum(s["correct"] for s in samples if s["id"] == pid) for pid in ("chal-777", "chal-508")]
    assert r["accuracy"] == r["avg@3"] == sum(correct) / 6
    assert r["pass@3"] == sum(c > 0 for c in correct) / 2
    assert "pass@3 %" in report
    assert samples[0]["prompt"].startswith("<|im_start|>system\nPlease reason step by step")


def test_a_server_of_another_model_is_refused(prepared, hf_server, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(prepared / "model", other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 128}))
    assert (
        cli.main(
            [
                "eval",
                "--model",
                str(other),
                "--server",
                hf_server,
                "--sets",
                "svamp",
                "--data",
                DATA,
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"{hf_server} serves a model with vocab_size 100" in err and "has 128: not the same model" in err


def test_check_vocabulary(prepared):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared / "model")
    check_vocabulary({"vocab_size": 100, "model": "m"}, prepared / "model", tok, "the server")  # the same model
    with pytest.raises(
        ValueError, match=r"the server serves a model with vocab_size 151936 \(qwen\), but --model .* has 100"
    ):
        check_vocabulary({"vocab_size": 151936, "model": "qwen"}, prepared / "model", tok, "the server")
    # a directory without config.json (the demo's output root): only the tokenizer is checked
    with pytest.raises(ValueError, match="the tokenizer of .* has 100 tokens, more than the vocab_size 64"):
        check_vocabulary({"vocab_size": 64, "model": "m"}, prepared, tok, "the server")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sets", "gsm8k,aime"], "unknown eval set 'aime'"),
        (["--sets", "math500", "--data", "/nonexistent/dir"], "eval data directory /nonexistent/dir does not exist"),
        (["--n", "4"], "greedy samples are all the same"),
        (["--tokenizer", str(FIXTURES)], "holds no tokenizer"),
    ],
)
def test_bad_input_is_named_before_any_engine_starts(prepared, tmp_path, capsys, extra, message):
    argv = ["eval", "--model", str(prepared / "model"), "--data", DATA, "--out", str(tmp_path / "o"), *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "rollout_server.log").exists()
