"""Weight deltas (cisjax.rollout.delta): which elements changed, sparse or whole by hand-counted bytes, the exact
result, refusals, the digest, the disk form, the chunked wire form and a server's kept base (rollout.weights.Base)."""

import grpc
import ml_dtypes
import numpy as np
import pytest

from cisjax.rollout import delta as delta_lib
from cisjax.rollout import protos, weights
from cisjax.rollout.backend import RequestError

BF16 = ml_dtypes.bfloat16


def _sets():
    """A base and a new set: `a` (bf16, 8 elements) changes at two of them, `b` (f32, 2 x 2) at three of four, `c`
    not at all."""
    a = np.arange(8, dtype=np.float32).astype(BF16)
    b = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    c = np.ones(3, np.float32)
    a2, b2 = a.copy(), b.copy()
    a2[1], a2[6] = BF16(1.5), BF16(-6.0)
    b2[0, 0], b2[0, 1], b2[1, 1] = 9.0, 8.0, 7.0
    return {"a": a, "b": b, "c": c}, {"a": a2, "b": b2, "c": c.copy()}


def test_diff_sends_changed_elements_or_whole_tensors_by_their_bytes():
    base, new = _sets()
    d = delta_lib.diff(base, new, base_version=3, digest_of_new="x")
    # a: 2 changed of 8 bf16: 2 x (4 + 2) = 12 bytes < 16 whole -> sparse; b: 3 of 4 f32: 3 x 8 = 24 >= 16 -> whole
    assert set(d.sparse) == {"a"} and set(d.dense) == {"b"}
    idx, values = d.sparse["a"]
    assert idx.dtype == np.uint32 and idx.tolist() == [1, 6] and values.dtype == BF16
    assert values.astype(np.float32).tolist() == [1.5, -6.0]
    assert d.nbytes == 12 + 16 and (d.elements, d.changed) == (15, 5) and d.changed_fraction == pytest.approx(5 / 15)
    assert d.base_version == 3 and d.digest == "x"


def test_diff_compares_bits():
    """-0.0 differs from 0.0 (the engine would serve another bit pattern); a NaN equals the same NaN."""
    base = {"w": np.array([0.0, np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], np.float32)}
    new = {"w": np.array([-0.0, np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], np.float32)}
    d = delta_lib.diff(base, new, base_version=0, digest_of_new="")
    assert d.sparse["w"][0].tolist() == [0] and d.changed == 1


def test_apply_gives_the_new_set_and_leaves_the_base_alone():
    base, new = _sets()
    kept = {k: v.copy() for k, v in base.items()}
    d = delta_lib.diff(base, new, base_version=1, digest_of_new=delta_lib.digest(new))
    got = delta_lib.apply(base, d)
    for k in new:
        assert got[k].dtype == new[k].dtype and np.array_equal(got[k], new[k])
        assert np.array_equal(base[k], kept[k])  # the base is never written
    assert got["c"] is base["c"]  # unchanged tensors are shared, not copied
    assert delta_lib.digest(got) == d.digest


def test_apply_refuses_what_does_not_fit_the_base():
    base, new = _sets()
    d = delta_lib.diff(base, new, base_version=1, digest_of_new="")
    with pytest.raises(delta_lib.DeltaError, match="'z' is not in the base"):
        delta_lib.apply(base, delta_lib.Delta(1, "", {"z": np.zeros(2, np.float32)}))
    with pytest.raises(delta_lib.DeltaError, match="'b'.*float32\\[4\\].*float32\\[2, 2\\]"):
        delta_lib.apply(base, delta_lib.Delta(1, "", {"b": np.zeros(4, np.float32)}))
    with pytest.raises(delta_lib.DeltaError, match="outside its 8 elements"):
        delta_lib.apply(base, delta_lib.Delta(1, "", {}, {"a": (np.array([8], np.uint32), d.sparse["a"][1][:1])}))
    with pytest.raises(delta_lib.DeltaError, match="values in float32"):
        delta_lib.apply(base, delta_lib.Delta(1, "", {}, {"a": (np.array([0], np.uint32), np.zeros(1, np.float32))}))
    with pytest.raises(delta_lib.DeltaError, match="tensor sets differ"):
        delta_lib.diff(base, {**new, "d": np.zeros(1, np.float32)}, base_version=1, digest_of_new="")


def test_digest_is_of_the_values_not_the_order_or_layout():
    base, _ = _sets()
    same = {"c": base["c"].copy(), "b": np.asfortranarray(base["b"]), "a": base["a"].copy()}
    assert delta_lib.digest(same) == delta_lib.digest(base)
    for changed in (
        {**base, "c": np.array([1.0, 1.0, np.nextafter(np.float32(1), np.float32(2))], np.float32)},  # one ulp
        {**base, "b": base["b"].reshape(4)},  # same bytes, other shape
        {**base, "c": base["c"].astype(BF16)},  # other dtype
        {"x" if k == "c" else k: v for k, v in base.items()},  # other name
    ):
        assert delta_lib.digest(changed) != delta_lib.digest(base)


def test_delta_directory_round_trip(tmp_path):
    base, new = _sets()
    d = delta_lib.diff(base, new, base_version=4, digest_of_new=delta_lib.digest(new))
    fields = delta_lib.write_dir(d, tmp_path)
    assert fields == {"kind": "delta", "base_version": 4, "digest": d.digest, "elements": 15, "changed": 5}
    from cisjax.rollout import manifest

    manifest.write(tmp_path, {"version": 5, **fields})
    assert delta_lib.is_delta_dir(tmp_path)
    back = delta_lib.read_dir(tmp_path)
    assert back.base_version == 4 and back.digest == d.digest and set(back.sparse) == {"a"} and set(back.dense) == {"b"}
    got = delta_lib.apply(base, back)
    assert all(np.array_equal(got[k], new[k]) for k in new)


def test_chunked_delta_assembles_and_a_lone_half_is_refused():
    rp = protos.load().rollout_pb2
    base, new = _sets()
    d = delta_lib.diff(base, new, base_version=2, digest_of_new=delta_lib.digest(new))
    parts = [(n, weights.WHOLE, a) for n, a in d.dense.items()]
    parts += [(n, p, x) for n, (i, v) in d.sparse.items() for p, x in ((weights.INDICES, i), (weights.VALUES, v))]
    first = rp.UpdateWeightsRequest(version=3, delta=rp.WeightsDelta(base_version=2, digest=d.digest))
    msgs = list(weights.chunk_messages(rp, first, iter(parts), chunk_bytes=4))  # several chunks per part
    assert msgs[0].version == 3 and msgs[0].delta.base_version == 2 and len(msgs) == 4 + 2 + 1
    back = weights.delta_from_chunks(reversed([m.chunk for m in msgs]), 2, d.digest)
    assert np.array_equal(delta_lib.apply(base, back)["a"], new["a"])
    lone = [m.chunk for m in msgs if m.chunk.part != weights.VALUES]
    with pytest.raises(RequestError, match="'a': indices without values"):
        weights.delta_from_chunks(lone, 2, d.digest)
    with pytest.raises(RequestError, match="whole tensors only"):
        weights.tensors_from_chunks([m.chunk for m in msgs])


def test_base_applies_only_over_its_own_version_and_digest():
    base, new = _sets()
    d = delta_lib.diff(base, new, base_version=7, digest_of_new=delta_lib.digest(new))
    kept = weights.Base()
    with pytest.raises(RequestError, match="keeps no base set") as e:
        kept.apply(d, serving=7)
    assert e.value.code == grpc.StatusCode.ABORTED
    kept.keep(7, base)
    with pytest.raises(RequestError, match="serves version 8 and keeps the set of version 7"):
        kept.apply(d, serving=8)
    with pytest.raises(RequestError, match="a delta over version 6"):
        kept.apply(delta_lib.Delta(6, d.digest, d.dense, d.sparse), serving=7)
    wrong = delta_lib.Delta(7, delta_lib.digest(base), d.dense, d.sparse)
    with pytest.raises(RequestError, match="nothing swapped") as e:
        kept.apply(wrong, serving=7)
    assert e.value.code == grpc.StatusCode.ABORTED
    got = kept.apply(d, serving=7)
    assert all(np.array_equal(got[k], new[k]) for k in new) and kept.tensors is base
