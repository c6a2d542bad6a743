"""Tests of the JAX sampler as an engine: sampling, programs, the engine, its backend and the colocated mode."""
