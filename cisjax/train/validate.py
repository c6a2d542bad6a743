"""Whole-config validation of a train run at load: every problem of `cfg`, named by field, in one UserError."""

from __future__ import annotations

import math
import numbers

from cisjax import errors
from cisjax.data import KINDS as DATA_KINDS
from cisjax.evaluation import prompts as eval_prompts
from cisjax.evaluation import sets as eval_sets
from cisjax.models import hf_config
from cisjax.models.attention import IMPLS as ATTENTION_IMPLS
from cisjax.models.moe import IMPLS as MOE_IMPLS
from cisjax.models.transformer import REMAT_POLICIES
from cisjax.rl.corrections import DEFAULT_BOUNDS, METHODS
from cisjax.rl.loss import AGGREGATIONS
from cisjax.rollout import placement, service
from cisjax.rollout.backend import MAX_MASK_TOP_K
from cisjax.rollout.server import BACKENDS
from cisjax.rollout.tls import ClientTLS
from cisjax.runtime import PRECISIONS
from cisjax.sharding import MESH_AXES, rules_from_config
from cisjax.train import perturb
from cisjax.train import spec as spec_lib
from cisjax.train.optim import GRAD_SUM_DTYPES, SCHEDULES, STATE_DTYPES
from cisjax.train.publish import MODES as PUBLISH_MODES
from cisjax.train.step import PROXIMAL

__all__ = ["ENGINE_DTYPES", "PROGRESS", "REPLAY", "check", "problems"]

# routing.replay: none | rollout (the rollout engine's expert ids replayed in every MoE layer of the trainer).
REPLAY = ("none", "rollout")
# run.progress as the loop reads it: auto (a terminal decides) | on | off.
PROGRESS = ("auto", "on", "off")
# The embedded rollout server's engine dtypes (cisjax.rollout.server's --dtype choices).
ENGINE_DTYPES = ("bfloat16", "float32")


def check(cfg, *, inputs: bool = True) -> spec_lib.TrainSpec:
    """The config read once: raise one errors.UserError listing every problem of the train config `cfg`, else return
    its typed sections (train.spec.TrainSpec), which the stages take instead of the ConfigDict.

    Pure: reads only `cfg` (no files, no devices, no JAX calls). inputs=False skips the fields only a real run reads
    (model.path, data.source): for the benches, which build the model and the batches themselves."""
    found = problems(cfg, inputs=inputs)
    if found:
        raise errors.UserError(
            f"{len(found)} problem{'s' if len(found) > 1 else ''} in the config:\n  - " + "\n  - ".join(found)
        )
    return spec_lib.from_config(cfg)


def problems(cfg, *, inputs: bool = True) -> list[str]:
    """The problems check() reports, one message per problem, each naming its field(s)."""
    c = _Checker(cfg)
    _model(c, inputs)
    _mesh(c)
    _logprobs_and_correction(c)
    _advantages_and_loss(c)
    _train(c)
    _publish(c)
    _run_data_rollout(c, inputs)
    _eval_and_reward(c)
    return c.problems


class _Checker:
    def __init__(self, cfg):
        self.cfg, self.problems = cfg, []

    def get(self, path: str):
        node = self.cfg
        for name in path.split("."):
            node = node[name]
        return node

    def add(self, message: str) -> None:
        self.problems.append(message)

    def one_of(self, path: str, choices):
        """The field's value if it is one of `choices`, else None and a problem."""
        value = self.get(path)
        if value not in tuple(choices):
            self.add(f"{path}={value!r}: one of {', '.join(map(str, choices))}")
            return None
        return value

    def raises(self, path: str, fn, *args) -> None:
        """The code's own parser of a field: its UserError becomes a problem of `path`."""
        try:
            fn(*args)
        except errors.UserError as err:
            self.add(f"{path}={self.get(path)!r}: {err}")

    def number(
        self,
        path: str,
        *,
        low=None,
        high=None,
        low_open=False,
        high_open=False,
        integer=False,
        allow_none=False,
        why: str = "",
    ):
        """The field's value if it is a (finite, for floats) number in the range, else None and a problem."""
        value = self.get(path)
        if value is None and allow_none:
            return None
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
            self.add(f"{path}={value!r} must be {kind}")
            return None
        if not integer and not math.isfinite(value):
            self.add(f"{path}={value!r} must be finite")
            return None
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
            hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
            self.add(f"{path}={value!r} must be {' and '.join(x for x in (lo, hi) if x)}{why}")
            return None
        return value


# ----------------------------------------------------------------------------- sections


def _model(c: _Checker, inputs: bool) -> None:
    if inputs and not c.get("model.path"):
        c.add("model.path is empty: the Hugging Face model directory to train")
    for path in ("model.dtype", "model.param_dtype", "model.router_dtype"):
        c.raises(path, hf_config.dtype_of, c.get(path))
    c.one_of("model.moe_impl", MOE_IMPLS)
    c.one_of("model.attention_impl", ATTENTION_IMPLS)
    c.one_of("model.remat", tuple(REMAT_POLICIES))
    if not isinstance(c.get("model.scan_layers"), bool):
        c.add(f"model.scan_layers={c.get('model.scan_layers')!r}: True or False")
    c.number("model.moe_tile", low=0, integer=True, why=" (0 = chosen from the shapes)")


def _mesh(c: _Checker) -> None:
    # Only what needs no devices: the product against the available devices is sharding.make_mesh's.
    sizes = {a: c.get(f"mesh.{a}") for a in MESH_AXES}
    bad = [
        a for a, s in sizes.items() if isinstance(s, bool) or not isinstance(s, numbers.Integral) or (s < 1 and s != -1)
    ]
    for a in bad:
        c.add(f"mesh.{a}={sizes[a]!r} must be a positive integer or -1 (the rest of the devices)")
    rest = [a for a, s in sizes.items() if s == -1 and a not in bad]
    if len(rest) > 1:
        c.add(f"{' and '.join(f'mesh.{a}' for a in rest)} are -1: at most one mesh axis may take the rest")
    c.raises("sharding.rules", rules_from_config, c.get("sharding.rules").to_dict())


def _logprobs_and_correction(c: _Checker) -> None:
    c.number("logprobs.chunk_size", low=1, integer=True)
    t_train = c.number("logprobs.temperature", low=0, low_open=True)
    c.one_of("routing.replay", REPLAY)
    c.number("logprobs.top_k", low=0, integer=True)
    t_roll = c.number(
        "rollout.temperature",
        low=0,
        low_open=True,
        why=" (the trainer computes p at this temperature; 0 = greedy has no logprobs)",
    )
    if t_train is not None and t_roll is not None and float(t_train) != float(t_roll):
        c.add(
            f"rollout.temperature={t_roll} but logprobs.temperature={t_train}: the trainer must score at the "
            "sampling temperature"
        )

    method = c.get("correction.method")
    c.one_of("correction.method", METHODS)
    c.number("correction.lam", low=0)
    c.number("correction.kappa", low=0, high=1)
    c.number("correction.cap", low=0, low_open=True)
    threshold = c.get("correction.threshold")  # inf allowed: KPop never masks
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold >= 0:
        c.add(f"correction.threshold={threshold!r} must be a number >= 0 (inf: never mask)")
    low = c.number("correction.low", low=0, allow_none=True, why=" (None: the method's default)")
    high = c.number("correction.high", low=0, low_open=True, allow_none=True, why=" (None: the method's default)")
    if method in DEFAULT_BOUNDS:
        d_low, d_high = DEFAULT_BOUNDS[method]
        eff_low = d_low if c.get("correction.low") is None else low
        eff_high = d_high if c.get("correction.high") is None else high
        if eff_low is not None and eff_high is not None and eff_low > eff_high:
            c.add(
                f"correction.low={c.get('correction.low')} > correction.high={c.get('correction.high')} "
                f"(None = {method}'s default [{d_low}, {d_high}]): the kept range is empty"
            )
    elif method in METHODS:
        for path in ("correction.low", "correction.high"):
            if c.get(path) is not None:
                c.add(
                    f"{path}={c.get(path)} is set but correction.method={method} does not read it (only "
                    f"{', '.join(DEFAULT_BOUNDS)} do); set it to None"
                )


def _advantages_and_loss(c: _Checker) -> None:
    c.number("advantages.reward_scale", low=0, low_open=True)
    c.number("advantages.reward_bias")
    for what in ("group", "batch"):
        on = c.get(f"advantages.{what}_norm")
        # eps 0 makes a group (batch) of equal rewards (advantages) 0 / 0 = NaN
        c.number(
            f"advantages.{what}_eps",
            low=0,
            low_open=bool(on),
            why=f" with advantages.{what}_norm on (a group of equal values gives 0 / 0)" if on else "",
        )
    group = c.number("rollout.group_size", low=1, integer=True)
    if group is not None and group < 2 and c.get("advantages.group_norm"):
        c.add(
            f"rollout.group_size={group} with advantages.group_norm: a group needs >= 2 samples, or every "
            "advantage is 0"
        )

    c.one_of("loss.aggregation", AGGREGATIONS)
    c.number("loss.clip_low", low=0, high=1, high_open=True)
    c.number("loss.clip_high", low=0)
    c.number("loss.gspo_clip_low", low=0, high=1, high_open=True)
    c.number("loss.gspo_clip_high", low=0)
    kl = c.number("loss.kl_coef", low=0)
    if kl:
        c.add(
            f"loss.kl_coef={kl}: a KL term needs reference-policy logprobs, which the trainer does not compute "
            "(only 0 is supported)"
        )


def _train(c: _Checker) -> None:
    c.number("train.lr", low=0)
    c.number("train.weight_decay", low=0)
    c.number("train.b1", low=0, high=1, high_open=True)
    c.number("train.b2", low=0, high=1, high_open=True)
    c.number("train.eps", low=0, low_open=True)
    c.number("train.grad_clip", low=0, why=" (0 = off)")
    c.one_of("train.schedule", SCHEDULES)
    warmup = c.number("train.warmup_steps", low=0, integer=True)
    total = c.number("train.total_steps", low=0, integer=True)
    c.number("train.final_lr_ratio", low=0, high=1)
    c.one_of("train.optimizer_state_dtype", STATE_DTYPES)
    c.one_of("train.grad_sum_dtype", GRAD_SUM_DTYPES)
    if not isinstance(c.get("train.offload_optimizer"), bool):
        c.add(f"train.offload_optimizer={c.get('train.offload_optimizer')!r}: True or False")
    schedule = c.get("train.schedule")
    decays = schedule in SCHEDULES and schedule != "constant"
    if decays and warmup is not None and total is not None and total <= warmup:
        c.add(f"train.schedule={schedule} needs train.total_steps ({total}) > train.warmup_steps ({warmup})")
    steps = c.get("run.steps")
    if (
        decays
        and total is not None
        and isinstance(steps, numbers.Integral)
        and steps > total
        and c.get("train.final_lr_ratio") == 0
    ):
        c.add(
            f"run.steps={steps} > train.total_steps={total} with train.schedule={schedule} and "
            "train.final_lr_ratio=0: the steps past the horizon train at learning rate 0"
        )
    c.number("train.micro_batches", low=1, integer=True)
    updates = c.number("train.updates_per_batch", low=1, integer=True)
    if c.one_of("train.proximal", ("auto", *PROXIMAL)) == "step" and updates is not None and updates > 1:
        c.add(
            f"train.proximal=step with train.updates_per_batch={updates}: the step's own forward is the proximal "
            "policy only for a rollout batch's first update (the later ones start from params it has moved); set "
            "train.proximal=rescore (or auto)"
        )
    c.number("train.length_multiple", low=1, integer=True)
    c.one_of("train.precision", PRECISIONS)
    if c.get("train.precision") == "fp16" or c.get("correction.method") == "fp16":
        c.number("train.loss_scale", low=0, low_open=True, why=" (fp16 precision's static loss scale)")
    c.number("checkpoint.every", low=0, integer=True, why=" (0 = never)")
    c.number("checkpoint.keep", low=0, integer=True, why=" (0 = keep all)")


def _truncation(c: _Checker, top_p, top_k) -> None:
    """Truncated sampling is corrected by mask replay: the engine must return each token's support, bounded by
    top_k; a method without q in its weights may train on an engine that cannot."""
    if top_p is None or top_k is None or (top_p >= 1 and top_k <= 0):
        return
    method, backend, server = c.get("correction.method"), c.get("rollout.backend"), str(c.get("rollout.server"))
    if not spec_lib.sampling_mask(top_p, top_k, str(method), str(backend), server):
        return  # an unweighted method on an engine without the support: trained as sampled
    if not 0 < top_k <= MAX_MASK_TOP_K:
        c.add(
            f"rollout.top_p={top_p} / rollout.top_k={top_k}: truncated sampling is corrected by replaying each token's "
            f"sampling support, which needs rollout.top_k in [1, {MAX_MASK_TOP_K}] to bound it (top_p alone may keep "
            "the whole vocabulary)"
        )
    if not server.strip() and backend not in spec_lib.MASK_BACKENDS:
        c.add(
            f"rollout.top_p={top_p} / rollout.top_k={top_k} with rollout.backend={backend} and "
            f"correction.method={method}: the engine returns q after the truncation while the trainer's p spans the "
            "whole vocabulary (k = p/q biased low on every token); correcting it needs each token's sampling "
            f"support, which the {backend} engine does not return yet. Use rollout.backend in "
            f"{', '.join(spec_lib.MASK_BACKENDS)}, sample with rollout.top_p=1 and rollout.top_k=0, or train with "
            f"correction.method in {', '.join(spec_lib.UNWEIGHTED)}"
        )


def _publish(c: _Checker) -> None:
    c.one_of("publish.mode", PUBLISH_MODES)
    if c.get("publish.dtype"):
        c.raises("publish.dtype", hf_config.dtype_of, c.get("publish.dtype"))
    c.number("publish.keep", low=0, integer=True, why=" (0 = keep all)")
    if not isinstance(c.get("publish.delta"), bool):
        c.add(f"publish.delta={c.get('publish.delta')!r}: True or False")
    every = c.number("publish.canary.every", low=0, integer=True, why=" (0 = never)")
    if every:
        for what in ("num_sequences", "prompt_len", "response_len"):
            c.number(f"publish.canary.{what}", low=1, integer=True)
    for what in ("mean_abs", "max_abs"):
        c.number(f"publish.canary.{what}", low=0, why=" (0 = unchecked)")


def _run_data_rollout(c: _Checker, inputs: bool) -> None:
    c.number("seed", integer=True)
    c.number("run.steps", low=0, integer=True, why=" (0 = as many as the data give)")
    c.number("run.dump_every", low=0, integer=True, why=" (0 = never)")
    c.number("run.dump_tokens", low=0, integer=True, why=" (0 = all)")
    c.one_of("run.progress", PROGRESS)
    c.number("run.print_every", low=1, integer=True)

    if inputs and not c.get("data.source"):
        c.add("data.source is empty: a .jsonl/.parquet file or directory, or hf:<dataset>[:<config>]")
    c.one_of("data.kind", DATA_KINDS)
    limit = c.number("data.limit", low=0, integer=True, why=" (0 = all)")
    c.number("data.max_prompt_tokens", low=0, integer=True, why=" (0 = no limit)")
    per_step = c.number("data.prompts_per_step", low=1, integer=True)
    c.number("data.epochs", low=1, integer=True)
    if limit and per_step and limit < per_step:  # the stream drops incomplete batches
        c.add(f"data.limit={limit} < data.prompts_per_step={per_step}: no complete batch, every step would be dropped")

    c.one_of("rollout.backend", BACKENDS)
    c.one_of("rollout.dtype", ENGINE_DTYPES)
    _colocated(c)
    _exact(c)
    c.number("rollout.kv_cache_gib", low=0)
    top_p = c.number("rollout.top_p", low=0, high=1, low_open=True)
    top_k = c.number("rollout.top_k", low=0, integer=True, why=" (0 = off)")
    _truncation(c, top_p, top_k)
    c.number("rollout.max_new_tokens", low=1, integer=True)
    c.number("rollout.max_staleness", low=0, integer=True, why=" (0 = synchronous)")
    c.number("rollout.seed", low=-1, integer=True, why=" (-1 = fresh randomness)")
    for what in ("timeout_s", "retry_s", "startup_s"):
        c.number(f"rollout.{what}", low=0, low_open=True)
    c.raises("rollout.server", service.parse_servers, c.get("rollout.server"))
    replicas = c.number("rollout.replicas", low=1, integer=True, why=" (1 = one embedded server)")
    if replicas and replicas > 1 and str(c.get("rollout.server")).strip():
        c.add(
            f"rollout.server={c.get('rollout.server')!r} and rollout.replicas={replicas}: embedded replicas are for "
            "rollout.server=''; list running servers in rollout.server instead"
        )
    tls = [c.get(f"rollout.tls_{k}") for k in ("ca", "cert", "key", "server_name")]
    c.raises("rollout.tls_ca", ClientTLS.of, *tls)  # the files are read by the run (loop.train), before the model
    if any(tls) and not str(c.get("rollout.server")).strip():
        c.add("rollout.tls_* is for running servers (rollout.server); the embedded ones bind localhost in plain text")
    for what in ("cpus", "gpus"):  # the syntax here; cores and GPUs are counted where the replicas start
        spec = str(c.get(f"rollout.replica_{what}")).strip()
        if spec not in ("", "none"):
            c.raises(f"rollout.replica_{what}", _replica_sets, spec, what == "gpus", replicas)
    # controlled mismatch (cisjax.train.perturb, the loop's lag)
    c.number("rollout.perturb_scale", low=0)
    c.number("rollout.perturb_seed", low=0, integer=True)
    c.raises("rollout.perturb", perturb.check, c.get("rollout.perturb"), c.get("rollout.perturb_scale"))
    if c.get("rollout.perturb") != "none" and c.get("rollout.server"):
        c.add(
            f"rollout.perturb={c.get('rollout.perturb')!r} with rollout.server={c.get('rollout.server')!r}: version 0 "
            "is the weights the engine starts on, so a perturbed run starts its own (embedded) server"
        )
    if c.get("rollout.perturb") != "none" and c.get("eval.sets") and c.get("eval.every"):
        c.add(
            f"rollout.perturb={c.get('rollout.perturb')!r} with eval.every={c.get('eval.every')}: the engine holds the "
            "perturbed copy until the last step, which publishes the trainer's own weights; evaluate at the end only "
            "(eval.every=0)"
        )
    lag = c.number("rollout.lag", low=0, integer=True, why=" (0 = the engine gets each step's weights)")
    stale = c.get("rollout.max_staleness")
    if lag and isinstance(stale, int) and lag > stale:
        c.add(f"rollout.lag={lag} > rollout.max_staleness={stale}: lagged rollouts would break the staleness bound")
    if lag and c.get("eval.sets") and c.get("eval.every"):
        c.add(
            f"rollout.lag={lag} with eval.every={c.get('eval.every')}: the engine holds older weights than the step's; "
            "evaluate at the end only (eval.every=0), where the final weights are published"
        )


def _colocated(c: _Checker) -> None:
    """rollout.colocated: the JAX sampler in the trainer's process, so no server, replicas or delta to ask for."""
    on = c.get("rollout.colocated")
    if not isinstance(on, bool):
        c.add(f"rollout.colocated={on!r}: True or False")
        return
    if not on:
        return
    if c.get("rollout.backend") != "jax":
        c.add(f"rollout.colocated with rollout.backend={c.get('rollout.backend')!r}: the colocated engine is jax")
    if str(c.get("rollout.server")).strip():
        c.add(f"rollout.colocated with rollout.server={c.get('rollout.server')!r}: one or the other")
    if c.get("rollout.replicas") != 1:
        c.add(f"rollout.colocated with rollout.replicas={c.get('rollout.replicas')!r}: one engine, the trainer's")
    if c.get("publish.delta") is True:
        c.add("rollout.colocated with publish.delta: nothing travels, the params are swapped in memory")


def _exact(c: _Checker) -> None:
    """rollout.exact: the colocated sampler and the train step on the exact path (cisjax.models.exact), so nothing
    that makes q and p differ on purpose, and only what that path covers."""
    on = c.get("rollout.exact")
    if not isinstance(on, bool):
        c.add(f"rollout.exact={on!r}: True or False")
        return
    if not on:
        return
    if c.get("rollout.colocated") is not True:
        c.add("rollout.exact needs rollout.colocated=True: the exact sampler runs the trainer's model in its process")
    if c.get("routing.replay") != "none":
        c.add(
            f"rollout.exact with routing.replay={c.get('routing.replay')!r}: the exact path routes alike on both sides"
        )
    if c.get("rollout.perturb") != "none" or c.get("rollout.lag"):
        c.add("rollout.exact with rollout.perturb or rollout.lag: these make q differ from p on purpose")
    if c.get("mesh.tensor") != 1 or c.get("mesh.expert") != 1:
        c.add("rollout.exact with mesh.tensor or mesh.expert > 1: the exact path shards rows only (data, fsdp)")
    if c.get("train.precision") not in ("fp32", "bf16") or c.get("correction.method") == "fp16":
        c.add(
            f"rollout.exact with train.precision={c.get('train.precision')!r}: the exact path computes in fp32 or bf16"
        )


def _replica_sets(spec: str, gpus: bool, replicas) -> None:
    sets = placement.parse_sets(spec, "sets", gpus=gpus)
    if isinstance(replicas, int) and len(sets) != replicas:
        raise errors.UserError(f"{len(sets)} sets for rollout.replicas={replicas}")


def _eval_and_reward(c: _Checker) -> None:
    c.number("reward.workers", low=1, integer=True)
    c.number("reward.timeout_s", low=0, low_open=True)
    if not c.get("eval.sets"):
        return
    c.raises("eval.sets", eval_sets.parse_sets, c.get("eval.sets"))
    c.raises("eval.data", eval_sets.parse_data, c.get("eval.data"))
    c.one_of("eval.prompt", eval_prompts.STYLES)
    every = c.number("eval.every", low=0, integer=True, why=" (0 = only the final evaluation)")
    if every == 0 and not c.get("eval.final"):
        c.add(f"eval.sets={c.get('eval.sets')!r} but eval.every=0 and eval.final=False: nothing would be evaluated")
    c.number("eval.limit", low=0, integer=True, why=" (0 = all)")
    c.number("eval.max_new_tokens", low=1, integer=True)
    c.number("eval.grade_workers", low=1, integer=True)
    c.number("eval.grade_timeout_s", low=0, low_open=True)
