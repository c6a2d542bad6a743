"""`cisjax config`: a config file printed with its --config.x=y overrides applied."""

from __future__ import annotations

import argparse

from cisjax import config as config_lib


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=config_lib.FLAG_HELP)


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    print(config_lib.redacted(config_lib.load(args.config, overrides or [])))
    return 0
