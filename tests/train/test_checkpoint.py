"""Checkpoints: bitwise round trips, keep-last-N, async saves, restore onto other meshes, clear errors, crash safety, resume."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from cisjax import sharding
from cisjax.models import hf_io
from cisjax.train import checkpoint as ckpt_lib
from cisjax.train import state as state_lib
from cisjax.train.checkpoint import Checkpointer, CheckpointError, abstract_state, target_shardings
from cisjax.train.state import TrainState
from tests.support.hf import SHARDABLE_QWEN2_MOE
from tests.support.runs import spec_of

REPO = Path(__file__).resolve().parents[2]

TINY = SHARDABLE_QWEN2_MOE
RULES = sharding.rules_from_config()


def _mesh(shape):
    return sharding.make_mesh(shape)


def _leaves(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _host(tree) -> dict:
    return {k: np.asarray(jax.device_get(v)) for k, v in _leaves(tree).items()}


def _assert_bitwise(got, want_host: dict):
    got_host = _host(got)
    assert got_host.keys() == want_host.keys()
    for k, want in want_host.items():
        g = got_host[k]
        assert g.dtype == want.dtype and g.shape == want.shape, k
        assert g.tobytes() == want.tobytes(), f"{k} differs"


def _model_state(
    param_dtype: str, mesh, seed: int = 0
) -> tuple[nnx.GraphDef, TrainState, optax.GradientTransformation]:
    """A tiny random MoE's train state on `mesh`, with non-trivial optimizer moments and counters."""
    cfg = hf_io.model_config(TINY, dtype="float32", param_dtype=param_dtype)
    tx = optax.adamw(1e-2)
    graphdef, abstract = hf_io.abstract_model(TINY, cfg)
    init = jax.jit(
        lambda: nnx.split(hf_io.init_model(TINY, cfg, seed), nnx.Param)[1],
        out_shardings=sharding.param_shardings(abstract, mesh, RULES),
    )
    graphdef, state = state_lib.create(nnx.merge(graphdef, init()), tx)
    shardings = target_shardings(state, mesh, RULES)

    def one_update(params, opt_state):  # non-zero Adam moments and a count of 1
        grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.25, p.dtype) * jnp.sign(p), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.jit(one_update, out_shardings=(shardings.params, shardings.opt_state))(
        state.params, state.opt_state
    )
    counters = {
        k: jax.device_put(jnp.int32(v), NamedSharding(mesh, P()))
        for k, v in dict(step=7, policy_version=3, data_position=1234, skipped_steps=1).items()
    }
    state = state._replace(params=params, opt_state=opt_state, **counters)
    return graphdef, state, tx


def _small_state(step: int, seed: int = 0, n: int = 64) -> TrainState:
    """A model-free train state (fast): fp32 and bf16 params, an optimizer-like tuple, counters."""
    r = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(r.standard_normal((n, n)), jnp.float32),
        "b": jnp.asarray(r.standard_normal(n), jnp.bfloat16),
    }
    return TrainState(
        step=jnp.int32(step),
        params=params,
        opt_state=(jnp.int32(step), jax.tree.map(lambda x: x * 0.5, params)),
        policy_version=jnp.int32(step // 2),
        data_position=jnp.int32(10 * step),
        skipped_steps=jnp.int32(0),
    )


@pytest.fixture(scope="module")
def fsdp8_state():
    return _model_state("float32", _mesh({"fsdp": 8}))


# ----------------------------------------------------------------------------- round trips


# bf16 builds a second model state (compiles): `slow`; fp32 reuses the module's state and stays in the fast tier
@pytest.mark.parametrize("param_dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_round_trip_is_bitwise(tmp_path, param_dtype, fsdp8_state):
    mesh = _mesh({"fsdp": 8})
    state = fsdp8_state[1] if param_dtype == "float32" else _model_state(param_dtype, mesh, seed=1)[1]
    assert {np.dtype(x.dtype) for x in jax.tree.leaves(state.params)} == {np.dtype(param_dtype)}
    want = _host(state)
    with Checkpointer(tmp_path / "ck", keep=3, metadata={"config": {"train": {"lr": 3e-6}}, "model_dir": "m"}) as ck:
        assert ck.save(state) is True
        ck.wait()
        assert ck.latest_step() == 7 and ck.all_steps() == [7]
        assert ck.save(state) is False  # the same step again: nothing to do
        got = ck.restore(abstract_state=abstract_state(state))
        meta = ck.metadata()
    assert isinstance(got, TrainState) and isinstance(got.params, nnx.State)
    assert jax.tree.structure(got) == jax.tree.structure(state)
    _assert_bitwise(got, want)
    for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
        assert g.sharding.is_equivalent_to(s.sharding, g.ndim)
    assert meta["step"] == 7 and meta["model_dir"] == "m" and meta["config"]["train"]["lr"] == 3e-6
    assert meta["cisjax_version"]


def test_metadata_and_should_save(tmp_path):
    with Checkpointer(tmp_path / "checkpoints", keep=2, every=3, metadata={"model": "/m"}) as ck:
        assert ck.directory == str(tmp_path / "checkpoints") and ck.keep == 2
        assert [s for s in range(10) if ck.should_save(s)] == [3, 6, 9]
        ck.save(_small_state(3), metadata={"version": 3})
        meta = ck.metadata(3)
    assert meta["model"] == "/m" and meta["version"] == 3 and meta["step"] == 3  # the run's and the step's metadata
    assert not any(Checkpointer(tmp_path / "never", every=0).should_save(s) for s in range(100))


def test_keep_last_n(tmp_path):
    with Checkpointer(tmp_path, keep=2) as ck:
        for step in range(1, 6):
            ck.save(_small_state(step, seed=step))
        ck.wait()
        assert ck.all_steps() == [4, 5]
        got = ck.restore(4, abstract_state=abstract_state(_small_state(0)))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "5"]
    _assert_bitwise(got, _host(_small_state(4, seed=4)))


def _block_commits(monkeypatch):
    """Hold orbax's commit (the atomic rename of <step>.orbax-checkpoint-tmp) until the event is set."""
    from orbax.checkpoint._src.path import atomicity

    release, reached = threading.Event(), threading.Event()
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        import asyncio

        reached.set()
        await asyncio.to_thread(release.wait, 60)
        return await original(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    return reached, release


def test_async_save_returns_before_commit_and_survives_donation(tmp_path, monkeypatch):
    state = _small_state(5, n=256)
    want = _host(state)
    reached, release = _block_commits(monkeypatch)
    ck = Checkpointer(tmp_path, keep=3)
    try:
        assert ck.save(state)  # returns while the write is still in flight
        assert reached.wait(30), "orbax never reached the commit"
        assert ck.saving()
        assert not (tmp_path / "5").exists() and (tmp_path / f"5{ckpt_lib.TMP_SUFFIX}").is_dir()
        # The arrays were copied to host before save returned: the caller may donate/free them.
        target = abstract_state(state)
        for x in jax.tree.leaves(state):
            x.delete()
        release.set()
        ck.wait()
        assert not ck.saving() and (tmp_path / "5").is_dir() and ck.latest_step() == 5
        _assert_bitwise(ck.restore(abstract_state=target), want)
    finally:
        release.set()
        ck.close()


# ----------------------------------------------------------------------------- other meshes


def test_restore_onto_other_meshes(tmp_path, fsdp8_state):
    _, state, _ = fsdp8_state
    want = _host(state)
    assert any(x.sharding.spec != P() and "fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state))
    with Checkpointer(tmp_path) as ck:
        ck.save(state)
        ck.wait()

        mesh = _mesh({"fsdp": 2, "tensor": 2, "expert": 2})
        target = abstract_state(state, target_shardings(state, mesh, RULES))
        got = ck.restore(abstract_state=target)
        _assert_bitwise(got, want)
        for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(target)):
            assert g.sharding == t.sharding
        # the expert stacks of params and of both Adam moments really are split three ways now (the decoder layers
        # are stacked: one array per parameter for both layers, its leading "layers" axis replicated)
        specs = {k: v.sharding.spec for k, v in _leaves(got).items() if "wg_ExDxF" in k}
        assert len(specs) == 3 and set(specs.values()) == {P(None, "expert", "fsdp", "tensor")}, specs

        one = SingleDeviceSharding(jax.devices()[3])
        got1 = ck.restore(abstract_state=abstract_state(state, one))
        _assert_bitwise(got1, want)
        assert all(x.sharding == one for x in jax.tree.leaves(got1))


# ----------------------------------------------------------------------------- errors


def _saved(tmp_path, steps=(1, 2)) -> Path:
    with Checkpointer(tmp_path, keep=5) as ck:
        for s in steps:
            ck.save(_small_state(s, seed=s))
    return tmp_path


def _restore(path, step=None, target=None):
    with Checkpointer(path) as ck:
        return ck.restore(step, abstract_state=target or abstract_state(_small_state(0)))


def test_error_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*no complete checkpoint"):
        _restore(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        Checkpointer(tmp_path / "absent", read_only=True)


def test_error_missing_step(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7; available steps: \[1, 2\]"):
        _restore(tmp_path, 7)


def _state_files(step_dir: Path) -> list[Path]:
    return [Path(p) for p in glob.glob(str(step_dir / "state*" / "**" / "d" / "*"), recursive=True)]


# orbax abandons its other pending reads when one fails; their coroutines complain when collected
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage",
    [
        "delete_all_array_files",
        "delete_largest_array_file",
        "truncate_largest_array_file",
        "garbage_tree_metadata",
        "garbage_json_metadata",
    ],
)
def test_error_corrupt_checkpoint(tmp_path, damage):
    _saved(tmp_path)
    step_dir = tmp_path / "2"
    files = sorted(_state_files(step_dir), key=lambda p: p.stat().st_size)
    largest = files[-1]  # the chunks of params.w and opt_state[1].w (the small arrays and the tree sit elsewhere)
    if damage == "delete_all_array_files":
        for p in files:
            p.unlink()
    elif damage == "delete_largest_array_file":
        largest.unlink()
    elif damage == "truncate_largest_array_file":
        largest.write_bytes(largest.read_bytes()[:100])
    elif damage == "garbage_tree_metadata":
        (step_dir / "state" / "_METADATA").write_text("{not json")
    else:
        (step_dir / "meta" / "metadata").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{step_dir}.*: corrupt checkpoint") as info:
        with Checkpointer(tmp_path) as ck:
            ck.restore(abstract_state=abstract_state(_small_state(0)))
            ck.metadata()
    if "largest" in damage:
        assert re.search(r"(params|opt_state\.1)\.w", str(info.value))  # names the broken array
    assert len(str(info.value)) < 1000  # a message, not a dumped tensorstore spec
    _assert_bitwise(_restore(tmp_path, 1), _host(_small_state(1, seed=1)))  # the other step is fine


def test_error_state_does_not_fit(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"params\.w: saved \(64, 64\), wanted \(32, 32\)"):
        _restore(tmp_path, target=abstract_state(_small_state(0, n=32)))
    extra = _small_state(0)._replace(params={**_small_state(0).params, "extra": jnp.zeros(3)})
    with pytest.raises(CheckpointError, match=r"missing \['params\.extra'\]"):
        _restore(tmp_path, target=abstract_state(extra))


# ----------------------------------------------------------------------------- crash safety

_CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    from orbax.checkpoint._src.path import atomicity
    from cisjax.train.checkpoint import Checkpointer
    from tests.train.test_checkpoint import _small_state

    directory, signal = sys.argv[1], sys.argv[2]
    ck = Checkpointer(directory, keep=3)
    ck.save(_small_state(1, seed=1))
    ck.wait()

    async def hang(self):  # everything is written; the commit never comes (we are killed first)
        open(signal, "w").write(str(self.get()))
        await asyncio.sleep(3600)

    atomicity.AtomicRenameTemporaryPath.finalize = hang
    ck.save(_small_state(2, seed=2, n=512))
    time.sleep(3600)
    """
)


def test_killed_save_is_never_restored(tmp_path):
    """A writer SIGKILLed after writing step 2 but before orbax's commit: the directory keeps only
    <2>.orbax-checkpoint-tmp; the step is neither listed nor restored, and the next writer cleans it up."""
    directory, signal = tmp_path / "ck", tmp_path / "signal"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(signal)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 60
        while not signal.exists():
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"child never reached the commit: {proc.stdout.read().decode()[-3000:]}")
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    tmp = directory / f"2{ckpt_lib.TMP_SUFFIX}"
    assert tmp.is_dir() and not (directory / "2").exists()
    assert _state_files(tmp), "the interrupted save had written its arrays"

    reader = Checkpointer(directory, read_only=True)
    assert reader.all_steps() == [1] and reader.latest_step() == 1
    with pytest.raises(CheckpointError, match="no checkpoint for step 2"):
        reader.restore(2, abstract_state=abstract_state(_small_state(0)))
    assert tmp.is_dir()  # a reader leaves it alone

    with Checkpointer(directory, keep=3) as ck:
        _assert_bitwise(ck.restore(abstract_state=abstract_state(_small_state(0))), _host(_small_state(1, seed=1)))
        ck.save(_small_state(2, seed=2))  # a writer removes the leftover (in the background, done by its first save)
        ck.wait()
        assert ck.all_steps() == [1, 2] and not tmp.exists()
        _assert_bitwise(ck.restore(abstract_state=abstract_state(_small_state(0))), _host(_small_state(2, seed=2)))


# ----------------------------------------------------------------------------- resume


@pytest.mark.slow  # compiles a sharded train step and its rescoring
def test_resume_reproduces_the_next_step_bitwise(tmp_path):
    """k real GRPO steps (cisjax.train.step) on a tiny MoE -> async save -> the uninterrupted run takes step k+1
    (donating the state orbax was handed) -> restore -> step k+1 again: loss, metrics and state bitwise equal."""
    from cisjax.train import step as step_lib
    from tests.support import steps

    cfg = steps.make_cfg()
    mesh = _mesh({"fsdp": 8})
    graphdef, tx, rules, state = steps.build(cfg, mesh)
    batch = steps.host_batch(m=1)
    prox = step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)(
        state.params, sharding.place(batch, mesh, rules, sharding.BATCH_AXES)
    )
    placed = sharding.place(
        steps.with_logprobs(batch, np.asarray(jax.device_get(prox))), mesh, rules, sharding.BATCH_AXES
    )
    train_step = step_lib.make_train_step(graphdef, tx, spec_of(cfg).step, mesh, rules, state_lib.shardings(state))

    k = 2
    for _ in range(k):
        state, _ = train_step(state, placed)
    state = state._replace(data_position=state.data_position + 16, policy_version=state.policy_version + k)
    target = abstract_state(state)
    saved = _host(state)
    with Checkpointer(tmp_path, keep=2) as ck:
        ck.save(state)
        state, want_metrics = train_step(state, placed)  # donates the state just handed to orbax
        want_after = _host(state)
    assert float(want_metrics["loss"]) != 0.0 and int(want_after[".step"]) == k + 1

    with Checkpointer(tmp_path, keep=2) as ck:  # a new process would start here
        assert ck.latest_step() == k
        resumed = ck.restore(abstract_state=target)
    _assert_bitwise(resumed, saved)
    resumed, got_metrics = train_step(resumed, placed)
    assert got_metrics.keys() == want_metrics.keys()
    for name in want_metrics:
        assert np.asarray(got_metrics[name]).tobytes() == np.asarray(want_metrics[name]).tobytes(), name
    _assert_bitwise(resumed, want_after)


def test_step_dir_without_commit_marker_is_ignored(tmp_path):
    """A final-named step directory that lacks orbax's commit marker (a partial copy, an empty dir) is
    never picked; the constants this relies on are orbax's own."""
    from orbax.checkpoint._src.path import atomicity_types

    assert (ckpt_lib.TMP_SUFFIX, ckpt_lib.COMMIT_FILE) == (
        atomicity_types.TMP_DIR_SUFFIX,
        atomicity_types.COMMIT_SUCCESS_FILE,
    )
    _saved(tmp_path)
    assert (tmp_path / "2" / ckpt_lib.COMMIT_FILE).is_file()
    shutil.copytree(tmp_path / "2", tmp_path / "3", ignore=shutil.ignore_patterns(ckpt_lib.COMMIT_FILE))
    (tmp_path / "4").mkdir()
    with Checkpointer(tmp_path) as ck:
        assert ck.all_steps() == [1, 2] and ck.latest_step() == 2
        _assert_bitwise(ck.restore(abstract_state=abstract_state(_small_state(0))), _host(_small_state(2, seed=2)))
        with pytest.raises(
            CheckpointError, match=r"no checkpoint for step 3 \(.*3 has no commit_success.txt: incomplete\)"
        ):
            ck.restore(3, abstract_state=abstract_state(_small_state(0)))
        with pytest.raises(CheckpointError, match="3: exists but is incomplete"):
            ck.save(_small_state(3))  # neither skipped as "already saved" nor silently overwritten
