"""cisjax.bench.gpu_sampler (the GPU check's sampler part) at toy size on the CPU: prefill and decode tokens/s per
batch, the sampled tokens' logprobs against the trainer forward's, a profiler trace of one decode call, the time box;
transformers' generate on the same workload (gpu_torch_generate)."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import flax.nnx as nnx
import pytest

from cisjax.bench import gpu_parts, gpu_profile, gpu_sampler, gpu_torch_generate
from cisjax.engines.jax import costs
from cisjax.models import hf_io
from tests.test_launchers import REPO

BATCHES = [gpu_torch_generate.batch_key(p, n) for p, n in gpu_torch_generate.WORKLOAD["small"]["batches"]]


def _real(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """run("small") with a trace folder: (result, the results it saved on the way, the trace folder)."""
    trace = tmp_path_factory.mktemp("trace")
    saves = []
    res = gpu_sampler.run("small", time.time() + 600, lambda r: saves.append(json.loads(json.dumps(r))), trace)
    return res, saves, trace


@pytest.mark.slow
def test_prefill_and_decode_tokens_per_s_per_batch(sampled):
    res, saves, _ = sampled
    assert res["status"] == "ok" and res["init"]["status"] == "ok" and res["device_kind"] == "cpu"
    assert list(res["batches"]) == BATCHES
    for key, b in res["batches"].items():
        assert b["status"] == "ok", b
        assert b["full_length"]  # no stop token: every row decoded new_tokens tokens
        for phase in ("prefill", "decode"):
            f = b[phase]
            assert _real(f["first_call_s"]) and _real(f["median_s"]) and _real(f["tokens_per_s"]), (key, phase, f)
            assert f["timed_calls"] == gpu_torch_generate.TIMED_CALLS and "note" not in f
        assert b["prefill"]["tokens"] == b["prompts"] * b["prompt_len"]
        assert b["decode"]["tokens"] == b["rows"] * b["new_tokens"] == b["prompts"] * b["n"] * b["new_tokens"]
        assert _real(b["prefill"]["flops"]) and b["prefill"]["mfu"] is None  # no peak for a CPU: said once, above
        assert b["decode"]["roofline_fraction"] is None and "cpu" in b["decode"]["roofline_omitted"]
        assert b["decode"]["bytes_per_step"]["bytes"] > 0
        # the flat headline keys gpu_report reads
        assert b["prefill_tokens_per_s"] == b["prefill"]["tokens_per_s"] and _real(b["generate_tokens_per_s"])
        assert b["decode_tokens_per_s"] == b["decode"]["tokens_per_s"]
        assert b["decode_roofline"] is None and "cpu" in b["decode_roofline_omitted"]
    assert "cpu" in res["mfu_omitted"] and "cpu" in res["roofline_omitted"]
    assert len(saves) >= 1 + len(BATCHES) + 3 and saves[-1] == json.loads(json.dumps(res))


@pytest.mark.slow
def test_sampled_logprobs_agree_with_the_trainer_forward(sampled):
    """fp32: the sampler's q and the trainer's p of the same tokens agree to float rounding (measured 1.9e-7 mean,
    4.8e-7 max); read one position off, p differs by 0.15 mean, 0.51 max even on this toy's near-flat distributions
    (log q = -6.23 +- 0.13 over 512 ids). bf16 (the trainer's bf16 forward of the fp32 weights rounded as published):
    measured 5e-6 mean, 3e-4 max."""
    res, _, _ = sampled
    fp32, bf16 = res["agreement"]["float32"], res["agreement"]["bfloat16"]
    assert fp32["status"] == bf16["status"] == "ok"
    assert fp32["finite"] and bf16["finite"] and fp32["tokens"] > 0 and bf16["tokens"] > 0
    assert fp32["mean_abs_log_k"] < 1e-5 and fp32["max_abs_log_k"] < 1e-4, fp32
    assert bf16["mean_abs_log_k"] < 0.01 and bf16["max_abs_log_k"] < 0.1, bf16


@pytest.mark.slow
def test_a_trace_of_one_decode_call(sampled):
    res, _, trace = sampled
    prof = res["profile"]
    assert prof["status"] == "ok"
    names = sorted(p.name for p in trace.iterdir())  # flat: the GPU machine's tool brings back no deep folders
    assert (
        names
        == sorted(Path(f["path"]).name for f in prof["files"])
        == [
            "sampler_decode_small.trace.json.gz",
            "sampler_decode_small.xplane.pb",
        ]
    )
    for f in prof["files"]:
        assert Path(f["path"]).stat().st_size == f["bytes"] > 0 and not f["over_limit"]
    # the CPU backend records host events only: said, and the host's top events listed instead
    assert prof["device_events"] == 0 and prof["top_source"] == "host" and "no device events" in prof["note"]
    assert 0 < len(prof["top"]) <= gpu_profile.TOP and all(t["total_us"] >= 0 for t in prof["top"])


def test_units_past_the_deadline_are_skipped_saying_so(tmp_path):
    saves = []
    res = gpu_sampler.run("small", time.time() - 1, saves.append, tmp_path)
    units = [res["init"], res["profile"], *res["batches"].values(), *res["agreement"].values()]
    assert len(units) == 3 + len(BATCHES) + 1
    for u in units:
        assert u["status"] == "skipped" and "time box" in u["reason"], u
    assert not any(tmp_path.iterdir())  # no trace taken


def test_full_cut_counts_and_kv_cache_by_hand():
    """The full-width 4-layer Qwen1.5-MoE cut (abstract: nothing allocated). Per layer: q, k, v 2048 x 2048 with
    biases, o 2048 x 2048, two norms, the router 2048 x 60, the shared expert 3 x 2048 x 5632 and its 2048 x 1 gate;
    then the final norm and the 2048 x 151,936 unembedding; the embedding table is gathered, not read. Routed experts:
    4 x 60 x 3 x 2048 x 1408. KV cache of 256 rows x 512 slots: 4 layers x (k, v) x 16 heads x 128 x 2 bytes."""
    hf, cfg = gpu_parts.model_of("full", 512, gpu_sampler._sampler_kwargs("bfloat16"))
    model = nnx.merge(*hf_io.abstract_model(hf, cfg))
    counts = costs.param_counts(model)
    layer = 4 * 2048 * 2048 + 3 * 2048 + 2 * 2048 + 2048 * 60 + 3 * 2048 * 5632 + 2048
    assert counts["shared"] == 4 * layer + 2048 + 2048 * 151936
    assert counts["experts"] == 4 * 60 * 3 * 2048 * 1408 and (counts["num_experts"], counts["top_k"]) == (60, 4)
    assert counts["total"] == counts["shared"] + counts["experts"] + 151936 * 2048
    assert costs.kv_cache_bytes(model, 256, 512) == 4 * 2 * 256 * 512 * 16 * 128 * 2 == 4 * 2**30


def test_top_kernels_of_a_device_trace():
    """A GPU trace's layout: kernels on the device's stream lines (the derived XLA Ops line not counted again)."""
    meta = [
        dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
        dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #7(Compute)")),
        dict(ph="M", pid=1, tid=8, name="thread_name", args=dict(name="XLA Ops")),
        dict(ph="M", pid=2, name="process_name", args=dict(name="/host:CPU")),
    ]
    ev = lambda pid, tid, name, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=0, dur=dur)  # noqa: E731
    events = meta + [ev(1, 7, "gemm", 30), ev(1, 7, "gemm", 30), ev(1, 7, "softmax", 40), ev(1, 8, "fusion", 500)]
    got = gpu_profile.top_events(events + [ev(2, 3, "PjitFunction", 900)])
    assert got["top_source"] == "device stream lines" and got["device_events"] == 4 and got["host_events"] == 1
    assert [(t["name"], t["total_us"], t["count"]) for t in got["top"]] == [("gemm", 60.0, 2), ("softmax", 40.0, 1)]
    assert got["top"][0]["share"] == pytest.approx(0.6)


@pytest.mark.slow
def test_torch_generate_small():
    res = gpu_torch_generate.torch_generate("small", time.time() + 300, lambda r: None)
    assert res["status"] == "ok" and res["device"] == "cpu"
    assert list(res["batches"]) == BATCHES
    for b in res["batches"].values():
        assert b["status"] == "ok" and b["full_length"], b
        assert _real(b["tokens_per_s"]) and b["timed_calls"] == gpu_torch_generate.TIMED_CALLS


def test_timed_calls_stop_at_their_time_target_keeping_one(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_torch_generate, "TIMED_S", 0.05)
    times, note = gpu_torch_generate.timed_calls(lambda: (calls.append(1), time.sleep(0.03)), time.time() + 60, 0.03)
    # the first call always; a second would take the timed calls to ~0.06 s, past 0.05
    assert len(calls) == len(times) == 1 and times[0] >= 0.03 and "1 of 3 timed calls" in note
    monkeypatch.setattr(gpu_torch_generate, "TIMED_S", 10.0)
    times, note = gpu_torch_generate.timed_calls(lambda: None, time.time() + 60, 0.0)
    assert len(times) == gpu_torch_generate.TIMED_CALLS and note is None
    times, note = gpu_torch_generate.timed_calls(lambda: None, time.time() - 1, 0.0)  # past the deadline: none
    assert times == [] and "time box" in note


def test_the_torch_side_imports_no_jax():
    """The torch process's module (its workload constants too) loads without JAX."""
    code = "import sys, cisjax.bench.gpu_torch_generate; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_capture_lists_what_it_wrote(tmp_path):
    """A trace of a trivial call: jax's .trace.json.gz and .xplane.pb moved to NAME.*, sized; an .xplane.pb over the
    size limit is deleted, saying so."""
    import jax.numpy as jnp

    x = jnp.ones((64, 64))
    got = gpu_profile.capture(lambda: x @ x, tmp_path, "tiny", max_file_bytes=1)
    assert [Path(d["path"]).name for d in got["deleted"]] == ["tiny.xplane.pb"]
    (trace,) = got["files"]
    assert trace["path"] == str(tmp_path / "tiny.trace.json.gz") and trace["over_limit"]  # 1 byte: over, and kept
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.trace.json.gz"]  # jax's folders gone
    assert json.loads(gzip.open(trace["path"]).read())["traceEvents"]
