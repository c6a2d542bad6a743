"""`cisjax score` end to end: jsonl in, logprobs out, equal to the torch reference."""

import json

import numpy as np
import pytest

from cisjax import cli, config, rows, sharding
from cisjax import score as score_lib
from tests.support.hf import SERVER_QWEN2_MOE, hf_forward, log_softmax

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir):
    """The tiny Qwen2-MoE of the transformers rollout-server tests (vocabulary VOCAB)."""
    return tiny_hf_dir("qwen2_moe", **SERVER_QWEN2_MOE)


def _items(seed=0, n=7):
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(1, 12), rng.randint(0, 15) if i else 0  # first item: empty response
        out.append({"prompt_ids": rng.randint(0, VOCAB, p).tolist(), "response_ids": rng.randint(0, VOCAB, r).tolist()})
    return out


def _write(path, items):
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return str(path)


def test_score_matches_reference(model_dir, tmp_path):
    items = _items()
    inp = _write(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    argv = [
        "score",
        "--model",
        model_dir,
        "--input",
        inp,
        "--output",
        str(out),
        "--dtype",
        "float32",
        "--entropy",
        "--routing",
        "--top-k",
        "3",
        "--no-progress",
        "--config.score.row_tokens=32",
        "--config.score.rows=2",
        "--config.logprobs.chunk_size=16",
    ]
    assert cli.main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(items)
    for it, got in zip(items, lines):
        seq = np.array([it["prompt_ids"] + it["response_ids"]])
        logits, routing = hf_forward(model_dir, seq)
        lp = log_softmax(logits[0])
        p, n = len(it["prompt_ids"]), seq.shape[1]
        want = lp[np.arange(p - 1, n - 1), seq[0, p:]]
        assert len(got["logprobs"]) == len(it["response_ids"])
        np.testing.assert_allclose(got["logprobs"], want, atol=1e-5)
        ent = -(np.exp(lp) * lp).sum(-1)[p - 1 : n - 1]
        np.testing.assert_allclose(got["entropy"], ent, atol=1e-5)
        top = np.argsort(-lp[p - 1 : n - 1], axis=-1)[:, :3]
        if len(top):
            np.testing.assert_array_equal(got["topk_ids"], top)
            np.testing.assert_allclose(got["topk_logprobs"], np.take_along_axis(lp[p - 1 : n - 1], top, -1), atol=1e-5)
        # routing of the pass that produced each response token (position before it), [token][layer][k]
        ours = np.sort(np.array(got["routing"]).reshape(len(it["response_ids"]), 2, 2), -1)
        np.testing.assert_array_equal(ours, np.transpose(routing[:, 0, p - 1 : n - 1], (1, 0, 2)))
        # and of the prompt's positions before them (0 .. P-2; packed rows: at the sequence's offset)
        ours = np.sort(np.array(got["prompt_routing"]).reshape(p - 1, 2, 2), -1)
        np.testing.assert_array_equal(ours, np.transpose(routing[:, 0, : p - 1], (1, 0, 2)))


def test_score_temperature(model_dir, tmp_path):
    items = _items(seed=1, n=3)
    inp = _write(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    assert (
        cli.main(
            [
                "score",
                "--model",
                model_dir,
                "--input",
                inp,
                "--output",
                str(out),
                "--dtype",
                "float32",
                "--temperature",
                "0.7",
                "--no-progress",
            ]
        )
        == 0
    )
    for it, got in zip(items, map(json.loads, out.read_text().splitlines())):
        seq = np.array([it["prompt_ids"] + it["response_ids"]])
        logits, _ = hf_forward(model_dir, seq)
        lp = log_softmax(logits[0] / 0.7)
        p, n = len(it["prompt_ids"]), seq.shape[1]
        np.testing.assert_allclose(got["logprobs"], lp[np.arange(p - 1, n - 1), seq[0, p:]], atol=1e-5)


@pytest.mark.slow  # a second compile of the scorer (bf16); the fast tier has the fp32 reference check
def test_score_bf16_close_to_fp32(model_dir, tmp_path):
    items = _items(seed=2, n=4)
    inp = _write(tmp_path / "in.jsonl", items)
    res = {}
    for dt in ("float32", "bfloat16"):
        out = tmp_path / f"{dt}.jsonl"
        assert (
            cli.main(
                ["score", "--model", model_dir, "--input", inp, "--output", str(out), "--dtype", dt, "--no-progress"]
            )
            == 0
        )
        res[dt] = np.concatenate([json.loads(x)["logprobs"] for x in out.read_text().splitlines()])
    diff = np.abs(res["float32"] - res["bfloat16"])
    assert 0 < diff.max() < 0.2  # bf16 really ran (differs) and is close


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt_ids": [1, 2], "response_ids": [3, 100]}', "outside the vocabulary"),
        ('{"prompt_ids": [], "response_ids": [3]}', "'prompt_ids' is empty"),
        ('{"prompt_ids": [1], "response_ids": "abc"}', "must be a list of token ids"),
        ("not json", "not JSON"),
    ],
)
def test_score_bad_input(model_dir, tmp_path, capsys, line, message):
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"prompt_ids": [1], "response_ids": [2]}\n' + line + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["score", "--model", model_dir, "--input", str(inp), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and ":2:" in err
    assert not out.exists()  # nothing half-written


def test_score_missing_model(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    assert (
        cli.main(
            ["score", "--model", str(tmp_path / "nope"), "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]
        )
        == 2
    )
    assert "config.json" in capsys.readouterr().err


def test_score_spec_reads_the_config():
    """One reading of the config for `cisjax score` and the mismatch observatory: moe_tile 0 means the dispatch's own."""
    spec = score_lib.ScoreSpec.from_config(config.load(None, ["--config.score.rows=3", "--config.model.moe_tile=0"]))
    assert spec.rows == 3 and spec.moe_tile is None
    assert score_lib.ScoreSpec.from_config(config.load(None, ["--config.model.moe_tile=256"])).moe_tile == 256
    # the rules resolved here, once: a frozen table (load_for_scoring and the scorer take it as it is)
    spec = score_lib.ScoreSpec.from_config(config.load(None, ["--config.sharding.rules.embed=none"]))
    assert isinstance(spec.rules, sharding.FrozenRules) and spec.rules == sharding.rules_from_config({"embed": None})


def test_timed_pass_equals_score_items(model_dir):
    """Scorer.run_timed (the observatory's passes over the same rows) gives score_items' results, and its seconds."""
    spec = score_lib.ScoreSpec.from_config(config.load(None, ["--config.score.row_tokens=32", "--config.score.rows=2"]))
    loaded = score_lib.load_for_scoring(model_dir, "float32", spec)
    assert loaded.config.vocab_size == VOCAB and loaded.rules is spec.rules
    items = [rows.Seq(it["prompt_ids"], it["response_ids"]) for it in _items(seed=3, n=5)]
    kw = dict(temperature=1.0, chunk_size=spec.chunk_size, row_tokens=spec.row_tokens, rows_per_call=spec.rows)
    want = score_lib.score_items(loaded.model, items, loaded.mesh, loaded.rules, progress=False, **kw)
    scorer = score_lib.Scorer(loaded.model, loaded.mesh, loaded.rules, top_k=0, **kw)
    got, seconds = scorer.run_timed(items, scorer.prepare(items))
    assert seconds > 0 and len(got) == len(items)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
        np.testing.assert_array_equal(a["routing"], b["routing"])
