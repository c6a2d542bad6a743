"""The warm-up's supervised rows: prompt + target response as TrainBatch arrays whose policy gradient is the CE's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from cisjax import rows as rows_lib
from cisjax.demo.task import response_text
from cisjax.demo.tokenizer import IM_END
from cisjax.records import TrainBatch


def sft_arrays(formatter, rows: Sequence[dict], length: int | None = None, boxed: bool = True) -> dict:
    """Prompt + target response of every row (response_text(row, boxed)) as left-aligned [N, T] arrays (TrainBatch
    layout: position t holds tokens[t] and predicts targets[t]); loss_mask on the positions predicting the response
    and its <|im_end|>."""
    im_end = formatter.tokenizer.convert_tokens_to_ids(IM_END)
    seqs = [
        rows_lib.Seq(
            formatter.encode(row["question"]),
            formatter.tokenizer.encode(response_text(row, boxed), add_special_tokens=False) + [im_end],
        )
        for row in rows
    ]
    longest = max(s.positions for s in seqs)
    t = length or longest
    if t < longest:
        raise ValueError(f"length={t} < the longest sequence ({longest} positions)")
    built = rows_lib.build(seqs, rows_lib.one_per_row(len(seqs)), t)
    return dict(
        tokens=built.tokens_RxT,
        targets=built.targets_RxT,
        positions=built.positions_RxT,
        segments=built.segments_RxT,
        mask=built.response_RxT,
    )


def mix_styles(boxed: dict, plain: dict, use_boxed: np.ndarray) -> dict:
    """Row i from `boxed` where use_boxed[i], else from `plain` (sft_arrays of the same rows, padded alike)."""
    width = max(boxed["tokens"].shape[1], plain["tokens"].shape[1])
    pad = lambda a: np.pad(a, [(0, 0), (0, width - a.shape[1])])  # noqa: E731
    return {k: np.where(use_boxed[:, None], pad(boxed[k]), pad(plain[k])) for k in boxed}


def sft_batch(arrays: dict, index: np.ndarray, logprobs_MxBxT=None) -> TrainBatch:
    """A TrainBatch (M = 1) of the rows `index`: advantages 1 on the response tokens; prox = infer = `logprobs_MxBxT`
    (the current policy's, so that the ratio and the weight are 1: the policy-gradient loss is then the token-mean
    cross-entropy), zeros when not given yet."""
    pick = lambda k: arrays[k][index][None]  # noqa: E731
    mask = pick("mask")
    lp = np.zeros(mask.shape, np.float32) if logprobs_MxBxT is None else logprobs_MxBxT
    return TrainBatch(
        pick("tokens"), pick("positions"), pick("segments"), pick("targets"), mask, lp, lp, mask.astype(np.float32)
    )


def sft_batches(
    arrays: dict, plain: dict | None, batch_size: int, *, seed: int, boxed_fraction: float
) -> Iterator[TrainBatch]:
    """The warm-up's endless stream of host batches: `batch_size` rows at a time of a seeded permutation, drawn anew
    when fewer than `batch_size` remain. With `plain` (sft_arrays of the same rows, boxed=False), each row's closing
    style is drawn per use, boxed with probability `boxed_fraction`: the model learns both, neither tied to a
    problem."""
    n_rows = len(arrays["tokens"])
    style_rng = np.random.default_rng([seed, 3])
    rng = np.random.default_rng([seed, 2])
    order, pos = rng.permutation(n_rows), 0
    while True:
        if pos + batch_size > len(order):
            order, pos = rng.permutation(n_rows), 0
        index = order[pos : pos + batch_size]
        pos += batch_size
        if plain is None:
            yield sft_batch(arrays, index)
        else:
            pick = lambda a, index=index: {k: v[index] for k, v in a.items()}  # noqa: E731
            use_boxed = style_rng.random(len(index)) < boxed_fraction
            yield sft_batch(mix_styles(pick(arrays), pick(plain), use_boxed), np.arange(len(index)))
