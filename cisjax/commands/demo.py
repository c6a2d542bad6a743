"""`cisjax demo`: the offline demo: synthetic arithmetic task, character tokenizer, tiny MoE warmed up."""

from cisjax.demo import add_args, run  # noqa: F401  (moving here from cisjax.demo)
