"""cisjax.plan.inputs: the batch shape a plan compiles is one optimizer update's batch of the loop."""

from __future__ import annotations

import pytest

from cisjax import config as config_lib
from cisjax import errors
from cisjax.plan import inputs


@pytest.mark.parametrize(
    "micro_batches, updates, rows_multiple, want_rows",
    [
        (1, 1, 8, 64),  # 16 prompts x 4 samples
        (2, 1, 8, 32),
        (1, 2, 8, 32),  # two updates per rollout batch: each takes half the rows
        (2, 2, 8, 16),
        (1, 3, 8, 24),  # ceil(64 / 3) = 22, rounded up to the 8 batch shards
    ],
)
def test_rows_of_one_update(micro_batches, updates, rows_multiple, want_rows):
    cfg = config_lib.load(None)
    cfg.data.prompts_per_step, cfg.rollout.group_size = 16, 4
    cfg.train.micro_batches, cfg.train.updates_per_batch = micro_batches, updates
    cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.train.length_multiple = 100, 200, 128
    shape = inputs.step_shape(cfg, rows_multiple)
    assert shape["micro_batches"] == micro_batches and shape["rows"] == want_rows
    assert shape["seq_len"] == 384  # 100 + 200 - 1 rounded up to 128
    assert shape["samples_per_step"] == 64


def test_rows_not_on_the_shards_are_refused():
    with pytest.raises(errors.UserError, match="--rows 12: must be a multiple of the mesh's batch shards"):
        inputs.step_shape(config_lib.load(None), 8, rows=12, seq_len=128)
