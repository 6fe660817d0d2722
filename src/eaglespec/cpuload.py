"""Whether other processes used the CPU while we measured: timings taken beside other work are not kept.

A calibration measures how long forwards and draft rounds take; if a test suite or a training job shares the cores
meanwhile, those times are inflated unevenly (a wide verify pass loses more than a one-token step), and a choice
cached from them would slow every later run. `LoadMonitor` reads the kernel's CPU accounting (Linux `/proc/stat`
for all processes, `/proc/self/stat` for this one) around the measurement and reports how many cores' worth of time
the other processes used.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# other processes may use this much of one core on average (a shell, a logger, the OS) before a measurement counts
# as disturbed
QUIET_CORES = 0.15


def _total_busy_ticks() -> int | None:
    """Busy clock ticks of all CPUs since boot (user + nice + system + irq + softirq + steal), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> int | None:
    """Clock ticks this process (all its threads) has run, or None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


@dataclass
class LoadReading:
    """Cores' worth of CPU time other processes used per second of the measurement; None where unknown."""

    other_cores: float | None
    seconds: float

    @property
    def disturbed(self) -> bool:
        return self.other_cores is not None and self.other_cores > QUIET_CORES

    def describe(self) -> str:
        if self.other_cores is None:
            return "load of other processes unknown on this system"
        return f"other processes used {self.other_cores:.2f} cores on average"


class LoadMonitor:
    """`with LoadMonitor() as monitor: ...measure...`, then `monitor.reading`."""

    def __enter__(self) -> "LoadMonitor":
        self._t0 = time.perf_counter()
        self._busy0, self._own0 = _total_busy_ticks(), _own_ticks()
        self.reading: LoadReading | None = None
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self._t0
        busy, own = _total_busy_ticks(), _own_ticks()
        if None in (busy, own, self._busy0, self._own0) or seconds <= 0:
            self.reading = LoadReading(None, seconds)
            return
        ticks = os.sysconf("SC_CLK_TCK")
        others = max(0, (busy - self._busy0) - (own - self._own0)) / ticks
        self.reading = LoadReading(others / seconds, seconds)
