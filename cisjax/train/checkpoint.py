"""Train-state checkpoints over orbax's CheckpointManager: async, atomic, keep-last-N, restored onto any mesh."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import cisjax
from cisjax import sharding as sharding_lib
from cisjax.errors import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "Checkpointer", "abstract_state", "target_shardings", "TMP_SUFFIX", "COMMIT_FILE"]

STATE, META = "state", "meta"  # the two items of every step directory
# orbax 0.12 writes a step into `<step>.orbax-checkpoint-tmp/`, writes COMMIT_FILE into it, then renames it
# to `<step>/` (orbax.checkpoint._src.path.atomicity_types.TMP_DIR_SUFFIX / COMMIT_SUCCESS_FILE).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"


# ----------------------------------------------------------------------------- targets


def target_shardings(state, mesh: Mesh, rules: sharding_lib.FrozenRules = sharding_lib.DEFAULT_TABLE):
    """The sharding of every leaf of a train state (concrete or abstract) on `mesh`: each
    nnx.Variable (the params and the optimizer moments, which keep the params' `axes` metadata)
    by its logical axes through `rules` (the resolved table: a run's spec.rules), every other leaf
    (counters, optimizer step counts) replicated. Same tree structure as `state`."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if isinstance(x, nnx.Variable):
            axes = x.get_metadata().get("axes")
            if axes is None:
                return x.replace(value=replicated)
            return x.replace(value=sharding_lib.named_sharding(axes, rules, mesh, x.shape))
        return replicated

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_state(state, shardings=None):
    """jax.ShapeDtypeStruct per leaf of `state` (arrays or ShapeDtypeStructs), carrying the sharding
    to restore onto: `shardings` (a tree like `state`, e.g. from `target_shardings`, or one sharding
    for every leaf), else each leaf's own."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), state)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


# ----------------------------------------------------------------------------- checkpointer


def _key(entry) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _flat(tree) -> dict[str, Any]:
    return {".".join(_key(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _root_message(e: BaseException) -> str:
    """The first line of the innermost cause (tensorstore puts the real reason, e.g. a missing or
    truncated file, at the bottom of a chain whose top dumps a whole spec)."""
    seen, cur = [], e
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    root = seen[-1]
    lines = str(root).strip().splitlines()
    text = (lines[0] if lines else "").split(" [tensorstore_spec=")[0]
    return f"{type(root).__name__}: {text[:500]}"


class Checkpointer:
    """Saves and restores the full TrainState plus a JSON metadata item (config, model dir, version).

    * Asynchronous: `save` copies the arrays to host memory before it returns (the caller may then
      donate or overwrite them), and the files are written in a background thread; `wait()` blocks
      until that write is committed. A new `save` first waits for the previous one.
    * Atomic: orbax writes each step into `<step>.orbax-checkpoint-tmp/` and commits it by renaming
      it to `<step>/`, so a save killed midway leaves only a tmp directory, which `latest_step` and
      `restore` never pick (the next writing Checkpointer deletes it, in the background, at the
      latest before its first save).
    * Keeps the last `keep` committed steps (0 = all); `should_save(step)` is every `every` steps.
    * `restore` places every leaf with the sharding of the given abstract state, so a checkpoint
      written on one mesh restores onto another (or onto one device). Every problem with what is on
      disk (nothing there, a missing step, a corrupt or mismatched checkpoint) is a CheckpointError
      naming the path.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        every: int = 0,
        metadata: Mapping | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = int(keep)
        self.every = int(every)
        self.read_only = read_only
        self._metadata = _jsonable(dict(metadata or {}), "metadata")
        self._warned: set[int] = set()
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep if self.keep > 0 else None,
            create=not read_only,
            read_only=read_only,
            # stale <step>.orbax-checkpoint-tmp dirs of a crashed writer; a reader must not touch them
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=(STATE, META),
            item_handlers={STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        )

    # --- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `step` is a save step (a positive multiple of `every`; never when every = 0)."""
        step = int(step)
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, state, *, step: int | None = None, metadata: Mapping | None = None) -> bool:
        """Start saving `state` as step `step` (default `state.step`); returns once the arrays are
        on the host, while the files are still being written. False (nothing done) when that step
        is already saved."""
        if self.read_only:
            raise CheckpointError(f"{self.directory}: opened read-only")
        step = _scalar(state.step) if step is None else int(step)
        meta = {
            **self._metadata,
            **_jsonable(dict(metadata or {}), "metadata"),
            "step": step,
            "cisjax_version": cisjax.__version__,
            "saved_at_unix": time.time(),
        }
        if step in self._mgr.all_steps():
            if step not in self.all_steps():
                raise CheckpointError(
                    f"{self.step_dir(step)}: exists but is incomplete (no {COMMIT_FILE}); remove it to save step {step}"
                )
            log.info("checkpoint %s already exists; not saved again", self.step_dir(step))
            return False
        return bool(
            self._mgr.save(
                step,
                args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}),
                force=True,
            )
        )

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed."""
        self._mgr.wait_until_finished()

    def saving(self) -> bool:
        """Whether a save is still being written."""
        return bool(self._mgr.is_saving_in_progress())

    def close(self) -> None:
        """Finish the save in flight and release orbax's threads."""
        self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- finding -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The committed steps, ascending: orbax's (final directory names, never a tmp one) that also
        hold the commit marker (a step directory without it was not written by a completed save,
        e.g. a partial copy)."""
        steps = []
        for step in sorted(self._mgr.all_steps()):
            if os.path.isfile(os.path.join(self.step_dir(step), COMMIT_FILE)):
                steps.append(step)
            elif step not in self._warned:
                self._warned.add(step)
                log.warning("%s: no %s, not a complete checkpoint; ignored", self.step_dir(step), COMMIT_FILE)
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    def _resolve(self, step: int | None) -> int:
        if self.saving():  # a restore must not race our own write
            self.wait()
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        self._mgr.reload()
        steps = self.all_steps()
        if step is None:
            if not steps:
                partial = sorted(n for n in os.listdir(self.directory) if TMP_SUFFIX in n)
                extra = f" (incomplete saves, ignored: {partial})" if partial else ""
                raise CheckpointError(f"{self.directory}: no complete checkpoint{extra}")
            return steps[-1]
        step = int(step)
        if step not in steps:
            why = (
                f" ({self.step_dir(step)} has no {COMMIT_FILE}: incomplete)"
                if os.path.isdir(self.step_dir(step))
                else ""
            )
            raise CheckpointError(f"{self.directory}: no checkpoint for step {step}{why}; available steps: {steps}")
        return step

    # --- restoring ---------------------------------------------------------------------------

    def metadata(self, step: int | None = None) -> dict:
        """The JSON metadata of a step (default: the latest)."""
        step = self._resolve(step)
        path = os.path.join(self.step_dir(step), META)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        except Exception as e:
            raise CheckpointError(f"{path}: corrupt checkpoint (unreadable JSON metadata): {_root_message(e)}") from e
        if not isinstance(out, dict):
            raise CheckpointError(f"{path}: checkpoint metadata is not a JSON object")
        return out

    def restore(self, step: int | None = None, *, abstract_state) -> Any:
        """The state saved at `step` (default: the latest committed one), each leaf placed with the
        sharding of the matching leaf of `abstract_state` (ShapeDtypeStructs with `.sharding`, e.g.
        from `abstract_state(...)`, or concrete arrays) and returned in its tree structure. Shapes
        and leaf paths must match the checkpoint; a dtype that differs is cast."""
        step = self._resolve(step)
        path = self.step_dir(step)
        target = jax.tree.map(_as_abstract, abstract_state)
        self._check_fits(step, target)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)}))[STATE]
        except Exception as e:
            raise CheckpointError(f"{path}: corrupt checkpoint (cannot read the arrays): {_root_message(e)}") from e
        log.info("restored %s", path)
        return out

    def _check_fits(self, step: int, target) -> None:
        """Leaf paths and shapes of the checkpoint against the target, named (orbax's own errors
        do not say which array is wrong)."""
        path = os.path.join(self.step_dir(step), STATE)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: corrupt checkpoint (no {STATE!r} item)")
        try:
            stored = self._mgr.item_metadata(step)[STATE]
            stored = stored.tree if hasattr(stored, "tree") else stored
            if stored is None:
                raise ValueError("no tree metadata")
            stored = _flat(stored)
        except Exception as e:
            raise CheckpointError(f"{path}: corrupt checkpoint (unreadable tree metadata): {_root_message(e)}") from e
        wanted = _flat(target)
        missing = sorted(set(wanted) - set(stored))
        unexpected = sorted(set(stored) - set(wanted))
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: the checkpoint does not fit the state: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )
        bad = [
            f"{k}: saved {tuple(stored[k].shape)}, wanted {tuple(wanted[k].shape)}"
            for k in wanted
            if getattr(stored[k], "shape", None) is not None and tuple(stored[k].shape) != tuple(wanted[k].shape)
        ]
        if bad:
            raise CheckpointError(f"{path}: shapes differ from the state: {bad[:8]}{' ...' if len(bad) > 8 else ''}")


def _scalar(x) -> int:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # replicated across processes
        x = x.addressable_data(0)
    return int(np.asarray(jax.device_get(x)))


def _as_abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        if getattr(x, "sharding", None) is None:
            raise ValueError(f"abstract leaf {x} has no sharding; build the target with abstract_state(...)")
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _jsonable(obj: dict, what: str) -> dict:
    """A JSON round trip now, so that a bad value fails in the caller, not in the background write
    (values JSON cannot hold are written as their str)."""
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {what} is not JSON-serialisable: {e}") from e


# ----------------------------------------------------------------------------- params alone (cisjax export)


def restore_params(checkpoint_dir: str | os.PathLike, abstract_params, *, step: int | None = None) -> tuple[Any, dict]:
    """(params, {"step", "policy_version", "data_position", "checkpoint"}) of a cisjax.train.checkpoint step (default: the latest
    committed one), on one device, each leaf in its saved dtype.

    Only `params` and the counters are read (orbax partial restore of the step's `state`
    item): the optimizer state, twice the params' size for Adam, is neither needed nor
    allocated, and its structure (which depends on the run's train config) does not matter.
    `abstract_params` (the nnx.State of hf_io.abstract_model) gives the tree and the shapes;
    a checkpoint of another model is a CheckpointError naming the differing parameters.
    """
    ckpt = Checkpointer(checkpoint_dir, read_only=True, async_save=False)
    try:
        steps = ckpt.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"{ckpt.directory}: no complete checkpoint")
            step = steps[-1]
        elif int(step) not in steps:
            raise CheckpointError(f"{ckpt.directory}: no checkpoint for step {step}; available steps: {steps}")
        path = Path(ckpt.step_dir(int(step))) / STATE
    finally:
        ckpt.close()

    handler = ocp.PyTreeCheckpointer()
    try:
        stored = handler.metadata(path).item_metadata
        stored = stored.tree if hasattr(stored, "tree") else stored
        stored_params = {
            _keystr(k).removesuffix(".value"): v for k, v in jax.tree_util.tree_flatten_with_path(stored["params"])[0]
        }
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata (not a cisjax train state?): {e}") from e
    flat = [(".".join(map(str, k)), k, v) for k, v in nnx.to_flat_state(abstract_params)]
    missing = sorted({p for p, _, _ in flat} - stored_params.keys())
    unexpected = sorted(stored_params.keys() - {p for p, _, _ in flat})
    bad = [
        f"{p}: saved {tuple(stored_params[p].shape)}, model {tuple(v.shape)}"
        for p, _, v in flat
        if p in stored_params and tuple(stored_params[p].shape) != tuple(v.shape)
    ]
    if missing or unexpected or bad:
        raise CheckpointError(
            f"{path}: the checkpoint's params do not fit the model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}, shapes {bad[:8]}"
        )

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params_target = nnx.from_flat_state(
        [
            (k, v.replace(value=jax.ShapeDtypeStruct(v.shape, stored_params[p].dtype, sharding=device)))
            for p, k, v in flat
        ]
    )
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=device)
    target = {"params": params_target, "step": scalar, "policy_version": scalar, "data_position": scalar}
    try:
        out = handler.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
            ),
        )
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt checkpoint (cannot read the params): {e}") from e
    counters = {k: int(out[k]) for k in ("step", "policy_version", "data_position")}
    return out["params"], {**counters, "checkpoint": str(path.parent)}


def _keystr(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
