"""Weight exports: transformers loads them exactly, the manifest catches damage, versions, pruning, LATEST, SIGKILLed writers, `cisjax export`."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import config as config_lib
from cisjax import export as ex
from cisjax.commands import export as export_command
from cisjax.models import hf_io
from cisjax.train import state as state_lib
from cisjax.train.checkpoint import Checkpointer, CheckpointError
from cisjax.train.optim import make_optimizer
from tests.models.parity import LOGITS_TOL
from tests.models.parity import run as jax_forward
from tests.support.hf import hf_forward, tiny_hf_config
from tests.support.runs import spec_of

REPO = Path(__file__).resolve().parents[1]
CONFIG = tiny_hf_config("qwen2_moe", decoder_sparse_step=2)  # a dense and an MoE layer
TOKENS = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 11), dtype=np.int32)


@pytest.fixture(scope="module")
def src(tiny_hf_dir):
    return tiny_hf_dir("qwen2_moe", decoder_sparse_step=2)


@pytest.fixture(scope="module")
def loaded(src):
    """(model with fp32 params and compute, hf config dict)."""
    model, _, hf = hf_io.load(src, dtype="float32")
    return model, hf


@pytest.fixture(scope="module")
def exported(loaded, tmp_path_factory):
    """A root holding one fp32 export, version 1 (not to be modified: copy it)."""
    model, hf = loaded
    root = tmp_path_factory.mktemp("exported")
    ex.export(model, hf, root, 1, dtype="float32")
    return root


def tensors(model_dir) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def bits(t):
    import torch

    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()]).numpy()


def params(model) -> dict:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def names(root) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir())


# ----------------------------------------------------------------------------- exports load exactly


def test_fp32_export_loads_in_transformers(loaded, exported, src):
    model, hf = loaded
    path = exported / "v000001"
    assert names(exported) == ["LATEST", "v000001"]  # no tmp left behind
    assert (exported / "LATEST").read_text() == "v000001\n"
    assert ex.latest(exported) == (1, path)
    assert names(path) == ["config.json", "manifest.json", "model.safetensors"]
    manifest = ex.verify(path)
    assert manifest["version"] == 1 and manifest["dtype"] == "float32" and manifest["format"] == ex.FORMAT
    assert (
        manifest["cisjax_version"]
        and manifest["created"].endswith("Z")
        and manifest["architecture"] == "Qwen2MoeForCausalLM"
    )
    for name in ("config.json", "model.safetensors"):
        data = (path / name).read_bytes()
        assert manifest["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # The same tensors as the source bit for bit, so transformers computes the very same logits,
    # and they match our model's forward.
    want = tensors(src)
    got = tensors(path)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(bits(got[k]), bits(want[k]), err_msg=k)
    ref, routing = hf_forward(str(src), TOKENS)
    logits, routing_exported = hf_forward(str(path), TOKENS)
    np.testing.assert_array_equal(logits, ref)
    np.testing.assert_array_equal(routing_exported, routing)
    ours, _ = jax_forward(model, TOKENS)
    assert np.abs(ours - logits).max() <= LOGITS_TOL


def test_bf16_export_rounds_like_torch(loaded, src, tmp_path):
    """The default dtype: fp32 params -> bf16 files equal to torch's rounding; a (graphdef, params) pair works too."""
    import torch
    import transformers

    model, hf = loaded
    path = ex.export(nnx.split(model, nnx.Param), hf, tmp_path, 5)
    assert path == tmp_path / "v000005" and ex.verify(path)["dtype"] == "bfloat16"
    want = tensors(src)
    got = tensors(path)
    for k in want:
        assert got[k].dtype == torch.bfloat16, k
        np.testing.assert_array_equal(bits(got[k]), bits(want[k].to(torch.bfloat16)), err_msg=k)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    assert next(hf_model.parameters()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- the manifest catches damage


def _flip(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])


DAMAGE = {
    "flipped_byte": (_flip, ["model.safetensors", "sha256"]),
    "truncated": (_truncate, ["model.safetensors", "size"]),
    "missing": (lambda p: (p / "config.json").unlink(), ["config.json", "missing"]),
    "unexpected": (
        lambda p: (p / "model-00002-of-00002.safetensors").write_bytes(b"x"),
        ["model-00002-of-00002.safetensors", "unexpected"],
    ),
    "edited_config": (
        lambda p: (p / "config.json").write_text((p / "config.json").read_text().replace("97", "98")),
        ["config.json"],
    ),
    "no_manifest": (lambda p: (p / "manifest.json").unlink(), ["no manifest.json"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_catches_damage(exported, tmp_path, damage):
    path = tmp_path / "v000001"
    shutil.copytree(exported / "v000001", path)
    ex.verify(path)
    edit, fragments = DAMAGE[damage]
    edit(path)
    with pytest.raises(ex.ExportError) as info:
        ex.verify(path)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


# ----------------------------------------------------------------------------- versions, pruning, LATEST


def test_versions_must_increase(loaded, tmp_path):
    model, hf = loaded
    ex.export(model, hf, tmp_path, 3)
    for bad in (3, 2, 0):
        with pytest.raises(ex.ExportError, match="not newer than the existing v000003"):
            ex.export(model, hf, tmp_path, bad)
    assert names(tmp_path) == ["LATEST", "v000003"]  # a refused export leaves nothing behind
    with pytest.raises(ValueError, match="version"):
        ex.export(model, hf, tmp_path, -1)
    # LATEST counts even if its directory is gone
    shutil.rmtree(tmp_path / "v000003")
    (tmp_path / "LATEST").write_text("v000010\n")
    with pytest.raises(ex.ExportError, match="v000010"):
        ex.export(model, hf, tmp_path, 10)
    assert ex.latest(tmp_path) is None
    ex.export(model, hf, tmp_path, 11)
    assert ex.latest(tmp_path) == (11, tmp_path / "v000011")


def test_keep_prunes_old_versions(loaded, tmp_path):
    model, hf = loaded
    for v in (1, 2, 4, 7):
        path = ex.export(model, hf, tmp_path / "keep2", v, keep=2)
        assert ex.latest(tmp_path / "keep2") == (v, path)
    assert names(tmp_path / "keep2") == ["LATEST", "v000004", "v000007"]
    ex.verify(tmp_path / "keep2" / "v000004")
    for v in (1, 2, 3):
        ex.export(model, hf, tmp_path / "all", v, keep=0)
    assert names(tmp_path / "all") == ["LATEST", "v000001", "v000002", "v000003"]
    ex.export(model, hf, tmp_path / "all", 4, keep=1)
    assert names(tmp_path / "all") == ["LATEST", "v000004"]


def test_latest_without_pointer(exported, tmp_path):
    root = tmp_path / "r"
    assert ex.latest(root) is None
    root.mkdir()
    assert ex.latest(root) is None
    shutil.copytree(exported / "v000001", root / "v000001")
    shutil.copytree(exported / "v000001", root / "v000002")
    (root / "v000002" / "manifest.json").unlink()  # not complete: never picked
    assert ex.latest(root) == (1, root / "v000001")
    (root / "LATEST").write_text("v000009\n")  # dangling: falls back to the newest complete one
    assert ex.latest(root) == (1, root / "v000001")


def test_stale_tmp_dirs(loaded, tmp_path):
    """Tmp dirs of dead writers on this host, of any writer idle too long, and half-deleted versions go; a live
    writer's young tmp dir stays."""
    model, hf = loaded
    host = socket.gethostname()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    made = {
        f".tmp-v000002-aaaa-{dead}@{host}": False,  # dead pid here
        f".tmp-v000002-bbbb-{os.getppid()}@{host}": True,  # alive here
        ".tmp-v000002-cccc-1@elsewhere": True,  # another host, fresh
        ".tmp-v000002-dddd-1@elsewhere.old": False,  # another host, idle for an hour
        ".del-v000000-eeee": False,
    }
    for name in made:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    past = time.time() - 3600
    for p in [
        tmp_path / ".tmp-v000002-dddd-1@elsewhere.old",
        tmp_path / ".tmp-v000002-dddd-1@elsewhere.old" / "model.safetensors",
    ]:
        os.utime(p, (past, past))
    ex.export(model, hf, tmp_path, 1)
    assert names(tmp_path) == sorted(["LATEST", "v000001"] + [n for n, kept in made.items() if kept])


# ----------------------------------------------------------------------------- crash safety

WORKER = textwrap.dedent(
    """
    import os, signal, sys
    from cisjax import export as ex
    from cisjax.models import hf_io

    src, root, where = sys.argv[1:]
    model, _, hf = hf_io.load(src, dtype="float32")
    ex.export(model, hf, root, 1)
    if where == "mid_files":  # write the first shard whole and the second one partly, then die
        write = hf_io._write_shard
        calls = []

        def dying(path, items, produce, *rest):
            calls.append(path)
            if len(calls) == 2:
                with open(path, "wb") as f:
                    f.write(b"partial")
                    f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            write(path, items, produce, *rest)

        hf_io._write_shard = dying
    else:  # die after the rename, before LATEST is updated
        ex._point_latest = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    ex.export(model, hf, root, 2, max_shard_bytes=20_000)
    print("not killed")
    """
)


@pytest.mark.parametrize("where", ["mid_files", "before_latest"])
def test_sigkilled_writer(src, loaded, tmp_path, where):
    model, hf = loaded
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, src, str(tmp_path), where], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (tmp_path / "LATEST").read_text() == "v000001\n"
    assert ex.latest(tmp_path) == (1, tmp_path / "v000001")
    ex.verify(tmp_path / "v000001")
    if where == "mid_files":
        (tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-v000002-")]
        shards = sorted(f.name for f in tmp.iterdir())
        assert (
            len(shards) == 2
            and shards[0].startswith("model-00001-of-")
            and (tmp / shards[1]).read_bytes() == b"partial"
        )
        next_version = 2
    else:
        ex.verify(tmp_path / "v000002")  # complete, only not announced
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
        with pytest.raises(ex.ExportError, match="not newer"):
            ex.export(model, hf, tmp_path, 2)
        next_version = 3
    path = ex.export(model, hf, tmp_path, next_version, keep=3)
    assert ex.latest(tmp_path) == (next_version, path)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the dead writer's tmp dir is gone
    ex.verify(path)


def test_failed_export_leaves_root_as_it_was(loaded, tmp_path, monkeypatch):
    model, hf = loaded
    ex.export(model, hf, tmp_path, 1)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "write_manifest", fail)
    with pytest.raises(OSError, match="disk full"):
        ex.export(model, hf, tmp_path, 2)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    assert ex.latest(tmp_path) == (1, tmp_path / "v000001")


# ----------------------------------------------------------------------------- cisjax export


def _cli(*argv):
    parser = argparse.ArgumentParser()
    export_command.add_args(parser)
    return export_command.run(parser.parse_args(list(argv)), [])


def test_cli_export_from_checkpoint(src, loaded, tmp_path, capsys):
    """A train state (fp32 params moved away from the source + Adam moments) saved by Checkpointer exports to a
    directory transformers loads with exactly those params."""
    model, _ = loaded
    graphdef, state = state_lib.create(model, make_optimizer(spec_of(config_lib.load(None)).step.optim))
    rng = np.random.default_rng(1)
    moved = jax.tree.map(lambda p: p + jnp.asarray(rng.normal(0, 0.05, p.shape), p.dtype), state.params)
    state = state._replace(params=moved, step=jnp.int32(7), policy_version=jnp.int32(6), data_position=jnp.int32(448))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(state)
        ckpt.save(state._replace(step=jnp.int32(9)))
    out = tmp_path / "out"

    assert (
        _cli(
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--step",
            "7",
            "--model",
            src,
            "--out",
            str(out),
            "--dtype",
            "float32",
        )
        == 0
    )
    path = out / "v000007"
    printed = capsys.readouterr()
    assert printed.out.strip() == str(path)
    assert "checkpoint step 7, policy version 6, 448 prompts seen" in printed.err
    manifest = ex.verify(path)
    meta = manifest["metadata"]
    assert (meta["step"], meta["policy_version"], meta["data_position"], manifest["dtype"]) == (7, 6, 448, "float32")
    exported_model, _, _ = hf_io.load(path, dtype="float32")
    want = params(nnx.merge(graphdef, moved))
    got = params(exported_model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    logits, _ = hf_forward(str(path), TOKENS)
    ours, _ = jax_forward(nnx.merge(graphdef, moved), TOKENS)
    assert np.abs(ours - logits).max() <= LOGITS_TOL
    assert (
        np.abs(logits - hf_forward(src, TOKENS)[0]).max() > 10 * LOGITS_TOL
    )  # the checkpoint's params, not the source's

    # default version: the latest step; then a refused older version, a missing step, a checkpoint of another model
    assert _cli("--checkpoint", str(tmp_path / "ckpt"), "--model", src, "--out", str(out)) == 0
    assert ex.latest(out) == (9, out / "v000009") and ex.verify(out / "v000009")["dtype"] == "bfloat16"
    with pytest.raises(ex.ExportError, match="not newer"):
        _cli("--checkpoint", str(tmp_path / "ckpt"), "--step", "7", "--model", src, "--out", str(out))
    with pytest.raises(CheckpointError, match="no checkpoint for step 8"):
        _cli("--checkpoint", str(tmp_path / "ckpt"), "--step", "8", "--model", src, "--out", str(out))
    other = tmp_path / "other"
    shutil.copytree(src, other)
    hf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**hf, "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="do not fit the model"):
        _cli("--checkpoint", str(tmp_path / "ckpt"), "--model", str(other), "--out", str(out), "--version", "20")
    assert names(out) == ["LATEST", "v000007", "v000009"]


def test_host_tensor_and_delta_exports(loaded, tmp_path):
    """export_tensors (a publisher's host copy) writes the very files export writes; export_delta writes dNNNNNN
    directories that LATEST never names, pruned among themselves, whose delta leads back to the new set."""
    from cisjax.rollout import delta as delta_lib

    model, hf = loaded
    whole = ex.export(model, hf, tmp_path / "a", 1)
    tensors = {n: np.asarray(t) for n, t in hf_io.iter_tensors(model, hf, "bfloat16")}
    host = ex.export_tensors(tensors, hf, tmp_path / "b", 1)
    assert ex.verify(host)["files"] == ex.verify(whole)["files"]  # same bytes, file by file
    assert ex.latest(tmp_path / "b") == (1, host)

    new = dict(tensors)
    name = sorted(new)[0]
    new[name] = new[name].copy()
    new[name].reshape(-1)[3] = -new[name].reshape(-1)[3] - 1
    d = delta_lib.diff(tensors, new, base_version=1, digest_of_new=delta_lib.digest(new))
    assert set(d.sparse) == {name} and not d.dense and d.changed == 1
    for v in (2, 3, 5):
        path = ex.export_delta(d, tmp_path / "b", v, keep=2)
    assert names(tmp_path / "b") == ["LATEST", "d000003", "d000005", "v000001"]
    assert ex.latest(tmp_path / "b") == (1, host) and list(ex.deltas(tmp_path / "b")) == [3, 5]
    manifest = ex.verify(path)
    assert (manifest["kind"], manifest["version"], manifest["base_version"]) == ("delta", 5, 1)
    back = delta_lib.apply(tensors, delta_lib.read_dir(path))
    assert delta_lib.digest(back) == d.digest and np.array_equal(back[name], new[name])
    with pytest.raises(ex.ExportError, match="not newer than the existing d000005"):
        ex.export_delta(d, tmp_path / "b", 4)
