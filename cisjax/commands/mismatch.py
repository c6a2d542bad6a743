"""`cisjax mismatch`: the mismatch observatory: measure XLA vs vLLM token by token, then report."""

from cisjax.mismatch.command import add_args, run  # noqa: F401  (moving here from cisjax.mismatch.command)
