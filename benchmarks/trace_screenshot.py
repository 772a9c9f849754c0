"""Record a real trace and photograph it in a headless browser (docs/debugging.md).

    python benchmarks/trace_screenshot.py SPEEDSCOPE_DIR OUT_DIR

What it needs, none of it a dependency of unison: Chromium (Debian: ``apt-get install
chromium``), playwright (``pip install playwright``, driving /usr/bin/chromium), and the
speedscope viewer, which reads the Chrome trace format offline (``npm pack speedscope``, then
its ``package/dist/release`` folder is SPEEDSCOPE_DIR). ui.perfetto.dev needs the internet,
and this Chromium build serves no chrome://tracing, so speedscope is the viewer here.

Four workers run eight steps (a matmul, an allreduce, a barrier; worker 2 sleeps 4 ms in
each, the straggler), then a put and a call; the trace goes to OUT_DIR/trace-example.json,
the pictures of the controller's and worker 2's tracks to OUT_DIR/trace-*.png.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import unison


def step(i: int) -> float:
    x = np.ones((200, 200)) @ np.ones((200, 200))
    if unison.rank() == 2:
        time.sleep(0.004)  # the slow rank
    y = unison.allreduce(x[:4, :4])
    unison.barrier()
    return float(y.sum())


def record(path: Path) -> None:
    with unison.Session(4) as sess:
        with sess.trace(path):
            for i in range(8):
                sess.run(step, i)
            sess.put(np.zeros(100_000))
            sess.call(step, 9).gather()
        print(sess.stats())


def photograph(viewer: Path, trace: Path, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    shutil.copy(trace, viewer / "run.json")
    server = subprocess.Popen([sys.executable, "-m", "http.server", "8765", "--bind",
                               "127.0.0.1"], cwd=viewer, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync"])
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            page.goto("http://127.0.0.1:8765/index.html#profileURL="
                      "http://127.0.0.1:8765/run.json&title=unison%20trace")
            time.sleep(4)
            page.screenshot(path=str(out / "trace-controller.png"))
            for _ in range(3):  # the tracks are controller, worker 0, 1, 2, 3: go to worker 2
                page.keyboard.press("n")
                time.sleep(0.5)
            time.sleep(1)
            page.screenshot(path=str(out / "trace-worker2.png"))
            browser.close()
    finally:
        server.kill()
        server.wait()


def main() -> None:
    viewer, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace-example.json"
    record(trace)
    photograph(viewer, trace, out)


if __name__ == "__main__":
    main()
