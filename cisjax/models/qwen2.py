"""Dense Qwen2 / Qwen2.5 (the dense control), with the semantics of transformers' Qwen2ForCausalLM."""

from __future__ import annotations

import dataclasses

import flax.nnx as nnx

from cisjax.models import hf_config, qwen2_moe
from cisjax.models.transformer import CausalLM, decoder_layers

ARCHITECTURE = "Qwen2ForCausalLM"


@dataclasses.dataclass(frozen=True)
class Config(hf_config.DecoderConfig):
    @property
    def qkv_bias(self) -> bool:  # Qwen2 always has q/k/v biases (and no o_proj bias)
        return True

    @classmethod
    def from_hf(cls, hf: dict, **runtime) -> Config:
        r = hf_config.Reader(hf, ARCHITECTURE)
        layers = r.int("num_hidden_layers")
        # As Qwen2Config: the window only exists with use_sliding_window, on layers >= max_window_layers
        # unless layer_types spells the layers out.
        window = hf.get("sliding_window", 4096) if r.bool("use_sliding_window", False) else None
        layer_types = r.get("layer_types") or [
            "sliding_attention" if window is not None and i >= r.int("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        if sliding:
            raise ValueError(
                f"{ARCHITECTURE}: sliding-window attention (layers {sliding}, window {window}) is not supported"
            )
        # Qwen2Config: a missing num_key_value_heads is 32, an explicit null means num_attention_heads.
        return cls(**r.decoder_fields(kv_heads=None if "num_key_value_heads" in hf else 32), **runtime)

    def is_moe_layer(self, i: int) -> bool:
        return False


def build(cfg: Config, rngs: nnx.Rngs) -> CausalLM:
    """Qwen2-MoE's attention and a dense SwiGLU MLP in every layer (forward gives expert_ids None)."""
    return CausalLM(cfg, decoder_layers(cfg, rngs, attention=qwen2_moe.Attention), rngs=rngs)


# Qwen2-MoE's attention and dense-MLP rows (rows without a parameter here are dropped by hf_io).
WEIGHTS = hf_config.LM_WEIGHTS + qwen2_moe.ATTENTION_WEIGHTS
