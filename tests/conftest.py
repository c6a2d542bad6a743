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

import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

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


# Modules whose tests share an expensive module-scoped set-up (rollout servers, a vLLM engine, training runs, a bench
# section's run): one unit of work each, so that under `--dist loadgroup` (Makefile) the set-up happens on one worker,
# not on both.
ONE_WORKER_MODULES = (
    "tests/bench/test_gpu_sampler.py",  # its module fixture: the sampler section's run (~30 s)
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
    "tests/train/test_offload.py",  # its module fixture: two steps of each optimizer placement (~15-20 s)
    "tests/train/test_publish.py",
    "tests/test_wheel.py",
)
# With the pinned pytest 9.2 and pytest-xdist 3.8, xdist's own `loadgroup` ignores these groups (its worker renames
# `item._nodeid` to add "@group", which pytest 9 no longer reads), so the scheduler below does the grouping itself.


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown to a run without it
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

        def _reschedule(self, node):
            # xdist 3.8's LoadScopeScheduling after a worker died (pytest-xdist#1189, #1327, #1362), fixed here:
            # - a worker started in place of a dead one takes work once it has collected the tests: schedule() runs
            #   when any worker finishes collecting, and gave work to a replacement still collecting (KeyError, an
            #   INTERNALERROR that ended the run: seen here when two workers died at once);
            # - a worker runs a test only once it holds the next one (or was told to shut down): xdist gave a fresh
            #   replacement one test and never called on it again, so it sat idle until the others had emptied the
            #   queue (with one worker left: the run hung, #1327). Here a worker holds two tests or more while work is
            #   left, and is shut down (runs what it holds, then exits) when none is.
            if node.shutting_down or node not in self.registered_collections:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

        def remove_node(self, node):
            # A worker that died (a crash, the OOM killer, or the watchdog below ending a hung test): xdist reports
            # the test it was running as failed, and LoadScopeScheduling would queue that test again with the rest of
            # its unit. Run it once: a test that took a worker down would take the next one down too (and the time).
            workload = self.assigned_work.pop(node)
            pending = [(unit, nodeid) for unit in workload.values() for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            unit, crashed = pending[0]  # the worker runs its units and their tests in order
            unit[crashed] = True
            self.workqueue.update((scope, u) for scope, u in workload.items() if not all(u.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    # `slow` tests first (a stable sort: modules stay together): the workers take tests in this order, and a long test
    # taken last would keep one worker busy while the other has nothing left to do
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# A test that runs past HUNG_S (set-up, call and tear-down) is ended: faulthandler's watchdog (a C thread: it needs no
# GIL, so a test stuck in C code - a compile, a collective, a socket - is ended too) writes every thread's stack and
# exits the process. A worker that crashes (a segfault or abort in XLA, say) writes its threads' stacks too
# (faulthandler's fatal-signal handler). Under xdist the worker's stderr is not shown, so the stacks go to a file per
# worker that pytest_handlecrashitem puts in the test's failure report. The longest test takes ~3.5 minutes on a
# 2-core machine: a hang fails its test instead of holding CI to its time limit (tests/test_conftest.py sets a shorter
# one).
HUNG_S = float(os.environ.get("CISJAX_TEST_HUNG_S", 900))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.cisjax_hung_dir = tempfile.mkdtemp(prefix="cisjax-hung-")


def pytest_unconfigure(config):
    if hasattr(config, "cisjax_hung_dir"):
        shutil.rmtree(config.cisjax_hung_dir, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown to a run without it
def pytest_configure_node(node):
    node.workerinput["cisjax_hung_dir"] = node.config.cisjax_hung_dir


def _hung_file(config):
    if not hasattr(config, "cisjax_hung_file"):
        worker = getattr(config, "workerinput", None)
        config.cisjax_hung_file = (
            open(Path(worker["cisjax_hung_dir"]) / f"{worker['workerid']}.txt", "w") if worker else sys.stderr
        )
        # a fatal signal's stacks go there too (pytest's own handler wrote them to the worker's hidden stderr)
        faulthandler.enable(file=config.cisjax_hung_file, all_threads=True)
    return config.cisjax_hung_file


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HUNG_S, exit=True, file=_hung_file(item.config))
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown to a run without it
def pytest_handlecrashitem(crashitem, report, sched):
    dump = Path(report.node.config.cisjax_hung_dir) / f"{report.node.gateway.id}.txt"
    stacks = dump.read_text() if dump.exists() else ""
    if stacks.startswith("Timeout"):
        report.longrepr += (
            f"\nover {HUNG_S} s: ended by the suite's watchdog (tests/conftest.py); the stacks then:\n{stacks}"
        )
    elif stacks:
        report.longrepr += f"\nthe worker crashed; faulthandler's report:\n{stacks}"
    else:
        report.longrepr += "\nno stacks: the process was killed (the kernel's OOM killer sends SIGKILL) or exited"


@pytest.fixture(autouse=True, scope="module")
def _drop_programs():
    """After each test module, JAX's caches of traced and compiled programs are emptied: a worker runs ~900 tests, and
    with every program it compiled kept its memory grew to 7.5 GB by the end of the suite (measured: two workers and
    their tests' servers, 13.8 GB of the machine's memory). Five model and step modules: 2.1 / 1.7 GB at their end
    without, 1.4 / 1.4 GB with, the same time. A program shared between modules (tests/support's) is traced again."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()
