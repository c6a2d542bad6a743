"""Console logging for every cisjax process: cisjax's own INFO lines; other libraries' only from WARNING up unless verbose."""

from __future__ import annotations

import logging
import os

# Libraries whose INFO lines drown the step lines (orbax logs ~40 lines per checkpoint through absl)
LIBRARIES = (
    "absl",
    "orbax",
    "jax",
    "jax._src",
    "vllm",
    "transformers",
    "grpc",
    "urllib3",
    "filelock",
    "httpx",
    "tensorboardX",
)
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
ENV = "CISJAX_VERBOSE"  # set by `cisjax --verbose`, so that child processes (the rollout server) follow


def verbose_from_env() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def setup(verbose: bool | None = None) -> None:
    """Idempotent. verbose=None reads CISJAX_VERBOSE. Verbose: every library's INFO and cisjax's DEBUG lines."""
    if verbose is None:
        verbose = verbose_from_env()
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    libraries = logging.INFO if verbose else logging.WARNING
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(libraries)
    logging.getLogger("cisjax").setLevel(logging.DEBUG if verbose else logging.INFO)
    try:  # absl keeps its own verbosity next to the Python logger's level
        from absl import logging as absl_logging  # lazy: optional

        absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
    except ImportError:
        pass
    # vLLM configures its own handlers from the environment when it is imported (here or in a child process)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
