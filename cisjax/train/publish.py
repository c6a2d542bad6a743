"""The trainer's per-step weight publisher: export (disk) or stream the params to the rollout server, then the weight canary."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from cisjax import distributed, errors, forward, sharding
from cisjax import rows as rows_lib
from cisjax.models import hf_io
from cisjax.models.hf_config import dtype_of
from cisjax.models.padding import round_up
from cisjax.records import TrainBatch
from cisjax.rollout.fleet import RolloutFleet
from cisjax.train import canary as canary_lib
from cisjax.train import delivery
from cisjax.train import perturb as perturb_lib

log = logging.getLogger(__name__)

__all__ = ["Publisher", "PublishSpec", "CanarySpec", "PublishReport", "CanaryError", "PublishError", "MODES"]

MODES = ("disk", "stream")  # publish.mode; rollout.colocated publishes in memory (mode "colocated")
_OK, _MISMATCH, _ERROR = 0, 1, 2  # canary outcomes agreed across processes


class PublishError(RuntimeError):
    """The server did not take the weights (UpdateWeights failed, or it reports another version); raised on every
    process. (A failed export raises export.ExportError, also on every process.)"""


class CanaryError(RuntimeError):
    """The engine's logprobs of the canary sequences disagree with the trainer's beyond the configured
    bounds after a publish: the message holds the report (and, in disk mode, which tensor families of
    the export differ from the params). Raised on every process. `.report` (CanaryReport) and
    `.families` (list of canary.FamilyDiff) are set on process 0 (None elsewhere)."""

    def __init__(self, message: str, report=None, families=None):
        super().__init__(message)
        self.report = report
        self.families = families


@dataclass
class PublishReport:
    version: int  # the version the server now serves
    mode: str  # disk | stream | colocated
    path: str | None  # disk mode: the export directory
    bytes: int  # bytes of tensors exported / streamed
    export_s: float  # disk: writing the export; stream: gathering and converting the tensors
    reload_s: float  # disk: the UpdateWeights call (the server verifies and reloads); stream: the rest of the call (sending, reloading)
    canary_s: float  # trainer logprobs + server scoring + comparison; 0 when the canary did not run
    canary: canary_lib.CanaryReport | None  # None when the canary did not run (or on processes other than 0)
    # rollout.perturb: ||sent - params|| / ||params|| over the matrices; None = off
    perturb_rel_rms: float | None = None
    # a RolloutFleet: the replicas that failed their canary (quarantined by the fleet; the publish stands while one passes)
    failed_replicas: tuple = ()
    changed_fraction: float | None = None  # publish.delta: elements whose published bits changed; None = whole
    full_sends: int | None = None  # publish.delta: servers sent the whole set (first publish, a refused delta)

    def metrics(self) -> dict:
        """Flat numbers for the training log."""
        out = {
            "publish/version": float(self.version),
            "publish/bytes": float(self.bytes),
            "publish/export_s": self.export_s,
            "publish/reload_s": self.reload_s,
            "publish/canary_s": self.canary_s,
        }
        if self.canary is not None:
            out.update({"publish/canary_mean_abs": self.canary.mean_abs, "publish/canary_max_abs": self.canary.max_abs})
            out["publish/canary_failed_replicas"] = float(len(self.failed_replicas))
        if self.perturb_rel_rms is not None:
            out["publish/perturb_rel_rms"] = self.perturb_rel_rms
        if self.full_sends is not None:
            out["publish/full_sends"] = float(self.full_sends)
        if self.changed_fraction is not None:
            out["publish/changed_fraction"] = self.changed_fraction
        return out


@dataclass(frozen=True)
class CanarySpec:
    """publish.canary.*: fixed random-token sequences scored by the trainer and the server after a publish."""

    every: int = 1  # every n-th publish (the first one included); 0 = never
    num_sequences: int = 8
    prompt_len: int = 16
    response_len: int = 32
    mean_abs: float = 0.05  # bounds on |trainer - server| over the response tokens; 0 = unchecked
    max_abs: float = 3.0
    seed: int = 0  # the run's seed: the sequences


@dataclass(frozen=True)
class PublishSpec:
    """publish.* of a run, with what the canary's trainer forward takes from the step (precision, chunking) and the
    controlled mismatch of rollout.perturb."""

    mode: str = "disk"  # disk | stream | colocated (rollout.colocated: swapped into the trainer's own engine)
    dir: str = ""  # export root ("" = <run dir>/exports)
    server_dir: str = ""  # the export root as the server sees it ("" = the same path)
    dtype: str | None = "bfloat16"  # the published tensors' dtype; None = the params' own
    keep: int = 2  # versions kept under the root; 0 = all
    delta: bool = False  # send only what changed since the version the server holds (train.delivery.DeltaSender)
    canary: CanarySpec = CanarySpec()
    precision: str = "bf16"  # the trainer's (the canary's forward)
    chunk_size: int = 1024
    perturb: perturb_lib.Perturbation = perturb_lib.Perturbation()


def canary_shape(canary: CanarySpec, mesh, rules) -> tuple[int, int]:
    """(rows, length) of the canary's [1, rows, length] batch: the canary's sequences, padded to the mesh's batch
    and length shards."""
    rows_multiple, length_multiple = (sharding.axis_multiple(mesh, rules, name) for name in ("batch", "length"))
    length = int(canary.prompt_len) + int(canary.response_len)
    rows = int(canary.num_sequences)
    return round_up(rows, rows_multiple), round_up(length, length_multiple)


def canary_logprobs_fn(graphdef, spec: PublishSpec, mesh, rules):
    """The trainer side of the canary, jitted: (params, TrainBatch [1, rows, length]) -> logprobs at temperature 1
    (the server scores at temperature 1) through the step's forward, on the params rounded to the published dtype
    (the weights the engine got: the step's own bf16 compute rounds its matmul weights anyway; the router, norms and
    fp32 compute see the difference)."""
    return _canary_logprobs_fn(graphdef, mesh, sharding.freeze(rules), spec.precision, int(spec.chunk_size), spec.dtype)


@functools.lru_cache(maxsize=8)
def _canary_logprobs_fn(
    graphdef, mesh, rules: sharding.FrozenRules, precision: str, chunk_size: int, dtype: str | None
):
    # cached: the Publishers of one model share one compilation
    return forward.make_batch_logprobs(
        graphdef,
        mesh,
        rules,
        precision=precision,
        temperature=1.0,
        chunk_size=chunk_size,
        round_to=dtype_of(dtype) if dtype else None,
    )


class Publisher:
    """Publishes the trainer's params as policy version `version` to the rollout server, then checks it.

    Built once per run from the graphdef (train.state.create), the model's HF config.json dict, the run's
    PublishSpec, the RolloutClient (only process 0 uses it; other processes may pass None), and the mesh and rules
    the params live on. The export root (disk mode) is `root`, else spec.dir, else `run_dir`/exports.

    publish(params, version):
      * disk: `export.export` as root/vNNNNNN in spec.dtype (atomic, manifest, LATEST, keep), then
        `client.update_weights(path as the server sees it, version, the manifest's sha256)`;
        stream: `client.update_weights_from_tensors` with the HF tensors produced lazily (hf_io.HFTensors);
        colocated: swapped into `colocated` (cisjax.engines.jax.colocated.Colocated, the engine in this process), the
        last step (`full`) also exported as on disk.
      * the canary (first publish and every spec.canary.every-th): the trainer's logprobs of fixed random-token
        sequences under these params (the step's own forward, at temperature 1) against the server's `Score` of the
        same sequences (which must come from `version`); a mean or max |Δ| beyond spec.canary.{mean_abs,max_abs}
        raises CanaryError with the report, and in disk mode the per-family differences between the params and the
        files read back, worst first.
    Multi-process: every process calls publish (the export's and the canary's gathers are collective);
    only process 0 talks to the server; failures are agreed so that every process raises together.
    """

    def __init__(
        self,
        graphdef,
        hf_config,
        spec: PublishSpec,
        client,
        mesh,
        rules,
        *,
        root: str | os.PathLike | None = None,
        run_dir: str | os.PathLike | None = None,
        colocated=None,
    ):
        self.graphdef, self.hf_config, self.spec, self.mesh = graphdef, dict(hf_config), spec, mesh
        self.rules = rules  # the run's resolved table (spec.rules), as the params are sharded by it
        self.mode, self.dtype, self.keep = spec.mode, spec.dtype, int(spec.keep)
        self.is_writer = jax.process_index() == 0
        if self.is_writer and client is None:
            raise ValueError("Publisher: process 0 needs a RolloutClient")
        self.client = client
        self.colocated = colocated
        if self.mode == "colocated" and colocated is None:
            raise ValueError("Publisher: publish mode colocated needs the colocated engine")
        if root is None:
            root = spec.dir or (Path(run_dir) / "exports" if run_dir else None)
        if self.mode in ("disk", "colocated") and not root:
            raise errors.UserError(
                f"publish mode {self.mode} needs an export root (publish.dir, or a run_dir for <run dir>/exports)"
            )
        self.root = Path(root) if root else None
        self.server_dir = spec.server_dir or None
        self.target = delivery.Target(
            client, self.hf_config, self.dtype, self.mode, self.root, self.server_dir, self.keep, self.is_writer
        )
        self.delta = delivery.DeltaSender(self.target) if spec.delta else None
        self.publishes = 0
        # controlled mismatch (cisjax.train.perturb): the engine gets a perturbed copy; the canary checks that copy
        self.perturb = spec.perturb

        c = spec.canary
        self.every = int(c.every)
        self.bounds = {k: float(getattr(c, k)) or math.inf for k in ("mean_abs", "max_abs")}
        self.sequences = []
        if self.every:
            vocab = int(self.hf_config["vocab_size"])
            self.sequences = canary_lib.canary_sequences(
                vocab,
                num=int(c.num_sequences),
                prompt_len=int(c.prompt_len),
                response_len=int(c.response_len),
                seed=int(c.seed),
            )
            # the trainer side rounded to what the engine serves (colocated: the engine's own dtype)
            served = spec if colocated is None else dataclasses.replace(spec, dtype=colocated.dtype)
            self._logprobs_fn = canary_logprobs_fn(graphdef, served, mesh, self.rules)
            rows, length = canary_shape(c, mesh, self.rules)
            built = rows_lib.build(
                [rows_lib.Seq(p, r) for p, r in self.sequences],
                rows_lib.one_per_row(len(self.sequences)),
                length,
                rows=rows,
            )
            zeros = np.zeros((1, rows, length), np.float32)
            host = TrainBatch(*(x[None] for x in built[:4]), built.response_RxT[None], zeros, zeros, zeros)
            self._batch = sharding.place(host, mesh, self.rules, sharding.BATCH_AXES)

    @classmethod
    def for_run(cls, run, client, *, root=None, run_dir=None, colocated=None) -> Publisher:
        """The publisher of a train.build.Run (its graphdef, HF config, publish spec, mesh and rules)."""
        return cls(
            run.graphdef,
            run.hf_config,
            run.spec.publish,
            client,
            run.mesh,
            run.rules,
            root=root,
            run_dir=run_dir,
            colocated=colocated,
        )

    # ------------------------------------------------------------------ the canary's two sides

    def trainer_logprobs(self, params) -> list[list[float]]:
        """The trainer's logprobs of each canary sequence's response tokens under `params` (collective)."""
        lp = distributed.to_host(self._logprobs_fn(params, self._batch))[0]
        return [lp[i, len(p) - 1 : len(p) + len(r) - 1].tolist() for i, (p, r) in enumerate(self.sequences)]

    def canary_due(self) -> bool:
        """Whether the next publish runs the canary."""
        return self.every > 0 and self.publishes % self.every == 0

    # ------------------------------------------------------------------ publish

    def publish(self, params, version: int, *, perturbed: bool = True, full: bool = False) -> PublishReport:
        """Send `params` as `version` (rollout.perturb: a perturbed copy, unless perturbed=False: the loop sends the
        trainer's own weights at the last step, so what the run leaves behind, its last export and final evaluation,
        is the trained model). publish.delta: `full` sends the whole set (the last step: a complete export)."""
        version = int(version)
        rel_rms = None
        if self.perturb.on and perturbed:
            params, rel = perturb_lib.perturb(params, **dataclasses.asdict(self.perturb))
            rel_rms = float(rel)
        model = (self.graphdef, params)
        path = None
        jax.block_until_ready(params)  # the step that produced them is not export time
        due, trainer, trainer_s = self.canary_due(), None, 0.0
        if due:  # before the update: a fleet canaries each replica as it reloads, before it gets new work
            t1 = time.perf_counter()
            trainer = self.trainer_logprobs(params)  # collective
            trainer_s = time.perf_counter() - t1
        check = self._replica_check(trainer, version) if due and self.is_writer and self._fleet() else None
        more = {} if check is None else {"check": check}
        t0 = time.perf_counter()
        if self.colocated is not None:  # the last step (`full`) also exported: the trained model
            sent = delivery.send_colocated(self.target, self.colocated, model, version, export=full)
        elif self.delta is not None:
            sent = self.delta.send(model, version, more, full=full)
        else:
            sent = (delivery.send_disk if self.mode == "disk" else delivery.send_stream)(
                self.target, model, version, more
            )
        path, served, error = sent.path, sent.served, sent.error
        reload_s = time.perf_counter() - t0 - sent.export_s
        if error is None and self.is_writer and served != version:
            error = PublishError(f"the server reports version {served} after publishing version {version}")
        if distributed.agree(int(error is not None)):
            if error is None:
                raise PublishError(f"publishing version {version} failed on process 0; see its log")
            if isinstance(error, PublishError):
                raise error
            raise PublishError(
                f"publishing version {version} ({self.mode}) failed: {type(error).__name__}: {error}"
            ) from error

        report, canary_s, failed = None, 0.0, ()
        if due:
            t1 = time.perf_counter()
            report, failed = self._canary(params, version, path, trainer, check)
            canary_s = time.perf_counter() - t1 + trainer_s
        self.publishes += 1
        out = PublishReport(
            version=version,
            mode=self.mode,
            path=str(path) if path else None,
            bytes=int(sent.nbytes),
            export_s=sent.export_s,
            reload_s=reload_s,
            canary_s=canary_s,
            canary=report,
            perturb_rel_rms=rel_rms,
            failed_replicas=failed,
            changed_fraction=sent.changed_fraction,
            full_sends=sent.full_sends,
        )
        log.debug(
            "published version %d (%s, %.1f MB): export %.2fs, reload %.2fs, canary %.2fs%s",
            version,
            self.mode,
            sent.nbytes / 1e6,
            sent.export_s,
            reload_s,
            canary_s,
            f" (mean |dlogp| {report.mean_abs:.2e}, max {report.max_abs:.2e})" if report else "",
        )
        return out

    def _fleet(self) -> bool:
        return isinstance(self.client, RolloutFleet)

    def _server_check(self, scored, trainer, version: int):
        """(passed, CanaryReport or None, message) of a server's scores of the canary sequences."""
        stale = sorted({s["version"] for s in scored} - {version})
        if stale:
            return (
                False,
                None,
                f"weight canary FAILED: the server scored with version(s) {stale}, not the published {version}",
            )
        report = canary_lib.compare(trainer, [s["logprobs"] for s in scored], **self.bounds)
        return report.ok, report, "" if report.ok else report.summary()

    def _replica_check(self, trainer, version: int):
        """A fleet's check of each replica after its reload: client -> (passed, its CanaryReport or None, message)."""
        return lambda client: self._server_check(client.score(self.sequences, temperature=1.0), trainer, version)

    def _canary(self, params, version: int, path: Path | None, trainer, check=None):
        """(the CanaryReport, the failed replicas of a fleet) or CanaryError: every replica failed (one server: it)."""
        report, message, error = None, "", None
        code, failed = _OK, ()
        if self.is_writer:
            try:
                if check is not None:  # a fleet: each replica was checked as it reloaded
                    outcomes = self.client.last_checks
                    passed = [r for ok, r, _ in outcomes.values() if ok]
                    failed = tuple(sorted(i for i, (ok, _, _) in outcomes.items() if not ok))
                    if passed:
                        report = max(passed, key=lambda r: r.mean_abs)  # the worst replica that passed
                    elif not failed:
                        code, message = _ERROR, f"weight canary: no rollout replica was checked on version {version}"
                    else:
                        code = _MISMATCH
                        report = next((outcomes[i][1] for i in failed if outcomes[i][1] is not None), None)
                        message = f"every rollout replica failed the weight canary of version {version}:\n" + "\n".join(
                            f"replica {i}: {outcomes[i][2]}" for i in failed
                        )
                else:
                    scored = self.client.score(self.sequences, temperature=1.0)
                    passed_one, report, message = self._server_check(scored, trainer, version)
                    if not passed_one:
                        code = _MISMATCH
            except Exception as e:
                code, error = _ERROR, e
                message = f"weight canary: scoring on the server failed: {type(e).__name__}: {e}"
        code = distributed.agree(code)
        if code == _OK:
            return report, failed
        families = None
        if self.mode == "disk" and code == _MISMATCH and self.delta is None:
            expected = hf_io.HFTensors((self.graphdef, params), self.hf_config, self.dtype)
            if self.is_writer:
                families = canary_lib.family_differences(expected, hf_io.SafetensorsDir(path))
                message += (
                    "\nexported files vs the trainer's params (per tensor family, worst first):\n"
                    + canary_lib.format_differences(families)
                )
                if not any(f.note or f.max_abs > 0 for f in families):
                    message += (
                        "\n  -> the export is faithful: the engine's reload or its forward differs from the trainer's"
                    )
            else:
                for _ in expected.items():  # the gathers are collective
                    pass
        if not self.is_writer:
            message = f"weight canary failed for version {version} on process 0; see its log"
        elif self.delta is not None and code == _MISMATCH:
            message += "\n(publish.delta: the server's set matched the trainer's digest; its reload or forward differs)"
        elif self.mode == "stream" and code == _MISMATCH:
            message += "\n(stream mode: no files to compare; publish.mode=disk names the tensor families that differ)"
        if self.is_writer:
            log.error("%s", message)
        raise CanaryError(message, report, families) from error
