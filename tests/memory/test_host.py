"""Host RAM in the plan (memory/host.py): the pinned activations, streamed layers and paged optimizer state of the
12 GB recipes at their lengths, checked against the RAM available before anything loads, and shown by `plan`.

No card here: the plans are the CUDA recipes' (the planner is numbers in, numbers out), and where a check reads
the machine's available RAM a simulated figure stands in for it (said at each test)."""

import dataclasses
import re

import pytest
from conftest import REPO

from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.host import check_host_ram, checkpoint_bytes, host_problem, host_ram
from lowmem_dpo.memory.search import choose
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.runtime import ram
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.units import GiB, MiB

LLAMA = REPO / "recipes" / "llama3.1-8b-qlora-12gb.yaml"
MISTRAL = REPO / "recipes" / "mistral-7b-qlora-12gb.yaml"
BUDGET = int(11.25 * GiB)


def plan_at(recipe, length: int, **changes):
    cfg = load_config(recipe, [f"max_length={length}", "max_prompt_length=null"])
    arch = load_arch(cfg.model_name_or_path)
    return arch, choose(arch, dataclasses.replace(setup_from_config(cfg, BUDGET), micro_batch=1, **changes), BUDGET)


def test_a_long_run_s_host_ram_is_its_pinned_activations_streams_and_paged_state():
    """Mistral's recipe at 9,984 tokens offloads its activations: the term is the plan's own pinned bytes (each layer
    input rounded up to a power of two), with the paged 8-bit optimizer's state (the plan's own); precompute,
    which neither offloads nor streams here, holds nothing. The load's pages are the 16-bit checkpoint's."""
    arch, plan = plan_at(MISTRAL, 9984)
    assert plan.fits and plan.setup.activation_offloading and not plan.streams
    train = host_ram(arch, plan, "train")
    details = plan.prediction.train.details
    assert train.terms == {"pinned activations": details["offload.host_bytes"],
                           "paged optimizer state": plan.prediction.train.breakdown["optimizer_state"]}
    assert train.terms["paged optimizer state"] >= 2 * details["lora_param_count"]  # two 8-bit states a parameter
    assert 8 * GiB < train.total < 9 * GiB  # ~8.1 GiB pinned (test_plan), ~80 MiB of optimizer state
    assert host_ram(arch, plan, "precompute").total == 0
    assert train.load_file_pages == 2 * (arch.layers * arch.layer_params + arch.outer_params
                                         + arch.vocab * arch.hidden)
    assert 13 * GiB < checkpoint_bytes(arch) < 14 * GiB  # Mistral 7B's 7.24B parameters in bf16


def test_streamed_layers_are_host_ram_too():
    """Llama's recipe at 32,256 tokens: 4-bit layers streamed from pinned RAM (one buffer a layer, a power of two)
    beside the offloaded activations: every term is there, and the plan says which is the largest."""
    arch, plan = plan_at(LLAMA, 32256)
    host = host_ram(arch, plan, "train")
    assert set(host.terms) == {"pinned activations", "paged optimizer state", "streamed layers"}
    assert host.terms["streamed layers"] == plan.streams["train"].cpu_bytes == arch.layers * 128 * MiB
    assert host.terms["pinned activations"] > host.terms["streamed layers"] > host.terms["paged optimizer state"]
    # a stream the stage does not apply (it would not make the run fit) holds no host RAM; the rest is the same
    kept = host_ram(arch, plan, "train", streamed=False)
    assert kept.terms == {k: v for k, v in host.terms.items() if k != "streamed layers"}


@pytest.mark.parametrize("available, refused", [(16 * GiB, True), (64 * GiB, False)])
def test_a_desktop_without_the_ram_is_refused_naming_the_term_and_its_knob(available, refused):
    """Simulated machines: a 16 GB desktop cannot pin Llama's 32k run's activations; a 64 GB one can."""
    arch, plan = plan_at(LLAMA, 32256)
    problem = host_problem(host_ram(arch, plan, "train"), available, "train", "available (MemAvailable)")
    assert (problem is not None) == refused
    if refused:
        assert re.search(r"train needs \S+ GiB of host RAM it cannot give back \(pinned activations", problem)
        assert "The largest, pinned activations" in problem and "activation_offloading=false" in problem
        assert f"{available / GiB:.2f} GiB available (MemAvailable)" in problem


def test_the_process_itself_keeps_a_margin():
    """RAM for the planned terms alone is refused: the process's own growth after the check (HOST_MARGIN) must fit
    too; with it, the same run passes."""
    from lowmem_dpo.memory.host import HOST_MARGIN

    arch, plan = plan_at(LLAMA, 32256)
    host = host_ram(arch, plan, "train")
    problem = host_problem(host, host.total, "train")
    assert problem is not None and f"and {HOST_MARGIN / GiB:.2f} GiB for the process itself" in problem
    assert host_problem(host, host.total + HOST_MARGIN, "train") is None


def test_the_check_refuses_before_loading_and_says_nothing_for_a_run_that_pins_nothing(monkeypatch):
    """check_host_ram, which train and precompute call before loading the model, against a simulated 8 GiB
    of available RAM (monkeypatched: this machine's is what it is)."""
    arch, plan = plan_at(MISTRAL, 9984)
    monkeypatch.setattr(ram, "available", lambda: (8 * GiB, "available (MemAvailable)"))
    with pytest.raises(UserError, match=r"^train needs .* of host RAM .*activation_offloading=false"):
        check_host_ram(host_ram(arch, plan, "train"), "train")
    monkeypatch.setattr(ram, "available", lambda: (64 * GiB, "available (MemAvailable)"))
    (line,) = check_host_ram(host_ram(arch, plan, "train"), "train")
    assert line.startswith("host RAM: ") and "pinned activations" in line and "64.00 GiB available" in line
    assert check_host_ram(host_ram(arch, plan, "precompute"), "precompute") == []


@pytest.mark.parametrize("recipe", ["mistral-7b-qlora-12gb.yaml", "llama3.1-8b-qlora-12gb.yaml"])
def test_plan_shows_host_ram_beside_the_device_s(recipe, capsys):
    """`plan` on the 12 GB recipes at their length: a host RAM line per stage and this machine's available RAM."""
    from lowmem_dpo import plan
    from lowmem_dpo.config.cli import run_cli

    capsys.readouterr()
    assert run_cli(plan.main, [str(REPO / "recipes" / recipe), "--budget", "11.25GiB"], "plan", plan.__doc__) == 0
    out = capsys.readouterr().out
    train, = re.findall(r"^host RAM train: (.*)$", out, re.M)
    assert "paged optimizer state" in train and "the load reads" in train  # paged_adamw_8bit, the 12 GB rule's
    assert re.search(r"^host RAM precompute: nothing pinned or paged; the load reads", out, re.M)
    assert re.search(r"^ +this machine: \S+ GiB available", out, re.M)
