"""`cisjax mismatch report` end to end on synthetic measurements whose table entries are known by hand."""

import json
import math

import numpy as np
import pytest

from cisjax import cli
from cisjax.mismatch import records

N = 1000
N_SURE = 100  # tokens with p = q = 1 exactly: eps not finite
EPS_UP, EPS_DOWN = 1.5, -2.5
P_MOVED = 0.3

HEADINGS = (
    "## Checks",
    "### Controls",
    "## Per-logit perturbation δ (tab:appA_delta_stats)",
    "## δ by N_flip (tab:appA_routing)",
    "## Log-odds displacement ε (tab:appA_epsilon_stats)",
    "### ε by training phase",
    "## ε by confidence (tab:appA_confidence)",
    "## MAD of ε and log k over 18 log bins of 1 − p",
    "## Moments E[e^{αε}] and E[((1−p)e^ε)^α]",
    "## Share of Var(k) by side of k = 1",
    "## Truncation bias E[k − f(k)] per confidence bin, CIS vs TIS",
    "## Fraction of tokens each operator acts on",
    "## The p_train – p_infer plane",
)


def logq_from_eps(logp, eps):
    """Input construction only: log q with logit q = logit p - eps."""
    z = logp - math.log(-math.expm1(logp)) - eps
    return -math.log1p(math.exp(-z))


def measurement(pair, vocab, topk=True, phase=True):
    """N tokens: p in {0.3, 0.95, 0.9995} with q = p exactly, N_SURE with p = q = 1, and four moved tokens at
    p = 0.3: three with eps = +1.5 (k = 3.43: TIS and CIS truncate, IcePop keeps), one with eps = -2.5 (k = 0.357:
    IcePop masks it, the caps leave it)."""
    p = np.tile([0.3, 0.95, 0.9995], N)[: N - N_SURE]
    logp = np.concatenate([np.log(p), np.zeros(N_SURE)]).astype(np.float32)
    logq = logp.copy()
    moved = [0, 3, 6, 9]  # p = 0.3 (every third token)
    for i, e in zip(moved, (EPS_UP, EPS_UP, EPS_UP, EPS_DOWN)):
        logq[i] = logq_from_eps(float(logp[i]), e)
    tokens = dict(
        logp=logp,
        logq=logq,
        seq_id=np.repeat(np.arange(10), N // 10).astype(np.int32),
        position=np.tile(np.arange(N // 10), 10).astype(np.int32),
        token_id=np.arange(N, dtype=np.int32),
    )
    if phase:
        tokens["phase"] = (np.arange(N) * 3 // N).astype(np.int8)
    m = records.Measurement(
        meta={
            "pair": pair,
            "side_p": "xla/bfloat16",
            "side_q": "vllm/bfloat16",
            "model": pair,
            "vocab_size": vocab,
            "control_rescore_max_abs_diff": 0.0,
        },
        tokens=tokens,
    )
    if topk:
        # 2 positions, K = 3; ids {1, 2, 3} vs {1, 2, 4}: 2 pairs each; delta = logp_q - logp_p = 0, 0.6 | -1.2, 0
        m.topk = dict(
            token_index=np.array([5, 7]),
            ids_p=np.array([[1, 2, 3], [1, 2, 3]]),
            logp_p=np.array([[-0.5, -1.0, -2.0], [-0.2, -1.5, -3.0]]),
            ids_q=np.array([[1, 2, 4], [2, 1, 4]]),
            logp_q=np.array([[-0.5, -0.4, -2.5], [-1.5, -1.4, -3.5]]),
        )
        # 2 layers, top-2 experts: position 0 agrees everywhere (N_flip 0), position 1 differs in one layer
        m.routing = dict(
            token_index=np.array([5, 7]),
            experts_p=np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]]]),
            experts_q=np.array([[[1, 0], [2, 5]], [[0, 1], [3, 2]]]),
        )
    return m


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    a = records.save(root / "moe", measurement("xla-vllm-moe", 151936))
    b = records.save(root / "dense", measurement("xla-vllm-dense", 32000, topk=False, phase=False))
    out = root / "out"
    code = cli.main(["mismatch", "report", str(a), str(b), "--out", str(out), "--spearman-tokens", "500"])
    return code, out


def test_report_tables_and_known_values(two):
    code, out = two
    assert code == 0
    md = (out / "report.md").read_text()
    for h in HEADINGS:
        assert h in md, h
    assert "| | xla-vllm-moe | xla-vllm-dense |" in md.replace("|  |", "| |")
    assert "| Sampled tokens | 1,000 | 1,000 |" in md
    assert "| Finite ε | 900 | 900 |" in md
    assert "| Finite fraction | 90% | 90% |" in md
    assert "| P(\\|ε\\|>1) | 0.4444% | 0.4444% |" in md  # 4 / 900
    assert "| P(\\|ε\\|>2) | 0.1111% | 0.1111% |" in md  # 1 / 900
    assert "| tis | 0.3% | 0.3% |" in md and "| cis | 0.3% | 0.3% |" in md and "| icepop | 0.1% | 0.1% |" in md
    assert "identity k = p + (1−p)e^ε: max error" in md and "on 900 finite tokens" in md
    assert "control_rescore_max_abs_diff" in md
    # delta: 4 pairs, |delta| = 0, 0.6, 1.2, 0 -> P(|delta| > 0.5) = 50%, P(|delta| > 1) = 25%, max 1.2
    assert "| Paired entries | 4 |" in md and "| P(\\|δ\\|>0.5) | 50% |" in md and "| max \\|δ\\| | 1.2 |" in md
    assert "Omitted for xla-vllm-dense: no topk.npz" in md
    assert "**Warning:** the measurements come from different vocabularies" in md
    for name in (
        "ccdf_delta.png",
        "ccdf_eps.png",
        "eps_vs_uncertainty.png",
        "mad_vs_uncertainty.png",
        "plane_xla-vllm-moe.png",
        "plane_xla-vllm-dense.png",
    ):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert f"]({name})" in md, name


def test_summary_json_matches_hand_values(two):
    _, out = two
    doc = json.loads((out / "summary.json").read_text())
    moe, dense = doc["measurements"]["xla-vllm-moe"], doc["measurements"]["xla-vllm-dense"]
    for s in (moe, dense):
        e = s["eps_stats"]
        assert (e["tokens"], e["finite"]) == (N, N - N_SURE) and e["finite_frac"] == pytest.approx(0.9)
        assert e["frac_abs_gt_1"] == pytest.approx(4 / 900) and e["frac_abs_gt_2"] == pytest.approx(1 / 900)
        assert e["max_abs"] == pytest.approx(2.5, abs=1e-5)  # float32 log q
        assert s["identity"]["finite_tokens"] == 900 and s["identity"]["max_error"] < 1e-12
        acted = s["acted"]["acted_frac"]
        assert acted["tis"] == acted["cis"] == pytest.approx(3 / N) and acted["icepop"] == pytest.approx(1 / N)
        assert acted["seq_tis"] > 0  # seq_id is contiguous: sequence operators included
        # mean k: 996 tokens at k = 1, three at k = p / q(eps = 1.5), one at p / q(eps = -2.5)
        k = [math.exp(math.log(P_MOVED) - logq_from_eps(math.log(P_MOVED), e)) for e in (EPS_UP, EPS_DOWN)]
        assert s["controls"]["mean_k"] == pytest.approx((996 + 3 * k[0] + k[1]) / N, rel=1e-5)
        assert s["controls"]["control_rescore_max_abs_diff"] == 0.0
        assert sum(s["eps_by_confidence"]["tokens"]) == 900
    d = moe["delta_stats"]
    assert d["entries"] == 4 and d["frac_abs_gt_0.5"] == 0.5 and d["frac_abs_gt_1"] == 0.25
    r = moe["delta_by_nflip"]
    assert r["positions"][:2] == [1, 1] and r["entries"][:2] == [2, 2] and r["nflip_mean"] == 0.5
    assert r["frac_abs_gt_0.5"][:2] == [0.5, 0.5]  # N_flip 0: {0, 0.6}; N_flip 1: {1.2, 0}
    assert set(moe["eps_by_phase"]) == {"early", "middle", "late"} and "eps_by_phase" not in dense
    assert moe["eps_by_phase"]["late"]["finite"] == 333 - N_SURE  # tokens 667..999, the last 100 with p = 1
    assert "delta_stats" not in dense and len(doc["warnings"]) == 1
    raw = np.load(out / "raw" / "xla-vllm-moe.npz")
    assert raw["eps"].shape == (N,) and np.isnan(raw["eps"][-1])


def test_bitwise_agreement_by_hand(two):
    """996 of the 1,000 tokens have p = q bit for bit; the largest |log k| is the eps = -2.5 token's."""
    _, out = two
    doc = json.loads((out / "summary.json").read_text())
    logk = [abs(math.log(P_MOVED) - logq_from_eps(math.log(P_MOVED), e)) for e in (EPS_UP, EPS_DOWN)]
    for s in doc["measurements"].values():
        assert s["exact_frac"] == 996 / N
        assert s["max_abs_logk"] == pytest.approx(max(logk), rel=1e-5)  # float32 log q
    md = (out / "report.md").read_text()
    assert "exact frac (p = q) | max \\|log k\\| |" in md
    assert f"| 1,000 | 0.996000 | {max(logk):.4g} |" in md


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["mismatch", "report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "cisjax mismatch: error:" in err and "nowhere" in err and "no mismatch measurement" in err


def test_column_labels_tell_same_pair_measurements_apart():
    """Two dumps measured into lag0/train-dump and lag1/train-dump: the columns name lag0 and lag1; distinct pairs keep
    their pair's name; a collision left after that is numbered."""
    from cisjax.mismatch.report import _labels

    metas = [{"pair": "train-dump"}, {"pair": "train-dump"}, {"pair": "xla-vllm"}]
    paths = ["m/lag0/train-dump", "m/lag1/train-dump", "m/a/xla-vllm"]
    assert _labels(paths, metas) == ["train-dump (lag0)", "train-dump (lag1)", "xla-vllm"]
    assert _labels(["a/x", "b/x"], [{"pair": "p"}, {"pair": "p"}]) == ["p (x) #1", "p (x) #2"]
