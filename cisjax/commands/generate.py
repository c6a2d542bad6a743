"""`cisjax generate`: rollouts sampled from a rollout server: prompts jsonl in, one line per sample out."""

from cisjax.rollout.client import add_args, run  # noqa: F401  (moving here from cisjax.rollout.client)
