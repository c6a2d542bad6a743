"""`cisjax serve --device`: the platform vLLM picked is checked against the one asked for; the transformers engine's
device and GPU memory share; each engine's options refused to the others; --cpus pins the server."""

import argparse
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from cisjax import errors
from cisjax.commands import serve
from cisjax.engines import transformers_backend
from cisjax.engines.vllm import platform as vllm_platform
from cisjax.rollout import backend


@pytest.mark.parametrize(
    "backend_name, flags, error",
    [
        ("transformers", ["--device", "tpu"], "--device tpu is a vllm option"),
        (
            "transformers",
            ["--tensor-parallel-size", "2"],
            "--max-model-len and --tensor-parallel-size are vllm options",
        ),
        ("transformers", ["--max-model-len", "64"], "--max-model-len and --tensor-parallel-size are vllm options"),
        ("jax", ["--device", "cuda"], "--gpu-memory-utilization and --device are vllm and transformers options"),
        ("jax", ["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization and --device are vllm and transformers"),
        ("transformers", ["--exact"], "--exact is a jax option"),
        ("vllm", ["--exact"], "--exact is a jax option"),
    ],
)
def test_engine_options_are_checked(capsys, backend_name, flags, error):
    assert serve.main(["--backend", backend_name, "--model", "m", "--port", "0", *flags]) == 2
    assert error in capsys.readouterr().err


def test_transformers_engine_takes_its_device_and_memory_share():
    args = argparse.Namespace(
        backend="transformers",
        mesh="",
        device="cuda",
        gpu_memory_utilization=0.45,
        tensor_parallel_size=1,
        max_model_len=0,
        exact=False,
    )
    assert serve._engine_options(args) == {"device": "cuda", "gpu_memory_utilization": 0.45}
    args.device, args.gpu_memory_utilization = "auto", 0.0
    assert serve._engine_options(args) == {"device": "auto", "gpu_memory_utilization": None}


def test_jax_exact_takes_fp32_weights_computed_in_its_dtype():
    args = argparse.Namespace(
        backend="jax", mesh="", device="auto", gpu_memory_utilization=0.0, tensor_parallel_size=1, max_model_len=0
    )
    for dtype in ("bfloat16", "float32"):
        args.exact, args.dtype = True, dtype
        assert serve._engine_options(args) == {"exact": True, "runtime": {"dtype": dtype, "param_dtype": "float32"}}
    args.exact = False
    assert serve._engine_options(args) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals without a GPU")
@pytest.mark.parametrize(
    "flags, error",
    [
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization 0.5: the transformers engine runs on the CPU"),
        (["--device", "cuda"], "--device cuda: torch sees no CUDA GPU here"),
        (["--device", "cpu", "--gpu-memory-utilization", "0.5"], "runs on the CPU here"),
    ],
)
def test_transformers_gpu_options_are_refused_without_a_gpu(capsys, flags, error):
    """Refused before the model loads (there is none: the check comes first)."""
    assert serve.main(["--backend", "transformers", "--model", "no/such/model", "--port", "0", *flags]) == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    "requested, cuda, got",
    [
        ("auto", True, "cuda"),
        ("auto", False, "cpu"),
        ("cpu", True, "cpu"),
        ("cpu", False, "cpu"),
        ("cuda", True, "cuda"),
    ],
)
def test_transformers_device_choice(requested, cuda, got):
    assert transformers_backend.choose_device(requested, cuda) == got


def test_transformers_device_choice_refusals():
    with pytest.raises(errors.UserError, match="--device cuda: torch sees no CUDA GPU"):
        transformers_backend.choose_device("cuda", False)
    with pytest.raises(errors.UserError, match="--device tpu: the transformers engine runs on auto | cpu | cuda"):
        transformers_backend.choose_device("tpu", True)
    assert transformers_backend.check_memory_fraction(None, "cpu") is None
    assert transformers_backend.check_memory_fraction(0.45, "cuda") == 0.45
    with pytest.raises(errors.UserError, match="runs on the CPU here"):
        transformers_backend.check_memory_fraction(0.45, "cpu")
    for bad in (1.5, -0.2):
        with pytest.raises(errors.UserError, match=r"is not a share in \(0, 1\]"):
            transformers_backend.check_memory_fraction(bad, "cuda")


@pytest.mark.parametrize(
    "backend_name, mesh, error",
    [
        ("vllm", "fsdp=2", "--mesh is a jax option"),
        ("jax", "fsdp", "AXIS=SIZE"),
        ("jax", "pipeline=2", "unknown mesh axes ['pipeline']"),
        ("jax", "fsdp=3", "needs 3 devices, have 8"),
    ],
)
def test_serving_mesh_is_checked(capsys, tmp_path, backend_name, mesh, error):
    argv = ["--backend", backend_name, "--model", str(tmp_path), "--port", "0", "--mesh", mesh]
    assert serve.main(argv) == 2
    assert error in capsys.readouterr().err


@pytest.mark.slow  # imports vLLM in-process
def test_vllm_platform_is_checked():
    if os.environ.get("CISJAX_SKIP_VLLM") == "1":
        pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine")
    here = vllm_platform.platform_name()
    assert vllm_platform.check_device("auto") == here == vllm_platform.check_device(here)
    other = "tpu" if here != "tpu" else "cpu"
    with pytest.raises(errors.UserError, match=f"--device {other}: vLLM runs on {here} here"):
        vllm_platform.check_device(other)


def test_bad_cpus_are_refused(capsys, tmp_path):
    assert serve.main(["--backend", "transformers", "--model", str(tmp_path), "--port", "0", "--cpus", "1-0"]) == 2
    assert "empty range" in capsys.readouterr().err


def test_routing_refusal_says_why():
    class TPU(backend.Backend):
        engine = "vllm"
        routing_unsupported = "routing capture is not available on vLLM's TPU backend"

    with pytest.raises(backend.RequestError) as err:
        backend.check_routing(TPU())
    assert str(err.value) == (
        "the vllm backend does not return routing: routing capture is not available on vLLM's TPU backend"
    )
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(backend.RequestError, match=r"^the \? backend does not return routing$"):
        backend.check_routing(backend.Backend())


def test_python_dash_m_rollout_server_is_the_serve_command():
    """`python -m cisjax.commands.serve` (how children are started) runs `cisjax serve`, importing neither jax nor the
    trainer."""
    res = subprocess.run(
        [sys.executable, "-m", "cisjax.commands.serve", "--backend", "transformers", "--model", "m", "--port", "0"]
        + ["--device", "tpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and res.stderr.startswith("cisjax serve: error: --device tpu is a vllm option"), (
        res.stderr
    )
    code = (
        "import sys, cisjax.commands.serve; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'torch', 'vllm', 'ml_collections') "
        "or m.startswith(('cisjax.train', 'cisjax.models'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_transformers_engine_on_its_device(tiny_hf_dir, device):
    """The model on `device` (a GPU: under its memory cap), the sampling on the host: seeded samples repeat, their
    logprobs are the rescoring's, a GPU samples the CPU's tokens, and a weight update is copied in place."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.support.engines import engine_params
    from tests.support.hf import SERVER_QWEN2_MOE

    model_dir = tiny_hf_dir("qwen2_moe", **SERVER_QWEN2_MOE)
    share = 0.3 if device == "cuda" else None
    b = transformers_backend.Backend(model_dir, dtype="float32", device=device, gpu_memory_utilization=share)
    assert b.device.type == device and b.memory_fraction == share
    assert {p.device.type for p in b.m.parameters()} == {device}
    prompt, params = [5, 17, 3, 88, 41], engine_params(n=3, seed=11, max_new_tokens=6, return_routing=True)
    first = b.generate(prompt, 0, params)
    assert [(s.token_ids, s.logprobs) for s in b.generate(prompt, 0, params)] == [
        (s.token_ids, s.logprobs) for s in first
    ]
    for s in first:
        rescored = b.score(prompt, s.token_ids, 1.0, 0)["logprobs"]
        np.testing.assert_allclose(s.logprobs, rescored, atol=1e-5)
        assert s.routing.shape[:2] == (len(s.token_ids), b.m.config.num_hidden_layers)
    if device == "cuda":  # the same seed gives the CPU's tokens (float32: the logits agree to ~1e-6)
        cpu = transformers_backend.Backend(model_dir, dtype="float32", device="cpu").generate(prompt, 0, params)
        assert [s.token_ids for s in cpu] == [s.token_ids for s in first]
        for a, c in zip(first, cpu):
            np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-4)
    model = b.m
    b.load_directory(model_dir, 5)
    assert b.m is model and b.version == 5 and {p.device.type for p in b.m.parameters()} == {device}
    assert [s.token_ids for s in b.generate(prompt, 0, params)] == [s.token_ids for s in first]
