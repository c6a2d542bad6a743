"""cisjax.sampler.programs compiled: the KV cache is written in place, never copied per decode step or rebuilt per
layer, and the prefill attends over the prompt's slots only (XLA's memory analysis of a bucket where the cache
dominates)."""

import flax.nnx as nnx
import jax
import pytest

from cisjax import sharding
from cisjax.models import hf_io
from cisjax.sampler import programs
from tests.helpers import jaxpr_dots


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v2"])  # K and V; MLA's latent, rotary key
def test_the_cache_is_held_once(tiny_hf_dir, family):
    model = hf_io.load(tiny_hf_dir(family), dtype="float32", param_dtype="float32")[0]
    graphdef, params = nnx.split(model)
    b, p, n, new = 8, 64, 4, 1024  # 32 rows x 1,088 slots: the cache outweighs everything else
    compiled = (
        jax.jit(programs.sample_fn(graphdef, n=n, max_new=new, top_n=0))
        .lower(params, *programs.abstract_inputs(b, p, n))
        .compile()
    )
    cache = jax.eval_shape(lambda: model.init_cache(b * n, p + new))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    temp = compiled.memory_analysis().temp_size_in_bytes
    # the cache once, the prompts' cache before expansion (1/n of it), a layer's attention temporaries; a copy of the
    # cache per step, a stack rebuilt per layer, a prefill attending over every slot, or MLA's decode re-expanding
    # every slot's latent into per-head keys and values (it attends in the latent space: absorbed) passes 1.8x
    assert cache_bytes < temp < 1.8 * cache_bytes, (temp / cache_bytes, temp, cache_bytes)


def test_fp32_sampling_on_a_gpu_is_full_precision(tiny_hf_dir, monkeypatch):
    """The sampler's program traced for a GPU in fp32: every matmul outside the kernels at HIGHEST (no TF32)."""
    monkeypatch.setattr(sharding, "current_platform", lambda: "gpu")
    model = hf_io.load(tiny_hf_dir("qwen2_moe"), dtype="float32", param_dtype="float32")[0]
    graphdef, params = nnx.split(model)
    run = programs.sample_fn(graphdef, n=2, max_new=16, top_n=0)
    dots = list(jaxpr_dots(jax.make_jaxpr(run)(params, *programs.abstract_inputs(2, 16, 2)).jaxpr))
    outside = [eqn.params["precision"] for eqn, inside in dots if not inside]
    assert len(outside) > 5 and any(inside for _, inside in dots)  # the model's matmuls, the Triton kernels'
    assert all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in outside), outside
