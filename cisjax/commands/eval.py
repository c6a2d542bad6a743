"""`cisjax eval`: benchmark accuracy through the rollout service."""

from cisjax.evaluation.command import add_args, run  # noqa: F401  (moving here from cisjax.evaluation.command)
