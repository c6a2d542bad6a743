"""Multi-process agreement: process 0's status and host data on every process, any process's flag, whole arrays on the host."""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

# Every function is a collective when there are several processes: all processes call it at the same point, or they
# hang.

__all__ = ["agree", "broadcast", "any_process", "to_host"]


def agree(code: int) -> int:
    """Process 0's status code (an int: 0 = ok, by convention) on every process."""
    if jax.process_count() == 1:
        return int(code)
    return int(multihost_utils.broadcast_one_to_all(np.int32(code)))


def broadcast(tree):
    """Process 0's `tree` (any picklable host value: a pytree of numpy arrays, numbers, strings, ...) on every
    process, bit for bit; the other processes' `tree` is ignored (pass None)."""
    if jax.process_count() == 1:
        return tree
    # as bytes: nothing about the value need be known elsewhere, and every dtype travels exactly (a psum of uint8
    # with zeros from the other processes; numbers as jax arrays would lose 64-bit precision without jax_enable_x64)
    lead = jax.process_index() == 0
    data = np.frombuffer(pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL), np.uint8) if lead else None
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size if lead else 0)))
    data = multihost_utils.broadcast_one_to_all(data if lead else np.zeros(size, np.uint8))
    return pickle.loads(np.asarray(data, np.uint8).tobytes())


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process, answered alike on all."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def to_host(x) -> np.ndarray:
    """The whole of a global jax.Array on this process, as numpy (gathered when x spans processes)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
