"""The default thread count reads the container's CPU quota from cgroup files
(fixtures written in tmp_path, laid out as the kernel mounts them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from batchpilot_server.cpu_quota import available_cpus, default_threads, quota_cpus


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "400000 100000\n"}, 4),  # cgroup v2: 4 CPUs
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one thread
        ({"cpu.max": "max 100000\n"}, None),  # v2, no limit
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # v1
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            None,
        ),  # v1, no limit
        ({}, None),  # no cgroup files at all
    ],
)
def test_quota_from_cgroup_files(tmp_path: Path, files: dict[str, str], cpus: int | None) -> None:
    assert quota_cpus(write(tmp_path, files)) == cpus


def test_threads_are_the_quota_capped_by_affinity(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == affinity  # no quota: the affinity mask
    one = write(tmp_path / "one", {"cpu.max": "100000 100000"})
    assert default_threads(one) == 1
    many = write(tmp_path / "many", {"cpu.max": f"{(affinity + 8) * 100000} 100000"})
    assert default_threads(many) == affinity  # a quota above the cpuset: the cpuset
