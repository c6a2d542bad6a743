"""`cisjax serve`: the rollout gRPC server (token ids in/out) over an inference engine backend."""

from cisjax.rollout.server import add_args, run  # noqa: F401  (moving here from cisjax.rollout.server)
