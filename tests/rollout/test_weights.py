"""A streamed weight update's assembly (cisjax.rollout.weights.tensors_from_chunks): chunks in any order, bfloat16,
and the refusals of a stream that does not add up."""

import ml_dtypes
import numpy as np
import pytest

from cisjax.rollout import protos, weights
from cisjax.rollout.backend import RequestError

PB = protos.load().rollout_pb2


def _chunks(name, arr, dtype, size):
    data = arr.tobytes()
    return [
        PB.TensorChunk(name=name, dtype=dtype, shape=arr.shape, offset=off, data=data[off : off + size])
        for off in range(0, len(data), size)
    ]


def test_chunks_in_any_order_make_the_tensors():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.linspace(-1, 1, 6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    chunks = _chunks("a", a, "F32", 20) + _chunks("b", b, "BF16", 4)
    got = weights.tensors_from_chunks(reversed(chunks))
    assert got.keys() == {"a", "b"}
    np.testing.assert_array_equal(got["a"], a)
    assert got["b"].dtype == ml_dtypes.bfloat16 and got["b"].shape == (2, 3)
    np.testing.assert_array_equal(got["b"].view(np.uint16), b.view(np.uint16))


def test_a_stream_that_does_not_add_up_is_refused():
    a = np.zeros(4, np.float32)
    with pytest.raises(RequestError, match=r"tensor 'a': received 8 of 16 bytes"):
        weights.tensors_from_chunks(_chunks("a", a, "F32", 8)[:1])
    with pytest.raises(RequestError, match=r"tensor 'a': dtype 'F64' not one of \['BF16', 'F16', 'F32'\]"):
        weights.tensors_from_chunks(_chunks("a", a, "F64", 8))
    outside = PB.TensorChunk(name="a", dtype="F32", shape=[4], offset=12, data=b"\0" * 8)
    with pytest.raises(RequestError, match=r"tensor 'a': chunk \[12, 20\) outside its 16 bytes"):
        weights.tensors_from_chunks([outside])


def test_directories_are_confined_to_the_export_root(tmp_path):
    tmp_path = tmp_path.resolve()
    (tmp_path / "v1").mkdir()
    assert weights.confined("v1", tmp_path) == tmp_path / "v1"
    with pytest.raises(RequestError, match="outside the server's export root"):
        weights.confined(str(tmp_path.parent), tmp_path)
    with pytest.raises(RequestError, match="started without --export-root"):
        weights.confined("v1", None)
    with pytest.raises(RequestError, match="is not a directory"):
        weights.confined("v2", tmp_path)
