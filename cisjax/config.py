"""Loading ml_collections config files and applying `--config.path.to.field=value` overrides."""

from __future__ import annotations

import ast
import importlib.util
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


def load_file(path: str | Path) -> ml_collections.ConfigDict:
    """Run a config file and return its `get_config()`; `FILE.py:ARG` returns `get_config(ARG)` (ml_collections'
    convention; the paper's experiment files take an arm, e.g. `configs/qwen3_30b_a3b.py:cis+replay`)."""
    path, arg = str(path), None
    if not Path(path).is_file() and ":" in path:
        path, arg = path.rsplit(":", 1)
    path = Path(path)
    if not path.is_file():
        raise errors.MissingInput(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"cisjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # experiment files import configs/base.py as `base`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
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
    """A config file (default: configs/base.py of this checkout) with overrides applied, then locked: a field that
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


def default_config_path() -> Path:
    here = Path(__file__).resolve().parent.parent / "configs" / "base.py"
    if here.is_file():
        return here
    raise errors.MissingInput("no --config given and configs/base.py not found next to the package")
