"""The RAM a run may take: MemAvailable, lowered by a cgroup memory limit. The containers are simulated (a /proc and
/sys/fs/cgroup tree under tmp_path, as cgroup v1 and v2 lay them out): this machine's own group has no limit, and
a test cannot put itself in one. The last test reads this machine's real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lowmem_dpo.runtime import ram
from lowmem_dpo.runtime.units import GiB, MiB


def machine(root: Path, mem_available: int, cgroup_line: str) -> None:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       65536000 kB\nMemAvailable:   {mem_available // 1024} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup_line + "\n")


def group(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_no_cgroup_limit_leaves_mem_available(tmp_path):
    machine(tmp_path, 40 * GiB, "0::/user.slice/session-1.scope")
    group(tmp_path / "sys/fs/cgroup", {"cgroup.controllers": "cpu memory\n"})
    group(tmp_path / "sys/fs/cgroup/user.slice/session-1.scope",
          {"memory.max": "max\n", "memory.current": str(3 * GiB), "memory.stat": "anon 1\ninactive_file 5\n"})
    assert ram.available(tmp_path) == (40 * GiB, "available (MemAvailable)")
    assert ram.total(tmp_path) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_v2_container_limit_is_the_room_left_under_it_inactive_file_pages_counted(tmp_path):
    """docker --memory 8g with cgroup namespaces: /proc/self/cgroup says "0::/", and the container's group is the
    mount's root. 8 GiB limit, 6 GiB used of which 1 GiB inactive page cache: 3 GiB left, though MemAvailable
    (the host's) says 40."""
    machine(tmp_path, 40 * GiB, "0::/")
    group(tmp_path / "sys/fs/cgroup", {"cgroup.controllers": "cpu memory\n", "memory.max": f"{8 * GiB}\n",
                                       "memory.current": f"{6 * GiB}\n",
                                       "memory.stat": f"anon {5 * GiB}\nfile {GiB}\ninactive_file {GiB}\n"})
    nbytes, source = ram.available(tmp_path)
    assert nbytes == 3 * GiB
    assert source == "left under the cgroup's memory limit (8.00 GiB, memory.max)"
    assert ram.total(tmp_path) == min(8 * GiB, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def test_a_parent_s_tighter_limit_holds_and_mem_available_wins_when_it_is_less(tmp_path):
    machine(tmp_path, 40 * GiB, "0::/kubepods/pod1/ctr")
    root = tmp_path / "sys/fs/cgroup"
    group(root, {"cgroup.controllers": "memory\n"})
    group(root / "kubepods/pod1", {"memory.max": f"{4 * GiB}", "memory.current": f"{GiB}", "memory.stat": ""})
    group(root / "kubepods/pod1/ctr", {"memory.max": f"{16 * GiB}", "memory.current": f"{GiB}",
                                       "memory.stat": "inactive_file 0\n"})
    assert ram.available(tmp_path)[0] == 3 * GiB  # the pod's 4 GiB less 1 GiB used, not the container's 15
    (tmp_path / "proc/meminfo").write_text(f"MemAvailable:   {2 * GiB // 1024} kB\n")
    assert ram.available(tmp_path) == (2 * GiB, "available (MemAvailable)")


@pytest.mark.parametrize("exists", [True, False])
def test_a_v1_memory_limit_by_its_own_path_or_the_mount_s_root(tmp_path, exists):
    """cgroup v1: "N:memory:/path" under /sys/fs/cgroup/memory; in a container without a cgroup namespace the
    host's path is not there and the mount's root is the container's group. Unlimited is 2^63 less a page."""
    machine(tmp_path, 40 * GiB, "5:cpu,cpuacct:/x\n4:memory:/docker/abc")
    mount = tmp_path / "sys/fs/cgroup/memory"
    limited = {"memory.limit_in_bytes": f"{2 * GiB}\n", "memory.usage_in_bytes": f"{GiB + 512 * MiB}\n",
               "memory.stat": f"cache {GiB}\ntotal_inactive_file {256 * MiB}\n"}
    group(mount, {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "1\n",
                  "memory.stat": ""} if exists else limited)
    if exists:
        group(mount / "docker/abc", limited)
    nbytes, source = ram.available(tmp_path)
    assert nbytes == 768 * MiB and source.endswith("(2.00 GiB, memory.limit_in_bytes)")


def test_a_group_whose_files_cannot_be_read_is_skipped_not_the_others(tmp_path):
    """The container's own group lost its memory.max (a permission, a race with its removal); its parent's limit
    still holds. A group without memory.stat counts no inactive pages."""
    machine(tmp_path, 40 * GiB, "0::/a/b")
    root = tmp_path / "sys/fs/cgroup"
    group(root, {"cgroup.controllers": "memory\n"})
    group(root / "a", {"memory.max": f"{6 * GiB}", "memory.current": f"{2 * GiB}"})
    group(root / "a/b", {"memory.max": "not a number\n", "memory.current": "0", "memory.stat": "inactive_file 0\n"})
    assert ram.available(tmp_path) == (4 * GiB, "left under the cgroup's memory limit (6.00 GiB, memory.max)")


def test_a_v1_parent_limit_the_container_cannot_see_is_in_its_memory_stat(tmp_path):
    """cgroup v1 in a Kubernetes pod: the container's group is unlimited, the pod's 3 GiB shows only as
    hierarchical_memory_limit."""
    machine(tmp_path, 40 * GiB, "4:memory:/")
    group(tmp_path / "sys/fs/cgroup/memory", {
        "memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": f"{GiB}\n",
        "memory.stat": f"hierarchical_memory_limit {3 * GiB}\ntotal_inactive_file 0\n"})
    assert ram.available(tmp_path)[0] == 2 * GiB
    assert ram.total(tmp_path) == min(3 * GiB, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def test_a_cpu_run_without_memory_budget_plans_for_the_container_s_limit(tmp_path, monkeypatch):
    """memory.setup.default_budget reads ram.total: the limit, not the host's RAM."""
    from lowmem_dpo.memory import setup

    monkeypatch.setattr(ram, "total", lambda root=None: 5 * GiB)
    assert setup.default_budget("cpu") == 5 * GiB // setup.local_size()


def test_this_machine():
    """The real files: positive, at most the physical RAM."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nbytes, _ = ram.available()
    assert 0 < nbytes <= physical and 0 < ram.total() <= physical
