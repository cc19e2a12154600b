"""What pyproject.toml cannot say: the native CPU seal loop and the operator's files in the wheel.

- ``engine_hooks/_pageloop.c``: one native loop over page pointers for the CPU seal. Optional: where
  no C compiler is at hand the build goes on and the seal falls back to one call per page.
- The dashboards, rules, Grafana alert provisioning and deploy files live once, at the top of the
  repository where their generators write them; ``kvwatch/assets.py`` (``KINDS``) maps them into the
  package, and this copies them there when the wheel is built.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithAssets(build_py):
    def run(self) -> None:
        super().run()
        # Read the mapping without importing kvwatch: its dependencies need not be installed here.
        kinds = runpy.run_path(str(ROOT / "kvwatch" / "assets.py"))["KINDS"]
        for kind, files in kinds.items():
            for name, source in files.items():
                target = Path(self.build_lib, "kvwatch", "assets", kind, name)
                self.mkpath(str(target.parent))
                self.copy_file(str(ROOT / source), str(target))


setup(
    cmdclass={"build_py": BuildWithAssets},
    ext_modules=[
        Extension("engine_hooks._pageloop", ["engine_hooks/_pageloop.c"], optional=True),
    ],
)
