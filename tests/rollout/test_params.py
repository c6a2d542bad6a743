"""The one sampling-parameters record: its normal form, and the wire round trip from the client to the engine."""

import dataclasses

import numpy as np
import pytest

from cisjax.rollout import backend, protos
from cisjax.rollout.client import sampling_message
from cisjax.rollout.params import SamplingParams

PB = protos.load().rollout_pb2


def test_stop_ids_are_a_frozenset_and_the_record_is_frozen():
    p = SamplingParams(stop_token_ids=[3, 1, 3])
    assert p.stop_token_ids == frozenset({1, 3}) and hash(p) == hash(SamplingParams(stop_token_ids=(1, 3)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n = 2  # type: ignore[misc]


def test_truncates():
    assert not SamplingParams().truncates
    assert SamplingParams(top_k=5).truncates and SamplingParams(top_p=0.9).truncates
    assert not SamplingParams(top_k=5, greedy=True).truncates  # greedy samples no distribution


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(n=4, temperature=0.75, top_p=0.875, top_k=20, max_new_tokens=12, stop_token_ids=[7, 2], seed=0),
        SamplingParams(logprobs=5, return_routing=True, return_sampling_mask=True, seed=123),
    ],
)
def test_the_wire_round_trip_gives_the_same_record(params):
    # what the client sends is what the engine gets, field for field (seed 0 included: it is set, not absent), for
    # temperatures and top-p that float32 holds exactly
    assert backend.check_params(sampling_message(PB, params), vocab_size=10) == params


def test_greedy_comes_back_at_temperature_one():
    sent = SamplingParams(greedy=True, temperature=0.0)
    got = backend.check_params(sampling_message(PB, sent), vocab_size=10)
    assert got == dataclasses.replace(sent, temperature=1.0)


def test_the_wire_carries_temperature_and_top_p_in_float32():
    # rollout.proto's floats: 0.7 arrives as float32(0.7), which the engine samples at
    got = backend.check_params(sampling_message(PB, SamplingParams(temperature=0.7, top_p=0.9)), vocab_size=10)
    assert got.temperature == float(np.float32(0.7)) != 0.7 and got.top_p == float(np.float32(0.9))
