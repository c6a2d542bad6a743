"""rollout.exact's reference for tests: the trainer's exact forward (cisjax.models.exact) of one sequence alone."""

import numpy as np

from cisjax.models import exact

ROW = 96  # the reference's row length: not the shapes of the sampler or of `mismatch measure --exact`


def trainer_p(model, prompt, response, support=None) -> np.ndarray:
    """exact.exact_forward's logprob of each response token, its row alone in a batch of one of ROW positions (slots a
    multiple of exact.BLOCK above it); renormalised over `support` ((ids, a count per token), Sample.support) where
    given."""
    seq = list(prompt) + list(response)
    assert len(seq) <= ROW
    tokens, targets = np.zeros((1, ROW), np.int32), np.zeros((1, ROW), np.int32)
    tokens[0, : len(seq)], targets[0, : len(seq) - 1] = seq, seq[1:]
    ids_1xTxS = None
    if support is not None:
        ids, counts = support
        ids_1xTxS = np.full((1, ROW, max(counts, default=0) + 2), -1, np.int32)
        at = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        for j, c in enumerate(counts):
            ids_1xTxS[0, len(prompt) - 1 + j, :c] = ids[at[j] : at[j + 1]]
    p = exact.exact_forward(
        model,
        tokens,
        np.arange(ROW, dtype=np.int32)[None],
        targets,
        slots=ROW + exact.BLOCK,
        support_BxTxS=ids_1xTxS,
        moe_impl=exact.moe_impl(model),
        block=exact.BLOCK,
    )
    return np.asarray(p)[0, len(prompt) - 1 : len(seq) - 1]
