"""Packed rows (segment ids, per-segment positions, padding) give each sequence exactly its unpacked outputs."""

import numpy as np
import pytest

from cisjax.models import hf_io
from tests.models.parity import LOGITS_TOL, LOGPROB_TOL, assert_same_routing, pack, run
from tests.support.hf import hf_forward, log_softmax

# Families under test; another joins by adding a row, and every test below runs on each.
FAMILIES = {  # name -> (tests.support.hf.TINY_FAMILIES family, overrides of its base config)
    "qwen2_moe": ("qwen2_moe", {}),
    "deepseek_v2": (
        "deepseek_v2",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            q_lora_rank=16,
            v_head_dim=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.0,
            max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),
    ),
}
LENGTH = 24
SEQ_LENS = (5, 9, 3, 12, 4, 5)
SAME = 1e-6  # real-token outputs that must not move at all (bit-identical up to matmul blocking)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_hf_dir):
    family, overrides = FAMILIES[request.param]
    model_dir = tiny_hf_dir(family, **overrides)
    model, cfg, _ = hf_io.load(model_dir)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.vocab_size, n, dtype=np.int32) for n in SEQ_LENS]
    return model_dir, model, cfg, seqs


def layout_a(s):
    """Three segments then end padding; two segments with padding in between, then one more."""
    return [[s[0], s[1], s[2]], [s[3], 2, s[4], 1, s[5]]]


def layout_b(s):
    """The same sequences in other rows/places, with different amounts of padding."""
    return [[3, s[3], s[5]], [s[0], 1, s[1], s[2], 1, s[4]]]


def random_pad(cfg, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, LENGTH), dtype=np.int32)


def per_sequence(model, rows, pad):
    """Run a packed batch; return {sequence start token tuple: (log-softmax, routing ids [X, n, k])}."""
    tokens, seg, pos, spans = pack(rows, LENGTH, pad)
    logits, ids = run(model, tokens, pos, seg)
    out = {}
    for r, row_spans in enumerate(spans):
        for _, a, b in row_spans:
            out[tuple(tokens[r, a:b])] = (log_softmax(logits[r, a:b]), None if ids is None else ids[:, r, a:b])
    return out


def alone(model, seqs):
    """Each sequence on its own as a plain causal row (default positions, no segment ids): it is
    the prefix of a row whose later tokens, by causality, cannot reach it."""
    out = {}
    filler = np.zeros((len(seqs) + len(seqs) % 2, LENGTH), np.int32)
    for i, s in enumerate(seqs):
        filler[i, : len(s)] = s
    for i in range(0, len(filler), 2):
        logits, ids = run(model, filler[i : i + 2])
        for j in range(2):
            if i + j < len(seqs):
                n = len(seqs[i + j])
                out[tuple(seqs[i + j])] = (log_softmax(logits[j, :n]), None if ids is None else ids[:, j, :n])
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    for k in a:
        assert_same_routing(a[k][1], b[k][1], f"sequence of length {len(k)}")
    return max(float(np.abs(a[k][0] - b[k][0]).max()) for k in a)


def test_packed_matches_alone(family):
    _, model, cfg, seqs = family
    assert max_diff(per_sequence(model, layout_a(seqs), random_pad(cfg, 1)), alone(model, seqs)) <= LOGPROB_TOL


def test_packed_matches_hf_per_sequence(family):
    """Packed rows vs the torch reference run on each sequence separately, at its own length."""
    model_dir, model, cfg, seqs = family
    tokens, seg, pos, spans = pack(layout_a(seqs), LENGTH, random_pad(cfg, 1))
    logits, ids = run(model, tokens, pos, seg)
    checked = 0
    for r, row_spans in enumerate(spans):
        for _, a, b in row_spans:
            ref_logits, ref_ids = hf_forward(model_dir, tokens[r : r + 1, a:b])
            assert np.abs(logits[r, a:b] - ref_logits[0]).max() <= LOGITS_TOL
            assert np.abs(log_softmax(logits[r, a:b]) - log_softmax(ref_logits[0])).max() <= LOGPROB_TOL
            assert_same_routing(
                None if ids is None else ids[:, r, a:b],
                None if ref_ids is None else ref_ids[:, 0],
                f"row {r} [{a}:{b}]",
            )
            checked += 1
    assert checked == len(seqs)


def test_padding_never_reaches_real_tokens(family):
    """Other padding token ids, or other amounts and places of padding: real tokens unchanged."""
    _, model, cfg, seqs = family
    base = per_sequence(model, layout_a(seqs), random_pad(cfg, 1))
    assert max_diff(base, per_sequence(model, layout_a(seqs), random_pad(cfg, 2))) <= SAME
    assert max_diff(base, per_sequence(model, layout_a(seqs), 0)) <= SAME
    assert max_diff(base, per_sequence(model, layout_b(seqs), random_pad(cfg, 3))) <= SAME


def test_attention_stays_inside_segments(family):
    """Changing one segment's tokens changes that segment and nothing else in the batch."""
    _, model, cfg, seqs = family
    pad = random_pad(cfg, 1)
    base = per_sequence(model, layout_a(seqs), pad)
    for victim in (0, 1, 4):  # first, middle segment of row 0; the segment between paddings of row 1
        changed = list(seqs)
        changed[victim] = (seqs[victim] + 1 + np.arange(len(seqs[victim]))) % cfg.vocab_size
        after = per_sequence(model, layout_a(changed), pad)
        for i, s in enumerate(seqs):
            if i == victim:
                continue
            before_lp, before_ids = base[tuple(s)]
            after_lp, after_ids = after[tuple(s)]
            assert np.abs(after_lp - before_lp).max() <= SAME, f"segment {i} moved when segment {victim} changed"
            assert_same_routing(after_ids, before_ids, f"segment {i}")
        assert (
            tuple(changed[victim]) in after
            and np.abs(after[tuple(changed[victim])][0] - base[tuple(seqs[victim])][0]).max() > 1e-3
        )
