"""The attention backend the vLLM backend requests: CPU_MLA for an fp32 MLA model on a CPU with AMX tiles."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cisjax.engines.vllm import backend as vb
from cisjax.engines.vllm import platform as vp

REPO = Path(__file__).resolve().parents[2]
SKIP_VLLM = pytest.mark.skipif(
    os.environ.get("CISJAX_SKIP_VLLM") == "1", reason="CISJAX_SKIP_VLLM=1: this machine cannot run the vLLM engine"
)
# vLLM's own test (vllm_platform.cpu_has_amx), without importing vLLM at collection: torch's answer is False off x86
HAS_AMX = torch.cpu._is_amx_tile_supported()

# (amx, dtype, mla, platform) -> the backend requested of vLLM (None: its own choice)
CHOICES = [
    (True, "float32", True, "cpu", "CPU_MLA"),  # AMX_MLA would refuse the fp32 weights
    (True, "float", True, "cpu", "CPU_MLA"),  # vLLM's other name for fp32
    (True, "float16", True, "cpu", "CPU_MLA"),  # AMX_MLA declares bf16 alone
    (True, "half", True, "cpu", "CPU_MLA"),
    (True, "bfloat16", True, "cpu", None),  # AMX_MLA's own dtype
    (True, "BFloat16", True, "cpu", None),
    (True, "auto", True, "cpu", None),  # 16-bit on a CPU: vLLM's
    (False, "float32", True, "cpu", None),  # no AMX: vLLM picks CPU_MLA itself
    (False, "bfloat16", True, "cpu", None),
    (True, "float32", False, "cpu", None),  # not MLA: CPU_ATTN, which takes fp32
    (False, "float32", False, "cpu", None),
    (True, "float32", True, "cuda", None),  # GPUs and TPUs: vLLM's
    (True, "float32", True, "tpu", None),
]


@pytest.mark.parametrize("amx,dtype,mla,platform,want", CHOICES)
def test_choose_attention(amx, dtype, mla, platform, want):
    choice = vp.choose_attention(amx=amx, dtype=dtype, mla=mla, platform=platform)
    assert choice.backend == want
    assert choice.why.startswith("requested: " if want else "vLLM's default")


def test_the_reasons_say_why():
    assert vp.choose_attention(amx=True, dtype="float32", mla=True, platform="cpu").why == (
        "requested: float32 weights, and this CPU has AMX tiles, whose AMX_MLA backend (vLLM's default there) takes "
        "only bfloat16 ones"
    )
    assert vp.choose_attention(amx=False, dtype="float32", mla=True, platform="cpu").why == (
        "vLLM's default: no AMX tiles on this CPU"
    )
    assert vp.choose_attention(amx=True, dtype="bfloat16", mla=True, platform="cpu").why == (
        "vLLM's default: bfloat16 weights on a CPU with AMX tiles"
    )
    assert vp.choose_attention(amx=True, dtype="float32", mla=False, platform="cpu").why == "vLLM's default"


def test_a_backend_named_in_the_engine_options_stands():
    assert vp.named_attention({"tensor_parallel_size": 1}) is None
    assert vp.named_attention({"attention_config": {"backend": "auto"}}) is None
    assert vp.named_attention({"attention_backend": "AMX_MLA"}) == "AMX_MLA"
    assert vp.named_attention({"attention_config": {"backend": "CPU_ATTN"}}) == "CPU_ATTN"
    theirs = {"tensor_parallel_size": 1, "attention_config": {"backend": "AMX_MLA"}}
    assert vp.request_attention(theirs, "CPU_MLA") == theirs
    assert vp.request_attention({"attention_backend": "AMX_MLA"}, "CPU_MLA") == {"attention_backend": "AMX_MLA"}


def test_the_request_joins_the_engine_options():
    assert vp.request_attention({"tensor_parallel_size": 1}, None) == {"tensor_parallel_size": 1}
    assert vp.request_attention({"tensor_parallel_size": 1}, "CPU_MLA") == {
        "tensor_parallel_size": 1,
        "attention_config": {"backend": "CPU_MLA"},
    }
    options = {"attention_config": {"use_non_causal": False}}
    assert vp.request_attention(options, "CPU_MLA") == {
        "attention_config": {"use_non_causal": False, "backend": "CPU_MLA"}
    }
    assert options == {"attention_config": {"use_non_causal": False}}  # not changed in place


def _backend(architecture, dtype, platform="cpu", **engine_options):
    b = vb.Backend.__new__(vb.Backend)  # no engine started: only what _attention_options reads
    b.architecture, b.dtype, b.platform = architecture, dtype, platform
    b.engine_options = {"tensor_parallel_size": 1, **engine_options}
    return b


def test_backend_requests_cpu_mla_for_fp32_deepseek_on_amx(monkeypatch):
    monkeypatch.setattr(vb, "cpu_has_amx", lambda: True)
    options, why = _backend("DeepseekV2ForCausalLM", "float32")._attention_options()
    assert options == {"tensor_parallel_size": 1, "attention_config": {"backend": "CPU_MLA"}}
    assert why.startswith("requested: float32 weights")
    for arch, dtype in [("DeepseekV2ForCausalLM", "bfloat16"), ("Qwen3MoeForCausalLM", "float32")]:
        assert _backend(arch, dtype)._attention_options()[0] == {"tensor_parallel_size": 1}
    theirs = _backend("DeepseekV2ForCausalLM", "float32", attention_backend="AMX_MLA")._attention_options()
    assert theirs == ({"tensor_parallel_size": 1, "attention_backend": "AMX_MLA"}, "set in the engine options")
    monkeypatch.setattr(vb, "cpu_has_amx", lambda: False)
    assert _backend("DeepseekV2ForCausalLM", "float32")._attention_options() == (
        {"tensor_parallel_size": 1},
        "vLLM's default: no AMX tiles on this CPU",
    )


# ----------------------------------------------------------------------------- against vLLM itself


@pytest.fixture
def deepseek_v2_dir(tiny_hf_dir):
    """The fp32 DeepSeek-V2 the vLLM family tests serve (sizes vLLM's CPU MLA kernels take)."""
    from tests.rollout.test_rollout_vllm_families import FAMILIES  # lazy: vllm (that module imports it)

    return tiny_hf_dir("deepseek_v2", **FAMILIES["deepseek_v2"][2])


@pytest.fixture
def restored_environ():
    """os.environ as it was: vLLM's CPU platform sets variables of its own while it checks a config."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@SKIP_VLLM
@pytest.mark.slow  # imports vLLM in-process
def test_amx_mla_dtypes_are_vllms():
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend  # lazy: vllm
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend  # lazy: vllm

    assert [str(d).removeprefix("torch.") for d in AMXMLABackend.supported_dtypes] == list(vp.AMX_MLA_DTYPES)
    assert torch.float32 in CPUMLABackend.supported_dtypes


@SKIP_VLLM
@pytest.mark.slow  # imports vLLM in-process
def test_the_request_joins_an_attention_config():
    from vllm.config.attention import AttentionConfig  # lazy: vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum  # lazy: vllm

    options = {"attention_config": AttentionConfig(use_non_causal=True)}
    config = vp.request_attention(options, "CPU_MLA")["attention_config"]
    assert config.backend == AttentionBackendEnum.CPU_MLA and config.use_non_causal
    assert options["attention_config"].backend is None
    assert vp.named_attention({"attention_config": config}) == "CPU_MLA"


@SKIP_VLLM
@pytest.mark.slow  # imports vLLM in-process
def test_vllm_takes_the_requested_cpu_mla_on_a_cpu_it_believes_has_amx(monkeypatch, deepseek_v2_dir, restored_environ):
    """vLLM's own config check and backend selector, with torch made to report AMX tiles (no model loaded): with the
    engine options the backend builds, CPU_MLA (block size 16); with the bare options, AMX_MLA, whose fp32 weight
    packing fails on a real AMX CPU."""
    from vllm.config import set_current_vllm_config  # lazy: vllm
    from vllm.engine.arg_utils import EngineArgs  # lazy: vllm
    from vllm.v1.attention import selector  # lazy: vllm

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert vp.cpu_has_amx()
    b = _backend("DeepseekV2ForCausalLM", "float32")
    options, _ = b._attention_options()

    def taken(engine_options):
        config = EngineArgs(
            model=deepseek_v2_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=128, **engine_options
        ).create_engine_config()
        assert config.model_config.use_mla
        selector._cached_get_attn_backend.cache_clear()  # keyed without the AMX answer
        try:
            with set_current_vllm_config(config):
                backend = selector.get_attn_backend(576, torch.float32, "auto", use_mla=True)
        finally:
            selector._cached_get_attn_backend.cache_clear()
        return backend.get_name(), config.cache_config.block_size

    assert taken(options) == ("CPU_MLA", 16)
    assert taken(b.engine_options) == ("AMX_MLA", 128)


@SKIP_VLLM
@pytest.mark.slow  # a real vLLM engine
@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX tiles (amx_tile): vLLM picks CPU_MLA here by itself")
def test_fp32_deepseek_v2_engine_loads_with_cpu_mla_on_an_amx_cpu(deepseek_v2_dir):
    """The real engine on an AMX CPU: fp32 DeepSeek-V2 loads (AMX_MLA would refuse its weights) with CPU_MLA and
    generates. In a child process, as the server runs it."""
    script = textwrap.dedent(
        """
        import json, logging, sys
        from cisjax.rollout.params import SamplingParams
        from cisjax.engines.vllm import backend as vllm_backend
        from cisjax.engines.vllm import platform as vllm_platform
        logging.basicConfig(level=logging.INFO)  # the engine's start-up log, on stderr
        b = vllm_backend.Backend(sys.argv[1], dtype="float32", max_model_len=128)
        params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, stop_token_ids=frozenset(),
                                seed=1, greedy=False, logprobs=0, return_routing=False)
        samples = b.submit_generate([1, 2, 3], 0, params).result(timeout=300)
        print(json.dumps({"amx": vllm_platform.cpu_has_amx(), "attention": b.attention,
                          "tokens": len(samples[0].token_ids)}))
        b.close()
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script, deepseek_v2_dir], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "attention: CPU_MLA (requested: float32 weights" in res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"amx": True, "attention": ["CPU_MLA"], "tokens": 4}
