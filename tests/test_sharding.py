"""Sharding: the logical-axis table, meshes, sharded HF loading and sharded-forward parity on 8 CPU devices."""

from __future__ import annotations

import functools
import math

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from cisjax import sharding
from cisjax.models import hf_io
from tests.support.hf import MESHES as HELPER_MESHES
from tests.support.hf import SHARDABLE_QWEN2_MOE

TINY = SHARDABLE_QWEN2_MOE
MESHES = {**HELPER_MESHES, "expert8": {"expert": -1}}

# Hand-written specs of a few parameters under the default table, per mesh (size-1 axes drop out). Decoder layers are
# stacked: a leading "layers" axis, replicated.
EXPECTED = {
    "fsdp8": {
        "embed_VxD": P(None, "fsdp"),
        "stacks.0.attn.wk_DxK": P(None, "fsdp", None),
        "stacks.0.mlp.moe.router_DxE": P(None, "fsdp", None),
        "stacks.0.mlp.moe.wg_ExDxF": P(None, None, "fsdp", None),
        "stacks.0.mlp.moe.wo_ExFxD": P(None, None, None, "fsdp"),
        "norm.weight": P(None),
    },
    "data2_fsdp2_tensor2": {
        "embed_VxD": P("tensor", "fsdp"),
        "stacks.0.attn.wk_DxK": P(None, "fsdp", "tensor"),
        "stacks.0.attn.bq_Q": P(None, "tensor"),
        "stacks.0.mlp.moe.router_DxE": P(None, "fsdp", None),
        "stacks.0.mlp.moe.wg_ExDxF": P(None, None, "fsdp", "tensor"),
        "stacks.0.mlp.moe.wo_ExFxD": P(None, None, "tensor", "fsdp"),
    },
    "fsdp2_tensor2_expert2": {
        "embed_VxD": P("tensor", "fsdp"),
        "stacks.0.mlp.moe.wg_ExDxF": P(None, "expert", "fsdp", "tensor"),
        "stacks.0.mlp.moe.wo_ExFxD": P(None, "expert", "tensor", "fsdp"),
        "stacks.0.mlp.shared_gate_Dx1": P(None, "fsdp", None),
    },
    "expert8": {
        "embed_VxD": P(None, None),
        "stacks.0.mlp.moe.wg_ExDxF": P(None, "expert", None, None),
        "stacks.0.attn.wq_DxQ": P(None, None, None),
    },
}


@pytest.fixture(scope="module")
def tiny_dir(tiny_hf_dir):
    return tiny_hf_dir("qwen2_moe", **TINY)


@pytest.fixture(scope="module")
def tokens_BxL():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (8, 8)).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BxL):
    model = nnx.merge(graphdef, state)
    out = model(tokens_BxL)
    return model.logits(out.hidden_BxLxD), out.expert_ids_XxBxLxK


@pytest.fixture(scope="module")
def reference(tiny_dir, tokens_BxL):
    """The unsharded (single-device) model: flat params and (logits, routing ids)."""
    model, _, _ = hf_io.load(tiny_dir)
    graphdef, state = nnx.split(model)
    logits, ids = _forward(graphdef, state, tokens_BxL)
    return _flat_params(model), np.asarray(logits), np.asarray(ids)


def _flat_params(model) -> dict:
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ----------------------------------------------------------------------------- make_mesh


def test_make_mesh_sizes_and_minus_one():
    mesh = sharding.make_mesh({"data": 2, "tensor": -1})
    assert mesh.axis_names == ("data", "fsdp", "tensor", "expert")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4, "expert": 1}
    assert dict(sharding.make_mesh({"fsdp": -1}).shape)["fsdp"] == 8
    small = sharding.make_mesh({"expert": 2}, devices=jax.devices()[:2])
    assert small.devices.size == 2 and dict(small.shape)["expert"] == 2


@pytest.mark.parametrize(
    "shape, message",
    [
        ({"model": 2}, "unknown mesh axes"),
        ({"data": 3}, "needs 3 devices, have 8"),
        ({"data": -1, "fsdp": -1}, "at most one"),
        ({"data": -1, "fsdp": 3}, "does not divide 8"),
        ({"data": 0}, "positive or -1"),
        ({"data": -2, "fsdp": -4}, "positive or -1"),
    ],
)
def test_make_mesh_errors(shape, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(shape)


# ----------------------------------------------------------------------------- rules table


def test_rules_from_config_overrides():
    assert sharding.rules_from_config() == dict(sharding.DEFAULT_RULES)
    rules = sharding.rules_from_config({"embed": None, "vocab": ["tensor", "fsdp"], "mlp": "none", "my_axis": "expert"})
    assert rules["embed"] is None and rules["mlp"] is None
    assert rules["vocab"] == ("tensor", "fsdp")  # lists from YAML become tuples
    assert rules["my_axis"] == "expert"
    assert rules["heads"] == "tensor"  # untouched entries keep the default


def test_resolved_rules_are_one_frozen_value():
    """rules_from_config's table is immutable and hashable (a jit or cache key as it is), equal to the same entries
    in any mapping and order; freeze keeps it as it is, and use_mesh makes that very table active."""
    rules = sharding.rules_from_config({"embed": None})
    assert isinstance(rules, sharding.FrozenRules) and sharding.freeze(rules) is rules
    with pytest.raises(TypeError):
        rules["embed"] = "fsdp"
    same = sharding.freeze(dict(reversed(list(dict(rules).items()))))
    assert same == rules == dict(rules) and hash(same) == hash(rules) and len({rules, same}) == 1
    assert rules != sharding.DEFAULT_TABLE and sharding.DEFAULT_TABLE == sharding.rules_from_config()
    with sharding.use_mesh(sharding.make_mesh({"fsdp": 8}), rules):
        assert sharding.active()[1] is rules


@pytest.mark.parametrize(
    "override, message",
    [
        ({"embed": "model"}, "'embed' -> unknown mesh axis 'model'"),
        ({"batch": ["data", "data"]}, "names a mesh axis twice"),
    ],
)
def test_rules_from_config_errors(override, message):
    with pytest.raises(ValueError, match=message):
        sharding.rules_from_config(override)


# ----------------------------------------------------------------------------- logical_to_spec


def test_logical_to_spec_divisibility_and_size_one_axes():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_from_config()
    spec = functools.partial(sharding.logical_to_spec, rules=rules, mesh=mesh)
    # batch -> (data, fsdp, expert): expert has size 1 and drops out
    assert spec(("batch", "length", "act_embed"), shape=(8, 5, 64)) == P(("data", "fsdp"), None, None)
    # the longest prefix of mesh axes dividing the dim is kept
    assert spec(("batch", "length"), shape=(6, 5)) == P("data", None)
    assert spec(("batch", "length"), shape=(3, 5)) == P(None, None)
    assert spec(("embed", "mlp"), shape=(64, 32)) == P("fsdp", "tensor")
    assert spec(("embed", "mlp"), shape=(63, 32)) == P(None, "tensor")
    assert spec(("expert", "embed", "expert_mlp"), shape=(8, 64, 32)) == P(None, "fsdp", "tensor")
    assert spec(("norm",), shape=(64,)) == P(None)
    assert spec(("embed", None), shape=(64, 1)) == P("fsdp", None)
    # without a shape there is no divisibility check
    assert spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert spec(("embed", "mlp"), shape=(3, 3)) == P(None, None)


def test_logical_to_spec_mesh_axis_used_once():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = {"a": "tensor", "b": "tensor", "w": "fsdp", "batch": ("data", "fsdp", "expert")}
    assert sharding.logical_to_spec(("a", "b"), rules, mesh, (4, 4)) == P("tensor", None)
    # an axis dropped for divisibility stays available to later dims
    assert sharding.logical_to_spec(("a", "b"), rules, mesh, (3, 4)) == P(None, "tensor")
    # fsdp already taken by `w`: batch keeps the remaining (data,)
    assert sharding.logical_to_spec(("w", "batch"), rules, mesh, (4, 8)) == P("fsdp", "data")
    assert sharding.logical_to_spec(("batch", "w"), rules, mesh, (8, 4)) == P(("data", "fsdp"), None)


def test_logical_to_spec_unknown_name():
    mesh = sharding.make_mesh({"fsdp": 8})
    with pytest.raises(KeyError, match="'hiddden' has no entry"):
        sharding.logical_to_spec(("batch", "hiddden"), sharding.rules_from_config(), mesh, (8, 8))


# ----------------------------------------------------------------------------- constrain / place


def test_constrain_follows_mesh_context_through_jit_cache():
    """The mesh and rules are part of jit's cache key: no stale trace reused across contexts."""
    mesh = sharding.make_mesh({"fsdp": 8})
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return sharding.constrain(x * 2, ("batch", "act_embed"))

    x = jnp.ones((8, 16))
    assert isinstance(f(x).sharding, SingleDeviceSharding)
    with sharding.use_mesh(mesh, sharding.rules_from_config()):
        assert f(x).sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None)), 2)
    with sharding.use_mesh(mesh, sharding.rules_from_config({"batch": None, "act_embed": "fsdp"})):
        assert f(x).sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 2)
    assert isinstance(f(x).sharding, SingleDeviceSharding)
    assert len(traces) == 3


def test_constrain_is_off_in_a_shard_map_body_where_the_platform_stays_the_meshs():
    """sharding.manual: a shard_map body's arrays are per device, so constrain adds nothing there (a NamedSharding
    constraint inside the body would be refused), while current_platform still follows the mesh."""
    mesh = sharding.make_mesh({"fsdp": 8})

    def body(x):
        with sharding.use_mesh(mesh, sharding.rules_from_config()), sharding.manual():
            assert sharding.active()[0] is mesh  # what current_platform reads
            return sharding.constrain(x * 2, ("batch", "act_embed"))

    f = jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    jaxpr = str(jax.make_jaxpr(f)(jnp.ones((8, 16))))
    assert "sharding_constraint" not in jaxpr and "shard_map" in jaxpr
    np.testing.assert_array_equal(jax.jit(f)(jnp.ones((8, 16))), 2 * np.ones((8, 16)))
    with sharding.use_mesh(mesh, sharding.rules_from_config()):  # outside manual: the constraint is there
        assert "sharding_constraint" in str(
            jax.make_jaxpr(lambda x: sharding.constrain(x, ("batch", None)))(jnp.ones((8, 16)))
        )


def test_place():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_from_config()
    tokens = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    batch = {"tokens": tokens, "weights": np.ones((8,), np.float32), "odd": np.zeros((3, 16))}
    placed = sharding.place(batch, mesh, rules)
    assert placed["tokens"].sharding.spec == P(("data", "fsdp"), None)
    assert placed["tokens"].addressable_shards[0].data.shape == (2, 16)
    np.testing.assert_array_equal(np.asarray(placed["tokens"]), tokens)  # every shard holds its own rows
    assert placed["weights"].sharding.spec == P(("data", "fsdp"))
    assert placed["odd"].sharding.spec == P(None, None)  # 3 rows: replicated, not an error
    # a TrainBatch-like [M, B, T] leaf: micro-batches replicated, rows split, as the step's batch_sharding says
    mbt = sharding.place(np.zeros((2, 8, 4), np.float32), mesh, rules, sharding.BATCH_AXES)
    assert mbt.sharding.is_equivalent_to(sharding.batch_sharding(mesh, rules), 3)


def test_axis_multiple():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_from_config()
    assert sharding.axis_multiple(mesh, rules, "batch") == 4  # data x fsdp (expert has size 1)
    assert sharding.axis_multiple(mesh, rules, "length") == 1
    assert sharding.axis_multiple(mesh, sharding.rules_from_config({"batch": "data"}), "batch") == 2
    assert sharding.axis_multiple(sharding.make_mesh({"expert": 8}), rules, "batch") == 8


# ----------------------------------------------------------------------------- sharded load + forward


def _check_param_shardings(model, mesh, rules, reference_params):
    """Every parameter: placed as the table says, holding exactly the unsharded values."""
    n_split = 0
    for path, var in _flat_params(model).items():
        arr = var[...]
        axes = var.get_metadata()["axes"]
        want = sharding.logical_to_spec(axes, rules, mesh, arr.shape)
        assert isinstance(arr.sharding, NamedSharding) and arr.sharding.mesh == mesh, path
        assert arr.sharding.spec == want, (path, axes, arr.sharding.spec, want)
        shard_shape = arr.addressable_shards[0].data.shape
        assert shard_shape == tuple(
            d // math.prod(mesh.shape[a] for a in _axes_of(s))
            for d, s in zip(arr.shape, list(want) + [None] * arr.ndim)
        )
        n_split += math.prod(shard_shape) < arr.size
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(reference_params[path][...]), err_msg=path)
    return n_split


def _axes_of(entry) -> tuple:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_load_and_forward_match_unsharded(name, tiny_dir, tokens_BxL, reference):
    ref_params, ref_logits, ref_ids = reference
    mesh = sharding.make_mesh(MESHES[name])
    rules = sharding.rules_from_config()
    model, _, _ = hf_io.load(tiny_dir, mesh=mesh, rules=rules)
    params = _flat_params(model)
    for path, spec in EXPECTED[name].items():
        assert params[path][...].sharding.spec == spec, (name, path)
    assert _check_param_shardings(model, mesh, rules, ref_params) >= 3  # at least the 3 expert stacks (both layers)

    graphdef, state = nnx.split(model)
    with sharding.use_mesh(mesh, rules):
        tokens = sharding.place(tokens_BxL, mesh, rules)
        assert tokens.addressable_shards[0].data.shape[0] < tokens.shape[0]
        logits, ids = _forward(graphdef, state, tokens)
        hlo = _forward.lower(graphdef, state, tokens).compile().as_text()
    assert isinstance(logits.sharding, NamedSharding) and logits.sharding.mesh == mesh
    # the program really is partitioned: devices exchange data
    assert any(op in hlo for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"))
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)


@pytest.mark.slow  # the fast tier has tests/models/test_moe.py's gmm on this mesh
def test_gmm_dispatch_model_on_a_mesh_matches_unsharded(tiny_dir, tokens_BxL, reference):
    """The model with moe_impl="gmm" (megablox, in Pallas's interpreter here) on a data x fsdp x tensor mesh gives the
    unsharded default-dispatch model's logits and routes."""
    _, ref_logits, ref_ids = reference
    mesh, rules = sharding.make_mesh(MESHES["data2_fsdp2_tensor2"]), sharding.rules_from_config()
    model, _, _ = hf_io.load(tiny_dir, mesh=mesh, rules=rules, moe_impl="gmm")
    graphdef, state = nnx.split(model)
    with sharding.use_mesh(mesh, rules):
        logits, ids = _forward(graphdef, state, sharding.place(tokens_BxL, mesh, rules))
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)


def test_rules_override_changes_loaded_specs(tiny_dir, reference):
    mesh = sharding.make_mesh(MESHES["fsdp2_tensor2_expert2"])
    rules = sharding.rules_from_config({"embed": None, "vocab": ["tensor", "fsdp"], "expert": None})
    model, _, _ = hf_io.load(tiny_dir, mesh=mesh, rules=rules)
    params = _flat_params(model)
    assert params["embed_VxD"][...].sharding.spec == P(("tensor", "fsdp"), None)
    assert params["lm_head_DxV"][...].sharding.spec == P(None, ("tensor", "fsdp"))
    assert params["stacks.0.mlp.moe.wg_ExDxF"][...].sharding.spec == P(None, None, None, "tensor")
    assert params["stacks.0.mlp.moe.router_DxE"][...].sharding.spec == P(None, None, None)
    _check_param_shardings(model, mesh, rules, reference[0])


# ----------------------------------------------------------------------------- streamed slices


class _RecordingTensor:
    """Stands in for a memmapped tensor; records the shape of every slice taken from it."""

    def __init__(self, arr, name, log):
        self.arr, self.name, self.log = arr, name, log

    def __getitem__(self, index):
        out = self.arr[index]
        self.log.setdefault(self.name, []).append(out.shape)
        return out


@pytest.mark.parametrize("name", [None, "fsdp2_tensor2_expert2", "fsdp8"])
def test_load_reads_each_byte_once_in_device_slices(name, tiny_dir, monkeypatch):
    log: dict[str, list] = {}
    original = hf_io.SafetensorsDir.array
    monkeypatch.setattr(hf_io.SafetensorsDir, "array", lambda self, t: _RecordingTensor(original(self, t), t, log))
    mesh = sharding.make_mesh(MESHES[name]) if name else None
    hf_io.load(tiny_dir, mesh=mesh)
    files = hf_io.SafetensorsDir(tiny_dir)
    assert sorted(log) == sorted(files.names())
    for tensor, reads in log.items():
        # the distinct device slices tile the tensor: every element read exactly once in total
        assert sum(math.prod(s) for s in reads) == math.prod(files.shape(tensor)), (tensor, reads)
    expert = "model.layers.0.mlp.experts.3.gate_proj.weight"  # HF [F=32, D=64] -> our [E, D, F]
    if name is None:
        assert log[expert] == [(32, 64)]
    elif name == "fsdp8":  # wg_ExDxF: P(None, fsdp, None): 8 slices of D
        assert log[expert] == [(32, 8)] * 8
    else:  # P(expert, fsdp, tensor): the 4 devices holding expert 3 each read a quarter
        assert log[expert] == [(16, 32)] * 4
