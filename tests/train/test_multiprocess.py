"""Two processes x 4 CPU devices (gloo collectives) form one 8-device mesh: the step equals the one-process run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cisjax.rollout.launch import free_port
from tests.support import steps as U

pytestmark = pytest.mark.slow  # not in the fast tier (make test-fast): two jax.distributed processes

REPO = Path(__file__).resolve().parents[2]
MESH = "data2_fsdp2_tensor2"
TIMEOUT_S = 600  # a hang guard: CI hosts under load took 165 s for this test


def test_two_processes_match_one_process(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = []
    for pid in range(2):
        log = open(tmp_path / f"worker{pid}.log", "w")
        cmd = [
            sys.executable,
            "-m",
            "tests.train._two_process_worker",
            str(port),
            str(pid),
            MESH,
            str(tmp_path / f"out{pid}.npz"),
        ]
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        ref = U.reference(MESH)  # the same mesh shape on this process's 8 devices, computed while the workers run
        for proc, _ in procs:
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(2))
    assert all(proc.returncode == 0 for proc, _ in procs), logs

    outs = []
    for i in range(2):
        with np.load(tmp_path / f"out{i}.npz") as f:
            outs.append(dict(f))
    for key in ("prox", "losses", "grad_norms", "sums"):
        np.testing.assert_array_equal(outs[0][key], outs[1][key], err_msg=key)  # both processes see the same result
    out = outs[0]
    np.testing.assert_allclose(out["prox"], ref["prox"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["losses"], [m["loss"] for m in ref["metrics"]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["grad_norms"], [m["grad_norm"] for m in ref["metrics"]], rtol=1e-5)
    # the params after the two steps, value by value
    U.assert_same_update(out["params"], U.flat_params(ref["state"].params), lr=U.make_cfg().train.lr, steps=2)
