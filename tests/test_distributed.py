"""cisjax.distributed in one process (the two-process path: tests/train/test_loop_multiprocess.py, test_publish.py)."""

from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax import distributed


class Pair(NamedTuple):
    a: np.ndarray
    b: np.ndarray


def test_single_process_answers_are_this_process_values():
    assert jax.process_count() == 1
    assert distributed.agree(0) == 0 and distributed.agree(2) == 2 and distributed.agree(np.int32(1)) == 1
    assert distributed.any_process(False) is False and distributed.any_process(True) is True
    assert distributed.any_process(np.bool_(True)) is True


def test_broadcast_returns_process_zero_value_unchanged():
    tree = (
        Pair(np.arange(6, dtype=np.int32).reshape(2, 3), np.array([True, False])),
        np.array([2**40 + 1], np.int64),
        {"reward/mean": 0.125, "name": "x"},
        None,
    )
    out = distributed.broadcast(tree)
    assert out is tree  # one process: nothing travels
    assert distributed.broadcast(7) == 7


def test_to_host_gathers_a_sharded_array_whole():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    want = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    x = jax.device_put(want, NamedSharding(mesh, P("data")))
    got = distributed.to_host(x)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    bf = jax.numpy.asarray([1.5, -2.0], jax.numpy.bfloat16)
    got = distributed.to_host(bf)
    assert got.dtype == ml_dtypes.bfloat16 and got.tolist() == [1.5, -2.0]


class _TwoProcesses:
    """Plays one of two processes with a fake collective: process 0's run records what it contributes to each
    broadcast; process 1's run gets those back, and must contribute arrays of the same shape and dtype (as
    multihost_utils requires of every process)."""

    def __init__(self, monkeypatch):
        from jax.experimental import multihost_utils

        self.sent, self.index, self.mp = [], 0, monkeypatch
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "process_index", lambda: self.index)
        monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", self._broadcast)
        self.flags = [None, None]  # the other process's any_process flag
        monkeypatch.setattr(
            multihost_utils,
            "process_allgather",
            lambda x: np.stack([np.asarray(x), np.asarray(self.flags[1 - self.index])]),
        )

    def _broadcast(self, x):
        x = np.asarray(x)
        if self.index == 0:
            self.sent.append(x.copy())
            return x
        want = self.sent.pop(0)
        assert x.shape == want.shape and x.dtype == want.dtype and not x.any()  # zeros of process 0's shape
        return want

    def run(self, index, fn, *args):
        self.index = index
        return fn(*args)


def test_broadcast_between_two_processes_is_exact(monkeypatch):
    procs = _TwoProcesses(monkeypatch)
    value = (
        Pair(np.arange(6, dtype=np.int32).reshape(2, 3), np.array([True, False])),
        np.array([2**40 + 1, -3], np.int64),
        np.array([1.5, -0.0, np.inf], ml_dtypes.bfloat16),
        {"reward/mean": 0.1, "name": "é"},
        None,
    )
    assert procs.run(0, distributed.broadcast, value) is not None
    got = procs.run(1, distributed.broadcast, None)
    assert procs.sent == []  # process 1 took part in every broadcast process 0 did
    assert isinstance(got[0], Pair) and got[0].a.dtype == np.int32 and got[0].a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got[0].b.tolist() == [True, False]
    assert got[1].dtype == np.int64 and got[1].tolist() == [2**40 + 1, -3]  # no 32-bit truncation
    assert got[2].dtype == ml_dtypes.bfloat16 and got[2].view(np.uint16).tolist() == [0x3FC0, 0x8000, 0x7F80]
    assert got[3] == {"reward/mean": 0.1, "name": "é"} and got[4] is None


def test_agree_and_any_process_between_two_processes(monkeypatch):
    procs = _TwoProcesses(monkeypatch)
    assert procs.run(0, distributed.agree, 2) == 2
    assert procs.run(1, distributed.agree, 0) == 2  # process 0's code, whatever this process says
    procs.flags = [False, True]
    assert procs.run(0, distributed.any_process, False) is True and procs.run(1, distributed.any_process, True) is True
    procs.flags = [False, False]
    assert procs.run(0, distributed.any_process, False) is False
