"""cisjax.train.validate: the whole train config checked at load, every problem named by field in one UserError."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cisjax import config as config_lib
from cisjax import errors
from cisjax.train import validate

REPO = Path(__file__).resolve().parents[2]
INPUTS = ["--config.model.path=/models/m", "--config.data.source=/data/train.jsonl"]


def _cfg(*overrides):
    return config_lib.load(None, [*INPUTS, *overrides])


def _problems(*overrides):
    return validate.problems(_cfg(*overrides))


def test_base_with_inputs_is_valid():
    assert _problems() == []
    validate.check(_cfg())


# (overrides, text the single problem must contain: the field(s) it names)
RULES = [
    # enums, against the code's own tuples
    (["--config.correction.method=cis2"], "correction.method='cis2'"),
    (["--config.train.precision=int8"], "train.precision='int8'"),
    (["--config.train.schedule=exponential"], "train.schedule='exponential'"),
    (["--config.train.optimizer_state_dtype=float16"], "train.optimizer_state_dtype='float16'"),
    (["--config.loss.aggregation=sum"], "loss.aggregation='sum'"),
    (["--config.publish.mode=nfs"], "publish.mode='nfs'"),
    (["--config.model.moe_impl=megablocks"], "model.moe_impl='megablocks'"),
    (["--config.run.progress=yes"], "run.progress='yes'"),
    (["--config.data.kind=aime"], "data.kind='aime'"),
    (["--config.rollout.backend=sglang"], "rollout.backend='sglang'"),
    (["--config.rollout.dtype=float16"], "rollout.dtype='float16'"),
    (["--config.rollout.perturb=int2"], "rollout.perturb='int2'"),
    (["--config.rollout.perturb=noise"], "rollout.perturb='noise': rollout.perturb=noise needs"),
    (["--config.rollout.perturb_scale=0.1"], "only for rollout.perturb=noise"),
    (["--config.rollout.perturb=int8", "--config.rollout.server=h:1"], "a perturbed run starts its own"),
    (["--config.rollout.lag=-1"], "rollout.lag=-1"),
    (["--config.rollout.lag=3"], "rollout.lag=3 > rollout.max_staleness=2"),
    (
        ["--config.rollout.lag=1", "--config.eval.sets=gsm8k", "--config.eval.every=2"],
        "rollout.lag=1 with eval.every=2",
    ),
    (
        ["--config.rollout.perturb=int4", "--config.eval.sets=gsm8k", "--config.eval.every=2"],
        "rollout.perturb='int4' with eval.every=2",
    ),
    (["--config.model.dtype=fp8"], "model.dtype='fp8'"),
    (["--config.publish.dtype=int8"], "publish.dtype='int8'"),
    (["--config.eval.sets=gsm8k,aime"], "eval.sets='gsm8k,aime'"),
    (["--config.eval.sets=gsm8k", "--config.eval.prompt=fancy"], "eval.prompt='fancy'"),
    (["--config.sharding.rules.embed=model"], "sharding.rules"),
    # ranges
    (["--config.train.lr=-1e-6"], "train.lr=-1e-06 must be >= 0"),
    (["--config.train.lr=nan"], "train.lr=nan must be finite"),
    (["--config.train.warmup_steps=-1"], "train.warmup_steps=-1"),
    (["--config.train.grad_clip=-1"], "train.grad_clip=-1.0"),
    (["--config.train.final_lr_ratio=1.5"], "train.final_lr_ratio=1.5"),
    (["--config.train.b2=1.0"], "train.b2=1.0 must be >= 0 and < 1"),
    (["--config.train.eps=0"], "train.eps=0.0"),
    (["--config.train.micro_batches=0"], "train.micro_batches=0"),
    (["--config.train.updates_per_batch=0"], "train.updates_per_batch=0"),
    (["--config.train.proximal=both"], "train.proximal='both': one of auto, rescore, step"),
    (
        ["--config.train.updates_per_batch=2", "--config.train.proximal=step"],
        "train.proximal=step with train.updates_per_batch=2: the step's own forward is the proximal policy only",
    ),
    (["--config.train.precision=fp16", "--config.train.loss_scale=0"], "train.loss_scale=0.0"),
    (["--config.correction.method=fp16", "--config.train.loss_scale=-1"], "train.loss_scale=-1.0"),
    (["--config.loss.clip_low=1.0"], "loss.clip_low=1.0"),
    (["--config.loss.clip_high=-0.1"], "loss.clip_high=-0.1"),
    (["--config.loss.gspo_clip_high=-1"], "loss.gspo_clip_high=-1.0"),
    (["--config.correction.lam=-1"], "correction.lam=-1.0"),
    (["--config.correction.kappa=2"], "correction.kappa=2.0"),
    (["--config.correction.cap=0"], "correction.cap=0.0"),
    (["--config.correction.threshold=-1"], "correction.threshold=-1.0"),
    (["--config.correction.method=icepop", "--config.correction.low=-0.5"], "correction.low=-0.5"),
    (["--config.correction.method=icepop", "--config.correction.high=0"], "correction.high=0.0"),
    (["--config.publish.canary.every=-1"], "publish.canary.every=-1"),
    (["--config.publish.canary.mean_abs=-0.1"], "publish.canary.mean_abs=-0.1"),
    (["--config.publish.canary.max_abs=nan"], "publish.canary.max_abs=nan"),
    (["--config.publish.canary.num_sequences=0"], "publish.canary.num_sequences=0"),
    (["--config.publish.keep=-1"], "publish.keep=-1"),
    (["--config.logprobs.chunk_size=0"], "logprobs.chunk_size=0"),
    (["--config.data.prompts_per_step=0"], "data.prompts_per_step=0"),
    (["--config.data.epochs=0"], "data.epochs=0"),
    (["--config.rollout.group_size=0", "--config.advantages.group_norm=false"], "rollout.group_size=0"),
    (["--config.rollout.top_p=0"], "rollout.top_p=0.0"),
    (["--config.rollout.top_k=20"], "rollout.top_p=1.0 / rollout.top_k=20 with rollout.backend=vllm and correction"),
    (
        ["--config.rollout.top_p=0.8", "--config.rollout.backend=transformers"],
        "rollout.top_p=0.8 / rollout.top_k=0: truncated sampling is corrected by replaying each token's sampling "
        "support, which needs rollout.top_k in [1, 1024]",
    ),
    (["--config.rollout.max_new_tokens=0"], "rollout.max_new_tokens=0"),
    (["--config.rollout.max_staleness=-1"], "rollout.max_staleness=-1"),
    (["--config.rollout.seed=-2"], "rollout.seed=-2"),
    (["--config.rollout.timeout_s=0"], "rollout.timeout_s=0.0"),
    (["--config.rollout.replicas=0"], "rollout.replicas=0 must be >= 1"),
    (["--config.rollout.server=host:1,host"], "rollout.server='host:1,host': 'host' is not HOST:PORT"),
    (["--config.rollout.server=a:1,a:1"], "rollout.server='a:1,a:1': a server is listed twice"),
    (
        ["--config.rollout.server=a:1,b:2", "--config.rollout.replicas=2"],
        "rollout.server='a:1,b:2' and rollout.replicas=2: embedded replicas are for rollout.server=''",
    ),
    (
        ["--config.rollout.server=a:1", "--config.rollout.tls_cert=c.pem", "--config.rollout.tls_key=k.pem"],
        "rollout.tls_ca='': a TLS client certificate or server name needs the CA",
    ),
    (
        ["--config.rollout.server=a:1", "--config.rollout.tls_ca=ca.pem", "--config.rollout.tls_cert=c.pem"],
        "needs its key",
    ),
    (["--config.rollout.tls_ca=ca.pem"], "rollout.tls_* is for running servers (rollout.server)"),
    (["--config.run.steps=-1"], "run.steps=-1"),
    (["--config.run.print_every=0"], "run.print_every=0"),
    (["--config.checkpoint.every=-1"], "checkpoint.every=-1"),
    (["--config.reward.workers=0"], "reward.workers=0"),
    (["--config.eval.sets=gsm8k", "--config.eval.every=-1"], "eval.every=-1"),
    (["--config.mesh.tensor=0"], "mesh.tensor=0"),
    (["--config.mesh.data=-1"], "mesh.data and mesh.fsdp are -1"),
    (["--config.advantages.reward_scale=0"], "advantages.reward_scale=0.0"),
    (["--config.advantages.group_eps=0"], "advantages.group_eps=0.0 must be > 0 with advantages.group_norm"),
    (["--config.advantages.batch_eps=0"], "advantages.batch_eps=0.0 must be > 0 with advantages.batch_norm"),
    (["--config.logprobs.temperature=0"], "logprobs.temperature=0.0 must be > 0"),
    (["--config.rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
    # cross-field
    (
        ["--config.rollout.temperature=0.7"],
        "rollout.temperature=0.7 but logprobs.temperature=1.0: the trainer must score at the sampling temperature",
    ),
    (
        ["--config.advantages.group_norm=true", "--config.rollout.group_size=1"],
        "rollout.group_size=1 with advantages.group_norm",
    ),
    (
        ["--config.train.schedule=cosine", "--config.train.warmup_steps=10", "--config.train.total_steps=10"],
        "train.schedule=cosine needs train.total_steps (10) > train.warmup_steps (10)",
    ),
    (
        ["--config.train.schedule=linear", "--config.train.total_steps=50", "--config.run.steps=80"],
        "run.steps=80 > train.total_steps=50 with train.schedule=linear and train.final_lr_ratio=0",
    ),
    (["--config.loss.kl_coef=0.01"], "loss.kl_coef=0.01"),
    (["--config.correction.method=icepop", "--config.correction.low=6"], "correction.low=6.0 > correction.high=None"),
    (
        ["--config.correction.method=seq_mis", "--config.correction.low=1.5", "--config.correction.high=1.2"],
        "correction.low=1.5 > correction.high=1.2",
    ),
    (
        ["--config.correction.method=cis", "--config.correction.low=0.5"],
        "correction.low=0.5 is set but correction.method=cis",
    ),
    (["--config.data.limit=10", "--config.data.prompts_per_step=16"], "data.limit=10 < data.prompts_per_step=16"),
    (
        ["--config.eval.sets=gsm8k", "--config.eval.every=0", "--config.eval.final=false"],
        "eval.every=0 and eval.final=False",
    ),
    (["--config.model.path="], "model.path is empty"),
    (["--config.data.source="], "data.source is empty"),
]


@pytest.mark.parametrize("overrides, named", RULES, ids=[r[1][:50] for r in RULES])
def test_each_rule_names_its_field(overrides, named):
    found = _problems(*overrides)
    assert len(found) == 1 and named in found[0], found
    with pytest.raises(errors.UserError, match=re.escape(named)):
        validate.check(_cfg(*overrides))


def test_a_value_of_the_wrong_type_is_named():
    cfg = _cfg()
    cfg.train.lr = None  # ml_collections accepts None on any field
    cfg.rollout.group_size = None
    found = validate.problems(cfg)
    assert sorted(found) == ["rollout.group_size=None must be an integer", "train.lr=None must be a number"]


def test_every_problem_is_reported_together():
    cfg = _cfg(
        "--config.correction.method=cis2",
        "--config.train.lr=-1",
        "--config.rollout.temperature=0.7",
        "--config.publish.mode=nfs",
        "--config.loss.kl_coef=0.1",
        "--config.run.progress=yes",
    )
    with pytest.raises(errors.UserError) as info:
        validate.check(cfg)
    text = str(info.value)
    assert text.startswith("6 problems in the config:")
    for field in (
        "correction.method",
        "train.lr",
        "rollout.temperature",
        "publish.mode",
        "loss.kl_coef",
        "run.progress",
    ):
        assert field in text


def test_inputs_false_skips_the_paths_only():
    cfg = config_lib.load(None)
    assert len(validate.problems(cfg)) == 2
    validate.check(cfg, inputs=False)
    cfg.train.precision = "int8"
    with pytest.raises(errors.UserError, match="train.precision"):
        validate.check(cfg, inputs=False)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")), ids=lambda p: p.name)
def test_every_config_file_is_valid(path):
    """Every configs/ file validates; the experiment files leave model.path to the command line."""
    cfg = config_lib.load(path)
    validate.check(cfg, inputs=False)
    validate.check(config_lib.load(path, INPUTS))


# ----------------------------------------------------------------------------- correction.low/high: None = default


def _hparams(cfg) -> dict:
    return validate.check(cfg).correction.hparams()


@pytest.mark.parametrize("method", ["none", "fp16"])
def test_truncated_sampling_trains_without_weights(method):
    """top-p / top-k rollouts on an engine without the sampling support: refused with a q-weighted correction
    (above), allowed where the weights are 1 (trained as sampled, no support asked for)."""
    over = (f"--config.correction.method={method}", "--config.rollout.top_p=0.8", "--config.rollout.top_k=20")
    assert _problems(*over) == []
    assert not validate.check(_cfg(*over)).rollout.sampling_mask


@pytest.mark.parametrize(
    "over, mask",
    [
        (("--config.rollout.backend=transformers", "--config.rollout.top_p=0.8", "--config.rollout.top_k=20"), True),
        (("--config.rollout.backend=jax", "--config.rollout.top_p=0.8", "--config.rollout.top_k=20"), True),
        (
            ("--config.rollout.backend=transformers", "--config.correction.method=none", "--config.rollout.top_k=5"),
            True,
        ),
        (("--config.rollout.server=h:1", "--config.rollout.top_p=0.9", "--config.rollout.top_k=64"), True),
        (("--config.rollout.server=h:1", "--config.correction.method=none", "--config.rollout.top_k=64"), False),
        (("--config.rollout.backend=transformers",), False),
    ],
)
def test_truncated_sampling_asks_for_the_support(over, mask):
    """Mask replay: the engines that return the support (or a running server, which refuses when its engine cannot)
    are asked for it whenever the distribution is cut."""
    assert _problems(*over) == []
    assert validate.check(_cfg(*over)).rollout.sampling_mask is mask


def test_correction_bounds_none_is_the_default_and_zero_is_a_bound():
    cfg = _cfg("--config.correction.method=icepop")
    kw = _hparams(cfg)
    assert kw["low"] is None and kw["high"] is None  # the method's default

    cfg = _cfg("--config.correction.method=icepop", "--config.correction.low=0")
    kw = _hparams(cfg)
    assert kw["low"] == 0.0 and isinstance(kw["low"], float) and kw["high"] is None

    cfg = config_lib.apply_overrides(cfg, ["--config.correction.low=None", "--config.correction.high=3"])
    kw = _hparams(cfg)
    assert kw["low"] is None and kw["high"] == 3.0


def test_icepop_low_zero_keeps_small_ratios():
    """low=0 reaches the operator: a token with k = 0.1 is kept (the default 0.5 masks it)."""
    import numpy as np

    from cisjax.rl import corrections

    lp = np.log(np.asarray([[0.1, 0.5]], np.float32))  # k = p / q = 0.1 and 0.5
    lq = np.log(np.asarray([[1.0, 1.0]], np.float32))
    mask = np.ones((1, 2), bool)
    default = corrections.correction("icepop", lp, lq, mask, **_hparams(_cfg("--config.correction.method=icepop")))
    zero = corrections.correction(
        "icepop",
        lp,
        lq,
        mask,
        **_hparams(_cfg("--config.correction.method=icepop", "--config.correction.low=0")),
    )
    np.testing.assert_allclose(np.asarray(default.weights_BxT), [[0.0, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(zero.weights_BxT), [[0.1, 0.5]], rtol=1e-6)


def test_nullable_overrides():
    cfg = config_lib.load(None, ["--config.correction.low=0"])
    assert cfg.correction.low == 0.0 and isinstance(cfg.correction.low, float)
    for word in ("None", "none", "null"):
        assert config_lib.apply_overrides(cfg, [f"--config.correction.low={word}"]).correction.low is None
    assert config_lib.apply_overrides(cfg, ["--config.correction.low=0.25"]).correction.low == 0.25
    with pytest.raises(errors.UserError, match="correction.low"):
        config_lib.load(None, ["--config.correction.low=half"])


def test_check_touches_no_device():
    """check() is pure: with no usable JAX platform it still runs (a device query would fail)."""
    code = (
        "from cisjax import config; from cisjax.train import validate\n"
        "validate.check(config.load(None), inputs=False)\n"
        "print('ok')"
    )
    env = dict(os.environ, JAX_PLATFORMS="no_such_platform", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_train_checks_before_creating_anything(tmp_path):
    """loop.train refuses a bad config before the run directory, the model or the server."""
    from cisjax.train import loop

    run_dir = tmp_path / "run"
    cfg = _cfg(f"--config.run.dir={run_dir}", "--config.rollout.temperature=0.7", "--config.publish.mode=nfs")
    with pytest.raises(
        errors.UserError, match=r"2 problems in the config:(.|\n)*rollout.temperature=0.7(.|\n)*publish.mode"
    ):
        loop.train(cfg)
    assert not run_dir.exists()


def test_train_reads_the_tls_files_before_the_run_directory(tmp_path):
    from cisjax.train import loop

    run_dir = tmp_path / "run"
    cfg = _cfg(
        f"--config.run.dir={run_dir}", "--config.rollout.server=h:1", f"--config.rollout.tls_ca={tmp_path}/no.pem"
    )
    with pytest.raises(errors.MissingInput, match="rollout.tls_ca .*no.pem: no such file"):
        loop.train(cfg)
    assert not run_dir.exists()
