"""Loading ml_collections config files and applying `--config.path.to.field=value` overrides."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import ml_collections

from cisjax import errors

PREFIX = "--config."
# Config dicts whose keys are free (any logical axis name); everywhere else an unknown key is a typo.
OPEN_FIELDS = ("sharding.rules",)
# Fields never written or printed (redacted): the rollout service's bearer token.
SECRET_FIELDS = ("rollout.token",)
REDACTED = "<redacted>"
# The config files as a checkout has them (the package's sibling configs/) and as a wheel ships them (setup.py copies
# configs/ into the built package): configs_dir() takes the first that exists.
CHECKOUT_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "_configs"
# The --config flag of the commands that read a config.
FLAG_HELP = (
    "config file, or a config's name (qwen15_moe_a27b: configs/qwen15_moe_a27b.py; default base); --config.x=y "
    "overrides follow"
)


def load_file(path: str | Path) -> ml_collections.ConfigDict:
    """Run a config file and return its `get_config()`; `FILE.py:ARG` returns `get_config(ARG)` (ml_collections'
    convention; the paper's experiment files take an arm, e.g. `configs/qwen3_30b_a3b.py:cis+replay`). A name instead
    of a path (`qwen3_30b_a3b`, `qwen3_30b_a3b.py:cis+replay`) is a file of configs_dir()."""
    path, arg = find(path)
    spec = importlib.util.spec_from_file_location(f"cisjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    # experiment files import base.py as `base`: from their own folder, else (a user's file elsewhere) from configs_dir()
    folders = list(dict.fromkeys([str(path.parent), str(configs_dir(required=False) or path.parent)]))
    sys.path[0:0] = folders
    try:
        spec.loader.exec_module(module)
    finally:
        for folder in folders:
            sys.path.remove(folder)
    if not hasattr(module, "get_config"):
        raise errors.UserError(f"{path}: a config file must define get_config()")
    try:
        cfg = module.get_config() if arg is None else module.get_config(arg)
    except TypeError as err:
        if arg is not None and "positional argument" in str(err):
            raise errors.UserError(f"{path}: get_config() takes no argument, but {arg!r} was given") from None
        raise
    except ValueError as err:
        if arg is None:
            raise
        raise errors.UserError(f"{path}:{arg}: {err}") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise TypeError(f"{path}: get_config() must return an ml_collections.ConfigDict")
    return cfg


NONE_WORDS = ("None", "none", "null")


def _parse_value(text: str, current, field_type: type | None = None):
    """Convert an override string to the type of the field it replaces.

    `field_type` is given for a typed field that may hold None (an ml_collections placeholder, e.g. correction.low):
    None/none/null set it to None, anything else is parsed as that type, whatever the field holds now."""
    if field_type is not None and field_type is not str:
        if text.strip() in NONE_WORDS:
            return None
        current = field_type()  # a sample of the type: 0.0, 0, False
    if isinstance(current, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if isinstance(current, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """Apply `--config.a.b=value` (or `a.b=value`) strings; unknown fields are an error."""
    for item in overrides:
        item = item[len(PREFIX) :] if item.startswith(PREFIX) else item
        if "=" not in item:
            raise errors.UserError(f"override {item!r} must look like --config.path.to.field=value")
        key, text = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            if name not in node:
                raise errors.UserError(f"unknown config field {key!r} (no {name!r})")
            node = node[name]
        if not isinstance(node, ml_collections.ConfigDict):
            raise errors.UserError(f"unknown config field {key!r}")
        if leaf not in node:
            if ".".join(parents) not in OPEN_FIELDS:
                raise errors.UserError(f"unknown config field {key!r}")
            node[leaf] = _parse_value(text, None)
            continue
        try:
            node[leaf] = _parse_value(text, node[leaf], _nullable_type(node, leaf))
        except (TypeError, ValueError) as err:
            raise errors.UserError(f"bad value for {key!r}: {err}") from None
    return cfg


def _nullable_type(node: ml_collections.ConfigDict, leaf: str) -> type | None:
    """The declared type of a field that may hold None (a FieldReference, e.g. `config_dict.placeholder(float)`),
    else None (a plain field, typed by its value)."""
    ref = dict(node.items(preserve_field_references=True))[leaf]
    if not isinstance(ref, ml_collections.FieldReference):
        return None
    kind = ref.get_type()
    return kind if isinstance(kind, type) and kind is not type(None) else None


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate `--config.x=y` items from the other command-line arguments."""
    rest, overrides = [], []
    for arg in argv:
        (overrides if arg.startswith(PREFIX) else rest).append(arg)
    return rest, overrides


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """A config file or name (default: base.py of configs_dir()) with overrides applied, then locked: a field that
    does not exist can no longer be set (a typo fails instead of going unread)."""
    if path is None:
        path = default_config_path()
    cfg = apply_overrides(load_file(path), overrides)
    cfg.lock()
    return cfg


def redacted(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `cfg` with each set SECRET_FIELDS value replaced by REDACTED: what a run directory saves and `cisjax
    config` prints."""
    out = ml_collections.ConfigDict(cfg.to_dict())
    for path in SECRET_FIELDS:
        *parents, leaf = path.split(".")
        node = out
        for name in parents:
            node = node.get(name) if node is not None else None
        if node is not None and node.get(leaf):
            node[leaf] = REDACTED
    return out


def secret_overrides(overrides: Sequence[str]) -> list[str]:
    """The SECRET_FIELDS among `--config.x=y` overrides (a command line that other local users can read)."""
    return [f for f in SECRET_FIELDS if any(o.split("=", 1)[0] == PREFIX + f for o in overrides)]


def configs_dir(required: bool = True) -> Path | None:
    """The config files: configs/ of the checkout cisjax runs from (editable install or PYTHONPATH; the files a user
    edits), else the copy of them the wheel ships as cisjax/_configs (setup.py). Neither: MissingInput, or None when not
    `required`."""
    if (CHECKOUT_CONFIGS / "base.py").is_file() and (CHECKOUT_CONFIGS.parent / "pyproject.toml").is_file():
        return CHECKOUT_CONFIGS
    if (SHIPPED_CONFIGS / "base.py").is_file():
        return SHIPPED_CONFIGS
    if not required:
        return None
    raise errors.MissingInput(
        f"no config files: neither a checkout's configs/ next to the package ({CHECKOUT_CONFIGS}) nor the copy a wheel "
        f"ships ({SHIPPED_CONFIGS}); reinstall cisjax, or give --config FILE"
    )


def config_names() -> list[str]:
    """The names `--config NAME` takes: the config files of configs_dir(), without `.py`."""
    return sorted(p.stem for p in configs_dir().glob("*.py"))


def find(spec: str | Path) -> tuple[Path, str | None]:
    """`--config`'s value as (file, ARG of `FILE:ARG` or None). A path names a file (relative to the working
    directory); a bare name (`qwen15_moe_a27b`, `qwen15_moe_a27b.py`, no folder) that is not a file there names one of
    configs_dir(). MissingInput for a missing path; UserError, listing the names, for an unknown name."""
    text, arg = str(spec), None
    if not Path(text).is_file() and ":" in text:
        text, arg = text.rsplit(":", 1)
    path = Path(text)
    if path.is_file():
        return path, arg
    if os.sep in text or (os.altsep and os.altsep in text):
        names = config_names() if configs_dir(required=False) else []
        hint = f"; did you mean --config {path.stem} ({configs_dir() / path.name})?" if path.stem in names else ""
        raise errors.MissingInput(f"config file not found: {path}{hint}")
    folder = configs_dir()
    named = folder / (text if text.endswith(".py") else f"{text}.py")
    if not named.is_file():
        raise errors.UserError(
            f"unknown config {text!r}: not a file here, nor one of {folder}: {', '.join(config_names())}"
        )
    return named, arg


def default_config_path() -> Path:
    """base.py of configs_dir(): what `--config` defaults to."""
    return configs_dir() / "base.py"
