"""The RAM this process can still take without swapping or being killed, as the OS reports it: Linux's
MemAvailable (free memory and the page cache the kernel can drop), lowered to what is left under the memory limit
of this process's control group where one is set (a container's `docker run --memory`, a Kubernetes limit, a
systemd slice's MemoryMax): past that limit the kernel's out-of-memory killer ends the run, whatever MemAvailable
says. Elsewhere (macOS) the physical RAM.

    nbytes, source = available()    # (bytes, "available (MemAvailable)") or, in a container with less left,
                                    # (bytes, "left under the cgroup's memory limit (8.00 GiB, memory.max)")

A group's room is its limit less its usage plus its inactive file pages (memory.stat: page cache the kernel
reclaims inside the group before it kills anything), as container runtimes count the working set. Every group on
the path to the root counts (a limit on a parent holds for its children); cgroup v2 (memory.max, memory.current)
and v1 (memory.limit_in_bytes, memory.usage_in_bytes) alike.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lowmem_dpo.runtime.units import fmt

UNLIMITED = 1 << 60  # v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712)
# (limit file, usage file, inactive file pages in memory.stat) per cgroup version
FILES = {2: ("memory.max", "memory.current", "inactive_file"),
         1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def available(root: Path = Path("/")) -> tuple[int, str]:
    """(bytes, where from) of the RAM new allocations get now: MemAvailable, or the room under this process's
    cgroup memory limit where that is less; the physical RAM where /proc/meminfo is not there. `root`: where /proc
    and /sys are (a test's simulated machine)."""
    meminfo = None
    with contextlib.suppress(OSError, ValueError, IndexError):  # no /proc/meminfo (macOS), or not in its form
        for line in (root / "proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                meminfo = int(line.split()[1]) * 1024, "available (MemAvailable)"  # its unit is KiB ("kB")
    if meminfo is None:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "in this machine (physical)"
    limited = cgroup_room(root)
    return limited if limited is not None and limited[0] < meminfo[0] else meminfo


def cgroup_room(root: Path = Path("/")) -> tuple[int, str] | None:
    """(bytes, where from) left under the tightest memory limit of this process's cgroup and its parents, or
    None where no limit is set or the cgroup files cannot be read."""
    best = None
    with contextlib.suppress(OSError, ValueError):
        for version, group, mount in _memory_groups(root):
            limit_file, usage_file, inactive = FILES[version]
            for folder in (group, *group.parents):
                if not folder.is_relative_to(mount):
                    break
                if not (folder / limit_file).exists():
                    continue
                limit = (folder / limit_file).read_text(encoding="ascii").strip()
                if limit == "max" or int(limit) >= UNLIMITED:
                    continue
                usage = int((folder / usage_file).read_text(encoding="ascii"))
                stat = dict(line.split() for line in (folder / "memory.stat").read_text(encoding="ascii").splitlines())
                room = max(0, int(limit) - usage + int(stat.get(inactive, 0)))
                if best is None or room < best[0]:
                    best = room, f"left under the cgroup's memory limit ({fmt(int(limit))}, {limit_file})"
    return best


def _memory_groups(root: Path) -> list[tuple[int, Path, Path]]:
    """(cgroup version, folder, the hierarchy's mount) of this process's memory cgroup, from /proc/self/cgroup: v2's "0::/path" under
    /sys/fs/cgroup, v1's "N:memory:/path" under /sys/fs/cgroup/memory. In a container whose cgroup namespace hides
    the host's path, the mount's own root is the container's group."""
    out = []
    for line in (root / "proc/self/cgroup").read_text(encoding="ascii").splitlines():
        _, controllers, path = line.split(":", 2)
        mount = root / "sys/fs/cgroup"
        if controllers == "" and (mount / "cgroup.controllers").exists():
            version = 2
        elif "memory" in controllers.split(","):
            version, mount = 1, mount / "memory"
        else:
            continue
        folder = mount / path.lstrip("/")
        out.append((version, folder if folder.is_dir() else mount, mount))
    return out
