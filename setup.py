"""The one native part of kvwatch: the CPU seal's loop over page pointers
(engine_hooks/_pageloop.c). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("engine_hooks._pageloop", ["engine_hooks/_pageloop.c"])])
