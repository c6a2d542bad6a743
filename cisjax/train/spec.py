"""The run config read once: frozen, typed sections that the stages take instead of the ConfigDict."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from cisjax import runtime as runtime_lib
from cisjax import sharding
from cisjax.evaluation.in_loop import EvalSpec
from cisjax.rl.advantages import AdvantageSpec
from cisjax.rl.corrections import CorrectionSpec
from cisjax.rl.loss import LossSpec
from cisjax.rollout.tls import ClientTLS
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
    token: str | None = dataclasses.field(repr=False)  # rollout.token, else $CISJAX_ROLLOUT_TOKEN, else None
    tls: ClientTLS | None  # rollout.tls_*: None = plain text
    backend: str
    dtype: str
    kv_cache_gib: int | float  # 0 = the backend default; as configured (the engine takes whole GiB)
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
    # truncated sampling (top_p < 1 or top_k > 0) renormalised by mask replay: ask the engine for each token's
    # sampling support (sampling_mask below says when)
    sampling_mask: bool = False
    # rollout.colocated: the JAX sampler in the trainer's process, on its mesh (cisjax.engines.jax.colocated)
    colocated: bool = False
    # rollout.exact: the colocated sampler and the step on the exact path (cisjax.models.exact): q == p bit for bit
    exact: bool = False


# The engines that return each token's sampling support (rollout.proto SamplingMask); for a running server
# (rollout.server) the server says, refusing the request where its engine cannot.
MASK_BACKENDS = ("transformers", "jax", "fake")
# correction.method whose weights are 1 (no q in them): these may train on truncated samples without the support
UNWEIGHTED = ("none", "fp16")


def sampling_mask(top_p: float, top_k: int, method: str, backend: str, server: str) -> bool:
    """Whether a run asks its engine for the sampling support: it truncates, and either corrects with q or runs an
    engine that returns it (a running server is asked whenever the method weighs with q)."""
    if top_p >= 1.0 and top_k <= 0:
        return False
    return method not in UNWEIGHTED or (not server.strip() and backend in MASK_BACKENDS)


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
    rules: sharding.FrozenRules  # sharding.rules resolved: the run's one table (build, plan, publish take it)
    replay: bool  # routing.replay = "rollout" (a dense model ignores it: Run.replay)
    step: StepSpec
    advantages: AdvantageSpec
    micro_batches: int
    updates_per_batch: int  # optimizer updates (mini-batches) per rollout batch
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


def step_of(cfg) -> StepSpec:
    """The StepSpec of a ConfigDict (what the train step takes: runtime, logprobs, correction, loss, optimizer), read
    as from_config reads it; no other section is looked at, nothing checked."""
    m = cfg.model
    runtime = runtime_lib.make_runtime(
        cfg.train.precision,
        method=cfg.correction.method,
        **{
            k: m[k]
            for k in (
                "dtype",
                "param_dtype",
                "router_dtype",
                "moe_impl",
                "moe_tile",
                "attention_impl",
                "remat",
                "scan_layers",
            )
        },
    )
    return StepSpec(
        runtime=runtime,
        temperature=float(cfg.logprobs.temperature),
        chunk_size=int(cfg.logprobs.chunk_size),
        correction=section(CorrectionSpec, cfg.correction),
        loss=section(LossSpec, cfg.loss, gspo=cfg.correction.method == "gspo"),
        optim=section(OptimSpec, cfg.train),
        loss_scale=float(cfg.train.loss_scale) if runtime.precision == "fp16" else 1.0,
        proximal=proximal(cfg.train.proximal, int(cfg.train.updates_per_batch)),
        exact=bool(cfg.rollout.get("exact", False)),
    )


def from_config(cfg) -> TrainSpec:
    """The TrainSpec of a ConfigDict whose fields train.validate has checked (call validate.check, which calls
    this)."""
    m = cfg.model
    step = step_of(cfg)
    runtime = step.runtime
    tokenizer = str(cfg.data.tokenizer or m.path)
    r = cfg.rollout
    perturb = Perturbation(kind=str(r.perturb), scale=float(r.perturb_scale), seed=int(r.perturb_seed))
    canary = section(CanarySpec, cfg.publish.canary, seed=int(cfg.seed))
    return TrainSpec(
        seed=int(cfg.seed),
        model_path=str(m.path),
        tokenizer=tokenizer,
        runtime=runtime,
        mesh=tuple(cfg.mesh.to_dict().items()),
        rules=sharding.rules_from_config(cfg.sharding.rules.to_dict()),
        replay=cfg.routing.replay == "rollout",
        step=step,
        advantages=section(AdvantageSpec, cfg.advantages),
        micro_batches=int(cfg.train.micro_batches),
        updates_per_batch=int(cfg.train.updates_per_batch),
        length_multiple=int(cfg.train.length_multiple),
        publish=section(
            PublishSpec,
            cfg.publish,
            # colocated: the params swapped into the engine in memory (the last step's also exported)
            mode="colocated" if r.colocated else str(cfg.publish.mode),
            dtype=cfg.publish.dtype or None,
            canary=canary,
            precision=runtime.precision,
            chunk_size=int(cfg.logprobs.chunk_size),
            perturb=perturb,
        ),
        # the token: rollout.token, else $CISJAX_ROLLOUT_TOKEN
        rollout=section(
            RolloutSpec,
            r,
            token=r.token or os.environ.get("CISJAX_ROLLOUT_TOKEN") or None,
            # exact: a truncating row's support always reaches the trainer (its p renormalises over it)
            sampling_mask=sampling_mask(
                float(r.top_p), int(r.top_k), str(cfg.correction.method), str(r.backend), str(r.server)
            )
            or (bool(r.exact) and (float(r.top_p) < 1 or int(r.top_k) > 0)),
            tls=ClientTLS.of(r.tls_ca, r.tls_cert, r.tls_key, r.tls_server_name),
        ),
        perturb=perturb,
        data=section(DataSpec, cfg.data),
        run=section(RunSpec, cfg.run, progress=None if cfg.run.progress == "auto" else cfg.run.progress == "on"),
        checkpoint=section(CheckpointSpec, cfg.checkpoint),
        reward=section(RewardSpec, cfg.reward),
        eval=section(
            EvalSpec, cfg.eval, tokenizer=tokenizer, **{k: cfg.data[k] for k in ("instruction", "chat_template")}
        )
        if cfg.eval.sets
        else None,
    )


def proximal(value: str, updates_per_batch: int) -> str:
    """train.proximal resolved: "auto" is "step" with one optimizer update per rollout batch, else "rescore"."""
    if value == "auto":
        return "step" if updates_per_batch == 1 else "rescore"
    return str(value)


_TYPES = {"float": float, "int": int, "bool": bool, "str": str}


def section(cls, node, **given):
    """The frozen dataclass `cls` of a config section: each field from the section's field of the same name (as the
    field's declared type when that is float, int, bool or str), or from `given`."""
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            kind = _TYPES.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
            values[f.name] = node[f.name] if kind is None else kind(node[f.name])
    return cls(**values)
