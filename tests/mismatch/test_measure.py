"""`cisjax mismatch measure` end to end: the demo's tiny MoE sampled by the real vLLM engine (or the JAX sampler),
rescored by XLA and scored by the other engines."""

import argparse
import json
import os
import shutil

import numpy as np
import pytest

if os.environ.get("CISJAX_SKIP_VLLM") == "1":
    pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine", allow_module_level=True)
import vllm  # noqa: E402,F401  (a broken or missing install must fail the suite, not skip it)

from cisjax.commands import mismatch as command  # noqa: E402
from cisjax.mismatch import engines, records  # noqa: E402

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): the real vLLM engine

N_PROMPTS, N, NEW, TOPK, PROBES = 4, 2, 8, 20, 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory, prepared):
    """The tiny MoE, and a vLLM, a transformers and a JAX server on it (fp32: the engines agree to ~1e-5), once per
    module."""
    from cisjax.rollout.client import RolloutClient
    from cisjax.rollout.launch import ChildServer

    root = tmp_path_factory.mktemp("measure")
    (root / "exports").mkdir()
    started = []
    try:
        for backend in ("vllm", "transformers", "jax"):
            s = ChildServer(
                backend=backend,
                model_dir=str(prepared / "model"),
                export_root=str(root / "exports"),
                dtype="float32",
                log_path=root / f"{backend}.log",
                startup_s=300,
            )
            started.append(s)
        for s in started:
            with RolloutClient(s.target) as c:
                s.wait_ready(c)
        yield {
            "model": prepared / "model",
            "data": prepared / "data" / "heldout.jsonl",
            "vllm": started[0].target,
            "transformers": started[1].target,
            "jax": started[2].target,
            "root": root,
        }
    finally:
        for s in started:
            s.stop()


def _args(servers, out, **kw):
    p = argparse.ArgumentParser()
    command.add_args(p)
    argv = [
        "measure",
        "--out",
        str(out),
        "--model",
        str(servers["model"]),
        "--prompts",
        str(servers.get("prompts", servers["data"])),
        "--kind",
        "gsm8k",
        "--num-prompts",
        str(N_PROMPTS),
        "--n",
        str(N),
        "--max-new-tokens",
        str(NEW),
        "--seed",
        "3",
        "--server",
        servers["vllm"],
        "--transformers-server",
        servers["transformers"],
        "--jax-server",
        servers["jax"],
        "--no-progress",
    ]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def measured(servers):
    out = servers["root"] / "out"
    args = _args(
        servers,
        out,
        pairs="xla-vllm,xla-transformers",
        dtype="float32",
        topk=TOPK,
        probe_positions=PROBES,
        routing=True,
    )
    assert command.run(args, []) == 0
    return out


def test_pairs_load_with_consistent_tokens(measured, servers):
    hf = json.loads((servers["model"] / "config.json").read_text())
    ms = [records.load(d) for d in records.find([measured])]
    assert [m.meta["pair"] for m in ms] == ["xla-transformers", "xla-vllm"]
    a, b = ms
    for k in ("seq_id", "position", "token_id", "logp"):
        np.testing.assert_array_equal(a.tokens[k], b.tokens[k])  # the same sampled tokens and XLA scores in both pairs
    for m in ms:
        t, meta = m.tokens, m.meta
        assert meta["prompts"] == N_PROMPTS and meta["sequences"] == N_PROMPTS * N and meta["n"] == N
        assert meta["vocab_size"] == hf["vocab_size"] and meta["xla_dtype"] == "float32"
        lengths = np.bincount(t["seq_id"], minlength=N_PROMPTS * N)
        assert m.n_tokens == lengths.sum() == meta["tokens"] and lengths.max() <= NEW
        for s in range(N_PROMPTS * N):  # positions count 0.. within each response
            np.testing.assert_array_equal(t["position"][t["seq_id"] == s], np.arange(lengths[s]))
        assert np.all(np.isfinite(t["logp"])) and np.all(np.isfinite(t["logq"]))
        assert np.all((t["token_id"] >= 0) & (t["token_id"] < hf["vocab_size"]))
        log_k = t["logp"] - t["logq"]
        assert np.max(np.abs(log_k)) < 1e-3, np.max(np.abs(log_k))  # fp32 everywhere: the engines agree
        assert meta["control_rescore_max_abs_diff"] == 0.0
        assert abs(meta["mean_k"] - 1) < 1e-3
        assert meta["xla_float32_rescore_tokens_per_s"] > 0
        # top-K at the probed positions: the sampled-token logprob among each side's top-K where it is in it
        k = m.topk
        assert k["ids_p"].shape == k["ids_q"].shape == k["logp_p"].shape == (PROBES, TOPK)
        assert len(np.unique(k["token_index"])) == PROBES
        assert np.mean(k["ids_p"][:, 0] == k["ids_q"][:, 0]) == 1.0
        np.testing.assert_allclose(k["logp_p"], k["logp_q"], atol=1e-3)
        hits = 0
        for j, t in enumerate(k["token_index"]):  # the probes see the prefix of the token itself: its logprob is there
            where = np.flatnonzero(k["ids_p"][j] == t_id[t]) if (t_id := m.tokens["token_id"]) is not None else []
            if len(where):
                hits += 1
                assert abs(k["logp_p"][j, where[0]] - m.tokens["logp"][t]) < 1e-4
        assert (
            hits >= 1
        )  # the untrained model is near uniform over its 100 ids: some sampled tokens are outside the top 20
        r = m.routing
        moe_layers = hf["num_hidden_layers"]
        assert r["experts_p"].shape == r["experts_q"].shape == (moe_layers, PROBES, hf["num_experts_per_tok"])
        np.testing.assert_array_equal(r["token_index"], k["token_index"])
        assert meta["routing_agreement"] > 0.95


def test_replay_pair_rescores_with_the_engines_routing(servers, tmp_path):
    """--replay: a second XLA pass with vLLM's routing of every position replayed, measured as xla_replay-vllm beside
    xla-vllm on the same tokens. All fp32: the replayed forward matches the engine as closely as the plain one (ids
    replayed at the wrong positions or from another sample would move logprobs by far more); the routers' own choice
    agrees with the engine's almost everywhere. With --topk, the replayed side reports its top-K at the probes too."""
    out = tmp_path / "out"
    args = _args(
        servers, out, pairs="xla-vllm", dtype="float32", replay=True, routing=True, topk=TOPK, probe_positions=PROBES
    )
    assert command.run(args, []) == 0
    ms = {m.meta["pair"]: m for m in (records.load(d) for d in records.find([out]))}
    assert sorted(ms) == ["xla-vllm", "xla_replay-vllm"]
    plain, replayed = ms["xla-vllm"], ms["xla_replay-vllm"]
    np.testing.assert_array_equal(plain.tokens["logq"], replayed.tokens["logq"])
    assert replayed.meta["routing_replay"] is True and replayed.meta["side_p"].endswith("routing replayed")
    assert 0.0 <= replayed.meta["router_flip_frac"] < 0.05
    assert np.max(np.abs(replayed.tokens["logp"] - replayed.tokens["logq"])) < 1e-3
    assert replayed.routing["experts_p"].shape == plain.routing["experts_p"].shape
    # top-K: the same probes, the engine's side identical, the replayed XLA side next to the plain one
    np.testing.assert_array_equal(replayed.topk["token_index"], plain.topk["token_index"])
    np.testing.assert_array_equal(replayed.topk["ids_q"], plain.topk["ids_q"])
    assert replayed.topk["ids_p"].shape == (PROBES, TOPK)
    assert np.mean(replayed.topk["ids_p"][:, 0] == replayed.topk["ids_q"][:, 0]) >= 0.95
    np.testing.assert_allclose(replayed.topk["logp_p"][:, 0], replayed.topk["logp_q"][:, 0], atol=1e-3)


def test_perturbed_engine_mismatch_grows_with_the_dial(servers, tmp_path):
    """--perturb: the vLLM child serves a perturbed copy (seeded noise), XLA rescores the original; all fp32, so ε is
    the perturbation's. sd(ε) of the same prompts grows with the noise; the same seed reproduces the copy exactly."""
    from cisjax.mismatch import stats as S

    sd, copies = {}, {}
    for scale in (0.02, 0.1):
        out = tmp_path / f"noise{scale}"
        args = _args(servers, out, pairs="xla-vllm", dtype="float32", engine_dtype="float32", num_prompts=2)
        args.server = args.transformers_server = args.jax_server = None
        args.perturb, args.perturb_scale, args.perturb_seed = "noise", scale, 5
        assert command.run(args, []) == 0
        m = records.load(out / "xla-vllm")
        assert m.meta["perturb"]["kind"] == "noise" and abs(m.meta["perturb"]["rel_rms"] - scale) < 0.2 * scale
        sd[scale] = S.eps_stats(m.tokens["logp"], m.tokens["logq"])["sd"]
        copies[scale] = (out / "engine_model" / "v000000" / "model.safetensors").read_bytes()
    assert 0 < sd[0.02] < sd[0.1], sd
    args = _args(servers, tmp_path / "again", pairs="xla-vllm", num_prompts=1)
    args.server = args.transformers_server = args.jax_server = None
    args.perturb, args.perturb_scale, args.perturb_seed = "noise", 0.02, 5
    path, _ = engines.perturbed_copy(
        servers["model"], tmp_path / "again_model", kind=args.perturb, scale=args.perturb_scale, seed=args.perturb_seed
    )
    assert (path / "model.safetensors").read_bytes() == copies[0.02]
    with pytest.raises(Exception, match="drop --server"):
        bad = _args(servers, tmp_path / "bad", pairs="xla-vllm")
        bad.perturb, bad.perturb_scale = "int8", 0.0
        command.run(bad, [])


def test_bad_inputs_are_named(servers, tmp_path):
    with pytest.raises(ValueError, match="--replay .* needs --sampler vllm"):
        command.run(_args(servers, tmp_path / "r", sampler="jax", pairs="xla-jax", replay=True), [])
    with pytest.raises(ValueError, match="unknown engine pair.*xla-sglang"):
        command.run(_args(servers, tmp_path / "a", pairs="xla-vllm,xla-sglang"), [])
    with pytest.raises(FileNotFoundError, match="--prompts .*no such file"):
        command.run(_args(servers, tmp_path / "b", prompts=tmp_path / "missing.jsonl"), [])
    with pytest.raises(FileNotFoundError, match="--model .*not a Hugging Face model directory"):
        command.run(_args(servers, tmp_path / "c", model=tmp_path / "no_model"), [])
    with pytest.raises(FileNotFoundError, match="no dumps"):
        args = _args(servers, tmp_path / "d", dump=tmp_path)
        args.model = args.prompts = None
        command.run(args, [])
    # a --model whose vocabulary differs from the server's model: named before anything is sampled
    other = tmp_path / "other_model"
    shutil.copytree(servers["model"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size .* not the same model"):
        command.run(_args(servers, tmp_path / "e", model=other), [])
    assert not (tmp_path / "e" / "xla-vllm").exists()


def test_child_servers_and_the_other_pairs(servers, tmp_path):
    """No --server: measure starts (and stops) its own vLLM and transformers servers, bf16 as the paper's engines."""
    args = _args(servers, tmp_path / "out", pairs="vllm-transformers,xla_bf16-xla_fp32", routing=True, num_prompts=2)
    args.server = args.transformers_server = args.jax_server = None
    assert command.run(args, []) == 0
    vt, bf = (records.load(tmp_path / "out" / p) for p in ("vllm-transformers", "xla_bf16-xla_fp32"))
    assert vt.meta["side_p"] == "transformers/bfloat16 (Score)" and vt.meta["side_q"] == "vllm/bfloat16 (sampling)"
    assert bf.meta["side_p"] == "xla/bfloat16" and bf.meta["side_q"] == "xla/float32"
    assert vt.meta["control_rescore_max_abs_diff"] is None and bf.meta["control_rescore_max_abs_diff"] == 0.0
    for m in (vt, bf):
        log_k = m.tokens["logp"] - m.tokens["logq"]
        assert 0 < np.max(np.abs(log_k)) < 0.1  # bf16 on one side: a small, nonzero mismatch
        assert m.routing["experts_p"].shape[:2] == (2, m.n_tokens)  # no probes: routing at every token
    np.testing.assert_array_equal(vt.tokens["token_id"], bf.tokens["token_id"])
    assert (tmp_path / "out" / "servers" / "vllm.log").is_file()


def test_three_engines_on_the_jax_samplers_tokens(servers, tmp_path):
    """--sampler jax: cisjax's JAX sampler samples, the trainer (XLA) rescores and vLLM scores the same tokens, all in
    fp32. The sampler runs the trainer's kernels behind a KV cache: its sampling logprobs equal the trainer's rescoring
    to 1e-4 and its routers choose what the trainer's do; vLLM (other kernels) agrees to float noise."""
    out = tmp_path / "out"
    pairs = ("xla-jax", "jax-vllm", "xla-vllm")
    args = _args(servers, out, pairs=",".join(pairs), sampler="jax", dtype="float32", routing=True)
    assert command.run(args, []) == 0
    m = {p: records.load(out / p) for p in pairs}
    sides = {p: (x.meta["side_p"], x.meta["side_q"]) for p, x in m.items()}
    assert sides == {
        "xla-jax": ("xla/float32", "jax/float32 (sampling)"),
        "jax-vllm": ("jax/float32 (sampling)", "vllm/float32 (Score)"),
        "xla-vllm": ("xla/float32", "vllm/float32 (Score)"),
    }
    assert {x.meta["sampler"] for x in m.values()} == {"jax"} and 0 < m["xla-jax"].n_tokens <= N_PROMPTS * N * NEW
    for p in pairs[1:]:
        np.testing.assert_array_equal(m[p].tokens["token_id"], m["xla-jax"].tokens["token_id"])  # one sample set
    max_abs_logk = {p: float(np.max(np.abs(x.tokens["logp"] - x.tokens["logq"]))) for p, x in m.items()}
    assert max_abs_logk["xla-jax"] <= 1e-4, max_abs_logk
    assert max(max_abs_logk.values()) < 1e-3, max_abs_logk  # fp32 engines: float noise, not another model
    routing = m["xla-jax"].routing
    agree = np.all(np.sort(routing["experts_p"], -1) == np.sort(routing["experts_q"], -1), axis=-1)
    assert agree.mean() >= 0.95  # the same routers on the same weights (a near-tie may flip)


def test_truncated_sampling_renormalised_over_the_support(servers, tmp_path):
    """--top-k 5 --top-p 0.8 on the JAX sampler (fp32): its q is cut and renormalised; the XLA side renormalised over
    each token's support equals it to 1e-4 (k = 1), while p over the whole vocabulary puts log k at the support's log
    mass (below 0 on every token whose support is not the whole of p's mass), which meta.json reports beside."""
    out = tmp_path / "out"
    args = _args(servers, out, pairs="xla-jax", sampler="jax", dtype="float32", top_k=5, top_p=0.8)
    assert command.run(args, []) == 0
    m = records.load(out / "xla-jax")
    tok = m.tokens
    assert m.meta["top_k"] == 5 and m.meta["top_p"] == 0.8 and m.meta["renormalised_over_support"]
    assert float(np.max(np.abs(tok["logp"] - tok["logq"]))) <= 1e-4
    full = tok["logp_full"] - tok["logq"]  # log of the support's mass under p
    assert np.all(full <= 1e-5) and np.mean(full) < -0.05, np.mean(full)
    np.testing.assert_allclose(m.meta["control_mean_k_full_vocabulary"], np.mean(np.exp(full)), rtol=1e-5)
    assert abs(m.meta["mean_k"] - 1) < 1e-4 < 1 - m.meta["control_mean_k_full_vocabulary"]
    with pytest.raises(ValueError, match="the vllm sampler does not return"):
        command.run(_args(servers, tmp_path / "v", pairs="xla-vllm", top_k=5), [])
    with pytest.raises(ValueError, match="only pairs of an XLA side against the sampler"):
        command.run(_args(servers, tmp_path / "w", pairs="xla-jax,jax-vllm", sampler="jax", top_k=5), [])


def test_report_of_a_real_measurement_has_every_table_and_plot(measured, tmp_path):
    """The issue's end-to-end path: measure (real vLLM, top-K, routing) then report, every table and figure."""
    from cisjax import cli
    from tests.mismatch.test_report import HEADINGS

    out = tmp_path / "report"
    assert cli.main(["mismatch", "report", str(measured), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    for h in HEADINGS:
        if h != "### ε by training phase":  # phases exist in training dumps only
            assert h in md, h
    assert "Omitted for" not in md  # top-K and routing were measured: no table left out
    assert "identity k = p + (1−p)e^ε: max error" in md
    for name in (
        "ccdf_delta.png",
        "ccdf_eps.png",
        "eps_vs_uncertainty.png",
        "mad_vs_uncertainty.png",
        "plane_xla-vllm.png",
        "plane_xla-transformers.png",
    ):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md, name
    doc = json.loads((out / "summary.json").read_text())
    assert set(doc["measurements"]) == {"xla-vllm", "xla-transformers"}
    assert (out / "raw" / "xla-vllm.npz").is_file()
