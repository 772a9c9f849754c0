"""The optional C fast path of the shm channel (src/unison/_ring.c). Everything else is in
pyproject.toml. ``optional=True``: where it cannot build (no compiler), the install goes on
and unison uses its pure-Python ring (channel/shm.py picks it automatically)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("unison._ring", ["src/unison/_ring.c"], optional=True,
                             extra_compile_args=["-O2"])])
