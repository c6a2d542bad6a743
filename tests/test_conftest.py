"""The suite's scheduler (tests/conftest.py): a test that takes its worker down, or hangs, fails once, the rest run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The suite's hooks in a throwaway project: its conftest takes tests/conftest.py's scheduler. A test that kills its
# worker process, one that hangs past the timeout, and four that pass; each appends its name to runs.txt when it starts.
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
import os, time
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
    assert runs == ["a", "b", "c", "d", "hangs", "kills"], out[-3000:]  # each once: the two failures not run again
    assert "2 failed, 4 passed" in out, out[-3000:]
    # the hung test's report: the watchdog's stacks, down to the line it hung on; the killed one's: no stacks
    assert "ended by the suite's watchdog" in out and 'test_many.py", line 15 in test_hangs' in out, out[-3000:]
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
