"""One process of the two-process step test: `python -m tests.train._two_process_worker PORT PROCESS_ID MESH OUT.npz`."""

import os
import sys

from tests.support import xla_flags

# 4 CPU devices per process (and the suite's compile flags), gloo collectives between the processes; set before jax
# is imported.
os.environ["XLA_FLAGS"] = xla_flags.flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"


def main(port: str, process_id: str, mesh_name: str, out: str) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id), initialization_timeout=300
    )
    import numpy as np

    from cisjax import sharding
    from tests.support import steps

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = sharding.make_mesh(steps.MESHES[mesh_name])
    # the mesh really spans both processes
    assert {d.process_index for d in mesh.devices.flat} == {0, 1}
    res = steps.run_steps(steps.make_cfg(), mesh, steps=2)
    losses = np.array([m["loss"] for m in res["metrics"]])
    grad_norms = np.array([m["grad_norm"] for m in res["metrics"]])
    params = steps.flat_params(res["state"].params)  # collective: the whole params on both processes
    np.savez(out, prox=res["prox"], losses=losses, grad_norms=grad_norms, sums=res["sums"], params=params)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
