"""Tests of the JAX sampler as an engine: its backend and the colocated mode."""
