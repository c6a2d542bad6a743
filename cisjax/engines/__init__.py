"""The engines behind `cisjax serve`: vLLM, transformers (the torch reference) and the JAX sampler's adapter."""
