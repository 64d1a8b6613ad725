"""The RAM this process can still take without swapping or being killed, as the OS reports it: Linux's
MemAvailable (free memory and the page cache the kernel can drop), lowered to what is left under the memory limit
of this process's control group where one is set (a container's `docker run --memory`, a Kubernetes limit, a
systemd slice's MemoryMax): past that limit the kernel's out-of-memory killer ends the run, whatever MemAvailable
says. Elsewhere (macOS) the physical RAM.

    nbytes, source = available()    # (bytes, "available (MemAvailable)") or, in a container with less left,
                                    # (bytes, "left under the cgroup's memory limit (8.00 GiB, memory.max)")
    total()                         # the physical RAM, or the tightest cgroup limit where that is less

A group's room is its limit less its usage plus its inactive file pages (memory.stat: page cache the kernel
reclaims inside the group before it kills anything), as container runtimes count the working set. Every group on
the path to the root counts (a limit on a parent holds for its children); cgroup v2 (memory.max, memory.current)
and v1 (memory.limit_in_bytes, memory.usage_in_bytes) alike.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.runtime.units import fmt

UNLIMITED = 1 << 60  # v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712)
# (limit file, usage file, inactive file pages in memory.stat) per cgroup version
FILES = {2: ("memory.max", "memory.current", "inactive_file"),
         1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def available(root: Path = Path("/")) -> tuple[int, str]:
    """(bytes, where from) of the RAM new allocations get now: MemAvailable, or the room under this process's
    cgroup memory limit where that is less; the physical RAM (or the limit) where /proc/meminfo is not there.
    `root`: where /proc and /sys are (a test's simulated machine)."""
    meminfo = None
    with contextlib.suppress(OSError, ValueError, IndexError):  # no /proc/meminfo (macOS), or not in its form
        for line in (root / "proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                meminfo = int(line.split()[1]) * 1024, "available (MemAvailable)"  # its unit is KiB ("kB")
    if meminfo is None:
        return total(root), "in this machine (physical)"
    groups = _limited_groups(root)
    if not groups:
        return meminfo
    room, limit, name = min((max(0, g.limit - g.usage + g.inactive), g.limit, g.limit_file) for g in groups)
    if room >= meminfo[0]:
        return meminfo
    return room, f"left under the cgroup's memory limit ({fmt(limit)}, {name})"


def total(root: Path = Path("/")) -> int:
    """The machine's physical RAM, or this process's tightest cgroup memory limit where that is less: what a CPU
    run plans for when memory_budget does not say (memory.setup.default_budget)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([physical] + [g.limit for g in _limited_groups(root)])


@dataclass(frozen=True)
class _Group:
    limit: int
    usage: int
    inactive: int  # inactive file pages: page cache reclaimed in the group before anything is killed
    limit_file: str


def _limited_groups(root: Path) -> list[_Group]:
    """Every group with a memory limit on the path from this process's memory cgroup up to its hierarchy's root.
    A group whose files cannot be read is skipped, not the others."""
    try:
        groups = _memory_groups(root)
    except (OSError, ValueError, UnicodeDecodeError):  # no /proc/self/cgroup (macOS), or not in its form
        return []
    out = []
    for version, group, mount in groups:
        limit_file, usage_file, inactive = FILES[version]
        for folder in (group, *group.parents):
            if not folder.is_relative_to(mount):
                break
            with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):
                limit = _number((folder / limit_file).read_text(encoding="utf-8"))
                stat = _stat(folder / "memory.stat")
                if version == 1:  # v1: a parent's limit, which a container cannot see as a folder, is here
                    limit = min(limit, stat.get("hierarchical_memory_limit", UNLIMITED))
                if limit < UNLIMITED:
                    usage = int((folder / usage_file).read_text(encoding="utf-8"))
                    out.append(_Group(limit, usage, stat.get(inactive, 0), limit_file))
    return out


def _number(text: str) -> int:
    text = text.strip()
    return UNLIMITED if text == "max" else int(text)


def _stat(path: Path) -> dict[str, int]:
    """memory.stat's counters; none where the file is not there."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    fields = (line.split() for line in lines)
    return {f[0]: int(f[1]) for f in fields if len(f) == 2}


def _memory_groups(root: Path) -> list[tuple[int, Path, Path]]:
    """(cgroup version, folder, the hierarchy's mount) of this process's memory cgroup, from /proc/self/cgroup:
    v2's "0::/path" under /sys/fs/cgroup, v1's "N:memory:/path" under /sys/fs/cgroup/memory. In a container whose
    cgroup namespace hides the host's path, the mount's own root is the container's group."""
    out = []
    for line in (root / "proc/self/cgroup").read_text(encoding="utf-8").splitlines():
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
