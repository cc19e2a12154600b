"""Test-only stand-in for ``torchvision.transforms.v2``: see ``torchvision/_standin.py``."""

from typing import Any

from torchvision._standin import placeholder


def __getattr__(name: str) -> Any:
    return placeholder(__name__, name)
