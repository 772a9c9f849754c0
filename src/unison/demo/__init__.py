"""``unison demo``: a matrix multiply split across workers, checked against numpy.

    controller: A (rows split into N blocks), B (whole)
        scatter(A blocks) --> worker r holds A_r          put(B) --> every worker holds B
        call(matmul, A_r, B) --> C_r stays on worker r    gather() --> stack C_r == A @ B
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

import unison


def _block_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out: np.ndarray = a @ b
    return out


def _describe() -> str:
    return f"worker {unison.rank()} of {unison.world_size()} (pid {os.getpid()})"


def main(num_workers: int = 2, size: int = 512) -> int:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    t0 = time.perf_counter()
    with unison.Session(num_workers) as sess:
        started = time.perf_counter() - t0
        for line in sess.run(_describe):
            print(f"  {line}")
        for _ in range(100):  # warm up: the first calls define the function, touch pages
            sess.run(os.getpid)
        rounds = 1000
        times = []
        for _ in range(rounds):
            t1 = time.perf_counter()
            sess.run(os.getpid)
            times.append(time.perf_counter() - t1)
        per_call = statistics.median(times) * 1e6
        a_blocks = sess.scatter(np.array_split(a, num_workers))
        b_all = sess.put(b)
        c_blocks = sess.call(_block_matmul, a_blocks, b_all)
        c = np.vstack(c_blocks.gather())
    ok = np.allclose(c, a @ b, rtol=1e-4, atol=1e-3)
    print(f"session of {num_workers} workers started in {started * 1000:.0f} ms")
    print(f"A @ B ({size}x{size}, float32) split by rows over {num_workers} workers: "
          f"{'matches numpy' if ok else 'MISMATCH'}")
    print(f"round trip: {per_call:.1f} us per call to all workers and back (median of {rounds})")
    return 0 if ok else 1
