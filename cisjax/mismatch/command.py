"""`cisjax mismatch measure|report`: the observatory's two steps, each in its own module."""

from __future__ import annotations

import argparse
import importlib

STEPS = {
    "measure": (
        "cisjax.mismatch.measure",
        "sample with the inference engine, rescore with the trainer: per-token data of each engine pair",
    ),
    "report": ("cisjax.mismatch.report", "Appendix A tables, plots and report.md from one or more measurements"),
}


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mismatch_command", metavar="STEP", required=True)
    for name, (module, help_text) in STEPS.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_args(q)


def run(args, overrides=()) -> int:
    return importlib.import_module(STEPS[args.mismatch_command][0]).run(args, overrides)
