"""The one trainer forward: the rescoring, the step's loss, `cisjax score`'s packed rows and the canary agree."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import forward, rows, score, sharding
from cisjax.train import step as step_lib
from tests.support import steps as U
from tests.support.runs import spec_of


@pytest.fixture(scope="module")
def tiny():
    cfg = U.make_cfg()
    mesh = U.mesh_for("single")
    graphdef, _, rules, state = U.build(cfg, mesh)
    return cfg, mesh, rules, graphdef, state.params


def _seqs(batch):
    """The (prompt, response) of every row of a tests.support.steps.host_batch, read back from its arrays."""
    out = []
    for tok, tgt, mask in zip(
        batch.tokens_MxBxT.reshape(-1, U.T),
        batch.targets_MxBxT.reshape(-1, U.T),
        batch.loss_mask_MxBxT.reshape(-1, U.T),
    ):
        first, n = int(np.argmax(mask)), int(mask.sum())
        out.append(rows.Seq(tok[: first + 1].tolist(), tgt[first : first + n].tolist()))
    return out


def test_packed_scoring_equals_the_rescoring(tiny):
    """`cisjax score`'s packed rows (several sequences per row, other positions) give the logprobs the loop's
    proximal rescoring gives the same sequences one per row, to fp32 round-off."""
    cfg, mesh, rules, graphdef, params = tiny
    batch = U.host_batch()
    rescored = np.asarray(
        step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)(
            params, sharding.place(batch, mesh, rules, sharding.BATCH_AXES)
        )
    )
    model = nnx.merge(graphdef, params)
    seqs = _seqs(batch)
    got = score.score_items(
        model,
        seqs,
        mesh,
        rules,
        temperature=cfg.logprobs.temperature,
        row_tokens=32,
        rows_per_call=2,
        chunk_size=cfg.logprobs.chunk_size,
        progress=False,
    )
    mask = batch.loss_mask_MxBxT.reshape(-1, U.T)
    for i, s in enumerate(seqs):
        want = rescored.reshape(-1, U.T)[i][mask[i]]
        assert len(got[i]["logprobs"]) == len(s.response_ids) == len(want)
        np.testing.assert_allclose(got[i]["logprobs"], want, rtol=1e-5, atol=1e-5)
    packed = rows.pack(seqs, 32)
    assert max(len(r) for r in packed) > 1  # the test really packs


def test_step_loss_uses_the_same_forward(tiny):
    """The step's loss at ratio 1 (prox = the rescoring) with advantage -1 on every token is the token-mean logprob:
    the step's forward and the rescoring are one function."""
    cfg, mesh, rules, graphdef, params = tiny
    batch = U.host_batch()
    placed = sharding.place(batch, mesh, rules, sharding.BATCH_AXES)
    prox = step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)(params, placed)
    mask = np.asarray(batch.loss_mask_MxBxT)
    placed = placed._replace(
        prox_logprobs_MxBxT=prox,
        infer_logprobs_MxBxT=prox,
        advantages_MxBxT=jnp.asarray(-np.ones(mask.shape, np.float32)),
    )
    loss_fn = step_lib.make_loss_fn(graphdef, spec_of(cfg).step, mesh, rules)
    mb = jax.tree.map(lambda x: x[0], placed)
    loss, aux = loss_fn(params, mb, jnp.sum(mask[0]).astype(jnp.float32))
    # ratio exp(logp - prox) = 1, weight 1: the surrogate is -A * ratio summed / tokens = 1 exactly
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)
    assert float(aux["tokens"]) == mask[0].sum()


def test_round_params_and_the_canary_side(tiny):
    cfg, mesh, rules, graphdef, params = tiny
    x = {"w": jnp.asarray([1.0 + 2.0**-10, 3.0], jnp.float32), "ids": jnp.asarray([3, 4], jnp.int32)}
    r = forward.round_params(x, "bfloat16")
    np.testing.assert_array_equal(np.asarray(r["w"]), [1.0, 3.0])  # 1 + 2^-10 is below bf16's 8 mantissa bits
    assert r["w"].dtype == jnp.float32 and r["ids"] is x["ids"]
    batch = sharding.place(U.host_batch(m=1), mesh, rules, sharding.BATCH_AXES)
    kw = dict(precision=spec_of(cfg).runtime.precision, temperature=1.0, chunk_size=cfg.logprobs.chunk_size)
    canary = forward.make_batch_logprobs(graphdef, mesh, rules, round_to=jnp.bfloat16, **kw)(params, batch)
    plain = forward.make_batch_logprobs(graphdef, mesh, rules, **kw)(forward.round_params(params, jnp.bfloat16), batch)
    np.testing.assert_array_equal(np.asarray(canary), np.asarray(plain))
    assert not np.array_equal(
        np.asarray(canary), np.asarray(forward.make_batch_logprobs(graphdef, mesh, rules, **kw)(params, batch))
    )


def test_routing_flips_by_hand():
    """A (position, layer) flips when its SET of experts differs (order within the k does not count); padding never."""
    own = np.asarray([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [2, 3], [4, 5]]]])  # [X=2, B=1, T=3, k=2]
    replayed = np.asarray([[[[1, 0], [2, 4], [6, 7]]], [[[0, 1], [3, 5], [5, 4]]]], np.uint8)
    valid = np.asarray([[True, True, False]])
    f = forward.routing_flips(jnp.asarray(own), jnp.asarray(replayed), jnp.asarray(valid))
    assert np.asarray(f.layers_BxT).tolist() == [[0, 2, 0]]  # position 1 flips in both layers; 2 is padding
    assert np.asarray(f.per_layer_X).tolist() == [1, 1]


def _own_routing(tiny, batch):
    """The tiny model's own expert ids of every position of a host batch, [M, B, T, X, k] uint8."""
    cfg, mesh, rules, graphdef, params = tiny
    fwd = jax.jit(forward.make_forward(graphdef, mesh, rules, precision="fp32", temperature=1.0, chunk_size=64))
    ids = [
        fwd(params, *(jnp.asarray(getattr(batch, f)[i]) for f in batch._fields[:4])).expert_ids_XxBxTxK
        for i in range(batch.tokens_MxBxT.shape[0])
    ]
    return np.stack([np.moveaxis(np.asarray(x), 0, 2) for x in ids]).astype(np.uint8)


def test_rescoring_replays_the_batch_routing(tiny):
    """The rescoring on the routers' own ids is bitwise the plain rescoring with no flip; ids changed on one row (layer
    0, every valid position) change that row's logprobs only, and count as that many flips of layer 0."""
    cfg, mesh, rules, graphdef, params = tiny
    batch = U.host_batch()
    own = _own_routing(tiny, batch)
    place = lambda b: sharding.place(b, mesh, rules, sharding.BATCH_AXES)  # noqa: E731
    plain = np.asarray(step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)(params, place(batch)))
    rescore = step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules, flips=True)
    logp, flips = rescore(params, place(batch._replace(routing_MxBxTxXxK=own)))
    np.testing.assert_array_equal(np.asarray(logp), plain)
    assert not np.asarray(flips.layers_BxT).any() and not np.asarray(flips.per_layer_X).any()

    changed = own.copy()
    valid = batch.segment_ids_MxBxT[0, 3] > 0
    changed[0, 3, valid, 0] = (own[0, 3, valid, 0] + 1) % U.TINY_HF["num_experts"]  # another set of experts
    logp, flips = rescore(params, place(batch._replace(routing_MxBxTxXxK=changed)))
    logp = np.asarray(logp)
    assert np.asarray(flips.per_layer_X).tolist() == [int(valid.sum()), 0]
    assert np.asarray(flips.layers_BxT)[0, 3].tolist() == valid.astype(int).tolist()
    other = np.ones(logp.shape, bool)
    other[0, 3] = False
    np.testing.assert_array_equal(logp[other], plain[other])
    mask = batch.loss_mask_MxBxT[0, 3]
    assert np.abs(logp[0, 3][mask] - plain[0, 3][mask]).max() > 1e-3


def test_packed_scoring_replays_each_sequences_routing(tiny):
    """`cisjax score`'s Scorer (the mismatch observatory's XLA side) with routing on its items: packed several to a
    row, each sequence's ids follow its positions -- its own routers' ids give the plain scores, other ids others."""
    cfg, mesh, rules, graphdef, params = tiny
    batch = U.host_batch()
    own = _own_routing(tiny, batch).reshape(-1, U.T, *_own_routing(tiny, batch).shape[3:])
    seqs = _seqs(batch)
    model = nnx.merge(graphdef, params)
    kw = dict(temperature=1.0, row_tokens=32, rows_per_call=2, chunk_size=cfg.logprobs.chunk_size, progress=False)
    plain = score.score_items(model, seqs, mesh, rules, **kw)
    with_own = [rows.Seq(s.prompt_ids, s.response_ids, own[i, : s.positions]) for i, s in enumerate(seqs)]
    got = score.score_items(model, with_own, mesh, rules, **kw)
    for a, b in zip(got, plain):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
    other = [rows.Seq(s.prompt_ids, s.response_ids, (s.routing + 1) % 8) for s in with_own]
    moved = score.score_items(model, other, mesh, rules, **kw)
    assert max(np.abs(np.subtract(a["logprobs"], b["logprobs"])).max() for a, b in zip(moved, plain)) > 1e-2


def test_chunk_tokens_are_per_device():
    """logprobs.chunk_size counts one device's tokens: the whole batch's chunk is that times the shards of the batch
    axis (data x fsdp x expert in the default rules), and the same where nothing splits the batch."""
    rules = sharding.rules_from_config(None)
    devices = jax.devices()[:8]
    assert forward.chunk_tokens(1024, sharding.make_mesh({"fsdp": 8}, devices), rules) == 8192
    assert forward.chunk_tokens(1024, sharding.make_mesh({"data": 2, "tensor": 4}, devices), rules) == 2048
    assert forward.chunk_tokens(1024, sharding.make_mesh({"fsdp": 2, "expert": 4}, devices), rules) == 8192
    assert forward.chunk_tokens(512, sharding.make_mesh({"tensor": 8}, devices), rules) == 512
    assert forward.chunk_tokens(1024, sharding.make_mesh({"fsdp": 1}, devices[:1]), rules) == 1024
