"""The config read once: validate.check returns frozen, typed sections with the config's values."""

from __future__ import annotations

import dataclasses

import pytest

from cisjax import config as config_lib
from cisjax import errors
from cisjax.rollout.tls import ClientTLS
from cisjax.train import validate

INPUTS = ["--config.model.path=/m", "--config.data.source=/d.jsonl"]


def _spec(*overrides):
    return validate.check(config_lib.load(None, [*INPUTS, *overrides]))


def test_sections_hold_the_config_values():
    s = _spec("--config.correction.method=icepop", "--config.correction.low=0", "--config.data.tokenizer=/t")
    c = s.correction
    assert (c.method, c.lam, c.kappa, c.cap, c.threshold, c.low, c.high) == ("icepop", 2.3, 5e-3, 2.0, 2.0, 0.0, None)
    assert s.step.loss.kwargs() == dict(
        aggregation="token_mean", clip_low=0.2, clip_high=0.28, gspo=False, gspo_clip_low=3e-4, gspo_clip_high=4e-4
    )
    assert s.advantages.kwargs() == dict(
        reward_scale=10.0, reward_bias=-0.5, group_norm=True, group_eps=1e-5, batch_norm=True, batch_eps=1e-5
    )
    assert (s.step.optim.lr, s.step.optim.weight_decay, s.step.optim.schedule) == (3e-6, 0.01, "constant")
    assert (s.model_path, s.tokenizer, s.data.source, s.data.prompts_per_step) == ("/m", "/t", "/d.jsonl", 256)
    assert s.runtime.precision == "bf16" and s.runtime.model_kwargs() == dict(
        dtype="bfloat16",
        param_dtype="float32",
        router_dtype="float32",
        moe_impl="auto",
        moe_tile=None,  # 0 = chosen from the shapes
        attention_impl="auto",
        remat="none",
        scan_layers=True,
    )
    assert s.step.loss_scale == 1.0  # only fp16 scales the loss
    assert s.run.progress is None  # run.progress=auto: a terminal decides
    assert s.eval is None and not s.perturb.on and not s.replay
    assert (s.publish.mode, s.publish.dtype, s.publish.canary.every, s.publish.canary.seed) == (
        "disk",
        "bfloat16",
        1,
        0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.correction.lam = 1.0  # type: ignore[misc]


def test_derived_fields():
    s = _spec("--config.correction.method=fp16", "--config.train.precision=fp32", "--config.publish.dtype=")
    assert s.runtime.precision == "fp16" and s.runtime.dtype == "float16"  # the FP16 baseline forces fp16
    assert s.step.loss_scale == 1024.0 and s.publish.precision == "fp16"
    assert s.publish.dtype is None  # "" = the params' own dtype
    s = _spec("--config.correction.method=gspo", "--config.run.progress=off", "--config.eval.sets=gsm8k")
    assert s.step.loss.gspo and s.run.progress is False
    assert s.eval.sets == "gsm8k" and s.eval.tokenizer == "/m"  # the model's tokenizer when data.tokenizer is empty
    s = _spec(
        "--config.rollout.perturb=noise", "--config.rollout.perturb_scale=0.05", "--config.routing.replay=rollout"
    )
    assert s.perturb.on and s.publish.perturb == s.perturb and (s.perturb.kind, s.perturb.scale) == ("noise", 0.05)
    assert s.replay
    s = _spec("--config.rollout.kv_cache_gib=2", "--config.train.lr=1")
    assert s.rollout.kv_cache_gib == 2 and isinstance(s.rollout.kv_cache_gib, int)  # vLLM takes whole GiB
    assert s.step.optim.lr == 1.0 and isinstance(s.step.optim.lr, float)  # a float field of the spec is a float


def test_rollout_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("CISJAX_ROLLOUT_TOKEN", "from-env")
    assert _spec().rollout.token == "from-env"
    assert _spec("--config.rollout.token=from-config").rollout.token == "from-config"
    monkeypatch.delenv("CISJAX_ROLLOUT_TOKEN")
    assert _spec().rollout.token is None


def test_rollout_tls_and_the_token_kept_out_of_reprs():
    s = _spec("--config.rollout.server=h:1", "--config.rollout.token=very-secret")
    assert s.rollout.tls is None and "very-secret" not in repr(s) and "very-secret" not in repr(s.rollout)
    s = _spec(
        "--config.rollout.server=h:1",
        "--config.rollout.tls_ca=/pki/ca.pem",
        "--config.rollout.tls_cert=/pki/c.pem",
        "--config.rollout.tls_key=/pki/c.key",
        "--config.rollout.tls_server_name=rollout.internal",
    )
    assert s.rollout.tls == ClientTLS("/pki/ca.pem", "/pki/c.pem", "/pki/c.key", "rollout.internal")


@pytest.mark.parametrize(
    "proximal, updates, want",
    [("auto", 1, "step"), ("auto", 2, "rescore"), ("rescore", 1, "rescore"), ("step", 1, "step")],
)
def test_proximal_resolved_from_the_updates_per_batch(proximal, updates, want):
    s = _spec(f"--config.train.proximal={proximal}", f"--config.train.updates_per_batch={updates}")
    assert (s.step.proximal, s.updates_per_batch) == (want, updates)


def test_no_spec_for_a_bad_config():
    with pytest.raises(errors.UserError, match="correction.kappa"):
        _spec("--config.correction.kappa=2")


def test_a_loaded_config_refuses_unknown_fields():
    cfg = config_lib.load(None)
    cfg.train.lr = 1e-5  # known fields stay settable
    with pytest.raises(AttributeError):
        cfg.train.lrr = 1e-5
