"""Test session set-up: 8 fake CPU devices for sharding tests (must precede the first jax import)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compiler (cisjax plan's tests) in several test workers at once: libtpu's machine-wide lock would refuse
# all but one, and its host probes would warn on a machine without a TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# vLLM takes the installed libtpu for TPU hardware: tests importing vLLM in-process select its CPU build as the rollout
# server does (cisjax.rollout.engine_env imports neither jax nor vllm).
from cisjax.rollout import engine_env  # noqa: E402

if engine_env.cpu_build():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
