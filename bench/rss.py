"""Peak resident memory of a process, read from outside it (for the memory benchmarks).

A replica's process id is in ``model.replica_facts[i].pid``; on the machine it runs on, Linux
keeps its high-water mark in ``/proc/<pid>/status`` (``VmHWM``), so the replica needs no method
of its own for the benchmark to read it.
"""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mb(pid: int | None = None) -> float:
    """Peak resident memory (MiB) of process ``pid`` (this process when None)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line: the process is not on this Linux machine")


def replicas_peak_rss_mb(model) -> list[float]:
    """Peak resident memory (MiB) of each replica of a cluster model, read while they are alive."""
    return [peak_rss_mb(facts.pid) for facts in model.replica_facts]
