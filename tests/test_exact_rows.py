"""rollout.exact on a mesh (cisjax.exact_rows): the sampler and the trainer's exact forward each run on a device's own
rows with the weights gathered whole, so q == p bit for bit and equal to one device's values; the KV cache splits."""

import flax.nnx as nnx
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import exact_forward, sharding
from cisjax.engines.jax import exact_engine
from cisjax.engines.jax.engine import Request
from cisjax.engines.jax.exact_engine import ExactEngine
from cisjax.models import exact, hf_io
from cisjax.rollout.params import SamplingParams

RULES = sharding.DEFAULT_TABLE


def _mesh():
    return sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1, "expert": 1})  # rows over both: 8 shards


def _on_mesh(model, mesh):
    graphdef, state = nnx.split(model)
    return graphdef, jax.device_put(state, sharding.param_shardings(state, mesh, RULES))


def _batch(samples, t: int):
    """The samples as the trainer's rows [B, T] (B as many as samples: not a multiple of the mesh's 8 shards), each
    target's support ids (-1 padded) where its request truncates."""
    b, s = len(samples), 1 + max(max(s.support[1], default=0) for _, s in samples)
    tokens, targets = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    support = np.full((b, t, s), -1, np.int32)
    for i, (prompt, sample) in enumerate(samples):
        seq = prompt + sample.token_ids
        tokens[i, : len(seq)], targets[i, : len(seq) - 1] = seq, seq[1:]
        ids, counts = sample.support
        at = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        for j, c in enumerate(counts):
            support[i, len(prompt) - 1 + j, :c] = ids[at[j] : at[j + 1]]
    return tokens, np.tile(np.arange(t, dtype=np.int32), (b, 1)), targets, support


@pytest.mark.parametrize("family,dtype", [("deepseek_v2", "float32"), ("qwen2_moe", "bfloat16")])
def test_q_equals_p_on_a_mesh(tiny_hf_dir, family, dtype):
    """Rows of varied lengths, truncated and not, on a mesh of 8 row shards; B = 15 rows on the trainer's side (padded
    to 16 inside). Where one side ran as one GSPMD program over the sharded weights instead (the trainer before
    exact_rows), 0 of 150 tokens (qwen2_moe bf16) and 37 of 150 (deepseek_v2 fp32) agreed with the sampler's."""
    model, _, _ = hf_io.load(tiny_hf_dir(family), dtype=dtype, param_dtype="float32")
    mesh = _mesh()
    graphdef, params = _on_mesh(model, mesh)
    rng = np.random.default_rng(1)
    requests = [
        Request(
            rng.integers(2, 90, int(rng.integers(2, 14))).tolist(),
            i,
            SamplingParams(n=3, top_k=k, max_new_tokens=5 + 2 * i, seed=3, return_sampling_mask=True),
        )
        for i, k in enumerate((0, 8, 0, 5, 0))
    ]
    results = ExactEngine(graphdef, params, max_len=96, mesh=mesh, rules=RULES).generate_many(requests)
    samples = [(r.prompt, s) for r, ss in zip(requests, results) for s in ss]
    assert len(samples) == 15
    tokens, positions, targets, support = _batch(samples, 48)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P()))  # noqa: E731
    value = jax.jit(lambda p, *rows: exact_forward.exact_value(graphdef, mesh, RULES, 1.0, p, *rows))
    p_BxT = np.asarray(value(params, *map(put, (tokens, positions, targets, support))))
    n = 0
    for i, (prompt, s) in enumerate(samples):
        m = len(s.token_ids)
        np.testing.assert_array_equal(p_BxT[i, len(prompt) - 1 : len(prompt) - 1 + m], np.float32(s.logprobs))
        n += m
    assert n > 60


def test_the_decode_holds_its_rows_share_of_the_cache(tiny_hf_dir):
    """ExactEngine's programs on an 8-way mesh: every cache array and per-row state array split over the batch axes
    (each device its rows' eighth), the decode taking and giving them so."""
    model, _, _ = hf_io.load(tiny_hf_dir("qwen2_moe"), dtype="float32", param_dtype="float32")
    mesh = _mesh()
    graphdef, params = _on_mesh(model, mesh)
    (prefill, pargs), (decode, dargs) = exact_engine.abstract_programs(
        graphdef, params, mesh, RULES, batch=8, prompt_len=16, n=4, new_tokens=16
    )
    width = dargs[3]["tokens"].shape[0]
    assert width == 8 * exact.TILE  # 32 rows: each device's a whole tile
    compiled = decode.lower(*dargs).compile()
    cache_out, state_out = compiled.output_shardings
    for arrays, abstract in zip(cache_out, dargs[2]):
        for sh, a in zip(arrays, abstract):
            assert a.shape[0] == width and sh.shard_shape(a.shape)[0] == width // 8, (sh, a.shape)
    for key, sh in state_out.items():
        assert sh.shard_shape(dargs[3][key].shape)[0] == width // 8, key
    # the prefill's too: its prompts and the rows they fill
    cache_out, _ = prefill.lower(*pargs).compile().output_shardings
    assert all(
        sh.shard_shape(a.shape)[0] == width // 8 for arrays, c in zip(cache_out, dargs[2]) for sh, a in zip(arrays, c)
    )


def test_abstract_programs_refuse_prompts_the_shards_do_not_divide(tiny_hf_dir):
    model, _, _ = hf_io.load(tiny_hf_dir("qwen2_moe"), dtype="float32", param_dtype="float32")
    mesh = _mesh()
    graphdef, params = _on_mesh(model, mesh)
    with pytest.raises(ValueError, match="batch=6 prompts: not a multiple of the mesh's 8 row shards"):
        exact_engine.abstract_programs(graphdef, params, mesh, RULES, batch=6, prompt_len=16, n=4, new_tokens=16)
