"""Test-only stand-in for torchvision, used only by kvwatch's SGLang tests.

SGLang imports torchvision at module level (vision model helpers); the tests never run vision
code, and the real wheel would pull a second torch. Every attribute of every module here is a
placeholder class that raises when instantiated; a name that is one of our submodules imports it.
"""

from __future__ import annotations

import importlib
from typing import Any


class _AnyAttribute(type):
    """Class attributes (``InterpolationMode.BILINEAR``) are placeholders too."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__module__}.{cls.__name__}", name)


def placeholder(module: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if module.startswith("torchvision") and name[:1].islower():
        try:
            return importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            pass

    class Unavailable(metaclass=_AnyAttribute):
        """Raises on use: the kvwatch SGLang tests never run vision code."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{module}.{name}: torchvision is a test stand-in here")

    Unavailable.__name__ = Unavailable.__qualname__ = name
    Unavailable.__module__ = module
    return Unavailable
