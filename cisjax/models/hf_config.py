"""Reading HF config.json fields (old and new spellings) and the runtime options every family shares."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from cisjax import errors
from cisjax.errors import CheckpointError  # noqa: F401  (its home was here)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name) -> Any:
    """'bfloat16' | 'float32' | 'float16' (or a jnp dtype) -> jnp dtype, with a clear error."""
    if not isinstance(name, str):
        return name
    if name not in _DTYPES:
        raise errors.UserError(f"unknown dtype {name!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How a model runs (not what it is): dtypes, the MoE dispatch algorithm, rematerialisation, scanned layers."""

    dtype: Any = jnp.float32  # compute dtype of activations and matmuls
    param_dtype: Any = jnp.float32  # storage dtype of the parameters
    router_dtype: Any = jnp.float32  # router logits and softmax (fp32 as the HF reference)
    moe_impl: str = "auto"  # auto | tiled | gmm | triton | mgpu | ragged | dense (see models/moe.py)
    moe_tile: int | None = None  # rows per tile of the tiled dispatch; None = chosen from the shape
    attention_impl: str = "auto"  # auto | einsum | splash | triton (see models/attention.py)
    remat: str = "none"  # rematerialisation of each decoder layer in the backward pass (transformer.REMAT_POLICIES)
    scan_layers: bool = True  # run each stack of decoder layers with one lax.scan (False: a loop, unrolled)


@dataclasses.dataclass(frozen=True)
class DecoderConfig(RuntimeOptions):
    """What every decoder-only family has; each family's Config subclasses this and adds its own."""

    vocab_size: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0  # width of the dense SwiGLU MLP layers
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope: tuple = ()  # sorted (key, value) pairs of the normalised rope parameters (hashable)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False

    def attention_dims(self) -> tuple[int, int, int]:
        """(query heads, q.k width per head, value width per head): the shape of the attention core (FLOP counts)."""
        return self.num_attention_heads, self.head_dim, self.head_dim


# Rows common to every family: HF tensor name -> our parameter path -> layout kind.
LM_WEIGHTS = (
    ("model.embed_tokens.weight", "embed_VxD", "id"),
    ("model.norm.weight", "norm.weight", "id"),
    ("lm_head.weight", "lm_head_DxV", "T"),
)


class Reader:
    """Typed access to config.json with one clear error naming the missing or bad field."""

    def __init__(self, hf: dict, arch: str):
        self.hf, self.arch = hf, arch

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key, default)
        return default if value is None else value

    def _need(self, key: str, default: Any):
        if key not in self.hf or self.hf[key] is None:
            if default is None:
                raise CheckpointError(f"{self.arch} config.json: missing required field {key!r}")
            return default
        return self.hf[key]

    def int(self, key: str, default: int | None = None) -> int:
        value = self._need(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{self.arch} config.json: field {key!r} must be a non-negative int, got {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self._need(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.arch} config.json: field {key!r} must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool:
        value = self._need(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.arch} config.json: field {key!r} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        """A list of non-negative ints (missing or null: empty)."""
        value = self.get(key, [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
            raise CheckpointError(
                f"{self.arch} config.json: field {key!r} must be a list of non-negative ints, got {value!r}"
            )
        return tuple(value)

    def decoder_fields(self, *, kv_heads: int | None = None, max_positions: int = 32768) -> dict:
        """The DecoderConfig fields. `kv_heads`: the family's default for a missing
        num_key_value_heads (None: num_attention_heads). Only SiLU MLPs exist in these families."""
        if self.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{self.arch} config.json: hidden_act {self.get('hidden_act')!r} is not supported (only 'silu')"
            )
        hidden, heads = self.int("hidden_size"), self.int("num_attention_heads")
        if heads == 0:
            raise CheckpointError(f"{self.arch} config.json: field 'num_attention_heads' must be positive")
        return dict(
            vocab_size=self.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=self.int("intermediate_size"),
            num_hidden_layers=self.int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=self.int("num_key_value_heads", heads if kv_heads is None else kv_heads),
            head_dim=self.int("head_dim", hidden // heads),
            rms_norm_eps=self.float("rms_norm_eps", 1e-6),
            rope=self.rope(),
            max_position_embeddings=self.int("max_position_embeddings", max_positions),
            tie_word_embeddings=self.bool("tie_word_embeddings", False),
        )

    def num_experts(self) -> int:
        """`num_local_experts` (new) or `num_experts` / `n_routed_experts` (older spellings)."""
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if self.hf.get(key) is not None:
                return self.int(key)
        raise CheckpointError(f"{self.arch} config.json: missing required field 'num_experts' (or 'num_local_experts')")

    def rope(self) -> tuple:
        """Normalised rope parameters as sorted (key, value) pairs: `rope_parameters` (new) or
        `rope_theta` + `rope_scaling` (old); `type` is accepted for `rope_type`."""
        params = dict(self.hf.get("rope_parameters") or {})
        scaling = self.hf.get("rope_scaling") or {}
        if not params.get("rope_type") and scaling:
            params.update(scaling)
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.pop("type", None)
        params.setdefault("rope_type", "default")
        if params.get("rope_theta") is None:
            params["rope_theta"] = self.float("rope_theta", 10000.0)
        if params["rope_type"] == "yarn":
            if params.get("original_max_position_embeddings") is None:
                params["original_max_position_embeddings"] = self.hf.get(
                    "original_max_position_embeddings"
                ) or self.int("max_position_embeddings")
            if params.get("factor") is None:
                raise CheckpointError(f"{self.arch} config.json: yarn rope scaling needs 'factor'")
        return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
