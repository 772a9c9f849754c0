"""The benchmark harness (benchmarks/, outside the package) runs and produces numbers
(never a judgement of speed)."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness.measure import Cell, percentile  # noqa: E402
from harness.report import (  # noqa: E402
    END_MARK,
    START_MARK,
    render_floor_ratios,
    update_section,
)
from support import autogroup, wait_gone  # noqa: E402
from unison.cli import bench_script  # noqa: E402

SYSTEMS = ("unison", "pipe", "floor")
METRICS = {
    "dispatch": "us", "dispatch_script_fn": "us", "gather_small": "us",
    "fetch": "GB/s", "fetch_time": "ms", "fetch_memory": "x", "dispatch_hogs": "us",
}
BULK = ("fetch", "fetch_time", "fetch_memory")
"""Metrics the floor system does not offer."""


def test_quick_run_produces_numbers(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "benchmarks.md"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--workers", "1,2",
        "--only", "dispatch,dispatch_script_fn,gather_small,fetch,dispatch_hogs",
        "--fetch-mib", "1",
        "--systems", ",".join(SYSTEMS), "--json", str(out_json), "--out", str(out_md),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads(out_json.read_text())
    cells = {(c["system"], c["metric"], c["n"]): c for c in data["results"]}
    assert set(cells) == {(s, m, n) for s in SYSTEMS for m in METRICS for n in (1, 2)
                          if not (s == "floor" and m in BULK)}
    for key, cell in cells.items():
        assert cell["error"] is None, key
        assert cell["unit"] == METRICS[key[1]], key
        assert cell["samples"] > 0, key
        assert math.isfinite(cell["value"]), key
        # a 1 MiB result may fit in memory the allocator already holds: 0 extra is possible
        assert cell["value"] >= 0 if key[1] == "fetch_memory" else cell["value"] > 0, key
        if cell["p99"] is not None:
            assert cell["p99"] >= cell["value"], key

    text = out_md.read_text()
    assert START_MARK in text and END_MARK in text
    assert "| dispatch (µs, median / p99) | 2 |" in text
    assert "- CPU time stolen by the hypervisor during the run: " in text
    assert "| fetch 1 MiB (GB/s per worker) | 2 |" in text
    assert "Speed-up over the pipe baseline" in text
    assert "dispatch_script_fn / dispatch" in text
    assert "| dispatch_script_fn (µs, median / p99) | 1 |" in proc.stdout
    assert "| dispatch with 2 CPU hogs (µs, median / p99) | 2 |" in text
    assert "unison / floor" in text and "| N | dispatch: unison | gather_small: unison |" in text
    assert "dispatch_hogs: unison" in text  # read against the pipe too
    # (the hogs carry this run's marker: the leak check fails the test should one outlive it)


FLOOR_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from harness.systems.floor import FloorSystem
if __name__ == "__main__":
    system = FloorSystem()
    system.start(2)
    system.dispatch()
    pids = system.worker_pids()
    assert system.gather_small() == pids
    for _ in range(200):  # enough rounds for waits to take both the spin and sleep paths
        system.dispatch()
    if sys.argv[2] == "close":
        system.close()
    else:
        time.sleep(0.3)  # the workers are asleep on their eventfd by now
    print(*pids, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("end", ["close", "die"])
def test_floor_round_trips_and_leaves_nothing(tmp_path: Path, end: str) -> None:
    """The floor's workers answer, and leave when closed or when the controller dies (in a
    script: multiprocessing's resource tracker would outlive a test run in this process)."""
    (tmp_path / "ctl.py").write_text(FLOOR_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "ctl.py"), str(ROOT / "benchmarks"),
                           end], capture_output=True, text=True, timeout=60)
    assert proc.returncode == (0 if end == "close" else -signal.SIGKILL), proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    left = wait_gone(pids, 3.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert not [e for e in os.listdir("/dev/shm") if "floor" in e]


def test_floor_ratio_table() -> None:
    cells = [Cell(s, m, n, "us", value=v) for s, v in (("unison", 13.0), ("floor", 10.0))
             for m in ("dispatch", "gather_small") for n in (1, 2)]
    table = render_floor_ratios(cells, ["unison", "floor"], [1, 2])
    assert table.splitlines()[0] == "| N | dispatch: unison | gather_small: unison |"
    assert table.splitlines()[-1] == "| 2 | 1.30x | 1.30x |"


def test_start_is_read_against_bare_interpreters() -> None:
    cells = [Cell("unison", "start", 4, "ms", value=260.0), Cell("bare", "start", 4, "ms",
                                                                  value=200.0)]
    table = render_floor_ratios(cells, ["unison", "bare"], [4])
    assert table.splitlines()[0] == "| N | start: unison |"
    assert table.splitlines()[-1] == "| 4 | 1.30x |"


def test_bare_system_starts_interpreters() -> None:
    from harness.systems import make_system

    bare = make_system("bare")
    bare.start(2)  # returns once both have imported numpy and exited
    bare.close()


def _minor_faults() -> int:
    """This process's minor page faults so far (a mapped page's first touch is one)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _faults_reading(arrays: list[Any]) -> int:
    """The minor faults of reading every byte of ``arrays`` in this process."""
    before = _minor_faults()
    for a in arrays:
        float(a.sum())
    return _minor_faults() - before


def test_timed_fetch_pays_the_faults_of_reading_its_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """unison's ``ref.gather()`` returns arrays that map the workers' memory lazily: their
    page faults come with the first read of a block not fetched before. The fetch
    workload's timed op reads every page itself, so a user reading its result afterwards
    faults no more (before, those faults fell after the clock stopped, and only unison's
    figure left them out). Both reads below are of blocks no fetch used yet (a size not
    fetched before; the first result kept, so the second takes another block): a reused
    block's pages are mapped already, and reading them faults nowhere."""
    from harness import measure
    from harness.systems.unison_session import UnisonSystem

    timed: list[Callable[[], Any]] = []
    time_loop = measure.time_loop

    def keep_op(op: Callable[[], Any], loop: measure.Loop) -> list[int]:
        timed.append(op)
        return time_loop(op, loop)

    monkeypatch.setattr(measure, "time_loop", keep_op)
    system = UnisonSystem("unison", None)
    try:
        system.start(1)
        system.dispatch()
        measure._fetch_cells(system, 1, 16 << 20, measure.QUICK)
        system.hold(32 << 20)  # a size no fetch used yet: its blocks are not mapped
        first = system.fetch()
        untouched = _faults_reading(first)  # a fetch not read yet
        after_timed = _faults_reading(timed[0]())  # another block: ``first`` holds its own
        del first
    finally:
        system.close()
    if untouched < 16:
        pytest.skip(f"reading an untouched fetch faulted only {untouched} times here")
    assert len(timed) == 1 and after_timed < untouched / 4, (after_timed, untouched)


def _worker_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worker_faults_reading(a: Any) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    float(a.sum())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_timed_put_ends_once_the_workers_have_read_every_page() -> None:
    """unison's put maps the array into each worker lazily: the put workload's op has every
    worker read a byte of each page before it returns, so the page faults are timed (as the
    baselines' copies are); before, a worker faulted them in only when something read it.
    Both puts below land in blocks not read before: a reused block's pages are mapped in
    the worker already (its whole copy-on-write mapping of the arena)."""
    import numpy as np

    from harness.systems.unison_session import UnisonSystem

    a = np.ones((16 << 20) // 4, dtype=np.float32)
    system = UnisonSystem("unison", None)
    try:
        system.start(1)
        system.dispatch()
        sess = system.session
        ref = sess.put(a)
        untouched = sess.run(_worker_faults_reading, ref)[0]  # what reading it first costs
        before = sess.run(_worker_faults)[0]
        system.put(a)  # into another block (``ref`` holds the first): one not read yet
        during = sess.run(_worker_faults)[0] - before
        ref.free()
    finally:
        system.close()
    if untouched < 16:
        pytest.skip(f"reading an untouched put faulted only {untouched} times here")
    assert during >= untouched / 2, (during, untouched)


def test_touch_reads_a_byte_of_every_page() -> None:
    import mmap

    import numpy as np

    from harness.tasks import PAGE, touch

    pages = np.frombuffer(mmap.mmap(-1, 5 * PAGE), dtype=np.uint8)  # page-aligned
    pages[:] = np.repeat(1 << np.arange(5, dtype=np.uint8), PAGE)  # page i's bytes: 2**i
    part = pages[100:4 * PAGE + 50]  # from inside page 0 into page 4: each read once
    assert touch(part) == 31 and touch([part, part]) == 62
    assert touch(pages) == 31 + 16  # aligned: the last byte is page 4's second read
    assert touch(pages.reshape(5, PAGE).T) == 47  # F-contiguous: read in place
    assert touch(pages.reshape(5, PAGE)[:, ::2]) == 1 + 4 + 16 + 16  # a copy, read
    assert touch(np.empty(0)) == touch(None) == 0


def test_update_section_keeps_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    update_section(doc, "first\n")
    intro = doc.read_text().split(START_MARK)[0]
    assert intro.startswith("# Benchmarks")
    doc.write_text(doc.read_text() + "\nafterwards\n")
    update_section(doc, "second\n")
    text = doc.read_text()
    assert text == f"{intro}{START_MARK}\nsecond\n{END_MARK}\n\nafterwards\n"

    plain = tmp_path / "plain.md"
    plain.write_text("# Notes\n")
    update_section(plain, "third")
    assert plain.read_text() == f"# Notes\n\n{START_MARK}\nthird\n{END_MARK}\n"


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0], 99) == 3.0


def test_unison_bench_finds_the_checkout_script() -> None:
    """``unison bench`` runs benchmarks/run.py of the checkout (an installed wheel has none)."""
    assert bench_script() == ROOT / "benchmarks" / "run.py"


def test_cluster_bench_tcp_plain_writes_json_without_ray(tmp_path: Path) -> None:
    """What ``compare_revs.py --tcp`` reads: the TCP channel's dispatch to plain processes,
    as JSON, from a run that needs no Ray (so no Ray daemon starts beside it)."""
    out = tmp_path / "tcp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cluster_bench.py"), "--systems",
         "tcp-plain", "--workers", "1", "--quick", "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Ray" not in proc.stderr  # ray.init says "... this Ray cluster ..." on stderr
    assert "round 2 of 2" in proc.stderr
    cells = json.loads(out.read_text(encoding="utf-8"))
    assert [(c["system"], c["n"]) for c in cells] == [("unison TCP (plain processes)", 1)]
    assert 0 < cells[0]["median_us"] <= cells[0]["p99_us"]


def test_cluster_bench_ratio_cells_give_the_rounds_range() -> None:
    """A ratio cell: the pooled medians' ratio, then the range of the single rounds'."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cluster_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    tcp, actors = "unison TCP (Ray actors)", "Ray actor calls"
    results = {(tcp, 2): (100.0, 200.0), (actors, 2): (1200.0, 3000.0)}
    per_round = {(tcp, 2): [90.0, 100.0, 120.0], (actors, 2): [1080.0, 1200.0, 1080.0]}
    row = cluster_bench.render(results, [2], per_round).splitlines()[-1]
    assert row.endswith("| 12.0x (9.0-12.0) | n/a |"), row
    single = cluster_bench.render(results, [2]).splitlines()[-1]
    assert single.endswith("| 12.0x | n/a |"), single


def _tool(script: str, *args: str) -> str:
    """Run ``benchmarks/<script> args``; its stdout, once it exited 0 (else its stderr is the
    failure)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _last_rows(out: str, count: int) -> list[list[str]]:
    """The cells of the last ``count`` rows of the markdown table ``out`` ends with."""
    return [line.strip("| ").split(" | ") for line in out.splitlines()[-count:]]


def _half_unit(printed: str) -> float:
    """Half the last printed digit's unit: how far rounding may have moved the value."""
    decimals = len(printed.partition(".")[2])
    return 0.5 * 10.0 ** -decimals


def test_layers_measures_every_layer_against_the_floor() -> None:
    """benchmarks/layers.py: the floor, the channel alone and the session, one row per N;
    with --tails, each one's p99 / median and share of rounds at 3x+."""
    out = _tool("layers.py", "--workers", "1", "--seconds", "0.3", "--rounds", "1", "--tails")
    main, _, tails = out.strip().partition("\nTails:")
    tail_row = _last_rows(tails, 1)[0]
    assert tail_row[0] == "1" and len(tail_row) == 7, tail_row
    for cell in tail_row[1:]:
        ratio, share = cell.split(", ")
        assert float(ratio.rstrip("x")) >= 1.0 and 0 <= float(share.rstrip("%")) <= 100, cell
    row = _last_rows(main, 1)[0]
    assert row[0] == "1" and len(row) == 12, row
    # floor, channel run, channel quick, run, channel dispatch, dispatch; then each / floor
    times = [float(v) for v in row[1:7]]
    assert all(t > 0 for t in times), row
    floor, half_floor = times[0], _half_unit(row[1])
    for printed_time, printed_ratio in zip(row[2:7], row[7:]):  # of the unrounded times
        t, ht = float(printed_time), _half_unit(printed_time)
        ratio, hr = float(printed_ratio.rstrip("x")), _half_unit(printed_ratio.rstrip("x"))
        assert (t - ht) / (floor + half_floor) - hr <= ratio <= (
            t + ht) / (floor - half_floor) + hr, row


def test_session_parts_rebuilds_each_round_and_puts_each_piece_back() -> None:
    """benchmarks/session_parts.py: per N, dispatch's and run's kinds (the floor, the
    product, the lean round, each piece put back), each over the floor and the lean."""
    import session_parts

    if not session_parts.shm.NATIVE:
        pytest.skip("session_parts.py needs the shm channel's C ring")
    out = _tool("session_parts.py", "--workers", "1", "--seconds", "0.02", "--rounds", "2")
    kinds = {"dispatch": ("floor", "dispatch", "lean dispatch",
                          *(f"+ {p}" for p in session_parts.DISPATCH_PIECES)),
             "run": ("floor", "run", "lean run", *(f"+ {p}" for p in session_parts.RUN_PIECES))}
    count = sum(len(k) for k in kinds.values())
    rows = _last_rows(out, count)
    assert [(r[1], r[2]) for r in rows] == [(f, k) for f, ks in kinds.items() for k in ks]
    for row in rows:
        assert row[0] == "1" and float(row[3]) > 0, row
        assert row[4].endswith("x") and row[5].endswith("x"), row
    assert {r[4] for r in rows if r[2] == "floor"} == {"1.00x"}
    assert {r[5] for r in rows if r[2].startswith("lean")} == {"1.00x"}


def test_compare_revs_builds_a_checked_out_revision_like_this_checkout(tmp_path: Path) -> None:
    """A revision compare_revs checks out runs the same ring as this checkout: its C fast
    paths are built in place (a bare git worktree would run the pure-Python ring)."""
    import compare_revs
    from unison.channel import shm

    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      check=False).returncode:
        pytest.skip("not a git checkout")
    with compare_revs.checkout("base", "HEAD", tmp_path) as rev:
        assert rev.tree != ROOT
        assert compare_revs.check_import(rev) == shm.NATIVE


def test_layers_phases_split_a_round_where_the_controller_spends_it() -> None:
    """layers.py --phases: each phase of run and dispatch is timed, and they make up the round."""
    import layers

    got = layers.phases(1, rounds=300)
    assert set(got) == {"run", "dispatch"}
    assert set(got["run"]) == set(layers.PHASES)
    assert set(got["dispatch"]) == set(layers.PHASES) - {"after"}  # sync's wait ends it
    for name, split in got.items():
        parts = [v for k, v in split.items() if k != "total"]
        assert all(v >= 0 for v in parts) and split["total"] > 0, (name, split)
        assert sum(parts) == pytest.approx(split["total"], rel=0.5), (name, split)
    assert got["run"]["after"] > 0  # decoding the replies


def test_ab_worker_times_both_loops_and_the_lean_one_against_the_floor() -> None:
    """benchmarks/ab_worker.py: a base revision's worker loop and this tree's, nested in one
    session's workers, and the lean bound; one row per N and workload."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      check=False).returncode:
        pytest.skip("not a git checkout")
    rows = _last_rows(_tool("ab_worker.py", "--base", "HEAD", "--workers", "1", "--turns", "1",
                            "--per-turn", "30"), 2)
    assert [r[:2] for r in rows] == [["1", "dispatch"], ["1", "run"]], rows
    for row in rows:
        floor, base, head, lean = (float(v) for v in row[2:6])
        assert min(floor, base, head, lean) > 0, row
        # the ratio is of the unrounded times: within what rounding the printed ones allows
        hb, hh, hr = (_half_unit(v) for v in (row[3], row[4], row[6].rstrip("x")))
        ratio = float(row[6].rstrip("x"))
        assert (head - hh) / (base + hb) - hr <= ratio <= (head + hh) / (base - hb) + hr, row


def test_ab_controller_swaps_a_base_revisions_function_in_turns() -> None:
    """benchmarks/ab_controller.py: a base revision's controller function and this tree's,
    swapped on one live Session; both kinds timed for dispatch and gather_small."""
    out = _tool("ab_controller.py", "--base", "HEAD", "--swap", "unison.session.api:Session._sync",
                "--swap", "unison.channel.shm:ShmChannel.recv", "--workers", "1", "--turns", "2",
                "--per-turn", "50")
    rows = _last_rows(out, 2)
    assert [r[1] for r in rows] == ["dispatch", "gather_small"]
    for row in rows:
        base, head, ratio = float(row[2]), float(row[3]), float(row[4])
        assert base > 0 and head > 0
        # the ratio is of the unrounded times: within what rounding the printed ones allows
        # (a fixed 0.01 failed once on CI, at 12.11x: base 2.21 may have been 2.2149)
        hb, hh, hr = (_half_unit(v) for v in row[2:5])
        assert (head - hh) / (base + hb) - hr <= ratio <= (head + hh) / (base - hb) + hr, row


def test_python_cost_times_each_side_and_the_floor() -> None:
    """benchmarks/python_cost.py: each side's Python per round, the channel stubbed; the
    worker's rounds really ran their commands (the tool checks run's replies itself)."""
    rows = _last_rows(_tool("python_cost.py", "--rounds", "200"), 6)
    assert [r[0] for r in rows] == ["controller dispatch", "controller run", "worker dispatch",
                                    "worker run", "floor dispatch", "floor run"], rows
    for _, best, median in rows:
        assert 0 < float(best) <= float(median), rows


def test_python_cost_cold_times_each_controller_warm_and_after_a_sweep() -> None:
    """python_cost.py --cold: the controllers' rounds one at a time, back to back and each
    after a cache sweep, then the workers' loops the same way; both times are there for
    each."""
    rows = _last_rows(_tool("python_cost.py", "--cold", "--rounds", "30"), 7)
    assert [r[0] for r in rows] == ["controller dispatch", "controller run", "floor dispatch",
                                    "floor run", "worker dispatch", "worker run",
                                    "floor worker dispatch"], rows
    for _, warm, cold in rows:
        assert float(warm) > 0 and float(cold) > 0, rows


def test_python_cost_leaves_the_session_whole() -> None:
    """The stubs go with the block: the session then reaches its real workers again."""
    import python_cost
    import unison
    from harness.tasks import noop

    with unison.Session(2) as sess:
        with python_cost.stubbed(sess), python_cost.rounds("controller run", 50, sess) as it:
            assert list(it) == [None] * 50
        assert sess.run(unison.rank) == [0, 1]
        sess.call(noop)
        sess.sync()


def test_hogs_timeline_prints_points_per_tenth_of_a_second() -> None:
    """benchmarks/hogs_timeline.py: rounds beside hogs, one point per 0.1 s, with unison's
    run delay per round, and the points' medians by where the controller ran."""
    out = _tool("hogs_timeline.py", "--workers", "1", "--seconds", "0.35", "--hogs", "1",
                "--workload", "gather_small")
    lines = dict(line.split(": ", 1) for line in out.splitlines() if " N=1: " in line)
    assert set(lines) == {"unison N=1", "pipe N=1"}, out
    counts = [int(line.split(": ")[1].split()[0]) for line in out.splitlines()
              if line.startswith(("  on worker 0's CPU: ", "  apart: "))]
    for name, points in lines.items():
        fields = [p.rstrip("C=").split("/") for p in points.split()]
        assert len(fields) >= 3, points
        assert all(len(f) == (3 if name.startswith("unison") else 2) for f in fields), points
        assert all(float(f[0]) > 0 and int(f[1]) > 0 for f in fields), points
    assert sum(counts) == sum(len(points.split()) for points in lines.values()), out


def test_held_again_prints_a_line_per_block() -> None:
    """benchmarks/held_again.py: after each block, unison's and the floor's medians and
    the CPUs each unison worker may use."""
    out = _tool("held_again.py", "--workers", "2", "--blocks", "2", "--seconds", "0.05")
    lines = [line for line in out.splitlines() if "unison's workers may use" in line]
    assert len(lines) == 2, out
    for line in lines:
        assert float(line.split("unison")[1].split()[0]) > 0, line
        assert line.split("may use ")[1].startswith("[["), line


def test_blocks_alternates_systems_and_gives_unisons_ratios() -> None:
    """benchmarks/blocks.py: each system's block medians per workload and N, and unison's
    ratio to each other system from the medians it printed."""
    out = _tool("blocks.py", "--systems", "unison,floor,pipe", "--workers", "1", "--blocks",
                "3", "--seconds", "0.05")
    mid = {}
    for workload in ("dispatch", "gather_small"):
        for name in ("unison", "floor", "pipe"):
            line = next(x for x in out.splitlines()
                        if x.startswith(f"{workload} N=1 {name} ") and "median" in x)
            blocks, _, median = line.split(": ", 1)[1].partition(" | median ")
            assert len(blocks.split()) == 3 and all(float(b) > 0 for b in blocks.split()), line
            mid[name] = float(median.removesuffix(" µs"))
        ratios = next(x for x in out.splitlines() if x.startswith(f"{workload} N=1 unison /"))
        for name in ("floor", "pipe"):
            got = float(ratios.split(f"unison / {name}: ")[1].split("x")[0])
            assert got == pytest.approx(mid["unison"] / mid[name], rel=0.05, abs=0.01), ratios
            low, high = map(float, ratios.split(f"unison / {name}: ")[1].split("(90%: ")[1]
                            .split(")")[0].split("-"))
            assert low <= got <= high, ratios  # the blocks' own ratio lies in its interval
            line = next(x for x in out.splitlines() if x.startswith(f"{workload} N=1 {name}: "))
            assert "p99/median" in line and "% of rounds at 3x+" in line, line
    assert "N=1: CPU time stolen by the hypervisor meanwhile: " in out


def test_blocks_measures_workers_that_join_over_tcp() -> None:
    """The unison-tcp system: workers started as ``unison worker --connect``, joined over
    loopback; it measures as the others do, and leaves no worker behind (the suite's
    hygiene check)."""
    out = _tool("blocks.py", "--systems", "unison-tcp,pipe", "--workloads", "dispatch",
                "--workers", "2", "--blocks", "1", "--seconds", "0.02")
    line = next(x for x in out.splitlines() if x.startswith("dispatch N=2 unison-tcp: "))
    assert float(line.split(" | median ")[1].removesuffix(" µs")) > 0, out
    assert "dispatch N=2 unison-tcp / pipe: " in out, out


def test_interval_brackets_the_ratio_of_medians_and_reads_pairs_together() -> None:
    from harness.measure import interval

    base = [10.0, 12.0, 11.0, 30.0, 10.5, 11.5]
    assert interval([2 * b for b in base], base) == (2.0, 2.0)  # a pair moves as one
    low, high = interval([10.0, 20.0, 10.0, 20.0], [10.0, 10.0, 10.0, 10.0])
    assert 1.0 <= low < high <= 2.0
    assert interval(base, base, draws=50) == (1.0, 1.0)


def test_interval_leaves_out_its_share_of_draws_at_each_end() -> None:
    """A 90% interval of 20 draws leaves out the lowest and the highest draw (5% of 20 at
    each end); 20 * (1 - 0.9) / 2 is 0.9999999999999998 in floating point, which int() cut
    to 0, so the interval was every draw's range (and of 2000 draws it left out 99, not 100)."""
    from harness.measure import interval

    mine, theirs = [3.0, 9.0, 4.0, 12.0, 7.0, 5.0, 10.0, 6.0], [5.0] * 8
    lowest, highest = interval(mine, theirs, draws=20, level=1.0)  # every draw
    low, high = interval(mine, theirs, draws=20, level=0.9)
    assert lowest < low <= high < highest, (lowest, low, high, highest)


def test_steal_is_the_hypervisors_share_of_the_cpu_time_between_two_readings() -> None:
    from harness import report

    # user nice system idle iowait irq softirq steal guest guest_nice: guest lies in user
    before = [100, 0, 50, 800, 0, 0, 0, 50, 30, 0]
    after = [160, 0, 80, 900, 0, 0, 0, 60, 60, 0]
    assert report.steal(before, after) == "5.0%"  # 10 of 200
    assert report.steal(None, after) == "unknown"
    assert report.steal(before, before) == "unknown"
    assert report.cpu_ticks() is None or len(report.cpu_ticks() or []) >= 8


def test_added_work_prints_a_row_per_system_with_each_extra() -> None:
    """benchmarks/added_work.py: the round with D µs added on each side, floor and unison."""
    rows = _last_rows(_tool("added_work.py", "--workers", "1", "--extra", "5", "--reps", "1"), 2)
    assert [r[:2] for r in rows] == [["floor", "1"], ["unison", "1"]], rows
    for row in rows:
        base = float(row[2])
        for cell in row[3:]:
            median, _, growth = cell.partition(" (+")
            assert len(row) == 5 and base > 0, row
            assert float(growth.rstrip(")")) == pytest.approx(float(median) - base, abs=0.11), row


def test_switches_prints_sleeps_and_the_workers_scheduling_group() -> None:
    """benchmarks/switches.py: per round, each side's sleeps and switches, and how many
    workers share the controller's autogroup: all of unison's and the floor's."""
    rows = _last_rows(_tool("switches.py", "--workers", "2", "--seconds", "0.2", "--pin"), 2)
    assert [r[:2] for r in rows] == [["unison", "2"], ["floor", "2"]], rows
    for row in rows:
        assert len(row) == 10 and float(row[2]) > 0, row
        assert all(float(cell) >= 0 for cell in row[3:8]), row
        assert len(row[8].split()) == 2 and all(float(c) > 0 for c in row[8].split()), row
        assert row[9] == ("2/2" if autogroup() else "-"), row


def _perf_traces_syscalls() -> bool:
    """Whether ``perf stat`` can count the syscall tracepoints here (root, and perf)."""
    if shutil.which("perf") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["perf", "stat", "-e", "syscalls:sys_enter_sched_yield", "true"],
                           capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _perf_traces_syscalls(), reason="perf cannot count syscalls here")
def test_switches_syscalls_counts_each_sides_calls_and_yields() -> None:
    """switches.py --syscalls: a second table, each side's system calls per round and the
    sched_yields among them (never more yields than calls)."""
    out = _tool("switches.py", "--workers", "1", "--seconds", "0.3", "--syscalls")
    assert "System calls per round" in out, out
    rows = _last_rows(out, 2)
    assert [r[:2] for r in rows] == [["unison", "1"], ["floor", "1"]], rows
    for row in rows:
        calls, yields, worker_calls, worker_yields = map(float, row[2:6])
        assert calls >= yields >= 0 and worker_calls >= worker_yields >= 0, row
    assert float(rows[1][5]) > 0.5, rows  # the floor's worker yields while it waits


def test_allreduce_parts_splits_a_round_into_its_steps() -> None:
    """benchmarks/allreduce_parts.py: the whole allreduce, the same into one out array, its C
    steps and the Python around them, and each step of the numpy path, one row per N.
    Without the C steps (UNISON_PURE=1, or _coll not built) those two columns are nan."""
    from unison.collective import shm as coll_shm

    rows = _last_rows(_tool("allreduce_parts.py", "--workers", "1", "2", "--rounds", "300"), 2)
    assert [r[0] for r in rows] == ["1", "2"], rows
    for row in rows:
        whole, into, c_steps, python, *steps = map(float, row[1:])
        assert whole > 0 and into > 0 and all(s > 0 for s in steps), row
        if coll_shm._coll is None:
            assert math.isnan(c_steps) and math.isnan(python), row
            continue
        assert c_steps > 0 and python == pytest.approx(whole - c_steps, abs=0.05), row


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1")
def test_placement_gives_a_row_per_placement() -> None:
    """benchmarks/placement.py: a row per placement, in the order asked, each system's
    median and unison's ratio to it."""
    out = _tool("placement.py", "--workers", "2", "--places", "0|01,1|00,*|10,free",
                "--blocks", "1", "--seconds", "0.05", "--workload", "dispatch")
    rows = _last_rows(out, 4)
    assert [r[0] for r in rows] == ["0|01", "1|00", "*|10", "free"], out
    for row in rows:
        unison_us, floor_us, ratio = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
        assert unison_us > 0 and floor_us > 0, out
        assert ratio == pytest.approx(unison_us / floor_us, rel=0.05, abs=0.01), out
    assert "dispatch at N=2" in out


def test_placement_refuses_a_placement_it_cannot_hold() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "placement.py"),
                           "--workers", "2", "--places", "0|012"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "one digit per worker (2)" in proc.stderr, proc.stderr


_TRACING = Path("/sys/kernel/tracing")


@pytest.mark.skipif(not os.access(_TRACING / "trace", os.W_OK),
                    reason="needs a writable /sys/kernel/tracing (root)")
def test_sched_trace_says_where_each_process_ran_and_turns_the_event_off() -> None:
    """benchmarks/sched_trace.py: per block, the median, the switches, each process's CPUs
    and each CPU's sequence; the sched_switch event is off again after, tracing_on as it was."""
    was = (_TRACING / "tracing_on").read_text()
    out = _tool("sched_trace.py", "--workers", "2", "--blocks", "1", "--rounds", "50",
                "--pause", "0", "--workload", "gather_small")
    assert "gather_small N=2" in out and "block 0:" in out, out
    assert "'C':" in out and "'W0':" in out and "'W1':" in out, out
    assert "  cpu" in out, out
    assert "mean turn on a CPU" in out, out
    assert (_TRACING / "events/sched/sched_switch/enable").read_text().strip() == "0"
    assert (_TRACING / "tracing_on").read_text() == was


def test_crowd_blocks_shows_each_process_per_round_and_each_sides_verdict() -> None:
    """benchmarks/crowd_blocks.py: per block, the median, each process's time on and off
    the CPU per round, and for unison's blocks what pacing.crowd judged on both sides."""
    out = _tool("crowd_blocks.py", "--workers", "2", "--hogs", "0", "--blocks", "2",
                "--seconds", "0.05")
    lines = [line for line in out.splitlines() if line.startswith("block ")]
    assert len(lines) == 4 and sum("unison-pipe" in line for line in lines) == 2, out
    for line in lines:
        assert "controller: on " in line and "w1: on " in line and " cpu" in line, out
        if "unison-pipe" in line:
            assert "crowd: controller (" in line and "workers [(" in line, out


def test_class_call_times_a_class_against_a_function() -> None:
    """benchmarks/class_call.py: blocks of each, their medians, and the ratio."""
    out = _tool("class_call.py", "--blocks", "2", "--seconds", "0.02")
    assert "class   :" in out and "function:" in out and "class / function:" in out, out


def test_mixed_sync_times_a_mixed_session_and_counts_what_sync_sends() -> None:
    """benchmarks/mixed_sync.py: blocks of call+sync and run in a session of two workers
    over shared memory and one over TCP; each call+sync round sends that one a command
    and nothing more (no SYNC)."""
    out = _tool("mixed_sync.py", "--blocks", "2", "--seconds", "0.02")
    assert "call+sync:" in out and "run      :" in out, out
    per_round = float(out.rsplit("per call+sync round:", 1)[1].split()[0])
    assert 1.0 <= per_round < 1.1, out  # (a SYNC only where a look gave up: a slice)


def test_session_modes_times_fresh_sessions_one_after_another() -> None:
    """benchmarks/session_modes.py: each fresh session's two medians, then their range."""
    out = _tool("session_modes.py", "--workers", "1", "--sessions", "2", "--seconds", "0.02")
    pairs = next(x for x in out.splitlines() if x.startswith("dispatch N=1, each session"))
    assert len(pairs.split(": ", 1)[1].split()) == 2, out
    assert "dispatch N=1: sessions' medians " in out, out


def test_ring_costs_times_each_step_on_both_rings() -> None:
    """benchmarks/ring_costs.py: one row for the C ring and one for the pure-Python one,
    each step's µs (send, recv, a plain reply, its read), the two with a real worker, and
    the worker loop's own steps around a call (fence, board, the collectives' end)."""
    out = _tool("ring_costs.py", "--messages", "200")
    head = out.splitlines()[-4]
    assert all(k in head for k in ("send", "recv", "reply", "values", "sync alone", "fence",
                                   "board", "coll end")), out
    rows = _last_rows(out, 2)
    assert [r[0] for r in rows] == ["C ring", "pure-Python ring"], out
    for row in rows:
        assert len(row) == 10 and all(float(v) > 0 for v in row[1:7]), out
        assert all(float(v) >= 0 for v in row[7:]), out  # a few ns in C: may round to 0


def test_layouts_compares_forked_workers_with_workers_apart() -> None:
    """benchmarks/layouts.py: sessions whose workers are forked from one zygote (one
    layout) and sessions whose workers start apart (a layout each), each block's median and
    the CPU time of each process, and a table per arm."""
    out = _tool("layouts.py", "--workers", "2", "--sessions", "1", "--seconds", "0.05")
    forked = [line for line in out.splitlines() if line.startswith("forked session")]
    apart = [line for line in out.splitlines() if line.startswith("apart session")]
    assert forked and all(line.endswith("at 1 address") for line in forked), out
    assert apart, out
    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() != "0":
        assert all(line.endswith("at 2 addresses") for line in apart), out  # randomized
    blocks = [line for line in out.splitlines() if line.startswith("  controller on CPU")]
    assert len(blocks) == 2 * len(os.sched_getaffinity(0)), out
    for line in blocks:
        assert float(line.split("unison")[1].split()[0]) > 0, line
        assert len(line.split("workers ")[1].split()) == 2, line
    assert "| forked |" in out and "| apart |" in out, out


def test_pingpong_gives_microseconds_per_exchange() -> None:
    """benchmarks/pingpong.py: send/recv between two workers, µs per exchange."""
    out = _tool("pingpong.py", "--exchanges", "50", "--repeats", "2")
    line = next(x for x in out.splitlines() if x.startswith("send/recv ping-pong, N=2: "))
    median = float(line.split("median ")[1].split()[0])
    each = [float(x) for x in line.split("(")[1].rstrip(")").split(", ")]
    assert len(each) == 2 and median > 0 and min(each) <= median <= max(each), out


def test_deadlocks_times_each_cycle_to_its_error() -> None:
    """benchmarks/deadlocks.py: a row per cycle kind and N, the seconds to the error."""
    out = _tool("deadlocks.py", "--workers", "2", "--repeats", "2")
    rows = _last_rows(out, 2)
    assert [r[:2] for r in rows] == [["send", "2"], ["recv", "2"]], out
    for row in rows:
        assert 0 < float(row[2]) <= float(row[3]) < 5, out


@pytest.mark.parametrize("channel", ["shm", "pipe"])
def test_async_bench_times_each_await_beside_its_blocking_form(channel: str) -> None:
    """benchmarks/async_bench.py: a row per round trip (fetch, run, call then sync), each
    with both forms' medians and their ratio."""
    out = _tool("async_bench.py", "--rounds", "100", "--channel", channel)
    assert f"channel {channel}" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert len(rows) == 3 and "sess.sync_async()" in rows[2], out
    assert all(row.rstrip(" |").endswith("x") for row in rows), out


def test_quota_lag_says_when_the_kernel_counted_each_stall() -> None:
    """benchmarks/quota_lag.py, where this machine gives a cgroup to make (root, the cpu
    controller): it finds the quota's stalls and sorts them by when cpu.stat counted them."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quota_lag.py"),
                           "--seconds", "1"], capture_output=True, text=True, timeout=60,
                          check=False)
    if proc.returncode == 3:  # quota.NO_CGROUP
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("spells off the core"))
    total = int(line.split(": ", 1)[1].split(";")[0])
    assert total > 0 and "at once: " in line and "not by then: " in line, proc.stdout


def test_ref_args_times_each_kind_of_argument_against_none() -> None:
    """benchmarks/ref_args.py: a row per kind of argument, its block medians and its ratio
    to the round without one."""
    out = _tool("ref_args.py", "--blocks", "2", "--seconds", "0.02")
    rows = [line for line in out.splitlines() if "x no argument's" in line]
    assert [row.split(":")[0].strip() for row in rows] == [
        "no argument", "an int", "a tuple", "a numpy scalar", "an int by keyword", "a Ref",
        "a Ref by keyword",
        "a Ref in a list"], out
    assert rows[0].endswith("1.00x no argument's"), out


def test_large_reply_times_each_kind_both_ways() -> None:
    """benchmarks/large_reply.py: a line per kind and size, its gather and its put."""
    out = _tool("large_reply.py", "--kinds", "bytes", "str", "array", "--mib", "1",
                "--rounds", "1")
    rows = [line for line in out.splitlines() if line.startswith("shm: ")]
    assert [row.split(" of ")[0] for row in rows] == ["shm: bytes", "shm: str", "shm: array"]
    assert all(re.search(r"gather from 2 workers [\d.]+ ms, put to them [\d.]+ ms", row)
               for row in rows), out


def test_shared_reads_counts_each_calls_faults_per_worker() -> None:
    """benchmarks/shared_reads.py: a line per call, each worker's page faults and read time;
    the first call maps the shared array's pages, the later ones find them mapped."""
    out = _tool("shared_reads.py", "--mib", "8", "--calls", "2")
    rows = [line for line in out.splitlines() if line.startswith("call ")]
    assert [row.split(":")[0] for row in rows] == ["call 1", "call 2"], out
    faults = [[int(f) for f in re.findall(r"(\d+) faults [\d.]+ ms", row)] for row in rows]
    assert all(len(row) == 2 for row in faults), out
    assert min(faults[0]) > 10 * max(faults[1]), out


def test_view_cost_times_a_blocks_life_in_one_process() -> None:
    """benchmarks/view_cost.py: one line, the µs of a block placed, viewed, read, dropped."""
    out = _tool("view_cost.py", "--kib", "64", "--rounds", "50")
    assert re.search(r"^64 KiB: [\d.]+ us per place, view, read and drop$", out, re.M), out


def test_long_input_gives_each_kinds_ids_time_and_peak_memory() -> None:
    """benchmarks/long_input.py: a line per kind of text, its ids, seconds and peak RSS."""
    out = _tool("long_input.py", "--mb", "0.2", "--kinds", "words", "punct")
    for kind in ("words", "punct"):
        assert re.search(rf"^{kind}: 0.2 MB of .* repeated: 256 ids in [\d.]+ s, peak RSS \d+ "
                         rf"MB \(\d+ MB for the text\)$", out, re.M), out


def test_put_values_times_each_kind_of_value_against_a_call() -> None:
    """benchmarks/put_values.py: a row per kind of value put (and a scatter), its block
    medians and its ratio to a call's round."""
    out = _tool("put_values.py", "--blocks", "2", "--seconds", "0.02")
    rows = [line for line in out.splitlines() if "x the call's" in line]
    assert [row.split(":")[0].strip() for row in rows] == [
        "call", "put int", "put pair", "put dict", "put numpy", "put object", "scatter ints"], out
    assert rows[0].endswith("1.00x the call's"), out


def test_result_shapes_times_each_shape_against_the_int() -> None:
    """benchmarks/result_shapes.py: a row per result shape, then per gather of one, its
    block medians and its ratio to the int's run."""
    out = _tool("result_shapes.py", "--blocks", "2", "--seconds", "0.02")
    rows = [line for line in out.splitlines() if "x the int's" in line]
    assert [row.split(":")[0].strip() for row in rows] == [
        "int", "pair", "list3", "nested", "dict", "array", "float64", "object", "gather int",
        "gather pair", "gather array", "gather object"], out
    assert rows[0].endswith("1.00x the int's"), out


def test_close_time_prints_a_median_per_size() -> None:
    """benchmarks/close_time.py: a line per number of workers, its close's median in ms."""
    out = _tool("close_time.py", "--workers", "1", "2", "--sessions", "1")
    rows = [line for line in out.splitlines() if line.startswith("N=")]
    assert [row.split(":")[0] for row in rows] == ["N=1", "N=2"], out
    assert all(re.search(r"close [\d.]+ ms \(median of 1; ", row) for row in rows), out


def test_tcp_collectives_times_a_call_an_allreduce_and_a_left_rank() -> None:
    """benchmarks/tcp_collectives.py: five lines, the last two the seconds a left rank's
    peers took to raise (well under the call's timeout), where it raised and where it
    returned."""
    pytest.importorskip("torch")
    out = _tool("tcp_collectives.py", "--calls", "20", "--reduces", "5")
    assert re.search(r"^run\(noop\): median [\d.]+ us$", out, re.M), out
    assert re.search(r"^run\(a call that writes one store key, as a mark\): median [\d.]+ us$",
                     out, re.M), out
    assert re.search(r"^allreduce of 4 floats: [\d.]+ us$", out, re.M), out
    for how in ("raises", "returns"):
        took = re.search(rf"^a rank {how} before its collective: its peers raised in "
                         r"([\d.]+)-([\d.]+) s \(3 tries\)$", out, re.M)
        assert took is not None and float(took.group(2)) < 10, out


def test_idle_cpu_names_each_process_of_an_idle_session_and_its_busiest_thread() -> None:
    """benchmarks/idle_cpu.py: a line per process (controller, 2 workers, and the keepers),
    each with its share of a core, its wake-ups and its busiest thread."""
    out = _tool("idle_cpu.py", "--seconds", "0.5", "--modes", "local", "tcp")
    line = (r"^{mode} +{role} +pid \d+: [\d.]+% of a core, [\d.]+ wake-ups/s; busiest thread "
            r"'[^']+' [\d.]+%$")
    for mode in ("local", "tcp"):
        assert len(re.findall(line.format(mode=mode, role="controller"), out, re.M)) == 1, out
        assert len(re.findall(line.format(mode=mode, role="worker"), out, re.M)) == 2, out


def test_long_calls_counts_the_quick_path_of_calls_longer_than_its_spin() -> None:
    """benchmarks/long_calls.py: a row per workload, each round of which (workers that end
    apart too) takes run's quick path on shared memory."""
    out = _tool("long_calls.py", "--rounds", "5")
    rows = [line for line in out.splitlines() if "round - call" in line]
    assert len(rows) == 4, out
    for row in rows:
        assert "quick   5/5," in row, out
