"""`cisjax serve --device`: the platform vLLM picked is checked against the one asked for; --cpus pins the server."""

import os

import pytest

from cisjax import errors
from cisjax.rollout import server


def test_device_is_a_vllm_option(capsys):
    assert server.main(["--backend", "transformers", "--model", "m", "--port", "0", "--device", "tpu"]) == 2
    assert "--device are vllm options" in capsys.readouterr().err


@pytest.mark.slow  # imports vLLM in-process
def test_vllm_platform_is_checked():
    if os.environ.get("CISJAX_SKIP_VLLM") == "1":
        pytest.skip("CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine")
    from cisjax.rollout import vllm_backend

    here = vllm_backend.platform_name()
    assert vllm_backend.check_device("auto") == here == vllm_backend.check_device(here)
    other = "tpu" if here != "tpu" else "cpu"
    with pytest.raises(errors.UserError, match=f"--device {other}: vLLM runs on {here} here"):
        vllm_backend.check_device(other)


def test_bad_cpus_are_refused(capsys, tmp_path):
    assert server.main(["--backend", "transformers", "--model", str(tmp_path), "--port", "0", "--cpus", "1-0"]) == 2
    assert "empty range" in capsys.readouterr().err


def test_routing_refusal_says_why():
    class TPU(server.Backend):
        engine = "vllm"
        routing_unsupported = "routing capture is not available on vLLM's TPU backend"

    assert server._no_routing(TPU()) == (
        "the vllm backend does not return routing: routing capture is not available on vLLM's TPU backend"
    )
    assert server._no_routing(server.Backend()) == "the ? backend does not return routing"
