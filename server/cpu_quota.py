"""How many CPUs this process may use: the container's CPU quota, not the host's cores.

torch's default thread count is the host's core count: under a 4-CPU limit on a
64-core node it starts 64 threads that the kernel's CFS throttles in turn, and a
decode step waits for the slowest. The quota comes from cgroup v2's `cpu.max`
("<quota> <period>", or "max" for none) or cgroup v1's `cpu.cfs_quota_us` /
`cpu.cfs_period_us` (-1 for none), rounded up to whole CPUs, then capped by the
CPUs the scheduler lets this process run on (`sched_getaffinity`: cpusets).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(root: Path = CGROUP_ROOT) -> int | None:
    """Whole CPUs the cgroup quota allows (rounded up), None where no quota is set or
    no cgroup file can be read."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota == "max":
            return None
        return _whole_cpus(int(quota), int(period or 100_000))
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        quota_file, period_file = v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota = int(quota_file.read_text().strip())
            if quota <= 0:  # -1: no limit
                return None
            return _whole_cpus(quota, int(period_file.read_text().strip()))
    return None


def _whole_cpus(quota: int, period: int) -> int:
    return max(1, math.ceil(quota / period))


def available_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process can use: its affinity mask, capped by the cgroup quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cpus = affinity or os.cpu_count() or 1
    quota = quota_cpus(root)
    return cpus if quota is None else min(cpus, quota)


def default_threads(root: Path = CGROUP_ROOT) -> int:
    """torch intra-op threads for the engine: every CPU the container may use.

    The HTTP event loop wakes about once per step to hand tokens out (the engine
    batches its wake-ups), so it takes a small share beside the matmuls, which a
    thread fewer would slow by a whole core's share (docs/benchmarks.md, "Threads")."""
    return available_cpus(root)
