"""The suite's scheduler (tests/conftest.py): a test that takes its worker down, crashes it or hangs fails once, the
rest run."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import pytest_xdist_make_scheduler

ROOT = Path(__file__).resolve().parents[1]

# The suite's hooks in a throwaway project: its conftest takes tests/conftest.py's scheduler. A test that kills its
# worker process, one that hangs past the timeout, one that crashes it (a segfault), and four that pass; each appends
# its name to runs.txt when it starts.
CONFTEST = """from tests.conftest import (  # noqa: F401
    pytest_configure,
    pytest_configure_node,
    pytest_handlecrashitem,
    pytest_runtest_protocol,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
"""
TESTS = """
import faulthandler, os, time
from pathlib import Path

def _ran(name):
    with open(Path(__file__).parent / "runs.txt", "a") as f:
        f.write(name + "\\n")

def test_kills_its_worker():
    _ran("kills")
    os._exit(3)

def test_hangs():
    _ran("hangs")
    time.sleep(600)

def test_crashes():
    _ran("crashes")
    faulthandler._sigsegv()

def test_a():
    _ran("a")

def test_b():
    _ran("b")

def test_c():
    _ran("c")

def test_d():
    _ran("d")
"""


def test_a_dead_or_hung_worker_fails_its_test_once_and_the_rest_run(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_many.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CISJAX_TEST_HUNG_S": "8"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    runs = sorted((tmp_path / "runs.txt").read_text().split())
    assert runs == ["a", "b", "c", "crashes", "d", "hangs", "kills"], out[-3000:]  # each once: failures not run again
    assert "3 failed, 4 passed" in out, out[-3000:]
    # the hung test's report: the watchdog's stacks, down to the line it hung on; the crashed one's: the signal and
    # its stack; the killed one's: no stacks
    assert "ended by the suite's watchdog" in out and 'test_many.py", line 15 in test_hangs' in out, out[-3000:]
    assert "the worker crashed" in out and "Segmentation fault" in out, out[-3000:]
    assert 'test_many.py", line 19 in test_crashes' in out, out[-3000:]
    assert "no stacks: the process was killed" in out, out[-3000:]


def test_the_hooks_load_without_xdist(tmp_path):
    """pytest without pytest-xdist (`-p no:xdist`, or not installed): its hooks are optional, the suite still runs."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


class _Worker:
    """A pytest-xdist worker as its scheduler sees it, run as xdist's worker runs (remote.py): it runs a test only once
    it holds the next one or was told to shut down."""

    def __init__(self, name):
        self.gateway, self.shutting_down, self.queue = SimpleNamespace(id=name), False, []

    def __repr__(self):
        return self.gateway.id

    def send_runtest_some(self, indices):
        assert not self.shutting_down
        self.queue += indices

    def shutdown(self):
        self.shutting_down = True

    def can_run(self) -> bool:
        return len(self.queue) >= 2 or (len(self.queue) == 1 and self.shutting_down)


def test_workers_that_replace_dead_ones_get_work_once_collected_and_never_wait_for_ever():
    """xdist 3.8's scheduler after a worker died: two replacements, one still collecting when the other finishes (it
    used to get work it could not index: KeyError), the other given one test and then forgotten (a worker waits for a
    next test before it runs one: idle until the queue ran dry). Played to the end: every test but the dead worker's
    runs once, every worker is shut down."""
    config = SimpleNamespace(
        getvalue=lambda name: ["2*popen"] if name == "tx" else None,
        getoption=lambda name, default=None: "loadgroup" if name == "dist" else default,
        option=SimpleNamespace(loadscopereorder=False),
    )
    sched = pytest_xdist_make_scheduler(config, None)
    tests = [f"tests/test_x.py::test_{i}" for i in range(12)]
    a, b = _Worker("gw0"), _Worker("gw1")
    for w in (a, b):
        sched.add_node(w)
        sched.add_node_collection(w, tests)
    sched.schedule()
    assert len(a.queue) >= 2 and len(b.queue) >= 2

    ran = []

    def run_one(w):
        index = w.queue.pop(0)
        ran.append(tests[index])
        sched.mark_test_complete(w, index)

    run_one(b)
    crashed = tests[a.queue[0]]
    assert sched.remove_node(a) == crashed  # gw0 died in its first test: reported failed, not queued again
    c, d = _Worker("gw2"), _Worker("gw3")  # two replacements start; gw2 collects first
    sched.add_node(c)
    sched.add_node(d)
    sched.add_node_collection(c, tests)
    sched.schedule()
    assert not d.queue and len(c.queue) >= 2  # gw3 still collecting: nothing for it yet
    sched.add_node_collection(d, tests)
    sched.schedule()
    assert len(d.queue) >= 2

    live = (b, c, d)
    while any(w.can_run() for w in live):
        run_one(next(w for w in live if w.can_run()))
    assert all(w.shutting_down and not w.queue for w in live)
    assert sorted(ran) == sorted(set(tests) - {crashed}) and sched.tests_finished  # each of the others once
