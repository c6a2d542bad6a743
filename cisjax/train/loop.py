"""The RL loop, stage by stage: rollouts, rewards, proximal rescoring, correction, update, publish, evaluate, log."""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from cisjax import config as config_lib
from cisjax import distributed
from cisjax.train import batching, updates, validate
from cisjax.train import metrics as metrics_lib
from cisjax.train import state as state_lib
from cisjax.train.build import Run, build_run
from cisjax.train.services import open_services

log = logging.getLogger("cisjax.train")


def train(cfg, *, resume: bool = False, stop_event=None) -> dict:
    """Run the loop of `cfg` (a ConfigDict from configs/); returns the last step's metrics.

    Order of one step s (weights version s is served when it starts):
      1. rollouts of batch s (generated ahead by the producer, from weights at most
         rollout.max_staleness versions old) with their rewards;
      2. the TrainBatch: rows, loss mask, q from the sampling step, GRPO advantages; split into
         train.updates_per_batch mini-batches (cisjax.train.updates);
      3. p_prox, p of every token under the current params: the step's own forward, stop-gradient (train.proximal=
         step: nothing runs here), or a rescoring pass through the same forward (rescore) of every mini-batch;
      4. the jitted step once per mini-batch: correction weights from p and q, the clipped loss, AdamW; then the
         dump of every run.dump_every steps;
      5. publish version s + 1 (export or stream, reload, canary; rollout.lag: version s + 1 - lag; rollout.perturb:
         a perturbed copy, cisjax.train.perturb; the last step's weights are sent as they are);
      6. every eval.every steps and after the last one (eval.sets), greedy evaluation of version s + 1 on the
         server; then metrics, dump, checkpoint.
    """
    # every problem of the config at once, before the run directory, the model and the server
    spec = validate.check(cfg)
    if spec.rollout.tls is not None:  # its files readable, before the model loads
        spec.rollout.tls.check(("rollout.tls_ca", "rollout.tls_cert", "rollout.tls_key"))
    run_dir = Path(spec.run.dir or "runs/default").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0
    if lead:
        saved = config_lib.redacted(cfg)  # no token in a run directory
        (run_dir / "config.json").write_text(saved.to_json_best_effort(indent=2) + "\n")
    run = build_run(spec)  # mesh, model, optimizer, state, the jitted step and rescoring
    with open_services(run, run_dir, resume=resume) as sv:
        state, metrics, rollouts = sv.state, {}, None
        publish = _Publishing(sv.publisher, spec.rollout.lag, sv.total)
        for s in range(sv.start, sv.total):
            # on any process, answered alike on all: they leave at the same step, wherever the signal landed first
            if distributed.any_process(stop_event is not None and stop_event.is_set()):
                log.info("stop requested: leaving after step %d", s)
                break
            clock = _Clock()
            rollouts = clock.time("rollout_wait", sv.rollouts, s)  # 1. rollouts + rewards (process 0)
            # 2. the batch (every process holds the host copy)
            host_batch, versions, rollout_metrics = _host_batch(rollouts, s, run, lead)
            batches = updates.place(updates.split(host_batch, spec.updates_per_batch), run)  # a mini-batch per update
            flips = None
            if run.rescore is not None:  # 3. p_prox by a rescoring pass (train.proximal=rescore; step: in the step)
                batches, flips = clock.time("rescore", updates.rescore, run, state.params, batches)
            state, step_m, batches, flips = clock.time("train", updates.update, run, state, batches, flips)  # 4.
            flips = updates.host_flips(flips)  # collective
            if spec.run.dump_every and s % spec.run.dump_every == 0:
                _dump(run_dir, s, spec, host_batch, batches, versions, flips, lead)
            report = clock.time("publish", publish, state.params, s)  # 5. version s + 1 (or s + 1 - lag)
            position = int(rollout_metrics["data/position"])
            state = state_lib.with_counters(state, policy_version=s + 1, data_position=position)
            sv.published(report)
            clock.stop("step")
            evaluated = {}  # 6. greedy evaluation of the weights just published, on the same server
            if sv.evaluator is not None and sv.evaluator.due(s, sv.total):
                evaluated = sv.evaluator.run(sv.client, s + 1, model=report.path if report is not None else None)
            flip_m = (
                None if flips is None or not lead else metrics_lib.flip_metrics(flips, host_batch.segment_ids_MxBxT)
            )
            lead_m = sv.lead_metrics(rollouts, evaluated)
            metrics = metrics_lib.step_metrics(
                step_m, rollout_metrics, clock.seconds, publish=report, flips=flip_m, lead=lead_m
            )
            metrics.update(metrics_lib.device_memory(jax.local_devices()))
            sv.log_step(s, metrics)
            if sv.checkpointer.should_save(s + 1):  # the state after step s, data after batch s
                _checkpoint(sv, state, s + 1, rollouts)
        # the end of the run, or a stop: the state after the last step trained, once
        version = int(state.policy_version)  # rollout batches trained on (state.step counts optimizer updates)
        if metrics and not sv.checkpointer.should_save(version):
            _checkpoint(sv, state, version, rollouts)
        sv.checkpointer.wait()
        return metrics


# ----------------------------------------------------------------------------- the stages of a step


class _Clock:
    """Seconds of a step's stages (time/<stage>_s in the metrics)."""

    def __init__(self):
        self.start, self.seconds = time.monotonic(), {}

    def time(self, stage: str, fn, *args):
        t0 = time.monotonic()
        out = fn(*args)
        self.seconds[stage] = time.monotonic() - t0
        return out

    def stop(self, stage: str) -> None:
        self.seconds[stage] = time.monotonic() - self.start


def _checkpoint(sv, state, version: int, rollouts) -> None:
    """The state after `version` rollout batches, with the prompt stream's position after them (process 0's)."""
    meta = {"data_state": rollouts.data_state if rollouts is not None else None, "version": version}
    sv.checkpointer.save(state, step=version, metadata=meta)


def _host_batch(rollouts, step: int, run: Run, lead: bool):
    """(the TrainBatch of a step's rollouts on the host, each token's rollout version [M*B, T], the rollout metrics):
    process 0 builds them from its rollouts, every process gets a copy."""
    if not lead:
        return distributed.broadcast(None)
    spec = run.spec
    host_batch, info = batching.build_batch(
        rollouts.groups,
        micro_batches=spec.micro_batches * spec.updates_per_batch,
        rows_multiple=run.rows_multiple,
        length_multiple=spec.length_multiple,
        advantages=spec.advantages,
        replay=run.replay,
    )
    return distributed.broadcast((host_batch, info["versions"], metrics_lib.rollout_metrics(rollouts, step)))


def _dump(run_dir, step: int, spec, host, batches, versions, flips, lead: bool) -> None:
    prox = updates.host_prox(batches)  # collective when prox spans processes
    if lead:
        metrics_lib.dump_step(
            run_dir,
            step,
            spec.correction,
            host,
            prox,
            versions,
            flips,
            sample_tokens=spec.run.dump_tokens,
            seed=spec.seed,
        )


class _Publishing:
    """Step s's weights go out as version s + 1. rollout.lag = L: as version s + 1 - L, the params of L steps ago
    (copies: the step donates its state). The last step's weights always, unperturbed and whole (publish.delta):
    the run's final export and evaluation are the trained model."""

    def __init__(self, publisher, lag: int, total: int):
        self.publisher, self.lag, self.total = publisher, int(lag), total
        self.held = collections.deque()

    def __call__(self, params, step: int):
        if self.lag and step + 1 < self.total:
            self.held.append((step + 1, jax.tree.map(jnp.copy, params)))
            if len(self.held) <= self.lag:
                return None
            version, old = self.held.popleft()
            return self.publisher.publish(old, version=version)
        last = step + 1 >= self.total
        return self.publisher.publish(params, version=step + 1, perturbed=not last, full=last)
