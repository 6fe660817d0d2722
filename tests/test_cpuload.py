"""eaglespec.cpuload: other processes' CPU time around a measurement (Linux accounting)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglespec.cpuload import QUIET_CORES, LoadMonitor, LoadReading

linux = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux's /proc CPU accounting")


@linux
def test_a_busy_neighbour_is_seen():
    spin = "import time\nend = time.perf_counter() + 1.0\nwhile time.perf_counter() < end: pass\n"
    with LoadMonitor() as monitor:
        proc = subprocess.Popen([sys.executable, "-c", spin])
        proc.wait()
    reading = monitor.reading
    assert reading.other_cores is not None and reading.other_cores > 0.4 and reading.disturbed
    assert "other processes used" in reading.describe()


@linux
def test_our_own_time_is_what_is_subtracted():
    """The ticks counted as this process's are its CPU time (what the monitor takes out of the machine's busy time)."""
    import os

    from eaglespec.cpuload import _own_ticks

    ticks = os.sysconf("SC_CLK_TCK")
    own0, cpu0 = _own_ticks(), time.process_time()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    own, cpu = _own_ticks(), time.process_time()
    assert abs((own - own0) / ticks - (cpu - cpu0)) <= 3 / ticks


def test_unknown_load_is_not_disturbed():
    assert not LoadReading(None, 1.0).disturbed and "unknown" in LoadReading(None, 1.0).describe()
    assert LoadReading(QUIET_CORES + 0.01, 1.0).disturbed and not LoadReading(QUIET_CORES, 1.0).disturbed
