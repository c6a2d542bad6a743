"""`cisjax bench export` and `cisjax bench rollout` end to end at toy sizes, each in a subprocess (they start a rollout
server; the rollout bench also runs a vLLM engine in its own process). The numbers are not checked: benches report,
tests don't time. With CISJAX_SKIP_VLLM=1 the rollout bench is skipped (but for --jax --exact, which runs no vLLM)
and the export bench reloads into the transformers backend."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): rollout servers on the real engine

SKIP_VLLM = os.environ.get("CISJAX_SKIP_VLLM") == "1"
# hidden / expert widths multiples of 32 (vLLM's CPU MoE kernel pads others); head_dim 32
TINY_MODEL = [
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--experts",
    "4",
    "--top-k",
    "2",
    "--moe-intermediate",
    "32",
    "--shared-intermediate",
    "64",
    "--vocab",
    "256",
]


def _bench(argv, tmp_path, target="target >=") -> dict:
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [sys.executable, "-m", "cisjax.cli", "bench", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # the benches set the vLLM environment (cisjax.rollout.engine_env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert target in res.stdout, res.stdout
    return json.loads(out.read_text())


def test_bench_export_tiny(tmp_path):
    backend = "transformers" if SKIP_VLLM else "vllm"
    res = _bench(
        [
            "export",
            *TINY_MODEL,
            "--repeats",
            "1",
            "--backend",
            backend,
            "--server-dtype",
            "float32",
            "--dir",
            str(tmp_path / "disk"),
        ],
        tmp_path,
    )
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "export", "reload", "export_reload", "stream", "stream_params"}
    assert res["bytes"] > 0 and res["tensor_bytes"] > 0 and res["params"] > 0
    for r in rows.values():
        assert r["seconds"] > 0 and r["bytes_per_s"] > 0 and r["ratio"] > 0, r
    assert res["headline"] == "export_reload" and res["ratio"] == rows["export_reload"]["ratio"]
    assert isinstance(res["meets_target"], bool) and res["target_ratio"] == 0.5
    assert set(res["export_breakdown_s"]) == {
        "save",
        "save_convert",
        "save_write_fsync",
        "manifest",
        "sha256_pass",
        "commit_prune",
    }
    assert res["server_exit_code"] == 0
    assert not any((tmp_path / "disk").iterdir()), "the bench leaves nothing behind in --dir"


def test_bench_export_delta_tiny(tmp_path):
    """Three trainer steps at a large lr, each version published as a delta and whole; the delta server killed before
    the second publish comes back and is sent the full set."""
    res = _bench(
        ["export", "--delta", *TINY_MODEL, "--steps", "3", "--lr", "1e-3", "--backend", "transformers", "--seq", "16"],
        tmp_path,
        target="target <=",
    )
    steps = res["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["restarted"] for s in steps] == [False, True, False]
    assert res["full_sends"] == [1, 1, 0] and res["restart_full_set"] and res["canary_all_ok"]
    full = steps[0]["full"]["bytes"]
    assert all(s["full"]["bytes"] == full and s["full"]["full_sends"] is None for s in steps)
    assert steps[0]["delta"]["bytes"] == full and 0 < steps[2]["delta"]["bytes"] <= full
    assert 0 < steps[2]["delta"]["changed_fraction"] <= 1 and res["bytes_ratio"] == steps[2]["delta"]["bytes"] / full


@pytest.mark.skipif(SKIP_VLLM, reason="CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine")
def test_bench_rollout_tiny(tmp_path):
    res = _bench(
        [
            "rollout",
            *TINY_MODEL,
            "--prompts",
            "4",
            "--prompt-len",
            "8",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--lengths",
            "varied",
            "--clients",
            "2",
            "--repeats",
            "1",
            "--jax",
            "--tls",
        ],
        tmp_path,
    )
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"inproc", "grpc", "grpc_concurrent", "grpc_jax", "grpc_tls"}
    # --lengths varied: the random model's last 8 tokens stop a sample, 1 in 4 tokens on average at this length
    assert res["requests"]["stop_token_ids"] == list(range(256 - 8, 256))
    made = rows["inproc"]["tokens"]
    assert res["lengths"]["min"] < 8 and res["lengths"]["max"] <= 8 and made == 4 * 2 * res["lengths"]["mean"]
    for r in rows.values():
        assert r["tokens"] <= 4 * 2 * 8, r
        assert r["median_s"] > 0 and r["tokens_per_s"] > 0 and r["ratio"] > 0, r
    assert rows["grpc"]["tokens"] == rows["grpc_tls"]["tokens"] == made  # the same engine and seeds: the same samples
    assert res["ratio"] == rows["grpc"]["ratio"] and res["ratio_concurrent"] == rows["grpc_concurrent"]["ratio"]
    assert rows["grpc"]["server_prompts_in_flight"] > 0
    assert isinstance(res["meets_target"], bool) and res["target_ratio"] == 0.9
    assert res["compared_samples"] == 8 and 0 <= res["identical_samples"] <= 8
    assert res["server_exit_code"] == 0 and res["jax_server_exit_code"] == 0 and res["tls_server_exit_code"] == 0
    assert res["ratio_tls_vs_plain"] == pytest.approx(rows["grpc_tls"]["tokens_per_s"] / rows["grpc"]["tokens_per_s"])
    assert res["ratio_tls_vs_plain_paired"] > 0
    # the JAX sampler's programs apart, over the timed round: the 4 prompts, 8 samples x 8 tokens
    ph = res["jax_phases"]
    assert (
        ph["prefill_tokens"] == res["requests"]["prompt_tokens"] and ph["decode_tokens"] == rows["grpc_jax"]["tokens"]
    )
    assert ph["decode_steps"] == 8 and ph["decode_rows"] == 4 * 2
    assert ph["prefill_tokens_per_s"] > 0 and ph["decode_tokens_per_s"] > 0 and ph["decode_slot_use"] <= 1.0
    # the bytes its steps read, against no listed bandwidth on a CPU: the roofline omitted, said why
    assert ph["decode_bytes_per_s"] > 0 and ph["device_kind"] == "cpu" and ph["decode_roofline"] is None
    assert "no memory bandwidth listed" in ph["decode_roofline_omitted"]


def test_bench_rollout_exact_tiny(tmp_path):
    """--jax --exact: the exact and the plain JAX samplers alone (no vLLM), their tokens/s and the ratio."""
    argv = ["rollout", *TINY_MODEL, "--prompts", "3", "--prompt-len", "8", "--n", "2", "--max-new-tokens", "8"]
    res = _bench([*argv, "--repeats", "2", "--jax", "--exact"], tmp_path)
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"jax", "exact"} and res["mode"] == "exact"
    for r in rows.values():  # --lengths fixed: every sample runs to its 8 tokens
        assert r["tokens"] == 3 * 2 * 8 and r["median_s"] > 0 and r["tokens_per_s"] > 0, r
    assert rows["jax"]["ratio"] == 1.0 and res["ratio"] == rows["exact"]["ratio"]
    assert res["ratio"] == pytest.approx(rows["exact"]["tokens_per_s"] / rows["jax"]["tokens_per_s"])
    assert res["ratio_paired"] > 0 and len(res["times_s"]["exact"]) == len(res["times_s"]["jax"]) == 2
    assert isinstance(res["meets_target"], bool) and res["target_ratio"] == 0.5
    assert res["server_exit_codes"] == {"jax": 0, "exact": 0}


@pytest.mark.skipif(SKIP_VLLM, reason="CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine")
def test_bench_rollout_replicas_tiny(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--replicas 2 pins a core to each replica: needs two")
    res = _bench(
        [
            "rollout",
            "--replicas",
            "2",
            *TINY_MODEL,
            "--prompts",
            "4",
            "--prompt-len",
            "8",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--repeats",
            "2",
        ],
        tmp_path,
    )
    rows = {r["key"]: r for r in res["rows"]}
    assert set(rows) == {"one", "fleet", "wide"}
    for r in rows.values():
        assert r["tokens"] == 4 * 2 * 8, r  # EOS ignored: every sample has max_new_tokens
        assert r["median_s"] > 0 and r["tokens_per_s"] > 0 and r["ratio"] > 0 and r["ratio_paired"] > 0, r
    assert rows["one"]["ratio"] == 1.0
    assert res["ratio"] == rows["fleet"]["ratio"] and res["ratio_wide"] == rows["wide"]["ratio"]
    assert isinstance(res["meets_target"], bool) and res["target_ratio"] == 1.6
    cores = res["replica_cores"]
    assert len(cores) == 2 and cores[0] != cores[1]  # a core each
    assert all(t > 0 for t in res["fleet_tokens_per_replica"]), res  # both replicas served
    # versions 1..4: round 1 publishes to replica 0 (1), then to both (2); round 2 in turn to both (3), then replica 0 (4)
    assert res["fleet_versions"] == [3, 3]
    p = res["publish"]
    assert p["export_s"] > 0 and p["reload_1_s"] > 0 and p["reload_n_s"] > 0 and p["ratio"] > 0, p
    assert len(res["publish_s"]["reload_n"]) == 2 and isinstance(res["meets_publish_target"], bool)
    assert res["compared_samples"] == 8
    assert set(res["server_exit_codes"].values()) == {0}
