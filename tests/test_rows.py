"""The one row builder: sequences -> padded or packed rows, checked against hand-written arrays."""

import numpy as np
import pytest

from cisjax import errors
from cisjax import rows as rows_lib
from cisjax.rows import Seq


def test_one_per_row_by_hand():
    seqs = [Seq([5, 6], [7, 8]), Seq([9], [3])]
    r = rows_lib.build(seqs, rows_lib.one_per_row(2), length=4, rows=3)
    np.testing.assert_array_equal(r.tokens_RxT, [[5, 6, 7, 0], [9, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(r.targets_RxT, [[6, 7, 8, 0], [3, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(r.positions_RxT, [[0, 1, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(r.segments_RxT, [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # positions 1, 2 of row 0 predict the response tokens 7, 8; position 0 of row 1 predicts 3
    np.testing.assert_array_equal(r.response_RxT, [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert r.response_slice(seqs, 0) == (0, slice(1, 3)) and r.response_slice(seqs, 1) == (1, slice(0, 1))


def test_packed_segments_by_hand():
    seqs = [Seq([1, 2], [3]), Seq([4], [5, 6])]
    r = rows_lib.build(seqs, [[1, 0]], length=6)
    np.testing.assert_array_equal(r.tokens_RxT, [[4, 5, 1, 2, 0, 0]])
    np.testing.assert_array_equal(r.targets_RxT, [[5, 6, 2, 3, 0, 0]])
    np.testing.assert_array_equal(r.positions_RxT, [[0, 1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(r.segments_RxT, [[1, 1, 2, 2, 0, 0]])
    np.testing.assert_array_equal(r.response_RxT, [[1, 1, 0, 1, 0, 0]])
    assert r.where == {1: (0, 0), 0: (0, 2)}
    assert r.response_slice(seqs, 0) == (0, slice(3, 4))
    # an empty response occupies its prompt's positions and predicts nothing
    e = rows_lib.build([Seq([1, 2, 3], [])], [[0]], length=2)
    assert not e.response_RxT.any() and e.response_slice([Seq([1, 2, 3], [])], 0) == (0, slice(2, 2))


def test_pack_first_fit_decreasing():
    seqs = [Seq([1] * 3, [2] * 2), Seq([1] * 6, [2] * 3), Seq([1], [2] * 2), Seq([1] * 2, [2])]  # 4, 8, 2, 2 positions
    assert rows_lib.pack(seqs, 10) == [[1, 2], [0, 3]]
    assert rows_lib.pack(seqs, 8) == [[1], [0, 2, 3]]
    with pytest.raises(errors.UserError, match="sequence 1 needs 8 positions, more than a row \\(7\\)"):
        rows_lib.pack(seqs, 7)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        rows_lib.build([Seq([], [1, 2])], [[0]], length=4)
    with pytest.raises(ValueError, match="row 0 needs 5 positions"):
        rows_lib.build([Seq([1, 2], [3]), Seq([1, 2], [3, 4])], [[0, 1]], length=4)
    with pytest.raises(ValueError, match="do not fit"):
        rows_lib.build([Seq([1], [2])] * 2, rows_lib.one_per_row(2), length=4, rows=1)


def test_packed_routing_follows_its_positions():
    """Each sequence's routing (one row of [layers, k] per input position) lands on its positions in the packed row;
    padding holds 0..k-1; a sequence without routing leaves the rows without it."""
    a = Seq([1, 2], [3], routing=np.asarray([[[10, 11]], [[12, 13]]], np.uint8))  # 2 positions, 1 layer, k=2
    b = Seq([4], [5, 6], routing=np.asarray([[[20, 21]], [[22, 23]]], np.uint8))
    r = rows_lib.build([a, b], [[1, 0]], length=6)
    assert r.routing_RxTxXxK.dtype == np.uint8
    assert r.routing_RxTxXxK[0, :, 0].tolist() == [[20, 21], [22, 23], [10, 11], [12, 13], [0, 1], [0, 1]]
    assert rows_lib.build([a, Seq([4], [5, 6])], [[1, 0]], length=6).routing_RxTxXxK is None
    with pytest.raises(ValueError, match="routing"):
        rows_lib.build([Seq([1, 2], [3, 4], routing=a.routing)], [[0]], length=6)
