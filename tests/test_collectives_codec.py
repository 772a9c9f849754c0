"""One codec: whatever a call can return, a collective can carry. A class defined in the
user's script (``__main__``, which workers never import) and a lambda travel through every
moving collective and send/recv, as they do through sess.run."""

from __future__ import annotations

from support import stop

SCRIPT = """
import unison

class Point:
    def __init__(self, x):
        self.x = x

def moves():
    r, n = unison.rank(), unison.world_size()
    square = lambda v: v * v
    out = {}
    out["allgather"] = [p.x for p in unison.allgather(Point(r))]
    out["broadcast"] = unison.broadcast(square if r == 1 else None, src=1)(r + 3)
    out["scatter"] = unison.scatter([Point(10 + j) for j in range(n)] if r == 0 else None).x
    got = unison.gather(Point(20 + r), dst=0)
    out["gather"] = None if got is None else [p.x for p in got]
    unison.send((Point(30 + r), lambda: r), (r + 1) % n)
    p, f = unison.recv((r - 1) % n)
    out["send"] = (p.x, f())
    return out

with unison.Session(2) as sess:
    assert [p.x for p in sess.run(Point, 1)] == [1, 1]  # what a call can return
    for r, out in enumerate(sess.run(moves, timeout=60)):
        print(r, sorted(out.items()))
"""


def test_script_classes_and_lambdas_travel_through_collectives(controller):
    proc = controller(SCRIPT)
    try:
        proc.wait(timeout=120)
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0, err
    lines = out.strip().splitlines()
    assert lines == [
        "0 [('allgather', [0, 1]), ('broadcast', 9), ('gather', [20, 21]), "
        "('scatter', 10), ('send', (31, 1))]",
        "1 [('allgather', [0, 1]), ('broadcast', 16), ('gather', None), "
        "('scatter', 11), ('send', (30, 0))]",
    ], err
