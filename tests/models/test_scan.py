"""Scanned and unscanned decoder layers (model.scan_layers) both match the transformers reference, every family."""

import numpy as np
import pytest

from cisjax.models import hf_io
from tests.models.parity import assert_matches_hf

# Each family with more than one stack where it has two kinds of layer (transformer.layer_runs).
FAMILIES = {
    "qwen2_moe": dict(num_hidden_layers=4, mlp_only_layers=[1]),  # stacks [0], [1], [2, 3]
    "qwen3_moe": dict(num_hidden_layers=3),
    "deepseek_v2": dict(first_k_dense_replace=1),  # stacks [0], [1, 2]
    "qwen2": dict(num_hidden_layers=3),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scan", [True, False])
def test_parity_scanned_and_unscanned(tiny_hf_dir, family, scan):
    model_dir = tiny_hf_dir(family, **FAMILIES[family])
    model, cfg, _ = hf_io.load(model_dir, scan_layers=scan)
    assert cfg.scan_layers is scan
    tokens_BxL = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9), dtype=np.int32)
    assert_matches_hf(model_dir, model, tokens_BxL)
