"""The plan on several cards (memory/cards.py, plan --nproc): each card's share of a sharded base, the fsdp and
fsdp_offload_params choices of auto, and the shipped 2-card recipes' fits lines. The sharded run itself is tested
on 2 CPU processes in tests/test_distributed.py."""

import math

import pytest
import torch
from conftest import REPO
from test_plan import _run

from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.memory import cards
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.host import host_ram
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.memory.weights import base_weight_bytes, card_host_bytes, card_weight_bytes, linear_parts
from lowmem_dpo.runtime import devices, sharding
from lowmem_dpo.runtime.errors import UserError

GiB = 2**30
RECIPE = REPO / "recipes" / "llama3.1-8b-qlora-12gb.yaml"


def test_a_card_holds_its_shard_the_4bit_constants_the_head_and_two_gathered_layers():
    """Qwen2.5-14B in 4-bit over 2 cards: each holds half of the layers' packed bytes and of the embeddings, the
    quantization constants and the LM head whole, and two layers gathered; the shards of all cards add up to the
    sharded part of the whole base."""
    arch = load_arch("Qwen/Qwen2.5-14B")
    cfg = load_config(RECIPE, ["model_name_or_path=Qwen/Qwen2.5-14B", "fsdp=true"])
    setup = setup_from_config(cfg, int(11.25 * GiB), processes=2)
    assert setup.sharded and not setup.shard_offload
    whole, card = base_weight_bytes(arch, "bfloat16", "4bit"), card_weight_bytes(arch, setup)
    parts = [linear_parts(i, o, "4bit", 2) for i, o in arch.linears().values()]
    constants = arch.layers * sum(c for _, c in parts)
    sharded_part = sum(whole.values()) - constants - whole["lm_head"]
    assert card["shards"] == math.ceil(sharded_part / 2) == card_host_bytes(arch, "bfloat16", "4bit", 2)
    assert card["lm_head"] == whole["lm_head"] == 152064 * 5120 * 2 and card["constants"] == constants
    assert card["gathered"] == 2 * (sum(p for p, _ in parts) + arch.layer_extra_params() * 2)
    assert 5.6 * GiB < sum(card.values()) < 5.8 * GiB < 9.2 * GiB < sum(whole.values())  # 9.25 GiB on one card
    cfg = load_config(RECIPE, ["model_name_or_path=Qwen/Qwen2.5-14B", "fsdp=true", "fsdp_offload_params=true"])
    offloaded = card_weight_bytes(arch, setup_from_config(cfg, int(11.25 * GiB), processes=2))
    assert offloaded["shards"] == 0 and offloaded["gathered"] > card["gathered"]  # each shard copied in first


@pytest.mark.parametrize("model, budget, fsdp, offload", [
    ("meta-llama/Llama-3.1-8B", 11.25, False, False),  # fits one card: data parallel
    ("Qwen/Qwen2.5-14B", 11.25, True, False),  # fits only sharded
    ("meta-llama/Llama-3.1-70B", 22.5, True, True),  # fits only with the shards in CPU RAM
])
def test_fsdp_auto_shards_only_what_does_not_fit_one_card(model, budget, fsdp, offload):
    cfg = load_config(RECIPE, [f"model_name_or_path={model}"])
    plan = cards.on_cards(load_arch(model), cfg, int(budget * GiB), processes=2)
    assert plan.fits and (plan.setup.sharded, plan.setup.shard_offload) == (fsdp, offload)
    assert plan.steps[0].startswith("fsdp=true" if fsdp else "fsdp=false (auto: the whole model fits each process's budget")
    one = cards.on_cards(load_arch(model), cfg, int(budget * GiB), processes=1)
    assert not one.setup.sharded  # one process: nothing to shard


def test_a_sharded_plan_on_cuda_plans_the_load_and_the_offloaded_shards_in_host_ram():
    arch = load_arch("meta-llama/Llama-3.1-70B")
    cfg = load_config(REPO / "recipes" / "llama3.1-70b-qlora-2x24gb.yaml")
    plan = cards.on_cards(arch, cfg, int(22.5 * GiB), processes=2)
    host = host_ram(arch, plan, "train")
    assert host.terms["the whole base while it loads"] == sum(base_weight_bytes(arch, "bfloat16", "4bit").values())
    assert host.terms["offloaded shards"] == card_host_bytes(arch, "bfloat16", "4bit", 2)


@pytest.mark.parametrize("recipe, budget, lengths", [("qwen2.5-14b-qlora-2x12gb.yaml", "11.25GiB", (1024, 2048)),
                                                     ("llama3.1-70b-qlora-2x24gb.yaml", "22.5GiB", (1024,))])
def test_the_two_card_recipes_fit_as_their_comments_say(capsys, recipe, budget, lengths):
    """plan --nproc 2 on each shipped 2-card recipe: the plan fits each card, and the as-given line shows each way."""
    for length in lengths:
        p = _run(capsys, f"recipes/{recipe}", f"max_length={length}", "--nproc", "2", "--budget", budget)
        code, out = p.returncode, p.stdout
        assert code == 0 and "on 2 cards, each card's peak" in out and "fsdp + offload" in out
        plan_line = next(line for line in out.splitlines() if line.startswith("plan:"))
        assert plan_line.endswith(f"fits {float(budget[:-3]):.2f} GiB"), plan_line


def test_the_issue_command_plans_70b_from_its_architecture(capsys):
    """The 8B recipe pointed at the 70B with fsdp=true, --nproc 2 --budget 22.5GiB: planned from the shipped
    architecture alone; its fits line says yes for train and precompute (the shards go to CPU RAM: auto)."""
    p = _run(capsys, "recipes/llama3.1-8b-qlora-12gb.yaml", "model_name_or_path=meta-llama/Llama-3.1-70B",
             "max_length=1024", "fsdp=true", "--nproc", "2", "--budget", "22.5GiB")
    code, out = p.returncode, p.stdout
    fits = next(line for line in out.splitlines() if line.startswith("fits 22.50 GiB")).split()[3:]
    assert code == 0 and fits[-2:] == ["yes", "yes"] and "fsdp_offload_params=true" in out


def test_sharding_refuses_a_4bit_weight_stored_as_a_float():
    """bnb_4bit_quant_storage=bfloat16: FSDP2 would take the packed bytes for numbers (a cast corrupts them,
    ../shared/fsdp-probe): refused with what to do. uint8 storage (bitsandbytes' default) passes."""
    import bitsandbytes as bnb

    def layer(storage):
        lin = bnb.nn.Linear4bit(128, 128, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                quant_storage=storage)
        lin.weight = bnb.nn.Params4bit(torch.randn(128, 128, dtype=torch.bfloat16), requires_grad=False,
                                       quant_type="nf4", quant_storage=storage)._quantize("cpu")
        return torch.nn.Sequential(lin)

    assert sharding.storage_problem(layer(torch.uint8)) is None
    assert "stored as bfloat16 (bnb_4bit_quant_storage)" in sharding.storage_problem(layer(torch.bfloat16))


@pytest.mark.parametrize("keys, message", [(["loss_type=kto"], "loss_type=kto does not run sharded yet"),
                                           (["quantization=8bit"], "an 8-bit base cannot be sharded")])
def test_a_sharded_run_refuses_what_it_cannot_shard(keys, message):
    cfg = load_config("lowmem_dpo:tiny-cpu", ["fsdp=true", *keys])
    resolved = devices.Resolved(torch.device("cpu"), "cpu", torch.float32, False, "adamw_torch",
                                quantization=cfg.quantization, sharded=True)
    with pytest.raises(UserError, match=message):
        cards.sharded_as_planned(cfg, resolved, None)


def test_out_of_memory_in_a_sharded_forward_ends_the_run_at_once_with_what_to_lower():
    """Simulated (CUDA out of memory cannot happen on this CPU): with fsdp (collective) the process does not retry
    alone, whose retry would wait forever on the others' gathers: exit 2 naming the keys; without, it halves."""
    from lowmem_dpo.runtime import oom

    calls = []

    def run(size):
        calls.append(size)
        if size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return size

    message = sharding.oom_message("per_device_train_batch_size or max_length", offloaded=False)
    with pytest.raises(UserError, match="out of memory with fsdp: .*lower per_device_train_batch_size or max_length, "
                                        "or set fsdp_offload_params=true"):
        oom.halving_on_oom(run, 4, torch.device("cpu"), oom.Said(str, "exhausted", collective=message))
    assert calls == [4]
    assert oom.halving_on_oom(run, 4, torch.device("cpu"), oom.Said(str, "exhausted")) == 1 and calls == [4, 4, 2, 1]
