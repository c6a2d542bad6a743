"""`cisjax train`: the RL loop: rollouts, rewards, CIS-weighted GRPO update, weights published each step."""

from cisjax.train.loop import add_args, run  # noqa: F401  (moving here from cisjax.train.loop)
