"""The main job on GPUs: ``unison demo --device cuda``, for a machine with CUDA.

    python benchmarks/cuda_demo_check.py          # tp = min(GPUs, 4), then dp=2 if 2+ GPUs

Runs the demo as a user would (``python -m unison demo --device cuda --check --json``): one
worker per GPU (CUDA_VISIBLE_DEVICES per rank), the allreduces over NCCL
(``Session(collectives="torch")``), and sentence-transformers on the same GPU as the
reference. Prints each run's parity and speed; exits 0 when every run passed its check.
Without CUDA it says so and exits 0: there is nothing to check on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_demo(tp: int, dp: int) -> dict[str, Any] | None:
    """One demo run; its JSON report, or None when it failed (its stderr is shown)."""
    cmd = [sys.executable, "-m", "unison", "demo", "--device", "cuda", "--tp", str(tp),
           "--dp", str(dp), "--check", "--json", "--batch-size", "64"]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and not proc.stdout.strip():
        print(f"FAILED (exit {proc.returncode}):\n{proc.stderr}")
        return None
    report: dict[str, Any] = json.loads(proc.stdout)
    check = report["check"]
    print(f"  tp={tp} dp={dp}: worst cosine {check['worst_cosine']:.8f}, max |diff| "
          f"{check['max_abs_diff']:.2e}: {'ok' if check['ok'] else 'FAILED'}")
    for s in report["speed"]:
        print(f"  {s['system']:40} {s['sentences_per_s']:10.1f} sentences/s, batch median "
              f"{s['batch_ms_median']:.1f} ms")
    return report


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: torch sees no CUDA device here, so there is nothing to check "
              "(run this on a machine with GPUs)")
        return 0
    gpus = torch.cuda.device_count()
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}")
    layouts = [(min(gpus, 4), 1)]
    if gpus >= 2:
        layouts.append((1, 2))
    if gpus >= 4:
        layouts.append((2, 2))
    reports = [run_demo(tp, dp) for tp, dp in layouts]
    ok = all(r is not None and r["check"]["ok"] for r in reports)
    print("CUDA demo check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
