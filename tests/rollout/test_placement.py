"""cisjax.rollout.placement: each embedded replica's cores or GPUs, its environment and `cisjax serve` arguments."""

import os
import subprocess
import sys

import pytest

from cisjax import errors
from cisjax.rollout import placement
from cisjax.rollout.placement import Placement, plan


def test_id_lists_round_trip():
    assert placement.parse_ids("0-3,6, 5") == [0, 1, 2, 3, 5, 6]
    assert placement.format_ids([6, 0, 1, 2, 3, 5]) == "0-3,5-6"
    assert placement.format_ids([4]) == "4"
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(errors.UserError):
            placement.parse_ids(bad)


def test_sets_are_parsed_and_must_not_overlap():
    assert placement.parse_sets("0-1|2,3", "x") == [[0, 1], [2, 3]]
    assert placement.parse_sets("0,1|GPU-ab", "x", gpus=True) == [["0", "1"], ["GPU-ab"]]
    with pytest.raises(errors.UserError, match="empty set"):
        placement.parse_sets("0||1", "x")
    with pytest.raises(errors.UserError, match="two sets"):
        placement.parse_sets("0-2|2-3", "x")
    with pytest.raises(errors.UserError, match="distinct GPU ids"):
        placement.parse_sets("0,0|1", "x", gpus=True)


def test_cpu_replicas_get_contiguous_disjoint_cores():
    places = plan(2, allowed=[0, 1, 2, 3, 4], cpu_engine=True)
    assert [p.cpus for p in places] == [(0, 1, 2), (3, 4)] and all(p.gpus is None for p in places)
    assert places[0].env() == {"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-2"}
    assert places[1].args("vllm") == ("--cpus", "3-4")
    assert [p.cpus for p in plan(2, allowed=[4, 9], cpu_engine=True)] == [(4,), (9,)]  # the process's own cores
    # the transformers engine is pinned the same way, GPUs or not
    assert [p.cpus for p in plan(2, backend="transformers", allowed=[0, 1], visible=["0", "1"])] == [(0,), (1,)]


def test_explicit_cpu_sets_and_none():
    places = plan(2, cpus="0,2|1", allowed=[0, 1, 2, 3], cpu_engine=True)
    assert [p.cpus for p in places] == [(0, 2), (1,)]
    assert plan(2, cpus="none", allowed=[0, 1], cpu_engine=True) == [Placement(), Placement()]
    assert plan(1, allowed=[0, 1], cpu_engine=True) == [Placement()]  # one replica: unchanged unless asked
    assert plan(1, cpus="1", allowed=[0, 1], cpu_engine=True)[0].args("vllm") == ("--cpus", "1")


def test_cpu_errors():
    with pytest.raises(errors.UserError, match="may use 2 cores"):
        plan(3, allowed=[0, 1], cpu_engine=True)
    with pytest.raises(errors.UserError, match="1 sets for 2 replicas"):
        plan(2, cpus="0-1", allowed=[0, 1], cpu_engine=True)
    with pytest.raises(errors.UserError, match="cores 7 are not among"):
        plan(2, cpus="0|7", allowed=[0, 1], cpu_engine=True)
    with pytest.raises(errors.UserError, match="at least 1"):
        plan(0)


def test_gpu_replicas_split_the_visible_gpus():
    places = plan(2, visible=["2", "3", "5", "7"], cpu_engine=False, allowed=[0, 1])
    assert [p.gpus for p in places] == [("2", "3"), ("5", "7")] and all(p.cpus is None for p in places)
    assert places[1].env() == {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert places[0].args("vllm") == ("--tensor-parallel-size", "2")
    assert [p.gpus for p in plan(2, visible=["0", "1", "2"], cpu_engine=False)] == [("0",), ("1",)]  # one unused
    with pytest.raises(errors.UserError, match="2 GPUs are visible"):
        plan(3, visible=["0", "1"], cpu_engine=False)
    # the CPU build, or no GPU: cores instead
    assert [p.gpus for p in plan(2, visible=["0", "1"], cpu_engine=True, allowed=[0, 1])] == [None, None]
    assert [p.cpus for p in plan(2, visible=[], cpu_engine=False, allowed=[0, 1])] == [(0,), (1,)]


def test_explicit_gpu_sets_with_cores():
    places = plan(2, gpus="0,1|2,3", cpus="0-7|8-15", allowed=range(16))
    assert places[0].env() == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "OMP_NUM_THREADS": "8",
        "VLLM_CPU_OMP_THREADS_BIND": "0-7",
    }
    assert places[1].args("vllm") == ("--cpus", "8-15", "--tensor-parallel-size", "2")
    assert places[1].args("transformers") == ("--cpus", "8-15")
    with pytest.raises(errors.UserError, match="3 sets for 2 replicas"):
        plan(2, gpus="0|1|2")


def test_validate_reads_the_sets():
    from cisjax import config as config_lib
    from cisjax.train import validate

    cfg = config_lib.load("configs/demo_cpu.py", ["--config.rollout.replica_cpus=0-1|1"])
    assert any("rollout.replica_cpus" in p and "two sets" in p for p in validate.problems(cfg, inputs=False))
    cfg = config_lib.load("configs/demo_cpu.py", ["--config.rollout.replica_gpus=0,1|2"])
    assert any("2 sets for rollout.replicas=1" in p for p in validate.problems(cfg, inputs=False))
    cfg = config_lib.load("configs/demo_cpu.py", ["--config.rollout.replica_gpus=0,1|2", "--config.rollout.replicas=2"])
    assert not any("replica" in p for p in validate.problems(cfg, inputs=False))


def test_pin_holds_every_thread():
    """`pin` in a fresh process with a thread already running: it and the main thread end on the one core."""
    core = placement.allowed_cpus()[-1]
    code = f"""
import os, threading
ev = threading.Event()
t = threading.Thread(target=ev.wait); t.start()
from cisjax.rollout import placement
placement.pin([{core}])
masks = {{tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}}
ev.set(); t.join()
print(len(masks), set(map(tuple, masks.values())), os.environ["OMP_NUM_THREADS"], os.environ["VLLM_CPU_OMP_THREADS_BIND"])
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["2", f"{{({core},)}}", "1", str(core)], out
    with pytest.raises(errors.UserError, match="may use cores"):
        placement.pin([max(placement.allowed_cpus()) + 1000])
