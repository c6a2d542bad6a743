"""`cisjax plan` end to end: 2-layer cuts of the paper's models compiled for TPU v5p-16 and 8 H100s, on this CPU host."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import cli, sharding
from cisjax import config as config_lib
from cisjax.models import expert_parallel, gpu_grouped, moe
from cisjax.plan import hardware, planner, search
from cisjax.plan.programs import Compiled, loops_with_work, pallas_costs

# The XLA:TPU and XLA:GPU compiles of model cuts are marked `slow` (not in the fast tier, make test-fast); the row
# search, the argument errors and the TPU MoE dispatch are cheap and stay in it.

ROOT = Path(__file__).resolve().parents[2]
PAPER = {  # config -> (MoE layers, dense-MLP layers) in a 2-layer cut
    "qwen15_moe_a27b": (2, 0),
    "deepseek_v2_lite": (1, 1),
    "qwen3_30b_a3b": (2, 0),
    "qwen15_14b_dense": (0, 2),
}
# The one full paper-model compile: the train step of Qwen1.5-MoE-A2.7B's cut (GQA attention, MoE with shared
# experts, the head) at the paper's widths, which must fit (its rescoring and canary programs add a third to the
# compile time and are compiled on the narrow cut, with the whole report). The rest is compiled on narrow cuts: the paper
# model's config.json with its widths cut (NARROW) and everything else kept (layer kinds, MLA, dense-first layers,
# routing, top-k, shared experts, rope), so every layer kind and code path of the paper models is compiled for the
# TPU in a fraction of the time (2-layer train steps, quiet host: DeepSeek-V2-Lite 93 s at its widths, 34 s narrow;
# Qwen1.5-14B 71 s, 14 s). `make plan` compiles every paper model at its widths.
PAPER_WIDTHS = "qwen15_moe_a27b"
NARROW = {  # config -> the widths cut; every other key of the architecture stays
    "qwen15_moe_a27b": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=16,
        vocab_size=8192,
    ),
    "deepseek_v2_lite": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        vocab_size=8192,
    ),
    "qwen3_30b_a3b": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as the model's 32 / 4
        head_dim=64,
        num_experts=16,
        vocab_size=8192,
    ),
    "qwen15_14b_dense": dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, vocab_size=8192
    ),
}


def paper_plan(name, target="v5p-16", overrides=(), **kw):
    cfg = config_lib.load(ROOT / "configs" / f"{name}.py", overrides)
    return planner.plan(cfg, target_name=target, num_layers=2, **kw)


def narrow_plan(name, tmp_path, target="v5p-16", overrides=(), **kw):
    """`paper_plan` on the paper model's architecture with its widths cut to NARROW[name]."""
    cfg = config_lib.load(ROOT / "configs" / f"{name}.py", overrides)
    hf = json.loads(Path(cfg.model.hf_config).read_text())
    assert set(NARROW[name]) <= set(hf), set(NARROW[name]) - set(hf)  # only widths the architecture has
    path = tmp_path / f"{name}_narrow.json"
    path.write_text(json.dumps({**hf, **NARROW[name]}))
    report = planner.plan(cfg, target_name=target, num_layers=2, hf_config=str(path), **kw)
    assert report["model"]["config"] == str(path) and report["model"]["total_params"] < 20_000_000  # narrow: ~5M
    return report


def _check_target_and_shape(report):
    assert (report["target"]["chip"], report["target"]["chips"], report["mesh"]["fsdp"]) == ("v5p", 8, 8)
    assert report["shape"] == dict(
        micro_batches=16,
        rows=8,
        seq_len=256,
        rows_multiple=8,
        samples_per_step=1024,
        tokens_per_micro_batch=2048,
        head_chunks=1,  # logprobs.chunk_size (1024) is per chip: 8 x 1024 tokens per chunk, more than the 2048
        head_chunk_tokens=2048,
    )
    assert report["model"]["moe_impl_resolved"] == "gmm"  # the TPU path (megablox), not the CPU host's
    assert report["model"]["attention_impl_resolved"] == "splash"


def _splash_ratio(name, table, backward: bool) -> float:
    """XLA / analytic of the attention row on the TPU (splash) at 8 rows x 256 tokens, by hand: XLA counts the
    projections as the analytic count does, the plan adds the kernel. The analytic causal core is rows T^2 heads
    (qk + v) per pass (x3 with the backward); the kernel computes its one 256-block whole (twice the causal half) at
    widths padded to 128 lanes: forward 2 T^2 (128 + 128) per row and head, backward 2 T^2 ((2 128 + 2 128) + (2 128
    + 128)) (a dk/dv pass and a dq pass, each recomputing the scores)."""
    hf = NARROW[name]
    heads = hf["num_attention_heads"]
    qk_v = 2 * hf["hidden_size"] // heads if "head_dim" not in hf else 2 * hf["head_dim"]
    if name == "deepseek_v2_lite":
        qk_v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"]
    rows, t, chips = 8, 256, 8
    times = table["attention"]["times_per_step"]  # micro-batches x layers
    core = times * rows * t**2 * heads * qk_v * (3 if backward else 1) / chips
    kernel = times * rows * heads * 2 * t**2 * (256 + (896 if backward else 0)) / chips
    analytic = table["attention"]["analytic_flops_per_chip"]
    return (analytic - core + kernel) / analytic


def _check_layer_costs(report, name):
    """The per-layer-kind FLOP tables of a 2-layer cut: the kinds counted, XLA against the analytic count, the MFU."""
    moe_layers, mlp_layers = PAPER[name]
    kinds = report["flops"]["train_step"]["kinds"]
    assert tuple(kinds[k]["count"] if k in kinds else 0 for k in ("moe", "mlp", "attention")) == (
        moe_layers,
        mlp_layers,
        2,
    )
    assert kinds["head"]["times_per_step"] == 16 * 1  # micro-batches x logprob chunks (one: 8 x 1024 per chunk)
    rescore = report["flops"]["rescore"]["kinds"]
    for table, backward in ((kinds, True), (rescore, False)):
        assert table["attention"]["ratio"] == pytest.approx(_splash_ratio(name, table, backward), rel=0.05)
        assert 0.97 < table["head"]["ratio"] < 1.03  # the recompute of the logits is counted once, by both
        if mlp_layers:
            assert 0.97 < table["mlp"]["ratio"] < 1.05
    if moe_layers:  # megablox's kernels: the grouped work only, forward and backward (ragged_dot's backward: x E)
        assert 0.97 < rescore["moe"]["ratio"] < 1.1
        assert 0.97 < kinds["moe"]["ratio"] < 1.2
    for program in ("train_step", "rescore"):
        assert report["roofline"][f"{program}_s"] > 0
        assert 0 < report["roofline"][f"{program}_mfu_estimate"] < 1
    assert not report.get("warnings")  # no loop with work in the one-layer programs (megablox's searches are scalar)


def _check_programs(report, layer_costs: bool, programs=("train_step", "rescore", "canary")):
    """The programs compiled, each fits, and the train step donates the state."""
    chips = report["target"]["chips"]
    assert set(report["programs"]) == set(programs)
    for name_, p in report["programs"].items():
        left = p["usable_bytes"] - p["reserve_bytes"] - p["resident_bytes"] - p["total_bytes"]
        assert p["fits"] and p["memory"]["total"] > 0 and p["margin_bytes"] == pytest.approx(left), name_
        # the optimizer's two fp32 moments stay on the device beside every program but the train step (its arguments)
        moments = 8 * report["model"]["total_params"] / chips
        assert p["resident_bytes"] == (0 if name_ == "train_step" else pytest.approx(moments, rel=0.01)), name_
        assert p["seconds"] > 0
        assert (p["roofline_s"] > 0) if layer_costs else ("roofline_s" not in p)  # the roofline from the FLOP tables
    state_bytes = 12 * report["model"]["total_params"] / chips  # fp32 params + two fp32 Adam moments, sharded
    train = report["programs"]["train_step"]["memory"]
    assert train["arguments"] >= 0.99 * state_bytes and train["aliased"] >= 0.99 * state_bytes  # the state is donated


@pytest.mark.slow
def test_paper_model_cut_on_v5p16():
    """The one full paper-model compile: Qwen1.5-MoE-A2.7B's 2-layer cut at its widths, its train step."""
    report = paper_plan(PAPER_WIDTHS, rows=8, seq_len=256, layer_costs=False, programs=["train_step"])
    _check_target_and_shape(report)
    _check_programs(report, layer_costs=False, programs=["train_step"])
    assert report["model"]["total_params"] > 1e9  # the paper's widths: 2 layers of 60 experts and a 151,936-token head


@pytest.mark.slow
def test_narrow_full_report_on_v5p16(tmp_path):
    """The whole report on Qwen1.5-MoE's narrow cut: the three programs (the rescoring's under train.proximal=rescore),
    the per-layer-kind FLOP tables, the roofline of each program."""
    report = narrow_plan(PAPER_WIDTHS, tmp_path, rows=8, seq_len=256, overrides=["--config.train.proximal=rescore"])
    _check_target_and_shape(report)
    _check_programs(report, layer_costs=True)
    _check_layer_costs(report, PAPER_WIDTHS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen15_moe_a27b", "deepseek_v2_lite"])
def test_narrow_sampler_on_v5p16(name, tmp_path):
    """The JAX sampler's program for one step's rollouts, compiled for the slice on the trainer's mesh (GQA and MLA
    caches): the bucket the config asks for, the KV cache by hand, and the program's memory per chip."""
    overrides = [
        "--config.data.prompts_per_step=6",  # bucketed up to 8
        "--config.rollout.group_size=4",
        "--config.data.max_prompt_tokens=100",  # 128
        "--config.rollout.max_new_tokens=200",  # 256
    ]
    report = narrow_plan(name, tmp_path, overrides=overrides, programs=("sampler",), layer_costs=False)
    sp = report["sampler"]
    assert (sp["batch"], sp["n"], sp["prompt_len"], sp["new_tokens"], sp["slots"]) == (8, 4, 128, 256, 384)
    hf = {
        **json.loads(Path(config_lib.load(ROOT / "configs" / f"{name}.py").model.hf_config).read_text()),
        **NARROW[name],
    }
    if name == "deepseek_v2_lite":  # MLA: the latent and the rotary key per position
        per_position = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    else:  # K and V of every key-value head
        per_position = 2 * hf["num_key_value_heads"] * hf["hidden_size"] // hf["num_attention_heads"]
    assert sp["kv_cache_bytes"] == 2 * 32 * 384 * per_position * 2  # 2 layers x 32 samples x 384 slots, bf16
    assert set(report["programs"]) == {"sampler"}
    p = report["programs"]["sampler"]
    assert p["fits"] and p["memory"]["arguments"] > 0 and p["memory"]["temporaries"] > 0, p


@pytest.mark.slow
def test_narrow_sampler_on_h100s_in_a_fresh_process(tmp_path):
    """The sampler's program compiled for 8 deviceless H100s (bf16: its decode attention through the Pallas Triton
    decode kernel, one decode phase; the prompts prefilled straight into the rows). A fresh process: XLA's CUDA
    plugin must be on the path before JAX starts its backends."""
    out, hf = tmp_path / "plan.json", tmp_path / "narrow.json"
    cfg = config_lib.load(ROOT / "configs" / f"{PAPER_WIDTHS}.py")
    hf.write_text(json.dumps({**json.loads(Path(cfg.model.hf_config).read_text()), **NARROW[PAPER_WIDTHS]}))
    argv = ["--config", str(ROOT / "configs" / f"{PAPER_WIDTHS}.py"), "--topology", "h100x8", "--hf-config", str(hf)]
    argv += ["--num-layers", "2", "--programs", "sampler", "--no-layer-costs", "--json", str(out)]
    argv += ["--config.data.prompts_per_step=6", "--config.rollout.group_size=4"]
    proc = subprocess.run([sys.executable, "-m", "cisjax", "plan", *argv], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["target"]["platform"] == "cuda" and report["model"]["attention_impl_resolved"] == "triton"
    p = report["programs"]["sampler"]
    assert p["fits"] and p["memory"]["temporaries"] > report["sampler"]["kv_cache_bytes"] / 8, p


@pytest.mark.slow
def test_narrow_deepseek_layer_costs_on_v5p16(tmp_path):
    """The per-layer-kind programs of DeepSeek-V2-Lite's narrow cut (MLA, a dense-MLP first layer, its MoE block): the
    FLOP tables and roofline of the train step and the rescoring."""
    report = narrow_plan("deepseek_v2_lite", tmp_path, rows=8, seq_len=256, programs=[])
    _check_target_and_shape(report)
    assert report["programs"] == {}
    _check_layer_costs(report, "deepseek_v2_lite")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(PAPER) - {PAPER_WIDTHS}))
def test_narrow_train_step_on_v5p16(name, tmp_path):
    """The train step of each other family's narrow 2-layer cut compiles for the TPU, fits, and donates its state."""
    report = narrow_plan(name, tmp_path, rows=8, seq_len=256, programs=["train_step"], layer_costs=False)
    chips = report["target"]["chips"]
    assert (report["target"]["chip"], chips, report["mesh"]["fsdp"]) == ("v5p", 8, 8)
    assert report["model"]["layers"] == 2 and set(report["programs"]) == {"train_step"}
    p = report["programs"]["train_step"]
    assert p["fits"] and p["memory"]["total"] > 0 and p["margin_bytes"] == p["usable_bytes"] - p["total_bytes"]
    # fp32 params + two Adam moments (fp32, or bf16 where the config follows the paper: DeepSeek-V2-Lite, Qwen3), sharded
    moment_bytes = {"float32": 4, "bfloat16": 2}[
        config_lib.load(ROOT / "configs" / f"{name}.py").train.optimizer_state_dtype
    ]
    state_bytes = (4 + 2 * moment_bytes) * report["model"]["total_params"] / chips
    assert 0.99 * state_bytes <= p["memory"]["arguments"] <= 1.1 * state_bytes, (p["memory"], state_bytes)  # + padding
    assert p["memory"]["aliased"] >= 0.99 * state_bytes
    assert report["model"]["moe_impl_resolved"] == "gmm"
    assert "flops" not in report and not report.get("warnings")


@pytest.mark.slow
def test_offloaded_optimizer_on_v5p16(tmp_path):
    """train.offload_optimizer compiled for the TPU with bf16 moments (packed in host memory): the moments in the
    compiler's host memory (4 bytes per parameter per chip, but the stacked vectors' on the device), the device's
    arguments the fp32 params, the round trip costed at the host link."""
    report = narrow_plan(
        "qwen15_moe_a27b",
        tmp_path,
        rows=8,
        seq_len=256,
        programs=["train_step"],
        layer_costs=False,
        overrides=["--config.train.offload_optimizer=true", "--config.train.optimizer_state_dtype=bfloat16"],
    )
    chips, params = report["target"]["chips"], report["model"]["total_params"]
    mem, off = report["programs"]["train_step"]["memory"], report["offload"]
    assert report["programs"]["train_step"]["fits"]
    assert off["host_memory"] == "the compiler's buffer assignment"
    assert 0.97 * 4 * params / chips <= mem["host_arguments"] <= 1.1 * 4 * params / chips
    assert mem["host_aliased"] == mem["host_arguments"]  # donated: updated in place in host memory
    assert 0.99 * 4 * params / chips <= mem["arguments"] <= 1.1 * 4 * params / chips
    assert off["moments_bytes_per_chip"] == pytest.approx(mem["host_arguments"], rel=0.1)
    assert off["host_bytes_per_process"] == 4 * off["host_bytes_per_chip"]  # a v5p host drives 4 chips
    assert off["transfer_s"] == pytest.approx(2 * off["moments_bytes_per_chip"] / 15e9)


@pytest.mark.slow
def test_fit_flips_when_rows_grow(tmp_path):
    # Qwen1.5-MoE's narrow cut without remat on v5e-16, 256 tokens per row: 16 rows fit (0.04 GB); at 49,152 rows the
    # compiler refuses (57 GB of temporaries)
    kw = dict(target="v5e-16", overrides=["--config.model.remat=none"], programs=["train_step"], layer_costs=False)
    small = narrow_plan("qwen15_moe_a27b", tmp_path, rows=16, seq_len=256, **kw)
    big = narrow_plan("qwen15_moe_a27b", tmp_path, rows=49152, seq_len=256, **kw)
    assert (small["shape"]["seq_len"], big["shape"]["rows"]) == (256, 49152)
    assert small["programs"]["train_step"]["fits"] and not big["programs"]["train_step"]["fits"]
    usable = hardware.TPU_CHIPS["v5e"].usable_bytes
    assert small["programs"]["train_step"]["total_bytes"] <= usable
    refused = big["programs"]["train_step"]  # the TPU compiler refuses a program that does not fit, naming its needs
    assert refused["error"] and refused["oom_temporaries"] > usable and refused["total_bytes"] is None


@pytest.mark.slow
@pytest.mark.parametrize("moe_impl", ["triton", "auto", "mgpu"])
def test_gpu_target_in_a_fresh_process(tmp_path, moe_impl):
    """8 H100s through XLA's CUDA plugin, with no GPU: memory from the compiler, FLOPs from its cost model (Qwen1.5-MoE's
    narrow cut, given as --hf-config); the MoE on cisjax's Triton kernels, on what "auto" picks there (cisjax's
    warp-specialized kernels, mgpu_ws), and on JAX's Mosaic GPU kernels (mgpu, by name)."""
    out, hf = tmp_path / "plan.json", tmp_path / "narrow.json"
    cfg = config_lib.load(ROOT / "configs" / f"{PAPER_WIDTHS}.py")
    hf.write_text(json.dumps({**json.loads(Path(cfg.model.hf_config).read_text()), **NARROW[PAPER_WIDTHS]}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cisjax",
            "plan",
            "--config",
            str(ROOT / "configs" / "qwen15_moe_a27b.py"),
            "--topology",
            "h100x8",
            "--hf-config",
            str(hf),
            "--num-layers",
            "2",
            "--rows",
            "8",
            "--seq-len",
            "256",
            "--programs",
            "train_step",
            "--json",
            str(out),
            f"--config.model.moe_impl={moe_impl}",
            # the optimizer offloaded: the compile-only GPU devices have no host memory kind, the plan counts it
            *(["--config.train.offload_optimizer=true"] if moe_impl == "auto" else []),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["target"]["platform"] == "cuda" and report["target"]["chips"] == 8
    train = report["programs"]["train_step"]
    assert train["fits"] and train["memory"]["temporaries"] > 0
    kinds = report["flops"]["train_step"]["kinds"]
    assert 0.97 < kinds["head"]["ratio"] < 1.03 and 0.9 < kinds["attention"]["ratio"] < 1.6
    # the Triton kernels (counted by their estimates: XLA's cost model sees nothing) at their bound, not x E as
    # ragged_dot; 1 row per chip: small groups of 1,024 assignments over the narrow cut's 16 experts, 16-row tiles
    assert report["model"]["attention_impl_resolved"] == "triton"  # the Pallas Triton flash kernel, compiled for sm_90
    if moe_impl == "triton":
        assert report["model"]["moe_impl_resolved"] == "triton"
        assert 1.0 < kinds["moe"]["ratio"] < 1.6
    elif moe_impl == "mgpu":
        # the Mosaic kernels carry no estimate: the plan counts moe_hopper.kernel_flops, an upper bound: per device
        # 1,024 assignments plus a 128-row tile per boundary of the 16 groups = 2,944 rows, 2.9x the routed work (the
        # shared expert, counted by XLA, is exact)
        assert report["model"]["moe_impl_resolved"] == "mgpu"
        assert 1.5 < kinds["moe"]["ratio"] < 2.4
    else:
        # swiglu_ws.kernel_flops' bound: per device 1,024 assignments in 16 groups (64-row tasks: at most 33 of them,
        # 2,112 rows) and the weight gradients' 1,024 + 16 x 64 rows
        assert report["model"]["moe_impl_resolved"] == "mgpu_ws"
        assert 1.3 < kinds["moe"]["ratio"] < 2.4
        off, params = report["offload"], report["model"]["total_params"]
        assert off["host_memory"] == "counted from the state (not compiled)"
        assert off["moments_bytes_per_chip"] == pytest.approx(8 * params / 8, rel=0.02)  # two fp32 moments, 8 GPUs
        assert train["memory"]["host_total"] == off["moments_bytes_per_chip"] == off["host_bytes_per_chip"]
        assert 0.99 * 4 * params / 8 <= train["memory"]["arguments"] <= 1.1 * 4 * params / 8  # fp32 params alone
        assert off["host_bytes_per_process"] == 8 * off["host_bytes_per_chip"]
        assert off["transfer_s"] == pytest.approx(2 * off["moments_bytes_per_chip"] / 64e9)  # PCIe Gen5 x16
        assert "optimizer offload" in proc.stdout
    assert "train_step" in proc.stdout and "MFU estimate" in proc.stdout


def test_tpu_mesh_traces_the_tpu_moe_dispatch():
    """A CPU host compiling for TPU must trace the TPU MoE path (megablox's Mosaic kernels), not the CPU one (tiled
    loops)."""
    n, d, f, e, k = 64, 32, 16, 4, 2
    args = [
        jax.ShapeDtypeStruct(s, dt)
        for s, dt in [
            ((n, d), jnp.bfloat16),
            ((e, d, f), jnp.bfloat16),
            ((e, d, f), jnp.bfloat16),
            ((e, f, d), jnp.bfloat16),
            ((n, k), jnp.int32),
            ((n, k), jnp.float32),
        ]
    ]

    def lowered_text(devices):
        mesh = sharding.make_mesh({"fsdp": len(devices)}, devices)
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())) for a in args]

        def fn(*xs):
            with sharding.use_mesh(mesh):
                assert moe.default_impl() == ("tiled" if devices[0].platform == "cpu" else "gmm")
                return moe.moe_ffn(*xs)

        return jax.jit(fn).lower(*placed).as_text()

    tpu = lowered_text(hardware.target("v5p-16").devices())
    assert "tpu_custom_call" in tpu and "ragged_dot" not in tpu
    cpu = lowered_text(jax.devices())  # the 8 fake CPU devices: the tiled dispatch
    assert "tpu_custom_call" not in cpu and "ragged_dot" not in cpu


def test_pallas_costs_count_the_triton_kernels_forward_and_backward():
    """The plan counts a Triton kernel by its Pallas cost estimate: the MoE's grouped matmuls (3 forward, 3 + 3
    backward) at least the routed work and at most its bound (every row tile full)."""
    n, d, f, e, k = 64, 32, 16, 4, 2
    ids = jnp.asarray([[i % 3, 3] for i in range(n)], jnp.int32)  # groups of 22, 21, 21, 64 rows
    x, wg, wu, wo = (jnp.ones(s, jnp.float32) for s in ((n, d), (e, d, f), (e, d, f), (e, f, d)))

    def loss(x, wg, wu, wo):
        return moe.moe_ffn(x, wg, wu, wo, ids, jnp.ones((n, k)), impl="triton").sum()

    cost = pallas_costs(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, wg, wu, wo).jaxpr)
    routed = 3 * 2 * n * k * d * f  # three matmuls of the assignments, forward
    rows, bm = n * k, gpu_grouped.row_block(n * k, e)  # 32-row tiles
    assert 3 * routed <= cost["flops"] <= 3 * routed * (rows + (e + 1) * bm) / rows
    assert cost["bytes"] > 0


def test_loops_with_work_flags_matmul_loops_not_scalar_searches():
    """A loop of matmuls undercounts in cost_analysis; a binary search (megablox's group metadata) costs nothing."""
    a = jnp.ones((8, 8))

    def text(fn, *args):
        return jax.jit(fn).lower(*args).compile().as_text()

    matmuls = text(lambda a: jax.lax.fori_loop(0, a[0, 0].astype(jnp.int32), lambda i, x: x @ a, a), a)
    search = text(lambda a, v: (a @ a, jnp.searchsorted(v, a[0])), a, jnp.arange(60.0))
    assert " while(" in matmuls and " while(" in search  # both programs hold a loop
    assert loops_with_work(matmuls) and not loops_with_work(search)
    assert not loops_with_work(text(lambda a: a @ a, a))
    # an annotation custom call in a scalar loop (XLA:TPU, megablox's searches) is no work either
    annotated = search.replace("compare(", 'custom-call(), custom_call_target="AssumeGatherIndicesInBound" compare(')
    assert annotated != search and not loops_with_work(annotated)
    assert loops_with_work(search.replace("compare(", 'custom-call(), custom_call_target="tpu_custom_call" compare('))


def fake_compile(a, b, usable=None):
    """A train step whose per-chip total is a + b * rows bytes, and the probes made. With `usable`, the compiler
    refuses what does not fit, naming only its temporaries (the total minus a)."""
    probes = []

    def compile_at(rows):
        probes.append(rows)
        total = a + b * rows
        if usable is not None and total > usable:
            return Compiled("train_step", 1.0, oom_temporaries=total - a, error="RESOURCE_EXHAUSTED")
        return Compiled("train_step", 1.0, memory={"total": total})

    return compile_at, probes


@pytest.mark.parametrize(
    "a, b, usable, start, best",
    [
        (10.0, 1.0, 100.0, 16, 88),  # grows from 16: 32, 64 fit, 128 does not; the line through them meets 90
        (10.0, 1.0, 100.0, 256, 88),  # shrinks from 256
        (10.0, 1.0, 17.9, 8, 0),  # not even 8 rows fit
        (10.0, 1.0, 18.0, 8, 8),
    ],
)
@pytest.mark.parametrize("refuses", [False, True], ids=["measured", "refused"])
def test_search_rows_finds_the_boundary(a, b, usable, start, best, refuses):
    compile_at, probes = fake_compile(a, b, usable if refuses else None)
    result = search.search_rows(compile_at, start=start, step=8, usable=usable, max_rows=4096, log=lambda m: None)
    assert result["best_rows"] == best
    if best:
        assert a + b * best <= usable < a + b * (best + 8)
    assert len(probes) <= 6 and len(set(probes)) == len(probes)


def test_search_rows_stops_at_the_cap():
    compile_at, _ = fake_compile(1.0, 0.0)
    result = search.search_rows(compile_at, start=8, step=8, usable=10.0, max_rows=64, log=lambda m: None)
    assert result["best_rows"] == 64 and result["capped"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "v5p-12"], "no v5p slice of 6 chips"),
        (["--topology", "v5p-16", "--mesh", "fsdp=3"], "needs 3 devices"),
        (["--topology", "v5p-16", "--num-layers", "99"], "has 24 layers"),
        (["--topology", "v5p-16", "--rows", "12"], "multiple of the mesh's batch shards"),
        (["--topology", "v5p-16", "--programs", "train,foo"], "unknown"),
    ],
)
def test_bad_input_is_named(argv, message, capsys):
    code = cli.main(["plan", "--config", str(ROOT / "configs" / "qwen15_moe_a27b.py"), "--no-layer-costs", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_no_architecture_is_named(capsys):
    assert cli.main(["plan", "--topology", "v5p-16"]) == 2  # configs/base.py: no model.path, no model.hf_config
    assert "no architecture" in capsys.readouterr().err


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 8}, {"expert": 8}, {"expert": 4, "tensor": 2}])
def test_params_per_chip_counts_the_expert_stacks(mesh_shape):
    """At rest FSDP and EP both hold 1/8 of the expert stacks per chip; what the MoE computes with is the whole stack
    under FSDP (gathered) and 1/ep of it (1/(ep x tensor) with F split) under expert parallelism."""
    import flax.nnx as nnx

    from cisjax.models import hf_io
    from tests.support.hf import SHARDABLE_QWEN2_MOE

    hf = dict(SHARDABLE_QWEN2_MOE)
    mcfg = hf_io.model_config(hf, dtype="bfloat16", param_dtype="float32")
    _, abstract = hf_io.abstract_model(hf, mcfg)
    mesh, rules = sharding.make_mesh(mesh_shape), sharding.rules_from_config()
    shardings = sharding.param_shardings(abstract, mesh, rules)
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    params = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), abstract, shardings, is_leaf=is_var
    )
    pp = planner.params_per_chip(params, mesh, rules, jnp.bfloat16)
    stacks = 2 * 3 * 8 * 64 * 32 * 4  # layers x (gate, up, down) x E x D x F, fp32
    assert pp["expert_stacks_total_bytes"] == stacks
    assert pp["expert_stacks_bytes"] == stacks // 8
    ep = mesh_shape.get("expert", 1) * mesh_shape.get("tensor", 1)
    assert pp["expert_stacks_compute_bytes"] == stacks // 2 // ep  # bf16
    assert pp["expert_stacks_bytes"] < pp["all_bytes"]
    assert pp["experts_unsplit"] == (0 if "expert" in mesh_shape else 3)  # (gate, up, down), each stacking 2 layers


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["a2a", "gather"])
def test_tpu_expert_parallel_compiles_with_ragged_all_to_all(exchange, monkeypatch):
    """On a TPU mesh with an expert axis the MoE runs expert-parallel: the native ragged all-to-all (which XLA:CPU
    lacks, so the CPU tests run its all_to_all form) or all-gather + reduce-scatter, around megablox, forward and
    backward, and XLA:TPU compiles it."""
    monkeypatch.setattr(expert_parallel, "EXCHANGE", exchange)
    n, d, f, e, k = 256, 128, 128, 16, 2
    mesh = sharding.make_mesh({"expert": 8}, hardware.target("v5p-16").devices())
    rules = sharding.rules_from_config()

    def abstract(shape, dtype, axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named_sharding(axes, rules, mesh, shape))

    rows = ("batch", None)
    args = [
        abstract((n, d), jnp.bfloat16, rows),
        abstract((e, d, f), jnp.bfloat16, ("expert", "embed", "expert_mlp")),
        abstract((e, d, f), jnp.bfloat16, ("expert", "embed", "expert_mlp")),
        abstract((e, f, d), jnp.bfloat16, ("expert", "expert_mlp", "embed")),
        abstract((n, k), jnp.int32, rows),
        abstract((n, k), jnp.float32, rows),
    ]

    def loss(x, wg, wu, wo, ids, w):
        with sharding.use_mesh(mesh, rules):
            return jnp.sum(moe.moe_ffn(x, wg, wu, wo, ids, w).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 5))).lower(*args)
    text = lowered.as_text()
    assert "tpu_custom_call" in text
    assert ("ragged_all_to_all" in text) == (exchange == "a2a")
    if exchange == "gather":
        assert "all_gather" in text and "reduce_scatter" in text
    lowered.compile()


def _options_report(total: float, fits: bool, roofline: float = 2.0, transfer: float = 0.0) -> dict:
    """The parts of a plan report search_options reads."""
    return dict(
        programs={"train_step": dict(total_bytes=total, fits=fits, roofline_s=roofline, memory={"host_total": 0})},
        offload={"transfer_s": transfer} if transfer else None,
    )


def test_search_options_tries_the_fewest_then_the_cheapest_options():
    """The smallest set that fits: every option at once first (none adds memory: if that does not fit, nothing
    does), then single options in MEMORY_OPTIONS' order, then pairs; options the config already sets are not tried;
    each tried set's estimate adds the offload's round trip."""
    cfg = config_lib.load(ROOT / "configs" / "qwen15_moe_a27b.py")  # fp32 moments, no offload, its own remat
    cfg.model.remat = "full"  # already set: not an option to try
    needs = {"train.offload_optimizer", "train.optimizer_state_dtype"}  # fits with both (and with any superset)
    seen = []

    def plan_with(trial, recost):
        assert recost == (trial.model.remat != cfg.model.remat)  # FLOPs change with remat alone
        options = {
            k: v
            for k, v, _ in planner.MEMORY_OPTIONS
            if k != "model.remat" and planner._get(trial, k) != planner._get(cfg, k)
        }
        seen.append(options)
        fits = needs <= set(options)
        return _options_report(
            50.0 if fits else 90.0, fits, transfer=0.5 if "train.offload_optimizer" in options else 0
        )

    out = planner.search_options(cfg, _options_report(100.0, False), plan_with, log=lambda m: None)
    bf16_moments, bf16_sum = {"train.optimizer_state_dtype": "bfloat16"}, {"train.grad_sum_dtype": "bfloat16"}
    offload, bf16_params = {"train.offload_optimizer": True}, {"model.param_dtype": "bfloat16"}
    assert seen == [
        {**bf16_moments, **bf16_sum, **offload, **bf16_params},
        bf16_moments,
        bf16_sum,
        offload,
        bf16_params,
        {**bf16_moments, **bf16_sum},
        {**bf16_moments, **offload},
    ]
    assert out["best"] == {**bf16_moments, **offload}
    assert [t["fits"] for t in out["tried"]] == [False, True, False, False, False, False, False, True]
    assert out["tried"][-1]["estimate"]["train_step_s"] == 2.5  # the roofline + the round trip over the host link
    assert cfg.train.optimizer_state_dtype == "float32"  # the trials were copies
    # a config that fits needs nothing; one that every option together does not make fit stops after that one
    assert planner.search_options(cfg, _options_report(10.0, True), plan_with, log=print)["best"] == {}
    none = planner.search_options(cfg, _options_report(100.0, False), lambda c, r: _options_report(90.0, False), print)
    assert none["best"] is None and len(none["tried"]) == 2 and "every option" in none["note"]
    # the last free option alone: no set of every option to try first
    cfg.train.optimizer_state_dtype, cfg.train.grad_sum_dtype, cfg.model.param_dtype = (
        "bfloat16",
        "bfloat16",
        "bfloat16",
    )
    seen.clear()
    one = planner.search_options(cfg, _options_report(100.0, False), lambda c, r: _options_report(50.0, True), print)
    assert one["best"] == offload and len(one["tried"]) == 2


def test_gpu_programs_keep_a_reserve_of_one_parameter_copy():
    """A GPU program fits when total + the parameters' bytes per chip fit (the measured H200 gap); TPU keeps none."""
    per_chip = {"all_bytes": 10 * 2**30}
    assert planner.runtime_reserve(hardware.target("h200x1"), per_chip) == 10 * 2**30
    assert planner.runtime_reserve(hardware.target("v5p-8"), per_chip) == 0.0
    d = {}
    planner._fit(d, 44.3 * 2**30, True, 130.0 * 2**30, 10.82 * 2**30)
    assert d["fits"] and d["margin_bytes"] == pytest.approx((130.0 - 10.82 - 44.3) * 2**30)
    planner._fit(d, 60.0 * 2**30, True, 69.3 * 2**30, 10.0 * 2**30)  # within the HBM, not with the reserve
    assert not d["fits"] and d["margin_bytes"] < 0
    # a program beside the run's resident moments (the rescoring): they count against it too
    planner._fit(d, 30.0 * 2**30, True, 69.3 * 2**30, 13.3 * 2**30, resident=26.7 * 2**30)
    assert not d["fits"] and d["resident_bytes"] == 26.7 * 2**30
    assert d["margin_bytes"] == pytest.approx((69.3 - 13.3 - 26.7 - 30.0) * 2**30)
