"""The engines' tests' own: sampling parameters for an engine called directly, and cisjax's (XLA) side the engines are
checked against (`cisjax score` logprobs and the routing of sequences)."""

import json
import time

import numpy as np

from cisjax import cli
from cisjax.models import hf_io
from cisjax.rollout.params import SamplingParams
from tests.models import parity


def engine_params(**overrides):
    """cisjax.rollout.params.SamplingParams for a backend or engine called directly: one sample of 8 new tokens at
    temperature 1 (no top-k, top-p, stop tokens, seed, top logprobs or routing), with `overrides`."""
    base = dict(
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=8,
        stop_token_ids=frozenset(),
        seed=None,
        greedy=False,
        logprobs=0,
        return_routing=False,
    )
    return SamplingParams(**{**base, **overrides})


def routing_of_positions(model_dir, items) -> list:
    """Per (prompt_ids, response_ids): sorted routed expert ids as rollout.proto's Routing splits them, (prompt rows
    [P - 1, MoE layers, k] of positions 0 .. P-2, response rows [R, MoE layers, k] of the passes that produced each
    response token, positions P-1 .. P+R-2)."""
    model, _, _ = hf_io.load(model_dir, dtype="float32", param_dtype="float32")
    out = []
    for prompt, response in items:
        seq = np.asarray([list(prompt) + list(response)], np.int32)
        _, ids_XxBxLxK = parity.run(model, seq)
        ids = np.transpose(ids_XxBxLxK[:, 0], (1, 0, 2))  # [positions, layers, k]
        p = len(prompt)
        out.append((ids[: p - 1], ids[p - 1 : p - 1 + len(response)]))
    return out


def routing(model_dir, items) -> list:
    """Per (prompt_ids, response_ids): the response rows of routing_of_positions."""
    return [response for _, response in routing_of_positions(model_dir, items)]


def assert_routing_matches(got, ref: np.ndarray, where: str) -> None:
    """Engine routing ([token][layer][k], any order within k) equals the sorted reference."""
    got = np.sort(np.asarray(got, np.int64).reshape(ref.shape), axis=-1)
    bad = np.argwhere((got != ref).any(-1))
    assert bad.size == 0, f"{where}: routing differs at (token, layer) {bad[:5].tolist()} of {len(bad)}"


def rescore(model_dir, items, tmp_path, *, temperature=1.0, top_k=0, dtype="float32") -> list:
    """`cisjax score` of [(prompt_ids, response_ids)] (JAX, params and compute in `dtype`), one dict per item."""
    tag = f"{temperature}_{top_k}_{dtype}_{time.monotonic_ns()}"
    inp, out = tmp_path / f"rescore_in_{tag}.jsonl", tmp_path / f"rescore_out_{tag}.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": p, "response_ids": r}) + "\n" for p, r in items))
    argv = [
        "score",
        "--model",
        str(model_dir),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--dtype",
        dtype,
        "--temperature",
        str(temperature),
        "--top-k",
        str(top_k),
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def items_of(samples) -> list:
    """[(prompt_ids, response_ids)] of client Samples given as [prompt][sample]."""
    return [(s.prompt_ids, s.response_ids) for per in samples for s in per]
