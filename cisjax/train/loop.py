"""`cisjax train`: the RL loop, stage by stage — rollouts, rewards, proximal rescoring, correction, update, publish."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np

from cisjax import console, distributed, errors

log = logging.getLogger("cisjax.train")


def train(cfg, *, resume: bool = False, stop_event=None) -> dict:
    """Run the loop of `cfg` (a ConfigDict from configs/); returns the last step's metrics.

    Order of one step s (weights version s is served when it starts):
      1. rollouts of batch s (generated ahead by the producer, from weights at most
         rollout.max_staleness versions old) with their rewards;
      2. the TrainBatch: rows, loss mask, q from the sampling step, GRPO advantages;
      3. proximal rescoring: p of every token under the current params (the step's own forward);
      4. the jitted step: correction weights from p and q, the clipped loss, AdamW;
      5. publish version s + 1 (export or stream, reload, canary; rollout.lag: version s + 1 - lag; rollout.perturb:
         a perturbed copy, cisjax.train.perturb; the last step's weights are sent as they are);
      6. every eval.every steps and after the last one (eval.sets), greedy evaluation of version s + 1 on the
         server; then metrics, dump, checkpoint.
    """
    import jax
    import jax.numpy as jnp

    from cisjax import sharding
    from cisjax.rl import corrections
    from cisjax.rollout.client import SamplingParams
    from cisjax.rollout.fleet import RolloutFleet
    from cisjax.train import metrics as metrics_lib
    from cisjax.train import rollouts as rollouts_lib
    from cisjax.train import state as state_lib
    from cisjax.train import step as step_lib
    from cisjax.train.build import build
    from cisjax.train.checkpoint import Checkpointer, abstract_state
    from cisjax.train.publish import Publisher
    from cisjax.train.validate import check

    check(cfg)  # every problem of the config at once, before the run directory, the model and the server
    run_dir = Path(cfg.run.dir or "runs/default").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0
    if lead:
        (run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")

    # --- mesh, model, optimizer, state, the jitted step and rescoring ----------------------------
    run = build(cfg)
    mesh, rules, state, train_step, rescore = run.mesh, run.rules, run.state, run.train_step, run.rescore
    ckpt = Checkpointer(
        cfg.checkpoint.dir or run_dir / "checkpoints",
        keep=cfg.checkpoint.keep,
        every=cfg.checkpoint.every,
        metadata={"model": str(cfg.model.path)},
    )
    data_state = None
    if resume:
        if ckpt.latest_step() is None:
            raise errors.MissingInput(f"--resume: no checkpoint under {ckpt.directory}")
        state = ckpt.restore(abstract_state=abstract_state(state))
        data_state = ckpt.metadata().get("data_state")
    start = int(state.step)

    # --- data, rewards, rollout service (process 0 talks to the server) ----------------------
    # rollout.perturb: version 0 is what the engine starts on, so it starts on the perturbed copy (export: collective)
    engine_model = cfg.model.path
    if cfg.rollout.perturb != "none" and start == 0:
        engine_model = _perturbed_start(run, state.params, cfg, run_dir, lead)
    stream, formatter, pool, server, client, producer = None, None, None, None, None, None
    publisher = evaluator = None
    try:
        if lead:
            from cisjax import data as data_lib
            from cisjax.rl import rewards as rewards_lib

            problems = data_lib.load_problems(cfg.data.source, cfg.data.split, kind=cfg.data.kind)
            if cfg.data.limit:
                problems = problems[: cfg.data.limit]
            formatter = data_lib.PromptFormatter(
                cfg.data.tokenizer or cfg.model.path,
                instruction=cfg.data.instruction,
                chat_template=cfg.data.chat_template,
            )
            problems = data_lib.drop_long_prompts(problems, formatter, cfg.data.max_prompt_tokens)
            stream = data_lib.PromptStream(
                problems, batch_size=cfg.data.prompts_per_step, seed=cfg.seed, epochs=cfg.data.epochs
            )
            if data_state:
                stream.restore(data_state)
            pool = rewards_lib.RewardPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
            if cfg.eval.sets:  # its sets load (and fail) before the server starts
                from cisjax.evaluation.in_loop import LoopEval

                evaluator = LoopEval(cfg, run_dir, cfg.data.tokenizer or cfg.model.path)
            server, client = _rollout_service(cfg, run_dir, engine_model)
        available = distributed.broadcast(stream.total_steps if lead else None)
        total = int(cfg.run.steps) or available
        if total > available:  # found now, not when the prompts run out mid-run
            raise errors.UserError(
                f"run.steps={total}, but the data give {available} steps (data.prompts_per_step="
                f"{cfg.data.prompts_per_step}, data.epochs={cfg.data.epochs}); raise data.epochs or lower run.steps"
            )
        publisher = Publisher.for_run(run, client, run_dir=str(run_dir))
        if start > 0:  # resumed: the (fresh) server holds the initial weights, version 0; send the state's own
            if lead and publisher.root is not None:
                _drop_exports_from(publisher.root, start)
            publisher.publish(state.params, version=start)
        # rollout.lag = N: the engine is sent the params of N steps ago (copies: the step donates its state)
        lag, held = int(cfg.rollout.lag), collections.deque()
        version = start  # the params of step s are weights version s

        sampling = SamplingParams(
            n=cfg.rollout.group_size,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=list(formatter.stop_token_ids) if lead else [],
            seed=None,
            return_routing=run.replay,  # every position's expert ids, replayed by the rescoring and the update
        )

        if lead:

            def generate(problems, index):
                prompts = [formatter.encode(p.question) for p in problems]
                # a fixed rollout.seed makes the run's samples reproducible: one seed per batch
                seed = None if cfg.rollout.seed < 0 else cfg.rollout.seed * 1_000_003 + index
                samples = client.generate(prompts, dataclasses.replace(sampling, seed=seed))
                groups = rollouts_lib.rollouts_from_samples(samples, problems)
                texts = [[formatter.decode(r.response_ids) for r in g] for g in groups]
                return groups, texts

            def reward(groups, texts, problems):
                flat_texts = [t for ts in texts for t in ts]
                refs = [p.answer for p, g in zip(problems, groups) for _ in g]
                scores = pool.score(flat_texts, refs)
                for r, s in zip((r for g in groups for r in g), scores):
                    r.reward = float(s)

            producer = rollouts_lib.RolloutProducer(
                stream,
                generate,
                reward,
                max_staleness=cfg.rollout.max_staleness,
                first_index=start,
                published_version=version,
                server_version=lambda: client.expected_version,
            )

        mlog = (
            metrics_lib.MetricsLog(
                run_dir,
                total_steps=total,
                start_step=start,
                tensorboard=cfg.run.tensorboard and lead,
                progress=None if cfg.run.progress == "auto" else cfg.run.progress == "on",
                print_every=cfg.run.print_every,
            )
            if lead
            else None
        )
        corr_kw = step_lib.correction_kwargs(cfg)
        last: dict = {}
        stopped = False
        for s in range(start, total):
            # on any process, answered alike on all: they leave at the same step, wherever the signal landed first
            if distributed.any_process(stop_event is not None and stop_event.is_set()):
                log.info("stop requested: leaving after step %d", s)
                stopped = True
                break
            t_step = time.monotonic()
            # 1. rollouts + rewards
            t0 = time.monotonic()
            ro = producer.get(s) if lead else None
            wait_s = time.monotonic() - t0
            # 2. the batch (process 0 builds it; every process holds the same host copy)
            host, info, versions_rows = _host_batch(ro, cfg, run) if lead else (None, None, None)
            host, versions_rows, roll_metrics = distributed.broadcast(
                (host, versions_rows, _rollout_metrics(ro, s)) if lead else None
            )
            batch = sharding.place(host, mesh, rules, sharding.BATCH_AXES)
            # 3. proximal rescoring with the params of this step
            t0 = time.monotonic()
            prox, flips = rescore(state.params, batch) if run.replay else (rescore(state.params, batch), None)
            batch = batch._replace(prox_logprobs_MxBxT=prox)
            jax.block_until_ready(prox)
            rescore_s = time.monotonic() - t0
            flips_host = (
                None if flips is None else type(flips)(*map(distributed.to_host, flips))
            )  # collective across processes
            # dump before the step donates the params (the batch and prox are not donated)
            if cfg.run.dump_every and s % cfg.run.dump_every == 0:
                prox_host = distributed.to_host(prox)  # collective when prox spans processes
                if lead:
                    _dump(run_dir, s, cfg, host, prox_host, versions_rows, corrections, corr_kw, flips_host)
            # 4. the update
            t0 = time.monotonic()
            state, m = train_step(state, batch)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            train_s = time.monotonic() - t0
            # 5. publish the new weights as version s + 1 (with rollout.lag, version s + 1 - lag; the last step's always)
            t0 = time.monotonic()
            report = None
            if lag and s + 1 < total:
                held.append((s + 1, jax.tree.map(jnp.copy, state.params)))
                if len(held) > lag:
                    v, params = held.popleft()
                    report = publisher.publish(params, version=v)
                    del params
            else:  # the last step's weights unperturbed: the run's final export and evaluation are the trained model
                report = publisher.publish(state.params, version=s + 1, perturbed=s + 1 < total)
            publish_s = time.monotonic() - t0
            state = state_lib.with_counters(
                state, policy_version=s + 1, data_position=int(roll_metrics["data/position"])
            )
            if lead and report is not None:
                producer.published(report.version)
            step_s = time.monotonic() - t_step
            # 6. evaluation of the weights just published (version s + 1), greedy, on the same server
            evaluated = {}
            if evaluator is not None and evaluator.due(s, total):
                evaluated = evaluator.run(client, s + 1, model=report.path if report is not None else None)
            out = {f"train/{k}": v for k, v in m.items()}
            out.update(roll_metrics)
            if report is not None:
                out.update(report.metrics())
            if flips_host is not None and lead:
                out.update(_flip_metrics(flips_host, host.segment_ids_MxBxT))
            out.update(
                {
                    "reward_mean": roll_metrics["reward/mean"],
                    "accuracy": roll_metrics["reward/accuracy"],
                    "response_len": roll_metrics["rollout/response_len"],
                    "grad_norm": m["grad_norm"],
                    "entropy": m["entropy"],
                    "corr/acted_frac": m.get("acted_frac", 0.0),
                    "staleness_mean": roll_metrics["rollout/staleness_mean"],
                    "skipped_steps": float(m["skipped"]),
                    "time/rollout_wait_s": wait_s,
                    "time/rescore_s": rescore_s,
                    "time/train_s": train_s,
                    "time/publish_s": publish_s,
                    "time/step_s": step_s,
                    "tokens_per_s": m["tokens"] / max(step_s, 1e-9),
                }
            )
            if lead:
                out.update({"time/generate_s": ro.timings["generate_s"], "time/reward_s": ro.timings["reward_s"]})
                out.update(
                    {f"reward/pool_{k}": float(v) for k, v in pool.metrics().items()}
                )  # cumulative: lost scores show
                out.update(evaluated)
                if isinstance(client, RolloutFleet):  # tokens/s, in flight, version, failures, restarts per replica
                    out.update(client.metrics())
                mlog.log(s, out)
            last = out
            # checkpoint: the state after step s and the data position after batch s
            if ckpt.should_save(s + 1) or s + 1 == total:
                ckpt.save(state, metadata={"data_state": ro.data_state if lead else None, "version": s + 1})
        ckpt.wait()
        if stopped and last:
            ckpt.save(state, metadata={"data_state": ro.data_state if lead else None, "version": int(state.step)})
            ckpt.wait()
        return last
    finally:
        try:
            for closer in (producer, pool, evaluator):
                if closer is not None:
                    closer.close()
            if client is not None:
                client.close()
        finally:
            # a second Ctrl-C may land anywhere in this shutdown: the server (in its own session, out of the
            # terminal's reach) must still not outlive the trainer
            if server is not None:
                try:
                    server.stop()
                except BaseException:
                    server.kill()
                    raise
        ckpt.close()
        if lead and "mlog" in locals() and mlog is not None:
            mlog.close()


# ----------------------------------------------------------------------------- pieces of a step


def _drop_exports_from(root, version: int) -> None:
    """Exports of versions >= `version` under root: those of the killed run past its last checkpoint
    (or of the checkpoint itself, re-exported now) — removed so that numbering continues from it."""
    import shutil

    from cisjax import export as export_lib

    for v, path in export_lib.versions(root).items():
        if v >= version:
            log.info("resume: removing export %s (version %d >= %d)", path, v, version)
            shutil.rmtree(path)
    pointer = Path(root) / export_lib.LATEST
    if pointer.is_file() and pointer.read_text().strip() >= export_lib.version_name(version):
        pointer.unlink()  # re-pointed by the next export


def _host_batch(ro, cfg, run):
    """Process 0: the TrainBatch of a step's rollouts and the per-token rollout version [M*B, T]."""
    from cisjax.train import batching

    batch, info = batching.build_batch(
        ro.groups,
        micro_batches=cfg.train.micro_batches,
        rows_multiple=run.rows_multiple,
        length_multiple=cfg.train.length_multiple,
        advantages_cfg=cfg.advantages,
        replay=run.replay,
    )
    m, b, t = batch.tokens_MxBxT.shape
    versions = np.full((m * b, t), -1, np.int64)
    for row, (gi, si) in enumerate(info["index"]):
        r = ro.groups[gi][si]
        p = len(r.prompt_ids)
        versions[row, p - 1 : p - 1 + len(r.versions)] = r.versions
    return batch, info, versions


def _rollout_metrics(ro, step: int) -> dict:
    from cisjax.rl.rewards import last_boxed

    rs = [r for g in ro.groups for r in g]
    rewards = np.asarray([r.reward for r in rs], np.float64)
    lengths = np.asarray([len(r.response_ids) for r in rs], np.float64)
    versions = np.concatenate([np.asarray(r.versions, np.int64) for r in rs if r.versions] or [np.zeros(0, np.int64)])
    stale = step - versions  # the params of step s are version s
    solved = np.asarray([max(r.reward for r in g) for g in ro.groups])
    boxed = [last_boxed(t) is not None for ts in ro.texts for t in ts]  # format compliance, whatever the answer
    return {
        "reward/mean": rewards.mean(),
        "reward/accuracy": float((rewards >= 1.0).mean()),
        "reward/solved_groups": float((solved >= 1.0).mean()),
        "reward/all_same_groups": float(np.mean([len({r.reward for r in g}) == 1 for g in ro.groups])),
        "rollout/response_len": lengths.mean(),
        "rollout/response_len_max": lengths.max(),
        "rollout/truncated": float(np.mean([r.finish_reason == "length" for r in rs])),
        "rollout/staleness_mean": float(stale.mean()) if stale.size else 0.0,
        "rollout/staleness_max": float(stale.max()) if stale.size else 0.0,
        "rollout/samples": float(len(rs)),
        "rollout/tokens": float(lengths.sum()),
        "rollout/boxed_frac": float(np.mean(boxed)) if boxed else 0.0,
        "data/position": float(prompts_handed_out(ro.data_state)),
    }


def prompts_handed_out(data_state: dict) -> int:
    """Prompts a stream in `data_state` (PromptStream.state()) has handed out over all its epochs."""
    return int(data_state["epoch"]) * int(data_state["size"]) + int(data_state["position"])


def _flip_metrics(flips, host_segments) -> dict:
    """Routing replay: the fraction of valid positions (prompt and response) with any MoE layer whose own routing
    differs from the replayed one, and of (position, layer) pairs."""
    valid = float(np.sum(np.asarray(host_segments) > 0))
    layers = np.asarray(flips.layers_BxT)
    per_layer = np.asarray(flips.per_layer_X)
    return {
        "replay/flip_token_frac": float(np.sum(layers > 0)) / max(valid, 1.0),
        "replay/flip_pair_frac": float(per_layer.sum()) / max(valid * len(per_layer), 1.0),
        "replay/flip_layer_frac_max": float(per_layer.max()) / max(valid, 1.0),
    }


def _dump(run_dir, step, cfg, host, prox_MxBxT, versions_rows, corrections, corr_kw, flips=None) -> None:
    from cisjax.train import metrics as metrics_lib

    m, b, t = host.tokens_MxBxT.shape
    prox = prox_MxBxT.reshape(m * b, t)
    infer = np.asarray(host.infer_logprobs_MxBxT).reshape(m * b, t)
    mask = np.asarray(host.loss_mask_MxBxT).reshape(m * b, t)
    c = corrections.correction(cfg.correction.method, prox, infer, mask, **corr_kw)
    metrics_lib.write_dump(
        run_dir,
        step,
        infer_logprobs=infer,
        prox_logprobs=prox,
        mask=mask,
        weights=np.asarray(c.weights_BxT),
        acted=np.asarray(c.acted_BxT),
        token_versions=versions_rows,
        current_version=step,
        sample_tokens=cfg.run.dump_tokens,
        seed=cfg.seed,
        routing_flips=None if flips is None else np.asarray(flips.layers_BxT).reshape(m * b, t),
        routing_flips_per_layer=None if flips is None else np.asarray(flips.per_layer_X),
    )


def _perturbed_start(run, params, cfg, run_dir: Path, lead: bool) -> str:
    """The engine's version 0 under rollout.perturb: the initial params perturbed (cisjax.train.perturb), exported as
    an HF directory <run dir>/engine_start/v000000 (outside the export root, whose pruning would remove it; a fresh
    run, start 0, replaces an earlier run's)."""
    from cisjax.train import perturb as perturb_lib

    settings = perturb_lib.settings(cfg.rollout)
    path, rel = perturb_lib.export_copy(
        run.graphdef,
        params,
        run.hf_config,
        Path(run_dir) / "engine_start",
        **settings,
        dtype=cfg.publish.dtype or None,
        source="rollout.perturb",
        clear=lead,
    )
    log.info("rollout.perturb=%s: the engine starts on %s (relative rms change %.3g)", settings["kind"], path, rel)
    return str(path)


def _rollout_service(cfg, run_dir: Path, model_dir):
    """(embedded server(s) or None, connected client): the configured address(es), or child servers on `model_dir`
    (rollout.replicas of them; several: a RolloutFleet)."""
    from cisjax.rollout import service

    r = cfg.rollout
    return service.connect(
        r.server,
        model_dir=model_dir,
        export_root=Path(cfg.publish.dir or run_dir / "exports"),
        log_path=run_dir / "rollout_server.log",
        backend=r.backend,
        dtype=r.dtype,
        kv_cache_gib=r.kv_cache_gib,
        token=r.token or os.environ.get("CISJAX_ROLLOUT_TOKEN") or None,
        timeout_s=r.timeout_s,
        retry_s=r.retry_s,
        startup_s=r.startup_s,
        replicas=r.replicas,
        replica_cpus=r.replica_cpus,
        replica_gpus=r.replica_gpus,
    )


# ----------------------------------------------------------------------------- the command


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="config file (configs/*.py) returning a ConfigDict")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last checkpoint of the run (same data order and versions)",
    )


def _init_distributed() -> None:
    """Multi-host runs opt in with CISJAX_DISTRIBUTED=1 (launchers/tpu_pod.sh sets it): jax.distributed.initialize()
    before anything touches a device, its arguments auto-detected (TPU VM metadata, SLURM, Open MPI;
    JAX_COORDINATOR_ADDRESS is read too). Off by default: a single-host run needs no coordinator."""
    if os.environ.get("CISJAX_DISTRIBUTED", "0") in ("", "0"):
        return
    import jax

    jax.distributed.initialize()
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    import threading

    from cisjax import config as config_lib

    console.setup()
    cfg = config_lib.load(args.config, overrides or [])
    _init_distributed()
    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():
            raise KeyboardInterrupt
        log.warning("signal %d: finishing the current step, then a checkpoint (again to abort)", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    last = train(cfg, resume=args.resume, stop_event=stop)
    print(json.dumps({k: last[k] for k in ("reward_mean", "accuracy", "time/step_s") if k in last}))
    return 0
