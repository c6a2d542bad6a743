"""Rollout servers for tests: subprocesses (cisjax.rollout.launch's) with their output captured (start, wait until
serving, stop), and a model directory for the fake engine."""

import collections
import json
import threading
import time
from pathlib import Path

from cisjax.rollout import launch
from cisjax.rollout.client import RolloutClient

_LEASES: list[launch.PortLease] = []


def free_port() -> int:
    """A port for a test's rollout server, held (launch.PortLease) for this process's life: nothing else takes it
    while the server starts."""
    _LEASES.append(launch.PortLease())
    return _LEASES[-1].port


def start(
    backend,
    model_dir,
    port,
    *,
    export_root=None,
    token=None,
    host="127.0.0.1",
    env=None,
    dtype="float32",
    extra_args=(),
):
    """`python -m cisjax.commands.serve` (engine dtype fp32 unless told) with a 5 s shutdown grace, output captured."""
    import subprocess

    proc = launch.start(
        backend,
        model_dir,
        port=port,
        dtype=dtype,
        host=host,
        export_root=export_root or None,
        token=token,
        grace_s=5.0,
        env=env,
        extra_args=tuple(extra_args),
        stdout=subprocess.PIPE,
        text=True,
    )
    # drain the output continuously: a full pipe would block the server (it logs every reload)
    proc.output = collections.deque(maxlen=2000)
    threading.Thread(target=lambda: proc.output.extend(proc.stdout), daemon=True).start()
    return proc


def output(proc) -> str:
    """The last lines the server printed."""
    time.sleep(0.2)  # let the reader catch up with a process that just exited
    return "".join(proc.output)


def wait_serving(proc, target, timeout: float, poll: float = 0.2) -> None:
    """Until the health check says SERVING; the server's output in the error if it exits or times out (killed then)."""
    with RolloutClient(target) as client:
        try:
            launch.wait_serving(
                client,
                timeout,
                failed=lambda: None if proc.poll() is None else f"exited {proc.returncode}",
                tail=lambda: output(proc),
                poll_s=poll,
            )
        except RuntimeError:
            proc.kill()
            raise


def stop(proc, timeout: float = 30) -> int:
    """SIGTERM (graceful shutdown), SIGKILL after `timeout`; the exit code."""
    return launch.stop(proc, timeout)


def fake_model_dir(path, vocab_size: int = 97, max_len: int = 256, *, tensors: dict | None = None) -> str:
    """A model directory for the fake engine (`--backend fake`): an HF config.json, and `tensors` ({name: ndarray}) as
    its model.safetensors when given (the fake engine reads only their names: a streamed update must bring them all)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=vocab_size, max_position_embeddings=max_len)
    (path / "config.json").write_text(json.dumps(config))
    if tensors:
        from safetensors.numpy import save_file

        save_file(tensors, str(path / "model.safetensors"))
    return str(path)
