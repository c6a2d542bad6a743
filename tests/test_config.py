"""Config files and --config.x=y overrides."""

import shutil
import sys
from pathlib import Path

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


def test_a_config_by_name():
    """`--config NAME` (or NAME.py, NAME:ARM) is a file of configs_dir(): the checkout's configs/ here."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    assert config.configs_dir() == configs and config.default_config_path() == configs / "base.py"
    assert {"base", "qwen15_moe_a27b", "demo_cpu"} <= set(config.config_names())
    by_path = config.load(configs / "qwen15_moe_a27b.py").to_dict()
    assert config.load("qwen15_moe_a27b").to_dict() == by_path == config.load("qwen15_moe_a27b.py").to_dict()
    assert config.load("qwen3_30b_a3b:tis+replay").correction.method == "tis"
    with pytest.raises(errors.UserError, match=r"unknown config 'qwen15'.*: base, .*qwen15_moe_a27b"):
        config.load("qwen15")
    with pytest.raises(errors.MissingInput, match=r"did you mean --config qwen15_moe_a27b"):
        config.load("elsewhere/qwen15_moe_a27b.py")


def test_without_a_checkout_the_shipped_configs_are_used(tmp_path, monkeypatch):
    """Installed from a wheel there is no configs/ next to the package: the copy it ships (cisjax/_configs) serves the
    default, the names, and `import base` of the experiment files, theirs and a user's own."""
    configs = Path(__file__).resolve().parents[1] / "configs"
    shipped = tmp_path / "site" / "cisjax" / "_configs"
    shutil.copytree(configs, shipped, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(config, "CHECKOUT_CONFIGS", tmp_path / "site" / "configs")
    monkeypatch.setattr(config, "SHIPPED_CONFIGS", shipped)
    monkeypatch.chdir(tmp_path)
    for name in config.config_names():  # `import base` must find the shipped file, not a module cached from configs/
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert config.configs_dir() == shipped and config.default_config_path() == shipped / "base.py"
    cfg = config.load("qwen15_moe_a27b")
    assert cfg.model.hf_config == str(shipped / "models" / "qwen15_moe_a27b.json")
    mine = tmp_path / "mine" / "exp.py"
    mine.parent.mkdir()
    mine.write_text("import base\n\n\ndef get_config():\n    c = base.get_config()\n    c.seed = 7\n    return c\n")
    assert config.load(mine).seed == 7
    monkeypatch.setattr(config, "SHIPPED_CONFIGS", tmp_path / "nowhere")
    with pytest.raises(errors.MissingInput, match="no config files"):
        config.load(None)
