"""The run config read once: frozen, typed sections that the stages take instead of the ConfigDict."""

from __future__ import annotations

import os
from dataclasses import dataclass

from cisjax import runtime as runtime_lib
from cisjax import sharding
from cisjax.evaluation.in_loop import EvalSpec
from cisjax.rl.advantages import AdvantageSpec
from cisjax.rl.corrections import CorrectionSpec
from cisjax.rl.loss import LossSpec
from cisjax.train.optim import OptimSpec
from cisjax.train.perturb import Perturbation
from cisjax.train.publish import CanarySpec, PublishSpec
from cisjax.train.step import StepSpec

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "RewardSpec",
    "RolloutSpec",
    "RunSpec",
    "TrainSpec",
    "from_config",
]


@dataclass(frozen=True)
class RolloutSpec:
    """rollout.* (configs/base.py): where rollouts come from and how they are sampled."""

    server: str  # running server(s) "host:port[,host:port]"; "" = embedded children
    replicas: int
    replica_cpus: str
    replica_gpus: str
    token: str | None  # rollout.token, else $CISJAX_ROLLOUT_TOKEN, else None
    backend: str
    dtype: str
    kv_cache_gib: float  # 0 = the backend default
    group_size: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_staleness: int
    seed: int  # -1 = fresh randomness
    timeout_s: float
    retry_s: float
    startup_s: float
    lag: int  # the engine gets the weights of `lag` steps ago


@dataclass(frozen=True)
class DataSpec:
    """data.*: the training prompts."""

    source: str
    kind: str
    split: str
    limit: int
    tokenizer: str  # "" = the model's
    instruction: str
    chat_template: bool
    max_prompt_tokens: int
    prompts_per_step: int
    epochs: int


@dataclass(frozen=True)
class RunSpec:
    """run.*: the run directory, its length and what it writes."""

    dir: str
    steps: int  # 0 = as many as the data give
    dump_every: int
    dump_tokens: int
    tensorboard: bool
    progress: bool | None  # None = a terminal decides (run.progress=auto)
    print_every: int


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str  # "" = <run dir>/checkpoints
    every: int
    keep: int


@dataclass(frozen=True)
class RewardSpec:
    workers: int
    timeout_s: float


@dataclass(frozen=True)
class TrainSpec:
    """A whole train run, validated (cisjax.train.validate.check returns it): each stage takes its section."""

    seed: int
    model_path: str
    tokenizer: str  # data.tokenizer or model.path
    runtime: runtime_lib.Runtime
    mesh: tuple  # mesh.* as (axis, size) pairs
    rules: tuple  # sharding.rules frozen (sharding.freeze)
    replay: bool  # routing.replay = "rollout" (a dense model ignores it: Run.replay)
    step: StepSpec
    advantages: AdvantageSpec
    micro_batches: int
    length_multiple: int
    publish: PublishSpec
    rollout: RolloutSpec
    perturb: Perturbation
    data: DataSpec
    run: RunSpec
    checkpoint: CheckpointSpec
    reward: RewardSpec
    eval: EvalSpec | None  # None: no eval.sets

    @property
    def correction(self) -> CorrectionSpec:
        return self.step.correction


def from_config(cfg) -> TrainSpec:
    """The TrainSpec of a ConfigDict whose fields train.validate has checked (call validate.check, which calls
    this)."""
    runtime = runtime_lib.make_runtime(
        cfg.train.precision,
        method=cfg.correction.method,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        router_dtype=cfg.model.router_dtype,
        moe_impl=cfg.model.moe_impl,
        moe_tile=int(cfg.model.moe_tile),
        remat=cfg.model.remat,
        scan_layers=bool(cfg.model.scan_layers),
    )
    tokenizer = str(cfg.data.tokenizer or cfg.model.path)
    perturb = Perturbation(
        kind=str(cfg.rollout.perturb), scale=float(cfg.rollout.perturb_scale), seed=int(cfg.rollout.perturb_seed)
    )
    step = StepSpec(
        runtime=runtime,
        temperature=float(cfg.logprobs.temperature),
        chunk_size=int(cfg.logprobs.chunk_size),
        correction=_correction(cfg.correction),
        loss=LossSpec(
            aggregation=cfg.loss.aggregation,
            clip_low=float(cfg.loss.clip_low),
            clip_high=float(cfg.loss.clip_high),
            gspo=cfg.correction.method == "gspo",
            gspo_clip_low=float(cfg.loss.gspo_clip_low),
            gspo_clip_high=float(cfg.loss.gspo_clip_high),
        ),
        optim=_optim(cfg.train),
        loss_scale=float(cfg.train.loss_scale) if runtime.precision == "fp16" else 1.0,
    )
    return TrainSpec(
        seed=int(cfg.seed),
        model_path=str(cfg.model.path),
        tokenizer=tokenizer,
        runtime=runtime,
        mesh=tuple(cfg.mesh.to_dict().items()),
        rules=sharding.freeze(sharding.rules_from_config(cfg.sharding.rules.to_dict())),
        replay=cfg.routing.replay == "rollout",
        step=step,
        advantages=AdvantageSpec(**{k: cfg.advantages[k] for k in AdvantageSpec.__dataclass_fields__}),
        micro_batches=int(cfg.train.micro_batches),
        length_multiple=int(cfg.train.length_multiple),
        publish=_publish(cfg, runtime, perturb),
        rollout=_rollout(cfg.rollout),
        perturb=perturb,
        data=DataSpec(**{k: cfg.data[k] for k in DataSpec.__dataclass_fields__}),
        run=RunSpec(
            dir=str(cfg.run.dir),
            steps=int(cfg.run.steps),
            dump_every=int(cfg.run.dump_every),
            dump_tokens=int(cfg.run.dump_tokens),
            tensorboard=bool(cfg.run.tensorboard),
            progress=None if cfg.run.progress == "auto" else cfg.run.progress == "on",
            print_every=int(cfg.run.print_every),
        ),
        checkpoint=CheckpointSpec(
            dir=str(cfg.checkpoint.dir), every=int(cfg.checkpoint.every), keep=int(cfg.checkpoint.keep)
        ),
        reward=RewardSpec(workers=int(cfg.reward.workers), timeout_s=float(cfg.reward.timeout_s)),
        eval=_eval(cfg, tokenizer) if cfg.eval.sets else None,
    )


def _correction(c) -> CorrectionSpec:
    bound = lambda x: None if x is None else float(x)  # noqa: E731  (None = the method's default; 0 is a bound)
    return CorrectionSpec(
        method=c.method,
        lam=float(c.lam),
        kappa=float(c.kappa),
        cap=float(c.cap),
        threshold=float(c.threshold),
        low=bound(c.low),
        high=bound(c.high),
    )


def _optim(t) -> OptimSpec:
    return OptimSpec(
        lr=float(t.lr),
        weight_decay=float(t.weight_decay),
        b1=float(t.b1),
        b2=float(t.b2),
        eps=float(t.eps),
        grad_clip=float(t.grad_clip),
        schedule=t.schedule,
        warmup_steps=int(t.warmup_steps),
        total_steps=int(t.total_steps),
        final_lr_ratio=float(t.final_lr_ratio),
    )


def _publish(cfg, runtime: runtime_lib.Runtime, perturb: Perturbation) -> PublishSpec:
    p, c = cfg.publish, cfg.publish.canary
    return PublishSpec(
        mode=p.mode,
        dir=str(p.dir),
        server_dir=str(p.server_dir),
        dtype=p.dtype or None,
        keep=int(p.keep),
        canary=CanarySpec(
            every=int(c.every),
            num_sequences=int(c.num_sequences),
            prompt_len=int(c.prompt_len),
            response_len=int(c.response_len),
            mean_abs=float(c.mean_abs),
            max_abs=float(c.max_abs),
            seed=int(cfg.seed),
        ),
        precision=runtime.precision,
        chunk_size=int(cfg.logprobs.chunk_size),
        perturb=perturb,
    )


def _rollout(r) -> RolloutSpec:
    return RolloutSpec(
        server=str(r.server),
        replicas=int(r.replicas),
        replica_cpus=str(r.replica_cpus),
        replica_gpus=str(r.replica_gpus),
        token=r.token or os.environ.get("CISJAX_ROLLOUT_TOKEN") or None,
        backend=r.backend,
        dtype=r.dtype,
        kv_cache_gib=r.kv_cache_gib,  # as configured: the engine takes an integer GiB count
        group_size=int(r.group_size),
        temperature=float(r.temperature),
        top_p=float(r.top_p),
        top_k=int(r.top_k),
        max_new_tokens=int(r.max_new_tokens),
        max_staleness=int(r.max_staleness),
        seed=int(r.seed),
        timeout_s=float(r.timeout_s),
        retry_s=float(r.retry_s),
        startup_s=float(r.startup_s),
        lag=int(r.lag),
    )


def _eval(cfg, tokenizer: str) -> EvalSpec:
    e = cfg.eval
    return EvalSpec(
        sets=str(e.sets),
        data=str(e.data),
        every=int(e.every),
        final=bool(e.final),
        limit=int(e.limit),
        max_new_tokens=int(e.max_new_tokens),
        prompt=e.prompt,
        grade_workers=int(e.grade_workers),
        grade_timeout_s=float(e.grade_timeout_s),
        tokenizer=tokenizer,
        instruction=cfg.data.instruction,
        chat_template=bool(cfg.data.chat_template),
    )
