"""`cisjax sweep`: correction arms x seeds as train runs, then sweep.md + plots."""

from cisjax.sweep.command import add_args, run  # noqa: F401  (moving here from cisjax.sweep.command)
