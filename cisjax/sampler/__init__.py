"""The JAX sampler: cisjax's own models generating through a KV cache (sampling math, programs, batching)."""
