"""Config files and --config.x=y overrides."""

import pytest

from cisjax import config, errors


def test_base_loads_and_overrides_typed():
    c = config.load(
        None,
        [
            "--config.mesh.fsdp=2",
            "--config.model.dtype=float32",
            "--config.logprobs.temperature=0.5",
            "--config.sharding.rules.embed=none",
            "--config.sharding.rules.batch=('data','fsdp')",
        ],
    )
    assert c.mesh.fsdp == 2 and isinstance(c.mesh.fsdp, int)
    assert c.model.dtype == "float32"
    assert c.logprobs.temperature == 0.5
    assert c.sharding.rules.embed == "none"
    assert c.sharding.rules.batch == ("data", "fsdp")


def test_unknown_field_is_an_error():
    with pytest.raises(errors.UserError, match="unknown config field 'mesh.fsdpp'"):
        config.load(None, ["--config.mesh.fsdpp=2"])
    with pytest.raises(errors.UserError, match="unknown config field 'nope.x'"):
        config.load(None, ["--config.nope.x=1"])


def test_bad_value_is_an_error():
    with pytest.raises(errors.UserError, match="mesh.fsdp"):
        config.load(None, ["--config.mesh.fsdp=abc"])
    with pytest.raises(ValueError, match="boolean"):
        config.apply_overrides(_flag_config(), ["--config.flag=maybe"])


def _flag_config():
    import ml_collections

    return ml_collections.ConfigDict({"flag": False})


def test_experiment_file_builds_on_base(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(
        "from cisjax.config import default_config_path, load_file\n"
        "def get_config():\n"
        "    c = load_file(default_config_path())\n"
        "    c.mesh.tensor = 2\n"
        "    return c\n"
    )
    c = config.load(exp, ["--config.seed=3"])
    assert c.mesh.tensor == 2 and c.seed == 3


def test_missing_file():
    with pytest.raises(errors.MissingInput):
        config.load("does/not/exist.py")


def test_every_base_field_is_commented():
    """configs/base.py documents every field: each assignment line carries a comment."""
    src = config.default_config_path().read_text().splitlines()
    fields = [ln for ln in src if ln.strip().startswith("c.") and "=" in ln and "ConfigDict()" not in ln]
    assert fields and all("#" in ln for ln in fields), [ln for ln in fields if "#" not in ln]


def test_experiment_arms():
    """`FILE.py:ARM` passes the arm to get_config: the paper's configs take `<method>[+replay]`."""
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "configs"
    for arm, method, replay in [
        ("cis", "cis", "none"),
        ("cis+replay", "cis", "rollout"),
        ("tis+replay", "tis", "rollout"),
        ("none+replay", "none", "rollout"),
    ]:
        for name in ("qwen15_moe_a27b", "deepseek_v2_lite", "qwen3_30b_a3b", "demo_cpu"):
            cfg = config.load(f"{configs}/{name}.py:{arm}")
            assert (cfg.correction.method, cfg.routing.replay) == (method, replay), (name, arm)
    cfg = config.load(f"{configs}/qwen3_30b_a3b.py")
    assert (cfg.correction.method, cfg.routing.replay) == ("cis", "none")
    with pytest.raises(errors.UserError, match=r"arm 'cis\+rep'"):
        config.load(f"{configs}/qwen3_30b_a3b.py:cis+rep")
    with pytest.raises(errors.UserError, match="takes no argument"):
        config.load(f"{configs}/base.py:cis")


def test_the_token_is_redacted_in_what_is_saved_or_printed():
    cfg = config.load(None, ["--config.rollout.token=t0p-secret", "--config.rollout.server=h:1"])
    shown = config.redacted(cfg)
    assert shown.rollout.token == config.REDACTED and "t0p-secret" not in shown.to_json_best_effort()
    assert shown.rollout.server == "h:1" and cfg.rollout.token == "t0p-secret"  # the original untouched
    assert config.redacted(config.load(None)).rollout.token == ""  # unset stays unset
    assert config.secret_overrides(["--config.rollout.token=x", "--config.rollout.server=h:1"]) == ["rollout.token"]
    assert config.secret_overrides(["--config.rollout.tokenizer=x"]) == []
