"""HF directory <-> cisjax model: family registry, streamed sharded loading, streamed saving.

One piece, though over 500 lines: loading and saving walk the same rows (`resolve_rows`: HF tensor name <-> parameter
path and slice, per-expert and fused layouts) in opposite directions, which keeps each the exact inverse of the other."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cisjax import distributed, sharding
from cisjax.errors import CheckpointError
from cisjax.models import transformer
from cisjax.models.hf_config import dtype_of
from cisjax.safetensors_io import SafetensorsDir, plan_files, write_index
from cisjax.safetensors_io import write_file as _write_shard  # a module global: tests replace it to fail mid-write

log = logging.getLogger(__name__)

# architectures[0] in config.json -> family module (each defines Config, build, WEIGHTS)
FAMILIES = {
    "Qwen2MoeForCausalLM": "cisjax.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "cisjax.models.qwen3_moe",
    "DeepseekV2ForCausalLM": "cisjax.models.deepseek_v2",
    "Qwen2ForCausalLM": "cisjax.models.qwen2",
}
# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


# ----------------------------------------------------------------------------- config / family


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    return json.loads(path.read_text())


def family_module(hf: dict):
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in FAMILIES:
        raise CheckpointError(f"unsupported architecture {arch!r} in config.json; supported: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[arch])


def model_config(hf: dict, **runtime):
    """The family's Config from an HF config dict; runtime options as keyword overrides."""
    for key in ("dtype", "param_dtype", "router_dtype"):
        if key in runtime:
            runtime[key] = dtype_of(runtime[key])
    family = family_module(hf)
    try:
        return family.Config.from_hf(hf, **runtime)
    except CheckpointError:
        raise
    except ValueError as e:  # a family's own check of a config.json value
        raise CheckpointError(f"config.json: {e}") from e


def abstract_model(hf: dict, cfg):
    """(graphdef, abstract state) without allocating any parameter."""
    family = family_module(hf)
    return nnx.split(nnx.eval_shape(lambda: family.build(cfg, nnx.Rngs(0))))


def init_model(hf: dict, cfg, seed: int = 0):
    """A randomly initialised model (tests, benchmarks)."""
    return family_module(hf).build(cfg, nnx.Rngs(seed))


# ----------------------------------------------------------------------------- name table


@dataclasses.dataclass(frozen=True)
class Row:
    path: str  # our flat parameter path, e.g. stacks.0.attn.wq_DxQ (stacked layers) or embed_VxD
    hf_names: tuple[str, ...]  # one name, or one per expert for "experts_T"
    kind: str  # id | T | experts_T
    slot: int | None = None  # the layer's index in a stacked parameter's leading axis; None: not stacked

    def layer_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Our shape of one layer's parameter (a stacked parameter without its leading axis)."""
        return tuple(shape[1:]) if self.slot is not None else tuple(shape)

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of each HF tensor for our parameter shape (stacked: the whole stack's shape)."""
        shape = self.layer_shape(shape)
        if self.kind == "id":
            return shape
        if self.kind == "T":
            return shape[::-1]
        return (shape[2], shape[1])


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_STACKED = re.compile(r"^stacks\.(?P<r>\d+)\.(?P<rest>.+)$")


def resolve_rows(
    weights: tuple, flat_shapes: Mapping[str, tuple[int, ...]], runs: tuple[tuple[int, ...], ...] = ()
) -> list[Row]:
    """Expand the family's declarative table (per-layer paths `layers.{i}.<rest>`) against the parameters this model
    actually has. A stacked parameter `stacks.{r}.<rest>` (transformer.stack_layers) holds layers runs[r]: one Row per
    layer, its slot in the stack."""
    compiled = [(hf, _template_regex(ours), kind) for hf, ours, kind in weights]

    def row(path, per_layer_path, shape, slot):
        hits = [(hf, m, kind) for hf, rx, kind in compiled if (m := rx.match(per_layer_path))]
        if len(hits) != 1:
            raise CheckpointError(f"parameter {per_layer_path!r} matches {len(hits)} rows of the weight table (want 1)")
        hf, m, kind = hits[0]
        i = m.groupdict().get("i")
        if kind == "experts_T":
            names = tuple(hf.format(i=i, e=e) for e in range(shape[0]))
        else:
            names = (hf.format(i=i),)
        return Row(path, names, kind, slot)

    rows = []
    for path, shape in flat_shapes.items():
        m = _STACKED.match(path)
        if m is None:
            rows.append(row(path, path, shape, None))
            continue
        run = runs[int(m["r"])]
        if len(run) != shape[0]:
            raise CheckpointError(
                f"parameter {path!r} stacks {shape[0]} layers, the config's layer runs say {len(run)}"
            )
        rows.extend(row(path, f"layers.{i}.{m['rest']}", shape[1:], j) for j, i in enumerate(run))
    return rows


def _runs(hf: Mapping) -> tuple[tuple[int, ...], ...]:
    """The stacks of decoder layers of this architecture (transformer.layer_runs)."""
    return transformer.layer_runs(model_config(dict(hf)))


def _flat(state) -> dict:
    return {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}


# ----------------------------------------------------------------------------- safetensors files


# ----------------------------------------------------------------------------- loading


def load(
    model_dir: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding.FrozenRules = sharding.DEFAULT_TABLE,
    **runtime,
):
    """Load an HF model directory into a cisjax model, each tensor streamed straight into its
    target sharding (each device reads only its own slice from the memory-mapped files): with a
    `mesh`, each parameter sharded by its logical axes through `rules`, the resolved table (a
    run's spec.rules; default sharding.DEFAULT_TABLE); without, on the first device.

    Returns (model, cfg, hf_config_dict). Raises CheckpointError naming the tensor/field on an
    unknown architecture, a missing tensor or a shape that disagrees with the config.
    """
    hf = read_hf_config(model_dir)
    cfg = model_config(hf, **runtime)
    graphdef, abstract = abstract_model(hf, cfg)
    files = SafetensorsDir(model_dir)
    flat = _flat(abstract)
    rows = resolve_rows(
        family_module(hf).WEIGHTS, {p: tuple(v.shape) for p, v in flat.items()}, transformer.layer_runs(cfg)
    )
    if mesh is not None:
        shardings = _flat(sharding.param_shardings(abstract, mesh, rules))
    else:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = {p: single for p in flat}

    by_path: dict[str, list[Row]] = {}
    used = set()
    for row in rows:
        want = row.hf_shape(tuple(flat[row.path].shape))
        for name in row.hf_names:
            if name not in files:
                raise CheckpointError(f"{model_dir}: missing tensor {name!r} (for {row.path}, shape {list(want)})")
            if files.shape(name) != want:
                raise CheckpointError(
                    f"{model_dir}: tensor {name!r} has shape {list(files.shape(name))} but config.json implies {list(want)}"
                )
        used.update(row.hf_names)
        by_path.setdefault(row.path, []).append(row)
    values = {}
    for path, path_rows in by_path.items():
        var = flat[path]
        reader = _reader(files, path_rows, np.dtype(var.dtype))
        values[path] = jax.make_array_from_callback(tuple(var.shape), shardings[path], reader)
    # A tied model uses the embedding as the head; a stray lm_head.weight is ignored, as transformers does.
    tied_head = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    extra = [n for n in files.names() if n not in used and n not in tied_head and not _IGNORED.match(n)]
    if extra:
        raise CheckpointError(
            f"{model_dir}: tensors not used by {hf['architectures'][0]}: {extra[:8]}{' ...' if len(extra) > 8 else ''}"
        )

    for path, var in flat.items():
        var.set_value(values[path]) if hasattr(var, "set_value") else setattr(var, "value", values[path])
    model = nnx.merge(graphdef, abstract)
    return model, cfg, hf


def _reader(files: SafetensorsDir, rows: list[Row], dtype: np.dtype):
    """Callback for jax.make_array_from_callback: reads just the requested slice, once per distinct
    slice (jax asks once per device, so a partially replicated tensor would be read repeatedly).
    `rows`: the parameter's one Row, or a stacked parameter's Rows in slot order (one per layer)."""
    cache: dict[tuple, np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            if rows[0].slot is None:
                out = _read(rows[0], index)
            else:  # the leading axis picks layers, the rest slices each layer's tensors
                out = np.stack([_read(rows[j], index[1:]) for j in range(len(rows))[index[0]]])
            cache[key] = np.ascontiguousarray(out.astype(dtype))
        return cache[key]

    def _read(row: Row, index: tuple[slice, ...]) -> np.ndarray:
        if row.kind == "id":
            return files.array(row.hf_names[0])[index]
        if row.kind == "T":
            return files.array(row.hf_names[0])[index[1], index[0]].T
        experts = range(len(row.hf_names))[index[0]]
        return np.stack([files.array(row.hf_names[e])[index[2], index[1]].T for e in experts])

    return read


# ----------------------------------------------------------------------------- saving


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str  # HF tensor name
    shape: tuple[int, ...]  # HF shape
    dtype: np.dtype  # the dtype the tensor is produced in


def _params_of(model) -> dict:
    """Flat {path: Param variable} of an nnx model or a (graphdef, params) pair."""
    if isinstance(model, tuple):
        if len(model) != 2:
            raise TypeError("model must be an nnx model or a (graphdef, params) pair")
        model = nnx.merge(*model)
    return _flat(nnx.state(model, nnx.Param))


def _plan(flat: dict, hf_config: Mapping, dtype: str | None) -> list[tuple[TensorSpec, Row, int]]:
    """(spec, row, expert index) of every HF tensor, in the table's order (experts of one parameter back to back)."""
    rows = resolve_rows(
        family_module(dict(hf_config)).WEIGHTS, {p: tuple(v.shape) for p, v in flat.items()}, _runs(hf_config)
    )
    out_dtype = np.dtype(dtype_of(dtype)) if dtype else None
    plan = []
    for row in rows:
        var = flat[row.path]
        dt = out_dtype or np.dtype(var.dtype)
        for e, name in enumerate(row.hf_names):
            plan.append((TensorSpec(name, row.hf_shape(tuple(var.shape)), dt), row, e))
    return plan


def tensor_specs(model, hf_config: Mapping, dtype: str | None = None) -> list[TensorSpec]:
    """Name, shape and dtype of every HF tensor `iter_tensors` yields, in the same order (nothing is transferred)."""
    return [spec for spec, _, _ in _plan(_params_of(model), hf_config, dtype)]


def _iter_plan(flat: dict, plan) -> Iterator[tuple[str, np.ndarray]]:
    # one layer's parameter on the host at a time: the experts of one are yielded back to back
    held: tuple[tuple[str, int | None], np.ndarray] | None = None
    for spec, row, e in plan:
        if held is None or held[0] != (row.path, row.slot):
            held = None  # drop the previous parameter before fetching the next one
            # slice, cast and transpose where the data lives: XLA's conversion and tiled transposes are far faster
            # than numpy's strided copies, a narrower dtype halves the transfer, and only one layer of a stack moves
            x = flat[row.path][...]
            if row.slot is not None:
                x = _layer_slice(x, row.slot)
            held = ((row.path, row.slot), distributed.to_host(_hf_layout(x, np.dtype(spec.dtype), row.kind != "id")))
        arr = held[1]
        arr = arr[e] if row.kind == "experts_T" else arr  # stacked experts are [E, out, in] after the layout
        yield spec.name, np.ascontiguousarray(arr, dtype=spec.dtype)


def iter_tensors(model, hf_config: Mapping, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, C-contiguous numpy array) of every tensor of the HF checkpoint, lazily, in `tensor_specs` order.

    At most one parameter (e.g. the stacked experts of one projection of one layer) and one HF tensor
    are on the host at a time. `model` is an nnx model or a (graphdef, params) pair; `dtype`
    (float32 | bfloat16 | float16) defaults to the parameters' own. Multi-process: every process must
    iterate it to the end in step (each parameter's gather is collective); every process gets every tensor.
    """
    flat = _params_of(model)
    return _iter_plan(flat, _plan(flat, hf_config, dtype))


class HFTensors(Mapping):
    """The model's HF tensors as a read-only Mapping whose `items()` streams them lazily (`iter_tensors`):
    what `RolloutClient.update_weights_from_tensors` iterates, with bounded host memory.

    `keys()`/`len()`/`specs` need no transfer; `self[name]` fetches one tensor (its whole parameter).
    Multi-process: `items()`/`values()` are collective, as `iter_tensors`."""

    def __init__(self, model, hf_config: Mapping, dtype: str | None = None):
        self._flat = _params_of(model)
        self._plan = _plan(self._flat, hf_config, dtype)
        self.specs = {spec.name: spec for spec, _, _ in self._plan}

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize for s in self.specs.values())

    def __len__(self) -> int:
        return len(self._plan)

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, name: str) -> np.ndarray:
        hit = [p for p in self._plan if p[0].name == name]
        if not hit:
            raise KeyError(name)
        return next(_iter_plan(self._flat, hit))[1]

    def items(self):
        return _iter_plan(self._flat, self._plan)

    def values(self):
        return (arr for _, arr in self.items())


def save(
    model,
    out_dir: str | os.PathLike,
    hf_config: dict,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 << 30,
    digests: dict | None = None,
) -> Path:
    """Write the model as an HF directory (config.json + safetensors, sharded with an index when
    larger than `max_shard_bytes`), streaming one tensor at a time (`iter_tensors`). `dtype` (float32 |
    bfloat16 | float16) defaults to the parameters' own dtype. `model`: an nnx model or a (graphdef,
    params) pair. On multi-process runs every process must call this (the gather is collective); only
    process 0 writes. `digests` (a dict) receives the sha256 of each safetensors file, computed while
    writing."""
    out = Path(out_dir)
    flat = _params_of(model)
    plan = _plan(flat, hf_config, dtype)
    specs = [spec for spec, _, _ in plan]
    stream = _iter_plan(flat, plan)

    def produce(name: str) -> np.ndarray:
        got, arr = next(stream)
        if got != name:
            raise AssertionError(f"tensor stream out of order: {got!r} where {name!r} was planned")
        return arr

    if jax.process_index() != 0:
        for _ in stream:  # take part in the collective gathers, write nothing
            pass
        return out
    return _write_dir(out, [(s.name, s.shape, s.dtype) for s in specs], produce, hf_config, max_shard_bytes, digests)


def save_tensors(
    tensors: Mapping[str, np.ndarray],
    out_dir: str | os.PathLike,
    hf_config: Mapping,
    *,
    max_shard_bytes: int = 4 << 30,
    digests: dict | None = None,
) -> Path:
    """`save` of HF tensors already on this host (name -> ndarray, in the checkpoint's order, one dtype), e.g. a
    publisher's host copy: written by the calling process alone (no gathers)."""
    specs = [(name, arr.shape, arr.dtype) for name, arr in tensors.items()]
    return _write_dir(Path(out_dir), specs, tensors.__getitem__, hf_config, max_shard_bytes, digests)


def _write_dir(out: Path, specs, produce, hf_config: Mapping, max_shard_bytes: int, digests: dict | None) -> Path:
    """config.json (its dtype that of the tensors) + the safetensors files (+ index) of `specs` ((name, shape,
    dtype), `produce(name)` -> ndarray in that order) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    # Weights of an earlier save into the same directory would be mixed into (or, through a stale
    # index, replace) these ones on the next load.
    for stale in out.glob("model*.safetensors*"):
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json", stale.name):
            stale.unlink()
    files = plan_files(specs, max_shard_bytes)
    for fname, items in files:
        _write_shard(out / fname, items, produce, digests)
    write_index(out, files)
    hf_out = dict(hf_config)
    hf_out["dtype"] = {
        np.dtype(np.float32): "float32",
        np.dtype(ml_dtypes.bfloat16): "bfloat16",
        np.dtype(np.float16): "float16",
    }[np.dtype(specs[0][2])]
    if "torch_dtype" in hf_config:  # the transformers 4 spelling: kept up to date only where present
        hf_out["torch_dtype"] = hf_out["dtype"]
    (out / "config.json").write_text(json.dumps(hf_out, indent=2))
    return out


@jax.jit
def _layer_slice(x: jax.Array, slot) -> jax.Array:
    """Layer `slot` of a stacked parameter (a traced index: one compile per parameter shape, not per layer)."""
    return jax.lax.dynamic_index_in_dim(x, slot, 0, keepdims=False)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _hf_layout(x: jax.Array, dtype, transpose: bool) -> jax.Array:
    """The parameter in the HF file dtype, its last two axes swapped when the table says so (HF stores
    [out, in] where cisjax keeps [in, out]; stacked experts [E, in, out] -> [E, out, in])."""
    x = x.astype(dtype)
    return jnp.swapaxes(x, -1, -2) if transpose else x
