"""Per-process CPU counters from /proc: what a request or a job costs in each process,
which a shared machine disturbs far less than throughput."""

from __future__ import annotations

import math
import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def backend_pids(database: str) -> list[int]:
    """PostgreSQL backends connected to one database (their title names it), on this host."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith("postgres:") and f" {database} " in title:
            pids.append(int(entry.name))
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def backends_cpu(database: str) -> dict[int, float]:
    """CPU seconds so far of each backend serving ``database``."""
    return {pid: cpu_seconds(pid) for pid in backend_pids(database)}


def backends_spent(before: dict[int, float], database: str) -> float:
    """CPU seconds the backends of ``database`` spent since ``before`` (a backend that
    started meanwhile counts from zero; one that ended meanwhile is lost, so read this
    before the pool closes)."""
    after = backends_cpu(database)
    return sum(
        seconds - before.get(pid, 0.0) for pid, seconds in after.items() if not math.isnan(seconds)
    )
