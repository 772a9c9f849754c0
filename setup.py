"""The optional C fast paths: the shm channel's command ring (src/unison/_ring.c) and a
small allreduce's steps (src/unison/_coll.c). Everything else is in pyproject.toml.
``optional=True``: where they cannot build (no compiler), the install goes on and unison
uses pure Python instead (channel/shm.py and collective/shm.py pick it automatically)."""

import compileall
import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """The extensions; then, for an editable install (built in place), the package's bytecode
    too. pip compiles a regular install's bytecode, never an editable one's; and where Python
    may not write its cache (PYTHONDONTWRITEBYTECODE, a read-only tree) every process then
    compiles unison's sources again, each worker of every session included: start at N=4 on
    2 vCPUs took 350-368 ms from the sources, 264-275 from their bytecode (docs/benchmarks.md,
    issue 9's twelfth pass, with its command). A stale file is never used: Python checks each
    against its source."""

    def run(self) -> None:
        self.force = True  # by mtime alone, a build/ folder left from an older _ring.c was
        super().run()  # kept, and went into a wheel (its digest then refused it at import)
        if self.inplace:
            compileall.compile_dir(str(Path(__file__).resolve().parent / "src" / "unison"),
                                   quiet=1)


def source(path: str) -> list[tuple[str, str]]:
    """``SOURCE``, the start of the C file's sha256 (unison._native.source_digest, which
    setup.py cannot import before the install): unison refuses a module built from another
    version of its file, as after a ``git pull`` without a rebuild."""
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return [("UNISON_SOURCE", f'"{digest}"')]


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[
    Extension("unison._ring", ["src/unison/_ring.c"], optional=True,
              define_macros=source("src/unison/_ring.c"), extra_compile_args=["-O2"]),
    # no fused multiply-add: every rank's reduction must give numpy's bits
    Extension("unison._coll", ["src/unison/_coll.c"], optional=True,
              define_macros=source("src/unison/_coll.c"),
              extra_compile_args=["-O3", "-ffp-contract=off"]),
])
