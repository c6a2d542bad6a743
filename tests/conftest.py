"""Test session set-up: 8 fake CPU devices for sharding tests (must precede the first jax import)."""

import os

# 8 fake CPU devices, and the suite's cheaper compile (tests/support/xla_flags.py); subprocesses inherit them. Flags the
# caller set win.
from tests.support import xla_flags

_xla_flags = os.environ.get("XLA_FLAGS", "").split()
for _flag in xla_flags.flags(8).split():
    if not any(f.split("=")[0] == _flag.split("=")[0] for f in _xla_flags):
        _xla_flags.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_xla_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compiler (cisjax plan's tests) in several test workers at once: libtpu's machine-wide lock would refuse
# all but one, and its host probes would warn on a machine without a TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# vLLM takes the installed libtpu for TPU hardware: tests importing vLLM in-process select its CPU build as the rollout
# server does (cisjax.rollout.engine_env imports neither jax nor vllm).
from cisjax.rollout import engine_env  # noqa: E402

if engine_env.cpu_build():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """tiny_hf_dir(family, seed=0, dtype="float32", **overrides) -> the directory of a tiny random transformers model of
    a family in tests.support.hf.TINY_FAMILIES (its base config with `overrides`), saved by tests.support.hf.save_tiny_hf.
    Built once per session (one per xdist worker) for each distinct set of arguments and shared by every test that
    asks for it: read only, copy it to change it."""
    from tests.support.hf import TINY_FAMILIES, save_tiny_hf

    cache: dict[str, str] = {}

    def get(family: str, seed: int = 0, dtype: str = "float32", **overrides) -> str:
        key = json.dumps([family, seed, dtype, overrides], sort_keys=True)
        if key not in cache:
            config_cls, model_cls, base = TINY_FAMILIES[family]
            path = tmp_path_factory.mktemp(f"tiny_{family}")
            cache[key] = save_tiny_hf(path, config_cls, model_cls, seed=seed, dtype=dtype, **{**base, **overrides})
        return cache[key]

    return get


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory):
    """A persistent compilation cache directory for the `cisjax` subprocesses of the session's tests (one per xdist
    worker: its tests run one at a time, so two of them never write an entry at once), given to them by
    tests.support.processes.subprocess_env: the demo's programs compile once per worker, not once per test (runs of the
    loop, sweep, bench and launcher tests share their shapes)."""
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """The demo's task and tiny MoE, not warmed up (tests.support.runs.prepare): built once per session (one per
    xdist worker; ~10-25 s each) for the train, launcher, sweep, bench and evaluation tests that run on it. Read only:
    runs, exports and caches go to each test's own directories."""
    from tests.support import runs

    return runs.prepare(tmp_path_factory.mktemp("demo"))


# Modules whose tests share an expensive module-scoped set-up (rollout servers, a vLLM engine, training runs): one
# unit of work each, so that under `--dist loadgroup` (Makefile) the set-up happens on one worker, not on both.
ONE_WORKER_MODULES = (
    "tests/evaluation/test_command.py",
    "tests/mismatch/test_measure.py",
    "tests/rollout/test_fleet.py",
    "tests/rollout/test_rollout_jax.py",
    "tests/rollout/test_rollout_transformers.py",
    "tests/rollout/test_rollout_vllm.py",
    "tests/rollout/test_rollout_vllm_batching.py",
    "tests/rollout/test_rollout_vllm_families.py",
    "tests/train/test_loop.py",
    "tests/train/test_loop_multiprocess.py",
    "tests/train/test_loop_robustness.py",
    "tests/train/test_publish.py",
    "tests/test_wheel.py",
)
# With the pinned pytest 9.2 and pytest-xdist 3.8, xdist's own `loadgroup` ignores these groups (its worker renames
# `item._nodeid` to add "@group", which pytest 9 no longer reads), so the scheduler below does the grouping itself.


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: tests go one at a time to the free worker, except that each module of ONE_WORKER_MODULES is
    one unit of work, on one worker (its module-scoped servers start once, not once per worker)."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    # `slow` tests first (a stable sort: modules stay together): the workers take tests in this order, and a long test
    # taken last would keep one worker busy while the other has nothing left to do
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
