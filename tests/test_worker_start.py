"""How a worker starts: it imports from the controller's sys.path, never from the directory
the controller happens to run in (``python -c`` would put that first: a ``numpy.py`` lying
in /tmp must not run in the workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

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


def test_a_worker_waiting_for_its_spec_leaves_when_its_starter_goes(tmp_path):
    """Its stdin may outlive the process that started it (a child that process forked holds
    a copy; here, this test): a worker still waiting for its spec looks at its parent each
    second, and leaves once it has changed."""
    import psutil

    code = """
        import os, subprocess, sys
        worker = subprocess.Popen(
            [sys.executable, "-c", f"from unison.worker import main; main({os.getpid()})"],
            stdin=int(sys.argv[1]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(worker.pid, flush=True)
    """
    r, w = os.pipe()
    try:
        try:
            starter = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(r)],
                                     pass_fds=(r,), capture_output=True, text=True,
                                     timeout=60, env=dict(os.environ))
        finally:
            os.close(r)
        worker = psutil.Process(int(starter.stdout))  # an orphan now; we still hold its stdin
        try:
            worker.wait(5)
        except psutil.TimeoutExpired:
            worker.kill()
            raise AssertionError("the worker still waits for its spec from a starter that is "
                                 "gone") from None
    finally:
        os.close(w)
    assert not worker.is_running()


CLOSED_STD_FD = """
    import os, sys
    import unison

    log = open({log!r}, "w", buffering=1)
    for n, channel in ((1, "auto"), (2, "auto"), (2, "pipe")):
        try:
            os.close({fd})  # as a daemon, cron or `prog <&-` starts the controller
        except OSError:
            pass
        with unison.Session(n, channel=channel, start_timeout=20) as sess:
            log.write(f"{{n}} {{channel}} {{sess.run(unison.rank, timeout=20)}}\\n")
"""


@pytest.mark.parametrize("fd", [0, 1, 2])
def test_a_controller_started_with_a_standard_stream_closed_starts_sessions(tmp_path, fd):
    # before, the session's memfds and pipes took the closed number, which each worker's
    # start then set to its own stdin, stdout or stderr: shm workers died at start
    # (PermissionError mapping the ring); the pipe channel waited for good with fd 1 closed
    log = tmp_path / "log"
    code = textwrap.dedent(CLOSED_STD_FD.format(log=str(log), fd=fd))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["1 auto [0]", "2 auto [0, 1]", "2 pipe [0, 1]"]


FD_STARVED = """
    import errno, os, resource, sys
    import unison

    def fds():
        return {f: os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{f}")}

    n, channel = int(sys.argv[1]), sys.argv[2]
    base = fds()
    for limit in range(len(base) + 2, 80):  # just enough fds for part of the start, then more
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, 1024))
        try:
            unison.Session(n, channel=channel).close()
            err = None
        except OSError as exc:
            err = exc
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        left = {f: path for f, path in fds().items() if f not in base}
        if err is None:
            print("started at", limit, "left", left)
            break
        print("failed at", limit, err.errno == errno.EMFILE and "ulimit -n" in str(err),
              "left", left)
"""


@pytest.mark.parametrize("n, channel", [(1, "shm"), (2, "shm"), (2, "pipe")])
def test_a_start_out_of_fds_leaks_none_and_says_to_raise_the_limit(tmp_path, n, channel):
    # before, the channel's memfds and eventfds, the pipes made before a later one failed
    # and the cancellation board's memfd stayed open, and the error was a bare EMFILE
    code = textwrap.dedent(FD_STARVED)
    proc = subprocess.run([sys.executable, "-c", code, str(n), channel], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    shown = "\n".join(line[:300] for line in lines[:8])
    assert lines[-1].startswith("started at") and len(lines) > 5, shown
    assert all(line.endswith("left {}") for line in lines), shown
    assert all(" True left" in line for line in lines[:-1]), shown


INTERPRETER = """
    import json, os, sys
    sys.path.insert(0, {root!r})  # (-E and -I ignore PYTHONPATH)
    import unison

    def interpreter():
        return [repr(sys.flags), sys.warnoptions, sys._xoptions]

    got = {{}}
    for n in (1, 2):  # a lone worker starts as an interpreter of its own; two, from a zygote
        with unison.Session(n) as sess:
            got[n] = sess.run(interpreter)
    if sys.flags.ignore_environment:
        try:
            unison.Session(2, env={{1: {{"PYTHONHASHSEED": "0"}}}})
        except ValueError as exc:
            got["refused"] = str(exc)
    print(json.dumps([interpreter(), got]))
"""


@pytest.mark.parametrize("flags", [
    ["-O", "-W", "error::RuntimeWarning", "-b", "-X", "utf8", "-X", "int_max_str_digits=900"],
    ["-I", "-X", "faulthandler", "-B"],
])
def test_the_workers_start_with_the_controllers_interpreter_options(flags):
    """The workers started as plain ``python -c``: under ``python -O`` they ran the asserts
    the controller skipped, under ``-W error`` they returned inf where the controller
    raised, under ``-I`` they read the PYTHONOPTIMIZE it ignored. Now they, and the zygote
    that forks them, start with the controller's options."""
    import unison

    root = os.path.dirname(os.path.dirname(os.path.abspath(unison.__file__)))
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)  # (its filters would come twice: by -W, and from here)
    if "-I" in flags:
        env["PYTHONOPTIMIZE"] = "2"  # what -I ignores, and the workers with it
    proc = subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(
        INTERPRETER.format(root=root))], capture_output=True, text=True, timeout=120,
        env=env)
    assert proc.returncode == 0, proc.stderr
    mine, got = json.loads(proc.stdout)
    assert got["1"] == [mine] and got["2"] == [mine, mine]
    if "-I" in flags:
        assert "isolated=1" in mine[0] and "optimize=0" in mine[0]
        assert "env[1] sets PYTHONHASHSEED, which the worker would ignore" in got["refused"]
    else:
        assert "optimize=1" in mine[0] and "error::RuntimeWarning" in mine[1]


NO_SITE = """
    import sys
    sys.path[:0] = {paths!r}  # what site would have added: -S leaves it to the script
    import unison

    for n in (1, 2):
        with unison.Session(n) as sess:
            print(sess.run(sum, [n, 1]))
"""


def test_a_controller_under_dash_s_that_finds_its_libraries_itself_starts_its_workers():
    """``python -S`` reached the workers, whose bootstrap imports unison.worker (numpy,
    cloudpickle) before the controller's sys.path is theirs: a controller that put
    site-packages on its path by hand had every worker die of ModuleNotFoundError. -S is
    the one option the workers do not take (their sys.path is the controller's)."""
    import site

    import unison

    root = os.path.dirname(os.path.dirname(os.path.abspath(unison.__file__)))
    paths = [root, *site.getsitepackages()]
    proc = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(
        NO_SITE.format(paths=paths))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[2]", "[3, 3]"], proc.stdout
