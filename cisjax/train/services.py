"""The services of a train run, opened in order and closed together in reverse: checkpoints, prompts, rewards, the
rollout service, the rollout producer, the in-loop evaluation, the publisher and the metrics log."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from cisjax import data as data_lib
from cisjax import distributed, errors
from cisjax import export as export_lib
from cisjax.engines.jax import colocated as colocated_lib
from cisjax.evaluation.in_loop import LoopEval
from cisjax.rl.rewards import RewardPool
from cisjax.rollout import service
from cisjax.rollout.fleet import RolloutFleet
from cisjax.rollout.params import SamplingParams
from cisjax.train import perturb as perturb_lib
from cisjax.train.checkpoint import Checkpointer, abstract_state
from cisjax.train.metrics import MetricsLog
from cisjax.train.publish import Publisher
from cisjax.train.rollouts import RolloutProducer, Sampler

log = logging.getLogger("cisjax.train")


@dataclass
class Services:
    """What the step loop talks to. The fields below `lead` exist on process 0 only (None elsewhere); the methods are
    answered there and are no-ops (None) on the other processes."""

    checkpointer: Checkpointer
    publisher: Publisher
    state: Any  # the TrainState the run starts from (restored on --resume)
    start: int  # its step
    total: int  # the run's last step + 1
    lead: bool  # process 0: the rollout side, the metrics log
    producer: RolloutProducer | None = None
    client: Any = None  # RolloutClient or RolloutFleet
    pool: RewardPool | None = None
    evaluator: LoopEval | None = None
    log: MetricsLog | None = None

    def rollouts(self, step: int):
        """The rollouts of batch `step` with their rewards (rollouts.StepRollouts), from the producer; None elsewhere."""
        return self.producer.get(step) if self.lead else None

    def published(self, report) -> None:
        """Tell the producer a version went out (it may then generate from it)."""
        if self.lead and report is not None:
            self.producer.published(report.version)

    def log_step(self, step: int, metrics: dict) -> None:
        if self.lead:
            self.log.log(step, metrics)

    def lead_metrics(self, rollouts, evaluated: dict) -> dict | None:
        """Process 0's share of a step's metrics: the rollout side's timings, the reward pool's counts (cumulative:
        lost scores show), an evaluation, and a fleet's replicas (tokens/s, in flight, version, failures, restarts)."""
        if not self.lead:
            return None
        out = {"time/generate_s": rollouts.timings["generate_s"], "time/reward_s": rollouts.timings["reward_s"]}
        out.update({f"reward/pool_{k}": float(v) for k, v in self.pool.metrics().items()})
        out.update(evaluated)
        if isinstance(self.client, RolloutFleet):
            out.update(self.client.metrics())
        return out


@contextlib.contextmanager
def open_services(run, run_dir: Path, *, resume: bool) -> Iterator[Services]:
    """The services of `run` (a train.build.Run), from a fresh start or its last checkpoint (`resume`)."""
    spec, lead = run.spec, jax.process_index() == 0
    if spec.rollout.colocated and jax.process_count() > 1:  # on every process: they leave together
        raise errors.UserError(
            "rollout.colocated runs the sampler in the trainer's one process (the rollout producer calls it from "
            "process 0 alone); a multi-process run (a pod slice) samples with `cisjax serve --backend jax` on hosts of "
            "its own (rollout.server)"
        )
    with contextlib.ExitStack() as stack:
        ckpt = Checkpointer(
            spec.checkpoint.dir or run_dir / "checkpoints",
            keep=spec.checkpoint.keep,
            every=spec.checkpoint.every,
            metadata={"model": spec.model_path},
        )
        stack.callback(ckpt.close)
        state, data_state = _start_state(run.state, ckpt, resume)
        start = int(state.policy_version)  # rollout batches trained on (state.step counts optimizer updates)
        # rollout.perturb: version 0 is what the engine starts on, so it starts on the perturbed copy (collective)
        engine_model = spec.model_path
        if spec.perturb.on and start == 0:
            engine_model = _perturbed_start(run, state.params, run_dir, lead)
        stream = formatter = pool = evaluator = client = producer = metrics_log = None
        if lead:
            formatter, stream = _prompts(spec.data, spec.tokenizer, spec.seed, data_state)
            pool = RewardPool(workers=spec.reward.workers, timeout_s=spec.reward.timeout_s)
            stack.callback(pool.close)
            if spec.eval is not None:  # its sets load (and fail) before the server starts
                evaluator = LoopEval(spec.eval, run_dir)
                stack.callback(evaluator.close)
            server, client = _rollout_service(run, run_dir, engine_model)
            stack.callback(_stop, server)
            stack.callback(client.close)
        total = _total_steps(spec.run.steps, spec.data, stream)
        colocated = server if spec.rollout.colocated else None
        publisher = Publisher.for_run(run, client, run_dir=str(run_dir), colocated=colocated)
        if start > 0:  # resumed: the (fresh) server holds the initial weights, version 0; send the state's own
            if lead and publisher.root is not None:
                _drop_exports_from(publisher.root, start)
            publisher.publish(state.params, version=start)
        if lead:
            sampler = Sampler(client, formatter, pool, _sampling(spec, formatter, run.replay), spec.rollout.seed)
            producer = RolloutProducer(
                stream,
                sampler.generate,
                sampler.reward,
                max_staleness=spec.rollout.max_staleness,
                first_index=start,
                published_version=start,  # the params of step s are weights version s
                server_version=lambda: client.expected_version,
                end=total,
            )
            stack.callback(producer.close)
            metrics_log = MetricsLog(
                run_dir,
                total_steps=total,
                start_step=start,
                tensorboard=spec.run.tensorboard,
                progress=spec.run.progress,
                print_every=spec.run.print_every,
            )
            stack.callback(metrics_log.close)
        yield Services(ckpt, publisher, state, start, total, lead, producer, client, pool, evaluator, metrics_log)


def _start_state(state, ckpt: Checkpointer, resume: bool):
    """(the state to start from, the prompt stream's saved position or None)."""
    if not resume:
        return state, None
    if ckpt.latest_step() is None:
        raise errors.MissingInput(f"--resume: no checkpoint under {ckpt.directory}")
    state = ckpt.restore(abstract_state=abstract_state(state))
    return state, ckpt.metadata().get("data_state")


def _prompts(data, tokenizer: str, seed: int, data_state):
    """(the prompt formatter, the stream of prompt batches at `data_state`) of a run's data.* section."""
    problems = data_lib.load_problems(data.source, data.split, kind=data.kind)
    if data.limit:
        problems = problems[: data.limit]
    formatter = data_lib.PromptFormatter(tokenizer, instruction=data.instruction, chat_template=data.chat_template)
    problems = data_lib.drop_long_prompts(problems, formatter, data.max_prompt_tokens)
    stream = data_lib.PromptStream(problems, batch_size=data.prompts_per_step, seed=seed, epochs=data.epochs)
    if data_state:
        stream.restore(data_state)
    return formatter, stream


def _total_steps(steps: int, data, stream) -> int:
    """run.steps, or as many as the data give (process 0's stream, broadcast); more than the data give is an error
    found now, not when the prompts run out mid-run."""
    available = distributed.broadcast(stream.total_steps if stream is not None else None)
    total = int(steps) or available
    if total > available:
        raise errors.UserError(
            f"run.steps={total}, but the data give {available} steps (data.prompts_per_step="
            f"{data.prompts_per_step}, data.epochs={data.epochs}); raise data.epochs or lower run.steps"
        )
    return total


def _sampling(spec, formatter, replay: bool) -> SamplingParams:
    r = spec.rollout
    return SamplingParams(
        n=r.group_size,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=list(formatter.stop_token_ids),
        seed=None,
        return_routing=replay,  # every position's expert ids, replayed by the rescoring and the update
        return_sampling_mask=r.sampling_mask,  # truncated sampling: each token's support, for mask replay
    )


def _rollout_service(run, run_dir: Path, model_dir):
    """(embedded server(s) or None, connected client): the configured address(es), child servers on `model_dir`
    (rollout.replicas of them; several: a RolloutFleet), or (rollout.colocated) the JAX sampler in this process on the
    trainer's mesh."""
    spec = run.spec
    r = spec.rollout
    if r.colocated:
        engine = colocated_lib.Colocated(
            model_dir,
            dtype=r.dtype,
            mesh=run.mesh,
            rules=run.rules,
            runtime=spec.runtime.model_kwargs(),
            timeout_s=r.timeout_s,
            startup_s=r.startup_s,
            exact=r.exact,
        )
        return engine, engine.client
    return service.connect(
        r.server,
        model_dir=model_dir,
        export_root=Path(spec.publish.dir or run_dir / "exports"),
        log_path=run_dir / "rollout_server.log",
        backend=r.backend,
        dtype=r.dtype,
        kv_cache_gib=r.kv_cache_gib,
        token=r.token,
        tls=r.tls,
        timeout_s=r.timeout_s,
        retry_s=r.retry_s,
        startup_s=r.startup_s,
        replicas=r.replicas,
        replica_cpus=r.replica_cpus,
        replica_gpus=r.replica_gpus,
    )


def _stop(server) -> None:
    """Stop the embedded server(s). A second Ctrl-C may land anywhere in this shutdown: the server (in its own
    session, out of the terminal's reach) must still not outlive the trainer."""
    if server is None:
        return
    try:
        server.stop()
    except BaseException:
        server.kill()
        raise


def _drop_exports_from(root, version: int) -> None:
    """Exports of versions >= `version` under root: those of the killed run past its last checkpoint
    (or of the checkpoint itself, re-exported now) — removed so that numbering continues from it."""
    for v, path in [*export_lib.versions(root).items(), *export_lib.deltas(root).items()]:
        if v >= version:
            log.info("resume: removing export %s (version %d >= %d)", path, v, version)
            shutil.rmtree(path)
    pointer = Path(root) / export_lib.LATEST
    if pointer.is_file() and pointer.read_text().strip() >= export_lib.version_name(version):
        pointer.unlink()  # re-pointed by the next export


def _perturbed_start(run, params, run_dir: Path, lead: bool) -> str:
    """The engine's version 0 under rollout.perturb: the initial params perturbed (cisjax.train.perturb), exported as
    an HF directory <run dir>/engine_start/v000000 (outside the export root, whose pruning would remove it; a fresh
    run, start 0, replaces an earlier run's)."""
    p = run.spec.perturb
    path, rel = perturb_lib.export_copy(
        run.graphdef,
        params,
        run.hf_config,
        Path(run_dir) / "engine_start",
        kind=p.kind,
        scale=p.scale,
        seed=p.seed,
        dtype=run.spec.publish.dtype,
        source="rollout.perturb",
        clear=lead,
    )
    log.info("rollout.perturb=%s: the engine starts on %s (relative rms change %.3g)", p.kind, path, rel)
    return str(path)
