"""The comparison harness behind ``benchmarks/run.py``: unison against the usual ways to drive
N local worker processes. It is not part of the unison package and does not ship in the wheel.

    tasks.py      the functions every system's workers run (module functions, sent by name)
    systems/      one file per system, each behind the interface in systems/base.py
    measure.py    timed loops and the per-workload measurements -> a list of Cell
    report.py     the markdown table, ratios, docs section, plot and machine description
    cli.py        the flags of benchmarks/run.py
"""
