"""HF directory I/O: clear CheckpointErrors, and load -> save round trips that transformers and safetensors read back exactly."""

import json
import re
import shutil
from pathlib import Path

import flax.nnx as nnx
import numpy as np
import pytest

from cisjax import distributed
from cisjax.models import hf_io
from tests.support.hf import hf_forward, tiny_hf_config

SPARSE_STEP2 = dict(decoder_sparse_step=2)  # layer 0 dense MLP, layer 1 MoE: both kinds of rows of the weight table
CONFIG = tiny_hf_config("qwen2_moe", **SPARSE_STEP2)
TOKENS = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 11), dtype=np.int32)


@pytest.fixture(scope="module")
def src(tiny_hf_dir):
    """An fp32 checkpoint written by transformers."""
    return tiny_hf_dir("qwen2_moe", **SPARSE_STEP2)


@pytest.fixture(scope="module")
def src_tied(tiny_hf_dir):
    return tiny_hf_dir("qwen2_moe", seed=1, **SPARSE_STEP2, tie_word_embeddings=True, qkv_bias=False)


@pytest.fixture(scope="module")
def src_bf16(tiny_hf_dir):
    return tiny_hf_dir("qwen2_moe", seed=2, dtype="bfloat16", **SPARSE_STEP2)


def tensors(model_dir) -> dict:
    """Every tensor of a directory, read by the safetensors library (single file or shards)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        part = load_file(f)
        assert not out.keys() & part.keys(), f"{f.name} repeats tensors"
        out.update(part)
    return out


def bits(t):
    """The raw bits of a tensor (byte identity, also for -0.0 and bf16)."""
    import torch

    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()]).numpy()


def params(model) -> dict:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k].view(np.uint8), pb[k].view(np.uint8), err_msg=k)


def assert_same_tensors(saved_dir, want: dict, cast=None):
    """The tensors hf_io.save wrote, read by safetensors, are bit for bit `want` (optionally cast)."""
    got = tensors(saved_dir)
    assert got.keys() == want.keys()
    for k, t in want.items():
        t = t if cast is None else t.to(cast)
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        np.testing.assert_array_equal(bits(got[k]), bits(t), err_msg=k)


def assert_same_hf_logits(a_dir, b_dir):
    """transformers loads both directories to the same model (fp32 forward, routing included)."""
    la, ra = hf_forward(str(a_dir), TOKENS)
    lb, rb = hf_forward(str(b_dir), TOKENS)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(ra, rb)


# ----------------------------------------------------------------------------- errors


def variant(src, tmp_path, config=None, edit_tensors=None):
    """A copy of `src` with config.json and/or the tensors edited."""
    from safetensors.torch import save_file

    out = tmp_path / "variant"
    shutil.copytree(src, out)
    if config:
        hf = json.loads((out / "config.json").read_text())
        config(hf)
        (out / "config.json").write_text(json.dumps(hf))
    if edit_tensors:
        t = tensors(out)
        edit_tensors(t)
        save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    return out


def raises(model_dir, *fragments):
    with pytest.raises(hf_io.CheckpointError) as info:
        hf_io.load(model_dir)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_unknown_architecture(src, tmp_path):
    raises(variant(src, tmp_path, config=lambda hf: hf.update(architectures=["LlamaForCausalLM"])), "LlamaForCausalLM")


def test_missing_config(src, tmp_path):
    out = variant(src, tmp_path)
    (out / "config.json").unlink()
    raises(out, "config.json")


def test_missing_tensor(src, tmp_path):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    raises(variant(src, tmp_path, edit_tensors=lambda t: t.pop(name)), name, "missing")


def test_wrong_shape(src, tmp_path):
    import torch

    name = "model.layers.0.self_attn.k_proj.weight"
    raises(
        variant(src, tmp_path, edit_tensors=lambda t: t.update({name: torch.zeros(24, 32)})),
        name,
        "[24, 32]",
        "[16, 32]",
    )


def test_unused_tensor(src, tmp_path):
    import torch

    name = "model.layers.0.mlp.extra_proj.weight"
    raises(variant(src, tmp_path, edit_tensors=lambda t: t.update({name: torch.zeros(3)})), name)


def test_tied_checkpoint_with_stray_lm_head_loads(src_tied, tmp_path):
    """Some tied checkpoints still store lm_head.weight: ignored (the embedding is the head), as in transformers."""
    import torch

    def add_head(t):
        t["lm_head.weight"] = torch.full_like(t["model.embed_tokens.weight"], 7.0)

    model, cfg, _ = hf_io.load(variant(src_tied, tmp_path, edit_tensors=add_head))
    assert cfg.tie_word_embeddings and not hasattr(model, "lm_head_DxV")
    np.testing.assert_array_equal(np.asarray(model.unembedding_DxV()), np.asarray(model.embed_VxD[...]).T)


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", "32"),
        ("num_experts_per_tok", 2.5),
        ("rms_norm_eps", "1e-6"),
        ("tie_word_embeddings", "false"),
        ("mlp_only_layers", [0.5]),
    ],
)
def test_bad_config_field(src, tmp_path, field, value):
    raises(variant(src, tmp_path, config=lambda hf: hf.update({field: value})), repr(field))


def test_missing_config_field(src, tmp_path):
    raises(variant(src, tmp_path, config=lambda hf: hf.pop("num_experts_per_tok")), "'num_experts_per_tok'")


def test_unsupported_option_is_checkpoint_error(src, tmp_path):
    raises(variant(src, tmp_path, config=lambda hf: hf.update(use_sliding_window=True)), "use_sliding_window")


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("which", ["src", "src_tied"])
def test_roundtrip_fp32(request, tmp_path, which):
    model_dir = request.getfixturevalue(which)
    model, _, hf = hf_io.load(model_dir)
    out = hf_io.save(model, tmp_path / "out", hf)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_tensors(out, tensors(model_dir))
    assert_same_hf_logits(model_dir, out)
    assert_same_params(hf_io.load(out)[0], model)
    saved = json.loads((out / "config.json").read_text())
    assert saved["dtype"] == "float32" and "torch_dtype" not in saved
    assert {k: v for k, v in saved.items() if k != "dtype"} == {k: v for k, v in hf.items() if k != "dtype"}


def test_roundtrip_bf16_is_byte_identical(src_bf16, tmp_path):
    """A bf16 checkpoint loaded with bf16 params and saved again: the very same bytes."""
    model, _, hf = hf_io.load(src_bf16, param_dtype="bfloat16")
    assert {v.dtype.name for v in params(model).values()} == {"bfloat16"}
    out = hf_io.save(model, tmp_path / "out", hf)
    assert_same_tensors(out, tensors(src_bf16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert_same_hf_logits(src_bf16, out)


def test_save_fp32_as_bf16_rounds_like_torch(src, tmp_path):
    """fp32 params saved with dtype=bfloat16 equal torch's fp32 -> bf16 rounding; a source config
    with the old `torch_dtype` key gets it updated too."""
    import torch

    model, _, hf = hf_io.load(src)
    hf = {**hf, "torch_dtype": "float32"}
    out = hf_io.save(model, tmp_path / "out", hf, dtype="bfloat16")
    assert_same_tensors(out, tensors(src), cast=torch.bfloat16)
    saved = json.loads((out / "config.json").read_text())
    assert saved["dtype"] == saved["torch_dtype"] == "bfloat16"


def test_sharded_save(src, tmp_path):
    model, _, hf = hf_io.load(src)
    out = hf_io.save(model, tmp_path / "out", hf, max_shard_bytes=24_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert all(p.stat().st_size <= 24_000 + 4096 for p in out.glob("*.safetensors") if len(tensors_in(p)) > 1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    want = tensors(src)
    assert index["weight_map"].keys() == want.keys() and set(index["weight_map"].values()) == set(shards)
    assert all(k in tensors_in(out / f) for k, f in index["weight_map"].items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    assert_same_tensors(out, want)
    assert_same_hf_logits(src, out)
    assert_same_params(hf_io.load(out)[0], model)

    # Saving again, unsharded, into the same directory leaves no stale shard or index behind.
    hf_io.save(model, out, hf)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_params(hf_io.load(out)[0], model)


def tensors_in(path) -> list:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return list(f.keys())


def test_load_checkpoint_sharded_by_transformers(src, tmp_path):
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(src)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    assert_same_params(hf_io.load(tmp_path / "sharded")[0], hf_io.load(src)[0])


def test_duplicate_tensor_across_files(src, tmp_path):
    out = variant(src, tmp_path)
    shutil.copy(out / "model.safetensors", out / "model-extra.safetensors")
    raises(out, "is in both", "model-extra.safetensors")


# ----------------------------------------------------------------------------- the lazy tensor stream


def test_iter_tensors_is_lazy_and_equals_the_files(src, monkeypatch):
    """iter_tensors / HFTensors yield the checkpoint's tensors (bit for bit, in tensor_specs order) with one
    parameter on the host at a time: nothing is fetched before the first item, one fetch per parameter."""
    import ml_dtypes

    model, _, hf = hf_io.load(src)
    want = tensors(src)
    fetched = []
    to_host = distributed.to_host
    monkeypatch.setattr(distributed, "to_host", lambda x: fetched.append(x.shape) or to_host(x))

    specs = hf_io.tensor_specs(model, hf, "bfloat16")
    assert sorted(s.name for s in specs) == sorted(want) and fetched == []
    stream = hf_io.iter_tensors(nnx.split(model, nnx.Param), hf, "bfloat16")  # a (graphdef, params) pair works too
    assert fetched == []
    got = {}
    for spec, (name, arr) in zip(specs, stream):
        assert (
            name == spec.name
            and arr.shape == spec.shape
            and arr.dtype == np.dtype(ml_dtypes.bfloat16)
            and arr.flags.c_contiguous
        )
        got[name] = arr
    assert len(got) == len(want)
    experts = [n for n in want if ".mlp.experts." in n]
    assert experts and len(fetched) == len(want) - len(experts) + len({re.sub(r"experts\.\d+", "", n) for n in experts})
    import torch

    for name, t in want.items():
        np.testing.assert_array_equal(got[name].view(np.int16), bits(t.to(torch.bfloat16)), err_msg=name)

    lazy = hf_io.HFTensors(model, hf)
    assert set(lazy) == set(want) and len(lazy) == len(want)
    assert lazy.nbytes == sum(t.numel() * t.element_size() for t in want.values())
    name = experts[3]
    np.testing.assert_array_equal(lazy[name], want[name].numpy())
    before = len(fetched)
    first = next(iter(lazy.items()))
    assert len(fetched) == before + 1 and first[0] == specs[0].name
