"""The CUDA decisions as pure functions of a card's numbers (rules.py): the budget a run plans for, the device rule
it gets, the dtypes a card refuses; and a CPU run's budget from the RAM available. Numbers in, numbers out: the
cards and machines are ones this machine is not."""

import pytest
import torch

from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime import devices, oom, rules
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.units import GiB, MiB, fmt


@pytest.mark.parametrize("gib, tier", [(11.25, "12gb"), (11.7, "12gb"), (12, "12gb"), (12.01, "24gb"),
                                       (15.7, "24gb"), (24, "24gb"), (40, "large"), (79.2, "large")])
def test_memory_tiers(gib, tier):
    assert rules.memory_tier(int(gib * GiB)) == tier


@pytest.mark.parametrize("budget_gib, bf16, kind", [
    (11.25, True, "cuda-12gb-bf16"),  # an 80 GB H100 capped at 11.25 GiB is a 12 GB card
    (11.25, False, "cuda-12gb"),  # a T4 with a few GiB taken
    (14.5, False, "cuda-24gb"),  # a 16 GB T4 with the CUDA context and a display
    (22.0, True, "cuda-24gb-bf16"),
    (78.0, True, "cuda-large-bf16"),
    (31.0, False, "cuda-large"),  # a V100 32 GB
])
def test_the_rule_follows_the_budget_not_the_card(budget_gib, bf16, kind):
    assert rules.cuda_kind(int(budget_gib * GiB), bf16) == kind


H100 = 79.2 * GiB  # what torch.cuda.mem_get_info reports as an H100's total


@pytest.mark.parametrize("free, held, total, cap, budget, short", [
    # no memory_budget: what torch can get now (free + what this process's allocator holds already), less 0.5 GiB
    # for what CUDA loads later (rules.CUDA_AFTER_START)
    (11.3 * GiB, 0, 12 * GiB, None, 10.8 * GiB, False),  # a 12 GB card with its display and context
    (10.0 * GiB, 1.0 * GiB, 12 * GiB, None, 10.5 * GiB, False),
    (0.25 * GiB, 0, 12 * GiB, None, 0, False),  # a card someone else fills: nothing, not a negative budget
    # memory_budget on a big card: the budget
    (78.5 * GiB, 0, H100, 11.25 * GiB, 11.25 * GiB, False),
    # memory_budget above what is free (a 12 GB card driving a display): plan for what is free, and say so
    (6.0 * GiB, 0, 12 * GiB, 11.25 * GiB, 5.5 * GiB, True),
    (11.5 * GiB, 0, 12 * GiB, 11.25 * GiB, 11.0 * GiB, True),  # the reserve makes it short
    (12 * GiB, 0, 12 * GiB, 20 * GiB, 11.5 * GiB, True),
])
def test_cuda_budget(free, held, total, cap, budget, short):
    """Simulated card figures (what torch.cuda.mem_get_info would report: no card here). The cap torch is held to
    is the budget the plan uses, whichever figure set it: fraction x total = budget."""
    b = rules.cuda_budget(int(free), int(held), int(total), None if cap is None else int(cap))
    assert b.budget == int(budget)
    assert b.fraction * int(total) == pytest.approx(b.budget, abs=1) and b.fraction <= 1
    assert f"set_per_process_memory_fraction({b.fraction:.4f})" in b.why
    assert b.short == short
    assert ("only" in b.why) == short


def test_the_cap_torch_enforces_is_the_planned_budget(monkeypatch):
    """devices.run_cuda_budget on a simulated 12 GB card driving a display (5.5 GiB free; mem_get_info and the
    allocator's cap simulated: no card here), memory_budget=11.25GiB: the fraction torch's allocator is held to is
    the 5.0 GiB the plan uses, not the 11.25 GiB asked for (it was, and the back-off then fired late)."""
    from lowmem_dpo.runtime import devices

    caps = []
    monkeypatch.setattr(devices, "cuda_memory", lambda device: (int(5.5 * GiB), 0, 12 * GiB))
    monkeypatch.setattr(devices.torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: caps.append(fraction))
    b = devices.run_cuda_budget(devices.torch.device("cuda", 0), "11.25GiB")
    assert b.budget == 5 * GiB and b.short
    assert len(caps) == 1 and caps[0] * 12 * GiB == pytest.approx(5 * GiB, abs=1)
    # a card others fill (0.25 GiB free): refused in one line, not capped at 0 bytes
    monkeypatch.setattr(devices, "cuda_memory", lambda device: (int(0.25 * GiB), 0, 12 * GiB))
    with pytest.raises(UserError, match="no memory for torch on cuda:0: .*CUDA_VISIBLE_DEVICES"):
        devices.run_cuda_budget(devices.torch.device("cuda", 0), None)
    assert len(caps) == 1


def test_the_emulated_card_gets_the_small_cards_rule():
    """An H100 with 78.5 GiB free and memory_budget=11.25GiB: the 12 GB rule (checkpointing on), not the large
    card's (checkpointing off), and the planner's budget is the cap."""
    b = rules.cuda_budget(int(78.5 * GiB), 0, int(H100), int(11.25 * GiB))
    kind = rules.cuda_kind(b.budget, native_bf16=True)
    assert kind == "cuda-12gb-bf16" and rules.RULES[kind].gradient_checkpointing
    assert not rules.RULES[rules.cuda_kind(int(78.5 * GiB), True)].gradient_checkpointing



@pytest.mark.parametrize("available, processes, cap, budget, short", [
    # simulated machines (numbers in, numbers out): the RAM the OS says is available, the run's processes on it
    (23.5 * GiB, 1, 500 * GiB, 23.5 * GiB, True),  # above the RAM that is there: planned at it, and said
    (23.5 * GiB, 1, 16 * GiB, 16 * GiB, False),  # within it: the budget as given
    (23.5 * GiB, 1, 23.5 * GiB, 23.5 * GiB, False),
    (64 * GiB, 4, 20 * GiB, 16 * GiB, True),  # four processes, each with its own model: a quarter each
    (64 * GiB, 4, 8 * GiB, 8 * GiB, False),
])
def test_cpu_budget_plans_at_most_the_ram_that_is_there(available, processes, cap, budget, short):
    b = rules.cpu_budget(int(available), processes, int(cap), "available (MemAvailable)")
    assert b.budget == int(budget) and b.short == short
    share = f" ({processes} processes' share)" if processes > 1 else ""
    if short:
        assert b.why == (f"memory_budget={fmt(cap)} but only {fmt(budget)} of RAM available (MemAvailable){share} on "
                         f"this machine: planning for {fmt(budget)}")
    else:
        assert b.why == (f"memory_budget={fmt(cap)}, {fmt(available // processes)} of RAM available "
                         f"(MemAvailable){share}")

@pytest.mark.parametrize("key, setting, kind, refused", [
    ("dtype", "bfloat16", "cuda-12gb", True),  # a T4: emulated bf16
    ("ref_dtype", "bfloat16", "cuda-large", True),
    ("dtype", "bfloat16", "cuda-12gb-bf16", False),
    ("dtype", "float16", "cuda-12gb", False),
    ("dtype", "auto", "cuda-12gb", False),
    ("dtype", "bfloat16", "cpu", False),  # a CPU emulates too, but it is slow, not wrong: the user's choice
])
def test_bfloat16_on_a_card_without_it_is_refused(key, setting, kind, refused):
    problem = rules.dtype_problem(key, setting, kind)
    assert (problem is not None) == refused
    if refused:
        assert f"{key}=float16" in problem and "auto" in problem


def test_every_device_kind_has_a_rule():
    cuda = {f"cuda-{t}{b}" for t in ("12gb", "24gb", "large") for b in ("", "-bf16")}
    assert set(rules.RULES) == cuda | {"mps", "cpu", "cpu-bf16"}
    for kind, rule in rules.RULES.items():
        assert rule.dtype in devices.DTYPES and rule.why and rule.offload
        on_cuda = kind.startswith("cuda")
        assert rule.optimizer == (rules.PAGED_ADAMW_8BIT if on_cuda else rules.ADAMW_TORCH), kind
        # no bf16 on a GPU: float16 with loss scaling (float32 would not fit a 7B at 1024 on 12 GB)
        want = "bfloat16" if kind.endswith("bf16") else "float16" if on_cuda else "float32"
        assert rule.dtype == want, kind
        assert rule.share_prompt == (kind != "mps"), kind  # a shared prompt saves its activations on a GPU too


def test_the_12gb_recipes_leave_the_dtype_to_the_card():
    """dtype: auto, so that a T4 runs them in float16 instead of being refused."""
    from conftest import REPO

    for recipe in ("mistral-7b-qlora-12gb.yaml", "llama3.1-8b-qlora-12gb.yaml"):
        cfg = load_config(REPO / "recipes" / recipe)
        assert cfg.dtype == "auto" and cfg.ref_dtype is None, recipe
        assert rules.RULES[rules.cuda_kind(int(11.25 * GiB), False)].dtype == "float16"


def test_out_of_memory_errors_are_recognised():
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                                 "`cublasCreate(handle)`"))
    assert oom.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                 f"allocate {64 * MiB} bytes"))
    assert not oom.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not oom.is_out_of_memory(ValueError("out of memory"))  # not an allocator's error type


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when no GPU is present")
def test_a_budget_without_a_gpu_needs_a_size():
    from lowmem_dpo.memory.setup import device_kind_for

    with pytest.raises(UserError, match="pass --budget, e.g. 11.25GiB"):
        device_kind_for("cuda", None)
    assert device_kind_for("cuda", int(11.25 * GiB)) == "cuda-12gb-bf16"  # a card this machine lacks: bf16
