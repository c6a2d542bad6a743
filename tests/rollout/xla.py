"""cisjax's own (XLA, fp32) routing of scored sequences: the reference the engines' routing capture is checked against."""

import numpy as np

from cisjax.models import hf_io
from tests.models import parity


def routing(model_dir, items) -> list:
    """Per (prompt_ids, response_ids): sorted routed expert ids [R, MoE layers, k] of the passes that
    produced each response token (positions len(prompt) - 1 .. end - 1), as rollout.proto's Routing."""
    model, _, _ = hf_io.load(model_dir, dtype="float32", param_dtype="float32")
    out = []
    for prompt, response in items:
        seq = np.asarray([list(prompt) + list(response)], np.int32)
        _, ids_XxBxLxK = parity.run(model, seq)
        p = len(prompt)
        out.append(np.transpose(ids_XxBxLxK[:, 0, p - 1 : p - 1 + len(response)], (1, 0, 2)))
    return out


def assert_routing_matches(got: list, ref: np.ndarray, where: str) -> None:
    """Engine routing ([token][layer][k], any order within k) equals the sorted reference."""
    got = np.sort(np.asarray(got, np.int64).reshape(ref.shape), axis=-1)
    bad = np.argwhere((got != ref).any(-1))
    assert bad.size == 0, f"{where}: routing differs at (token, layer) {bad[:5].tolist()} of {len(bad)}"
