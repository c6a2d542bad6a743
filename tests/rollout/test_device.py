"""`cisjax serve --device`: the platform vLLM picked is checked against the one asked for; --cpus pins the server."""

import os
import subprocess
import sys

import grpc
import pytest

from cisjax import errors
from cisjax.commands import serve
from cisjax.rollout import backend, vllm_platform


def test_device_is_a_vllm_option(capsys):
    assert serve.main(["--backend", "transformers", "--model", "m", "--port", "0", "--device", "tpu"]) == 2
    assert "--device are vllm options" in capsys.readouterr().err


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
    assert res.returncode == 2 and res.stderr.startswith("cisjax serve: error: --max-model-len"), res.stderr
    code = (
        "import sys, cisjax.commands.serve; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'torch', 'vllm', 'ml_collections') "
        "or m.startswith(('cisjax.train', 'cisjax.models'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
