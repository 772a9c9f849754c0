"""How a worker starts: it imports from the controller's sys.path, never from the directory
the controller happens to run in (``python -c`` would put that first: a ``numpy.py`` lying
in /tmp must not run in the workers)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = """
    import os, sys
    import unison

    def probe():
        import numpy
        import helper_mod_of_the_script
        return [numpy.__name__, helper_mod_of_the_script.VALUE]

    with unison.Session(2) as sess:
        print(sess.run(probe))
"""


def test_a_broken_module_in_the_cwd_is_not_imported_but_the_scripts_path_is(tmp_path):
    script_dir = tmp_path / "scripts"
    cwd = tmp_path / "elsewhere"
    script_dir.mkdir()
    cwd.mkdir()
    (script_dir / "main.py").write_text(textwrap.dedent(SCRIPT))
    (script_dir / "helper_mod_of_the_script.py").write_text("VALUE = 42\n")
    (cwd / "numpy.py").write_text("raise RuntimeError('the cwd was imported from')\n")
    proc = subprocess.run([sys.executable, str(script_dir / "main.py")], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "[['numpy', 42], ['numpy', 42]]" in proc.stdout
    assert "the cwd was imported from" not in proc.stderr


def test_the_cwd_is_honoured_when_the_controllers_sys_path_has_it(tmp_path):
    (tmp_path / "mod_in_the_cwd.py").write_text("VALUE = 'from the cwd'\n")
    code = """
        import sys
        import unison
        assert "" in sys.path  # python -c: the cwd is on the controller's path

        def probe():
            import mod_in_the_cwd
            return mod_in_the_cwd.VALUE

        with unison.Session(1) as sess:
            print(sess.run(probe))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "['from the cwd']" in proc.stdout


def test_the_modules_a_worker_imports_have_their_bytecode():
    """An editable install compiles unison's bytecode (setup.py's build_ext, as pip does for a
    regular install): where Python may not write its cache (PYTHONDONTWRITEBYTECODE), every
    worker of every session would otherwise compile the sources again at its start (issue 9:
    start at N=4 on 2 vCPUs, 350-368 ms against 264-275; docs/benchmarks.md, twelfth pass)."""
    import importlib.util

    import unison.channel.shm
    import unison.collective.shm
    import unison.protocol
    import unison.worker

    for mod in (unison.worker, unison.protocol, unison.channel.shm, unison.collective.shm):
        cached = importlib.util.cache_from_source(mod.__file__)
        assert os.path.exists(cached), f"{mod.__name__} has no bytecode at {cached}"
