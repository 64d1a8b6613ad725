"""The C heap under a CPU run (runtime/heap.py): with the threshold fixed, a freed tensor leaves RAM; with glibc's
default, once its threshold has climbed, the same tensors stay resident. Real malloc, real RSS, in a fresh process
each (the setting is for the whole process)."""

import os
import subprocess
import sys
import textwrap

import pytest

from lowmem_dpo.memory import model as memory_model
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.runtime import heap

FRAGMENTS = textwrap.dedent("""
    import sys, torch
    from lowmem_dpo.runtime import heap
    def rss():
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
    if sys.argv[1] in ("configured", "room", "no room"):
        heap.configure()
    if sys.argv[1] in ("room", "no room"):  # a plan of 1 GiB with 0.5 GiB of freed tensors, a 2 GiB or 1 GiB budget
        if sys.argv[1] == "no room":  # an earlier stage of the process kept them: this one fixes the threshold again
            assert heap.keep_freed_blocks(1 << 30, 1 << 29, 2 << 30) is not None
        line = heap.keep_freed_blocks(1 << 30, 1 << 29, (2 if sys.argv[1] == "room" else 1) << 30)
        assert (line is None) == (sys.argv[1] == "no room"), line
    torch.ones(4 << 20).sum()  # a 16 MiB block, freed: glibc's default threshold climbs to 16 MiB
    before = rss()
    big, small = [], []
    for _ in range(64):
        big.append(torch.ones(1 << 20))  # 4 MiB each (a 7B layer's activation at 256 tokens), 256 MiB in all
        small.append(torch.ones(4096))  # 16 KiB each, kept: they sit between the big ones
    peak = rss()
    del big
    print((peak - before) >> 20, (rss() - before) >> 20)
""")


def freed_and_kept(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, check=True)
    grown, kept = map(int, out.stdout.split())
    return grown, kept


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc() is None, reason="glibc's malloc only")
def test_with_the_threshold_fixed_freed_tensors_leave_ram_and_without_they_stay():
    grown, kept = freed_and_kept("configured")
    assert 250 <= grown <= 270 and kept <= 8  # MiB: the 256 MiB came and went
    grown, kept = freed_and_kept("default")
    assert 250 <= grown <= 270 and kept >= 240  # glibc's default: still resident after del


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc() is None, reason="glibc's malloc only")
def test_with_room_to_spare_the_heap_keeps_its_freed_blocks():
    """The plan and what a heap may keep of a step's freed tensors fit the budget: the threshold rises and the
    freed 4 MiB blocks stay resident, for the next step to use without a page fault; without room it stays fixed."""
    grown, kept = freed_and_kept("room")
    assert 240 <= grown <= 270 and kept >= 230  # the first 16 MiB block, freed and kept, serves some of them
    grown, kept = freed_and_kept("no room")
    assert 250 <= grown <= 270 and kept <= 8


def test_keeping_blocks_is_said_and_a_threshold_from_the_environment_stands(monkeypatch):
    line = heap.keep_freed_blocks(1 << 30, 1 << 29, 2 << 30)
    assert line.startswith("CPU heap: freed blocks kept (malloc's mmap threshold 32 MiB") and "1.00 GiB" in line
    # no room (a later stage of the same process): the threshold is fixed again, as this test worker had it
    assert heap.keep_freed_blocks(1 << 30, 1 << 29, 1 << 30) is None
    monkeypatch.setenv(heap.ENV, str(heap.MMAP_THRESHOLD))
    assert heap.keep_freed_blocks(1 << 30, 1 << 29, 2 << 30) is None


def test_the_users_own_threshold_stands_and_the_log_says_what_it_means(monkeypatch):
    monkeypatch.setenv(heap.ENV, str(32 << 20))
    assert "RSS can exceed" in heap.configure()
    monkeypatch.setenv(heap.ENV, str(heap.MMAP_THRESHOLD))
    line = heap.configure()
    assert "from the environment" in line and "exceed" not in line


def test_the_cpu_plan_is_rss_the_process_plus_the_tensors(make_cfg):
    cfg = make_cfg(device="cpu")
    p = memory_model.predict(load_arch(cfg.model_name_or_path), setup_from_config(cfg))
    for stage in (p.train, p.precompute):
        assert stage.peak_bytes - stage.tensor_peak_bytes == memory_model.CPU_PROCESS
        assert stage.breakdown["framework_overhead"] == memory_model.CPU_PROCESS


HUGE = textwrap.dedent("""
    import sys
    if sys.argv[1] == "torch first":
        import torch
    import lowmem_dpo
    import torch
    from lowmem_dpo.runtime import heap
    x = torch.ones(16 << 20)  # 64 MiB, every page written
    rollup = open("/proc/self/smaps_rollup").read()
    print(next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages:")))
    print(heap.configure())
""")


def huge_kib_and_line(order: str, env: dict) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", HUGE, order], capture_output=True, text=True, check=True, env=env)
    kib, line = out.stdout.strip().split("\n")
    return int(kib), line


@pytest.mark.skipif(heap.thp_mode() not in ("always", "madvise") or heap._libc() is None,
                    reason="the kernel gives no transparent huge pages on request, or no glibc")
def test_torch_s_large_blocks_are_on_huge_pages_when_the_package_is_imported_first():
    """Real kernel, real allocator: AnonHugePages of a process holding a 64 MiB tensor. Imported before torch, the
    package asks torch's allocator for huge pages and the log line says so; after torch, or against the user's
    THP_MEM_ALLOC_ENABLE=0, it cannot, and the line says what the threshold then costs and why."""
    env = {k: v for k, v in os.environ.items() if k != heap.THP_ENV}
    kib, line = huge_kib_and_line("package first", env)
    assert kib >= 32 << 10 and "on transparent huge pages (THP_MEM_ALLOC_ENABLE=1)" in line and "costs" not in line
    if heap.thp_mode() == "always":  # every large mapping gets huge pages, asked or not, and the line says so
        kib, line = huge_kib_and_line("torch first", env)
        assert kib >= 32 << 10 and "(the kernel's transparent huge pages are always on)" in line
        return
    kib, line = huge_kib_and_line("torch first", env)
    assert kib == 0 and "costs ~30% step time: torch was imported before lowmem_dpo" in line
    kib, line = huge_kib_and_line("package first", env | {heap.THP_ENV: "0"})
    assert kib == 0 and "costs ~30% step time: THP_MEM_ALLOC_ENABLE=0 from the environment" in line


def test_the_kernel_s_mode_is_the_bracketed_one(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert heap.thp_mode(tmp_path / "enabled") == "madvise"
    assert heap.thp_mode(tmp_path / "absent") is None
