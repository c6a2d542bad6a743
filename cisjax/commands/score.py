"""`cisjax score`: training-side (XLA) logprobs of response tokens: jsonl in, jsonl out."""

from cisjax.score import add_args, run  # noqa: F401  (moving here from cisjax.score)
