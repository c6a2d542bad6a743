"""Shared set-up of the weight publisher's tests (tests/train/test_publish.py, tests/rollout/test_fleet.py): the
trainer side on the tiny model, publishers over a client or a fleet, changed params, a replica left on stale weights."""

from __future__ import annotations

import numpy as np

from tests.support.runs import spec_of


def load_trainer(model_dir) -> dict:
    """The default config (bf16 compute over fp32 master weights, bf16 publishes, the default canary bounds) with a
    small canary; the model of `model_dir` on a 2-device fsdp mesh (3 sequences: the batch is padded to the mesh)."""
    import flax.nnx as nnx
    import jax

    from cisjax import config as config_lib
    from cisjax import sharding
    from cisjax.models import hf_io

    cfg = config_lib.load(
        None,
        [
            "--config.publish.canary.num_sequences=3",
            "--config.publish.canary.prompt_len=8",
            "--config.publish.canary.response_len=12",
        ],
    )
    mesh = sharding.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    rules = sharding.rules_from_config(None)
    model, _, hf = hf_io.load(model_dir, mesh=mesh, rules=rules, **spec_of(cfg).runtime.model_kwargs())
    graphdef, params = nnx.split(model, nnx.Param)
    return dict(cfg=cfg, mesh=mesh, rules=rules, hf=hf, graphdef=graphdef, params=params)


def publish_cfg(trainer, **publish):
    """The trainer's config with these `publish` settings."""
    cfg = trainer["cfg"].copy_and_resolve_references()
    for k, v in publish.items():
        cfg.publish[k] = v
    return cfg


def publisher(trainer, client, root, **publish):
    """A Publisher of the trainer's model to `client` (a RolloutClient or a RolloutFleet), exports under `root`."""
    from cisjax.train.publish import Publisher

    t = trainer
    return Publisher(
        t["graphdef"], t["hf"], spec_of(publish_cfg(t, **publish)).publish, client, t["mesh"], t["rules"], root=root
    )


def changed(params, seed, scale=0.1):
    """Every parameter moved by `scale` of its own std: a change the canary must see when the engine misses it."""
    import jax

    rng = np.random.default_rng(seed)

    def one(x):
        host = np.asarray(x)
        moved = (host + scale * host.std() * rng.standard_normal(host.shape)).astype(host.dtype)
        return jax.device_put(moved, x.sharding)

    return jax.tree.map(one, params)


def old_tensors(trainer) -> dict:
    """The HF tensors (bf16, as published) of the trainer's initial params: what an engine that missed a change holds."""
    from cisjax.models import hf_io

    return {
        name: np.asarray(a)
        for name, a in hf_io.iter_tensors((trainer["graphdef"], trainer["params"]), trainer["hf"], "bfloat16")
    }


def stale_of(client, old):
    """`client`'s update_weights_from_tensors that consumes the publisher's stream and sends the `old` tensors."""
    honest = client.update_weights_from_tensors

    def stale(tensors, *, version, chunk_bytes=1 << 20):
        for _ in tensors.items():
            pass
        return honest(old, version=version)

    return stale
