"""The optional C fast paths: the shm channel's command ring (src/unison/_ring.c) and a
small allreduce's steps (src/unison/_coll.c). Everything else is in pyproject.toml.
``optional=True``: where they cannot build (no compiler), the install goes on and unison
uses pure Python instead (channel/shm.py and collective/shm.py pick it automatically)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("unison._ring", ["src/unison/_ring.c"], optional=True,
              extra_compile_args=["-O2"]),
    # no fused multiply-add: every rank's reduction must give numpy's bits
    Extension("unison._coll", ["src/unison/_coll.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off"]),
])
