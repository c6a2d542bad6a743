"""One process of the two-process publish test: `python -m tests.train._publish_worker PORT PROCESS_ID MODEL_DIR EXPORT_ROOT OUT.json`.

Process 0 holds a fake rollout client (no server); both processes publish and must succeed or raise together."""

import os
import sys

from tests.support import xla_flags
from tests.support.runs import spec_of

# 4 CPU devices per process (and the suite's compile flags), gloo collectives between the processes; set before jax
# is imported.
os.environ["XLA_FLAGS"] = xla_flags.flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"


class FakeClient:
    """Answers like a server that loaded the weights: `answers` are the logprobs Score returns."""

    def __init__(self):
        self.answers = None
        self.version = 0
        self.fail_stream_after = None

    def update_weights(self, path, *, version, checksums):
        from cisjax import export

        assert sorted(checksums) == sorted(export.verify(path)["files"])
        self.version = version
        return version

    def update_weights_from_tensors(self, tensors, *, version):
        for i, _ in enumerate(tensors.items()):
            if self.fail_stream_after is not None and i == self.fail_stream_after:
                raise ConnectionError("stream broken off")
        self.version = version
        return version

    def score(self, items, *, temperature):
        assert temperature == 1.0 and len(items) == len(self.answers)
        return [{"logprobs": a, "version": self.version} for a in self.answers]


def main(port: str, process_id: str, model_dir: str, export_root: str, out: str) -> int:
    import json

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id), initialization_timeout=300
    )
    import flax.nnx as nnx

    from cisjax import config as config_lib
    from cisjax import sharding
    from cisjax.models import hf_io
    from cisjax.train.publish import CanaryError, Publisher, PublishError

    assert jax.process_count() == 2 and jax.device_count() == 8
    cfg = config_lib.load(
        None,
        [
            "--config.publish.canary.num_sequences=3",
            "--config.publish.canary.prompt_len=8",
            "--config.publish.canary.response_len=12",
            f"--config.publish.dir={export_root}",
        ],
    )
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2, "data": 2})
    assert {d.process_index for d in mesh.devices.flat} == {0, 1}
    rules = sharding.rules_from_config(None)
    model, _, hf = hf_io.load(model_dir, mesh=mesh, rules=rules, **spec_of(cfg).runtime.model_kwargs())
    graphdef, params = nnx.split(model, nnx.Param)
    fake = FakeClient() if jax.process_index() == 0 else None
    pub = Publisher(graphdef, hf, spec_of(cfg).publish, fake, mesh, rules)
    result = {}

    right = pub.trainer_logprobs(params)  # collective; the same on both processes
    result["right"] = right
    if fake:
        fake.answers = right
    rep = pub.publish(params, 1)
    result["pass"] = rep.canary.ok if fake else rep.canary is None  # the report lives on process 0

    if fake:
        fake.answers = [[x + 0.5 for x in seq] for seq in right]
    try:
        pub.publish(params, 2)
        result["fail"] = "no error"
    except CanaryError as e:
        result["fail"] = str(e)

    with cfg.unlocked():
        cfg.publish.mode = "stream"
    stream = Publisher(graphdef, hf, spec_of(cfg).publish, fake, mesh, rules)
    if fake:
        fake.fail_stream_after = 3
    try:
        stream.publish(params, 3)
        result["broken_stream"] = "no error"
    except PublishError as e:
        result["broken_stream"] = str(e)
    if fake:
        fake.fail_stream_after, fake.answers = None, right
    result["stream_pass"] = stream.publish(params, 4).canary.ok if fake else stream.publish(params, 4).canary is None

    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
