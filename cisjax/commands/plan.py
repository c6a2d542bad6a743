"""`cisjax plan`: the train step compiled for a TPU slice or GPU set on this host: memory, fit, FLOPs."""

from cisjax.plan.command import add_args, run  # noqa: F401  (moving here from cisjax.plan.command)
