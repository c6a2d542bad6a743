"""The JAX sampler as an engine: its rollout-service backend and the colocated mode (the trainer's own process)."""
