"""The offline demo's learnable start: synthetic arithmetic, a character tokenizer, a tiny Qwen2-MoE warmed up."""

from cisjax.demo.write import prepare

__all__ = ["prepare"]
