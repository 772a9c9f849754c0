"""CUDA/NCCL check for the torch collectives backend, for a machine with GPUs.

    python benchmarks/cuda_check.py            # one worker per visible GPU (at most 4)

Each worker sees one GPU (CUDA_VISIBLE_DEVICES set per rank through Session(env=...)),
allreduces and allgathers CUDA tensors through unison's torch backend (NCCL), checks the
answers, and times a 16 MiB float32 allreduce. NCCL needs one GPU per rank: with a single
GPU the check runs one rank (the NCCL group is still made and used).
"""

from __future__ import annotations

import statistics
import sys
import time

import unison


def _work(nbytes: int) -> dict[str, object]:
    import torch

    r, n = unison.rank(), unison.world_size()
    x = torch.full((nbytes // 4,), float(r + 1), device="cuda")
    total = unison.allreduce(x)
    want = n * (n + 1) / 2
    ok_sum = bool(torch.all(total == want).item()) and total.is_cuda
    got = unison.allgather(torch.tensor([r], device="cuda"))
    ok_gather = [int(t.item()) for t in got] == list(range(n))
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        unison.allreduce(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter_ns() - t)
    return {"rank": r, "device": torch.cuda.get_device_name(0), "allreduce_ok": ok_sum,
            "allgather_ok": ok_gather, "allreduce_16MiB_us": statistics.median(times) / 1000}


def main() -> int:
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA device visible: nothing to check")
        return 1
    n = min(gpus, 4)
    env = {r: {"CUDA_VISIBLE_DEVICES": str(r)} for r in range(n)}
    with unison.Session(n, collectives="torch", env=env) as sess:
        rows = sess.run(_work, 16 << 20, timeout=300)
    for row in rows:
        print(row)
    ok = all(row["allreduce_ok"] and row["allgather_ok"] for row in rows)
    print("CUDA/NCCL check:", "passed" if ok else "FAILED", f"({n} worker(s), {gpus} GPU(s))")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
