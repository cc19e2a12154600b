"""Test-only stand-in for ``sgl_kernel`` (SGLang's CUDA/CPU kernel package), PD bed only.

``sgl_kernel`` has no CPU build on the package index, and SGLang 0.5.23 imports it at module
level (``kernels/ops/kvcache/cache_move.py``). This stand-in registers no ``torch.ops``, so
SGLang's AMX detection fails and every layer takes its ``forward_native`` path; any name taken
from it (``from sgl_kernel import silu_and_mul``, ``sgl_kernel.kvcacheio``) raises when called,
so a path that needs a real kernel fails loudly, never silently computes something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvwatch.standin"


class _AnyAttribute(type):
    """Class attributes (``scalar_types.uint4b8``) are placeholders too."""

    def __getattr__(cls, name: str) -> Any:
        return placeholder(f"{cls.__module__}.{cls.__name__}", name)


def placeholder(module: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    class Unavailable(metaclass=_AnyAttribute):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{module}.{name}: sgl_kernel is a CPU test-bed stand-in here")

    Unavailable.__name__ = Unavailable.__qualname__ = name
    Unavailable.__module__ = module
    return Unavailable


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel.<anything>`` imports as a module of placeholders."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: placeholder(spec.name, name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Submodules())
