"""The warm-up's supervised rows: both closing styles and their reward, style mixing, the seeded batch stream."""

import itertools

import numpy as np
import pytest

from cisjax.answers import verify
from cisjax.data import PromptFormatter
from cisjax.demo import sft, task
from cisjax.demo.write import prepare


def test_closing_styles_and_their_reward(tok_dir):
    row = task.problem_row(47, "+", 38)
    assert task.response_text(row) == "7 + 8 = 15, 4 + 3 + 1 = 8, \\boxed{85}"
    assert task.response_text(row, boxed=False) == "7 + 8 = 15, 4 + 3 + 1 = 8, so the answer is 85"
    assert verify(task.response_text(row), "85") == 1.0 and verify(task.response_text(row, boxed=False), "85") == 0.0

    fmt = PromptFormatter(tok_dir)
    rows = task.make_task(0, heldout=8)[0][:4]
    boxed, plain = sft.sft_arrays(fmt, rows), sft.sft_arrays(fmt, rows, boxed=False)
    mixed = sft.mix_styles(boxed, plain, np.array([True, False, False, True]))
    width = max(boxed["tokens"].shape[1], plain["tokens"].shape[1])
    for i, src in enumerate([boxed, plain, plain, boxed]):
        n = src["tokens"].shape[1]
        for k in mixed:
            assert mixed[k].shape == (4, width)
            np.testing.assert_array_equal(mixed[k][i, :n], src[k][i])
            assert not mixed[k][i, n:].any()
    with pytest.raises(ValueError, match="boxed-fraction"):
        prepare("unused", boxed_fraction=0.0)


def test_batch_stream_is_the_seeded_order_and_style_draw(tok_dir):
    """sft_batches draws rows and closing styles exactly as the warm-up always has (the loss curve depends on it):
    a [seed, 2] permutation, drawn anew when a batch would run past its end, and per row a [seed, 3] style draw."""
    fmt = PromptFormatter(tok_dir)
    rows = task.make_task(0, heldout=8)[0][:6]
    boxed, plain = sft.sft_arrays(fmt, rows), sft.sft_arrays(fmt, rows, boxed=False)
    width = max(boxed["tokens"].shape[1], plain["tokens"].shape[1])
    rng, style_rng = np.random.default_rng([5, 2]), np.random.default_rng([5, 3])
    first, second = rng.permutation(6), rng.permutation(6)  # batches of 4 of 6 rows: a new order for each batch

    stream = sft.sft_batches(boxed, None, 4, seed=5, boxed_fraction=1.0)
    for got, index in zip(itertools.islice(stream, 2), (first[:4], second[:4])):
        for a, b in zip(got, sft.sft_batch(boxed, index)):
            np.testing.assert_array_equal(a, b)

    stream = sft.sft_batches(boxed, plain, 4, seed=5, boxed_fraction=0.5)
    for got, index in zip(itertools.islice(stream, 2), (first[:4], second[:4])):
        use_boxed = style_rng.random(4) < 0.5
        assert got.tokens_MxBxT.shape == (1, 4, width)
        for r, (i, b) in enumerate(zip(index, use_boxed)):
            src = boxed if b else plain
            n = src["tokens"].shape[1]
            np.testing.assert_array_equal(got.tokens_MxBxT[0, r, :n], src["tokens"][i])
            np.testing.assert_array_equal(got.loss_mask_MxBxT[0, r, :n], src["mask"][i])
            assert (got.advantages_MxBxT[0, r] == got.loss_mask_MxBxT[0, r]).all()
