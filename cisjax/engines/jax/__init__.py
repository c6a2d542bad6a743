"""The JAX sampler as an engine: cisjax's own models generating through a KV cache (sampling math, programs,
batching), its rollout-service backend and the colocated mode (the trainer's own process)."""
