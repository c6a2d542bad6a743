"""Compile targets: names as users type them, the deviceless devices, and the usable HBM against the TPU compiler."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cisjax.plan import hardware
from tests.support.programs import fresh_process_json


@pytest.mark.parametrize(
    "name, chip, chips, topology",
    [
        ("v5p-16", "v5p", 8, "2x2x2"),
        ("v5p-8", "v5p", 4, "2x2x1"),
        ("v5p-64", "v5p", 32, "2x4x4"),
        ("v4-32", "v4", 16, "2x2x4"),
        ("v5e-16", "v5e", 16, "4x4"),
        ("v5litepod-16", "v5e", 16, "4x4"),
        ("v6e-64", "v6e", 64, "8x8"),
        ("v5p:2x2x2", "v5p", 8, "2x2x2"),
        ("v6e:4x8", "v6e", 32, "4x8"),
        ("h100x8", "h100", 8, "1x1x8"),
        ("H100x16", "h100", 16, "1x2x8"),
        ("a100x1", "a100", 1, "1x1x1"),
    ],
)
def test_target_names(name, chip, chips, topology):
    t = hardware.target(name)
    assert (t.chip.name, t.chips, t.topology) == (chip, chips, topology)


@pytest.mark.parametrize(
    "name, message",
    [
        ("v5p-7", "TensorCores"),  # odd core count: v5p chips have two
        ("v5p-12", "no v5p slice of 6 chips"),
        ("v5e-3", "no v5e slice of 3 chips"),
        ("v5p:2x2", "3 positive dimensions"),
        ("h100x12", "multiple of 8"),
        ("tpu-8", "unknown target"),
    ],
)
def test_bad_target_names(name, message):
    with pytest.raises(ValueError, match=message):
        hardware.target(name)


@pytest.mark.parametrize(
    "name, kind", [("v5p-16", "TPU v5"), ("v4-32", "TPU v4"), ("v5e-16", "TPU v5 lite"), ("v6e-8", "TPU v6 lite")]
)
def test_tpu_devices_compile_only(name, kind):
    t = hardware.target(name)
    devices = t.devices()
    assert len(devices) == t.chips  # v4 in megacore mode: one device per chip, as on a v4 VM
    assert devices[0].device_kind == kind and devices[0].platform == "tpu"


@pytest.mark.parametrize("chip", sorted(hardware.TPU_CHIPS))
def test_usable_hbm_is_what_the_compiler_allows(chip):
    """The table's usable HBM is the figure the TPU compiler names when a program is too big for the chip."""
    devices = hardware.target(f"{chip}-{4 * hardware.TPU_CHIPS[chip].cores_per_chip}").devices()
    mesh = Mesh(np.asarray(devices), ("x",))
    big = jax.ShapeDtypeStruct((len(devices) * 2**20, 2**16), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as err:
        jax.jit(lambda x: x * 2).lower(big).compile()
    available = float(re.search(r"exceeds available HBM \(([\d.]+)G\)", str(err.value))[1])
    assert available == pytest.approx(hardware.TPU_CHIPS[chip].usable_bytes / 2**30, abs=0.006)


def test_gpu_target_config_fields():
    chip, spec = hardware.GPU_CHIPS["h100"]
    text = hardware.gpu_target_config(spec, chip)
    assert "core_count: 132" in text and "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert f"device_memory_size: {int(80e9)}" in text and 'platform_name: "CUDA"' in text
    assert chip.usable_bytes == pytest.approx(80e9 * hardware.GPU_MEM_FRACTION)


def test_libtpu_dir_is_found_off_the_import_path(tmp_path, monkeypatch):
    """`make setup` puts libtpu in <environment>/libtpu, off the import path; $CISJAX_LIBTPU_DIR names another."""
    monkeypatch.setenv(hardware.LIBTPU_ENV, str(tmp_path))
    assert hardware.libtpu_dir() is None  # no libtpu/libtpu.so there
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "libtpu.so").write_bytes(b"")
    assert hardware.libtpu_dir() == tmp_path


def test_jax_starts_quietly_without_libtpu_on_the_path():
    """A JAX process that does not plan (no JAX_PLATFORMS, no TPU settings) prints nothing of libtpu's: it is not on
    the import path, so JAX does not start it on a machine without a TPU."""
    # (TPU_LIBRARY_PATH: set in this process by an import of libtpu, by the plans of other tests)
    quiet = (
        "JAX_PLATFORMS",
        "TPU_ACCELERATOR_TYPE",
        "TPU_WORKER_HOSTNAMES",
        "ALLOW_MULTIPLE_LIBTPU_LOAD",
        "TPU_LIBRARY_PATH",
    )
    env = {k: v for k, v in os.environ.items() if k not in quiet}
    code = (
        "import importlib.util, jax; print(importlib.util.find_spec('libtpu') is not None, jax.devices()[0].platform)"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    importable, platform = res.stdout.split()
    if importable == "True":
        pytest.skip("libtpu is installed in this environment (one built before `make setup` kept it off the path)")
    assert platform != "tpu" and not [line for line in res.stderr.splitlines() if "TPU" in line.upper()], res.stderr


def test_enable_libtpu_adds_its_folder_or_names_the_install(tmp_path, monkeypatch):
    """Where libtpu is not importable, a TPU target's devices put its folder on the import path (JAX imports libtpu
    when it first builds a TPU topology); without one, the error names the install."""
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(hardware.LIBTPU_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="make setup"):
        hardware.enable_libtpu()
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "libtpu.so").write_bytes(b"")
    hardware.enable_libtpu()
    hardware.enable_libtpu()  # once on the path
    assert sys.path.count(str(tmp_path)) == 1


def test_the_decode_attention_kernel_compiles_for_a_v5p():
    """cisjax.models.decode_attention's TPU kernel, libtpu compiling for a deviceless v5p (cisjax plan's targets; a fresh process: libtpu): "splash" runs the TPU
    kernel, and a decode step's attention over Qwen3-30B-A3B's heads (32 query, 4 kv, of 128) and 1,536 slots
    compiles through Mosaic to one custom call."""
    out = fresh_process_json(
        """
        import json
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cisjax import sharding
        from cisjax.models import decode_attention
        from cisjax.plan import hardware

        mesh = sharding.make_mesh({"fsdp": 4}, hardware.target("v5p-8").devices())
        spec = NamedSharding(mesh, P("fsdp"))
        b, n, kv, h, s = 16, 32, 4, 128, 1536
        shapes = [((b, 1, n, h), jnp.bfloat16), ((b, kv, s, h), jnp.bfloat16), ((b, kv, s, h), jnp.bfloat16),
                  ((b, 1, s), jnp.bool_)]
        args = [jax.ShapeDtypeStruct(shape, dt, sharding=spec) for shape, dt in shapes]

        def run(q, k, v, mask):
            with sharding.use_mesh(mesh):
                return decode_attention.attend(q, k, v, mask, h**-0.5, "splash")

        text = jax.jit(run).lower(*args).compile().as_text()
        print(json.dumps({"mosaic_calls": text.count('custom_call_target="tpu_custom_call"')}))
        """
    )
    assert out == {"mosaic_calls": 1}
