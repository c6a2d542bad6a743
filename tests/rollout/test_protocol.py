"""rollout.proto's Routing without an engine: the server's encoding (id width from the model's config), the client's
decoding into numpy arrays, and its refusal of malformed messages."""

import numpy as np
import pytest

from cisjax.rollout import protos
from cisjax.rollout.client import RolloutError, Sample, decode_routing
from cisjax.rollout.server import encode_routing, routing_id_bytes

PB = protos.load().rollout_pb2


@pytest.mark.parametrize(
    "config, want",
    [
        ({"num_experts": 60}, 1),  # Qwen1.5-MoE
        ({"num_experts": 256}, 1),
        ({"num_experts": 257}, 2),
        ({"n_routed_experts": 160}, 1),  # DeepSeek-V2
        ({"n_routed_experts": 384}, 2),
        ({"num_local_experts": 8}, 1),  # Mixtral
        ({"text_config": {"num_experts": 512}}, 2),
        ({"vocab_size": 97}, 2),  # no expert count: the wide ids
    ],
)
def test_id_bytes_from_the_expert_count(config, want):
    assert routing_id_bytes(config) == want


def _wire(msg):
    return PB.Routing.FromString(msg.SerializeToString())


def test_two_byte_ids_round_trip():
    """> 256 experts: uint16 ids, little-endian on the wire, prompt rows then response rows."""
    rng = np.random.default_rng(0)
    p, r, layers, k = 5, 3, 4, 6
    ids = rng.integers(0, 300, (p - 1 + r, layers, k)).astype(np.int32)
    ids[0, 0, 0] = 0x0102
    msg = _wire(encode_routing(PB, ids[: p - 1], ids[p - 1 :], routing_id_bytes({"num_experts": 300})))
    assert (msg.id_bytes, msg.prompt_positions, msg.num_layers, msg.k) == (2, p - 1, layers, k)
    assert len(msg.expert_ids) == ids.size * 2 and msg.expert_ids[:2] == b"\x02\x01"
    rows = decode_routing(msg, p, r)  # every input position, as the wire holds them
    assert rows.dtype == np.uint16
    np.testing.assert_array_equal(rows, ids)


def test_one_byte_ids_and_the_sample_json():
    ids = np.arange(2 * 3 * 2).reshape(6, 1, 2) * 40 % 256  # up to 255
    msg = _wire(encode_routing(PB, ids[:2], ids[2:], 1))
    assert len(msg.expert_ids) == ids.size
    rows = decode_routing(msg, 3, 4)
    assert rows.dtype == np.uint8 and rows.shape == (6, 1, 2)
    s = Sample(0, 0, [1, 2, 3], [4, 5, 6, 7], [0.0] * 4, "length", [0] * 4, input_routing=rows)
    # the sample keeps the wire's rows whole; its prompt's and response's are views of them
    assert s.prompt_routing.shape == (2, 1, 2) and s.routing.shape == (4, 1, 2)
    out = s.to_json()
    assert out["routing"] == ids[2:].tolist() and out["prompt_routing"] == ids[:2].tolist()
    # a one-token prompt and no response: no position, the shape kept
    rows = decode_routing(_wire(encode_routing(PB, ids[:0], ids[:0], 1)), 1, 0)
    assert rows.shape == (0, 1, 2)


def test_ids_that_do_not_fit_are_refused():
    ids = np.full((2, 1, 2), 256)
    with pytest.raises(ValueError, match="do not fit 1-byte ids"):
        encode_routing(PB, ids[:1], ids[1:], 1)


@pytest.mark.parametrize(
    "change, prompt_len, response_len, message",
    [
        (dict(expert_ids=bytes(11)), 3, 4, "11 bytes of expert ids, expected 12"),
        (dict(expert_ids=bytes(13)), 3, 4, "13 bytes of expert ids, expected 12"),
        ({}, 3, 5, "12 bytes of expert ids, expected 14"),  # another response length than the server's
        ({}, 4, 4, "2 prompt positions for a prompt of 4 tokens"),
        (dict(id_bytes=3), 3, 4, "id_bytes 3"),
        (dict(id_bytes=0), 3, 4, "id_bytes 0"),
        (dict(k=0), 3, 4, "k=0"),
    ],
)
def test_malformed_routing_is_a_clear_error(change, prompt_len, response_len, message):
    ids = np.arange(12).reshape(6, 1, 2)
    msg = encode_routing(PB, ids[:2], ids[2:], 1)
    for field, value in change.items():
        setattr(msg, field, value)
    with pytest.raises(RolloutError, match=message):
        decode_routing(_wire(msg), prompt_len, response_len)
