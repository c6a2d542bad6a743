"""Build hook (metadata in pyproject.toml): the wheel carries configs/ as cisjax/_configs (cisjax.config.configs_dir)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONFIGS = Path(__file__).resolve().parent / "configs"
SHIPPED = "cisjax/_configs"  # inside the built package: cisjax.config.SHIPPED_CONFIGS


class BuildPy(build_py):
    """build_py, then configs/ (the config files, with models/*.json that they name) copied into the built package.
    The checkout keeps them at the top level, where a user edits them; an editable install reads them there."""

    def _config_files(self) -> list[Path]:
        if not (CONFIGS / "base.py").is_file():
            raise FileNotFoundError(f"{CONFIGS / 'base.py'} is missing: the wheel must ship configs/")
        return [p for p in sorted(CONFIGS.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        shutil.rmtree(Path(self.build_lib, SHIPPED), ignore_errors=True)  # no file left from an earlier build
        for src in self._config_files():
            dst = Path(self.build_lib, SHIPPED, src.relative_to(CONFIGS))
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)

    def get_outputs(self, include_bytecode=True):
        extra = [str(Path(self.build_lib, SHIPPED, p.relative_to(CONFIGS))) for p in self._config_files()]
        return super().get_outputs(include_bytecode) + ([] if getattr(self, "editable_mode", False) else extra)


setup(cmdclass={"build_py": BuildPy})
