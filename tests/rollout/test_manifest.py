"""The export-directory manifest: written, read back, verified; each kind of damage named."""

import hashlib
import json
import subprocess
import sys

import pytest

from cisjax.rollout import manifest

FILES = {"config.json": b'{"architectures": ["X"]}', "model.safetensors": bytes(range(256)) * 40, "empty.bin": b""}


@pytest.fixture
def export_dir(tmp_path):
    d = tmp_path / "v000003"
    d.mkdir()
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    return d


def test_sha256_file_matches_hashlib_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "CHUNK", 7)  # many chunks, the last one short
    data = b"0123456789abcdef" * 5 + b"xyz"
    (tmp_path / "f").write_bytes(data)
    assert manifest.sha256_file(tmp_path / "f") == (hashlib.sha256(data).hexdigest(), len(data))
    (tmp_path / "e").write_bytes(b"")
    assert manifest.sha256_file(tmp_path / "e", fsync=True) == (
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        0,
    )


def test_round_trip(export_dir):
    written = manifest.write(export_dir, {"version": 3, "metadata": {"source": "test"}})
    on_disk = json.loads((export_dir / manifest.NAME).read_text())
    assert written == on_disk
    assert list(on_disk) == ["format", "version", "metadata", "files"]
    assert on_disk["format"] == "cisjax-export/1" == manifest.FORMAT and on_disk["version"] == 3
    assert on_disk["files"] == {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in FILES.items()
    }
    assert manifest.read(export_dir) == on_disk
    assert manifest.verify(export_dir) == on_disk
    manifest.check_sizes(export_dir)
    assert manifest.recorded_checksums(export_dir) == {
        name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()
    }


def test_digests_given_are_trusted_and_heartbeat_runs_per_hashed_file(export_dir):
    beats = []
    written = manifest.write(
        export_dir, {}, digests={"model.safetensors": "ab" * 32}, heartbeat=lambda: beats.append(1)
    )
    assert written["files"]["model.safetensors"] == {"size": len(FILES["model.safetensors"]), "sha256": "ab" * 32}
    assert len(beats) == 2  # config.json and empty.bin were hashed here
    with pytest.raises(manifest.ManifestError, match=r"model\.safetensors: sha256 .* differs from the manifest's abab"):
        manifest.verify(export_dir)


def test_a_flipped_byte_is_named(export_dir):
    manifest.write(export_dir, {"version": 3})
    path = export_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[5000] ^= 0x01
    path.write_bytes(bytes(data))
    manifest.check_sizes(export_dir)  # same size: only hashing sees it
    with pytest.raises(
        manifest.ManifestError, match=rf"{path}: sha256 {hashlib.sha256(data).hexdigest()} differs .*\(corrupted\)"
    ):
        manifest.verify(export_dir)


def test_a_truncated_file_is_named(export_dir):
    manifest.write(export_dir, {})
    (export_dir / "model.safetensors").write_bytes(FILES["model.safetensors"][:-1])
    size = len(FILES["model.safetensors"])
    with pytest.raises(
        manifest.ManifestError, match=rf"model\.safetensors: size {size - 1} bytes, the manifest says {size}"
    ):
        manifest.verify(export_dir)
    with pytest.raises(
        manifest.ManifestError,
        match=rf"v000003: model\.safetensors is missing or not the {size} bytes its manifest\.json lists",
    ):
        manifest.check_sizes(export_dir)


def test_a_missing_and_an_unexpected_file_are_named(export_dir):
    manifest.write(export_dir, {})
    (export_dir / "empty.bin").unlink()
    with pytest.raises(manifest.ManifestError, match=r"file empty\.bin is missing \(listed in manifest\.json\)"):
        manifest.verify(export_dir)
    with pytest.raises(manifest.ManifestError, match=r"empty\.bin is missing or not the 0 bytes"):
        manifest.check_sizes(export_dir)
    (export_dir / "empty.bin").write_bytes(b"")
    (export_dir / "stray.txt").write_text("x")
    with pytest.raises(manifest.ManifestError, match=r"unexpected file stray\.txt \(not in manifest\.json\)"):
        manifest.verify(export_dir)


def test_no_manifest_and_no_directory(tmp_path, export_dir):
    with pytest.raises(manifest.ManifestError, match=r"v000003: not a complete export \(no manifest\.json\)"):
        manifest.read(export_dir)
    assert manifest.recorded_checksums(export_dir) is None
    manifest.check_sizes(export_dir)  # a plain HF directory passes the cheap check
    with pytest.raises(manifest.ManifestError, match="no such export directory"):
        manifest.read(tmp_path / "nope")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            json.dumps({"format": "cisjax-export/0", "files": {}}),
            r"not a cisjax-export/1 manifest \(format 'cisjax-export/0'\)",
        ),
        (json.dumps(["cisjax-export/1"]), r"not a cisjax-export/1 manifest \(format None\)"),
        ("{not json", "unreadable manifest"),
        (json.dumps({"format": "cisjax-export/1", "files": {"a": {"size": 1}}}), "malformed 'files' table"),
    ],
)
def test_a_bad_manifest_is_named(export_dir, text, message):
    (export_dir / manifest.NAME).write_text(text)
    with pytest.raises(manifest.ManifestError, match=message) as err:
        manifest.read(export_dir)
    assert str(export_dir / manifest.NAME) in str(err.value)
    assert manifest.recorded_checksums(export_dir) is None
    with pytest.raises(manifest.ManifestError, match=message):
        manifest.check_sizes(export_dir)


def test_a_symlink_is_refused(export_dir):
    (export_dir / "link").symlink_to(export_dir / "config.json")
    with pytest.raises(manifest.ManifestError, match=r"link: not a regular file in an export"):
        manifest.write(export_dir, {})
    assert not (export_dir / manifest.NAME).exists()


def test_imports_neither_jax_nor_vllm():
    code = "import sys, cisjax.rollout.manifest; print(sorted({'jax', 'vllm', 'flax'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
