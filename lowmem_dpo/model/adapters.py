"""The SFT adapter in the DPO stages: the reference is base + SFT adapter, the policy continues that adapter.

    lowmem-dpo sft lowmem_dpo:tiny-sft                    # stage A: writes a LoRA adapter
    lowmem-dpo precompute lowmem_dpo:tiny-dpo-after-sft    # reference = base + that adapter, once
    lowmem-dpo train lowmem_dpo:tiny-dpo-after-sft         # keeps training that same adapter

`models.model_source` says which adapter (if any) a recipe names; this module puts it on a loaded base. One
adapter is active at any time, never two: with adapter_mode=continue the policy *is* the SFT adapter, trained on
(no second copy in memory: the reference is the cache); with adapter_mode=new_on_merged the SFT adapter is merged
into the base weights first, then a fresh adapter is added. The reference is base + SFT adapter in both modes
(merging changes the numbers only by rounding), so the mode is not part of the cache's model side.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from lowmem_dpo.config.schema import Config
from lowmem_dpo.model.models import ADAPTER_CONFIG, ModelSource, target_names
from lowmem_dpo.runtime.errors import UserError, log


def save(model, folder) -> None:
    """The PEFT adapter files into `folder`, the same bytes for the same adapter: peft writes target_modules (a
    set) in the order of this process's string hashes, and a later stage keys its inputs by these bytes (a rerun
    of a finished SFT run would otherwise change the DPO stage's reference)."""
    model.save_pretrained(folder, safe_serialization=True)
    path = Path(folder) / ADAPTER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def carries_adapter(model: torch.nn.Module) -> bool:
    """Whether peft layers (any adapter, active or not) are already injected into `model`."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return getattr(model, "_hf_peft_config_loaded", False) or any(
        isinstance(module, BaseTunerLayer) for module in model.modules())


def check_no_adapter(model: torch.nn.Module, wanted: str) -> None:
    """Refuse to put `wanted` (a new or loaded adapter) on a model that already carries one: never stacked."""
    if carries_adapter(model):
        raise UserError(f"the loaded model already carries a LoRA adapter, and this run would add {wanted} on top "
                        "(two adapters). lowmem_dpo keeps one: pass the adapter folder as model_name_or_path (or "
                        "sft_adapter) with its base, or merge it into the base first")


def load_adapter(base: torch.nn.Module, path, trainable: bool):
    """PeftModel.from_pretrained(base, path): the saved adapter on `base`, trainable or frozen."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, path, is_trainable=trainable)


def reference_model(base: torch.nn.Module, source: ModelSource) -> torch.nn.Module:
    """Precompute's reference: `base` as loaded, or base + the SFT adapter (frozen, eval mode, dropout off)."""
    if source.adapter_path is None:
        return base
    check_no_adapter(base, f"the SFT adapter {source.adapter_path}")
    model = load_adapter(base, source.adapter_path, trainable=False)
    model.eval()  # eval mode: LoRA dropout is inactive, as in train (its dropout is lora_dropout, default 0)
    return model


def adapter_off_is_start(cfg: Config, source: ModelSource) -> bool:
    """Whether the trained model with its adapter disabled is where the run starts (its reference): not when it
    continues an SFT adapter, whose start is base + that adapter."""
    return source.adapter_path is None or cfg.adapter_mode != "continue"


def check_mode(cfg: Config, source: ModelSource, quantization: str, reference: bool = True) -> None:
    """Before anything loads: the adapter_mode (and, for a stage with a reference, ref_source) settings that
    cannot work with this source."""
    if source.adapter_path is None:
        if "adapter_mode" in cfg.explicit_keys and cfg.adapter_mode != "continue":
            log(f"note: adapter_mode={cfg.adapter_mode} has no effect: {source.kind} model, no SFT adapter")
        return
    if cfg.adapter_mode == "new_on_merged" and quantization != "none":
        raise UserError(f"adapter_mode=new_on_merged with quantization={quantization}: merging the SFT adapter into "
                        f"a {quantization} base rounds the merged weights back to {quantization}, so the policy would "
                        "start from a different model than the cached reference and lose the adapter's precision. "
                        "Use adapter_mode=continue (trains the SFT adapter itself on the quantized base), or "
                        "quantization=none")
    if reference and cfg.ref_source == "live" and not adapter_off_is_start(cfg, source):
        raise UserError("ref_source=live with adapter_mode=continue: the live reference is the model with its "
                        "adapter off, which is the base without the SFT adapter, not the SFT model. Use "
                        "ref_source=cache (lowmem-dpo precompute first)")


def planned_lora(cfg: Config, source: ModelSource) -> Config:
    """The config the memory planner sees: with adapter_mode=continue, the SFT adapter's rank and target modules
    instead of the recipe's lora_* keys (the adapter's LoRA weights, grads and optimizer state are what train
    holds)."""
    if source.adapter_path is None or cfg.adapter_mode != "continue":
        return cfg
    adapter = source.adapter
    return dataclasses.replace(cfg, lora_r=adapter.get("r", cfg.lora_r),
                               lora_target_modules=target_names(adapter) or cfg.lora_target_modules)


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """Short names of the linear layers `all-linear` adapts: every nn.Linear (bitsandbytes' included) but the
    LM head."""
    head = model.get_output_embeddings()
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head}


def lora_conflicts(cfg: Config, adapter_config: dict, all_linear: set[str]) -> dict[str, tuple]:
    """Recipe LoRA keys the user set (not defaults) whose value differs from the adapter's: {key: (recipe,
    adapter)}. `all_linear` is what lora_target_modules=all-linear means on this model."""
    names = target_names(adapter_config)
    adapter_targets = all_linear if names == ["all-linear"] else set(names)
    recipe_targets = all_linear if cfg.lora_target_modules == ["all-linear"] else set(cfg.lora_target_modules)
    differs = {
        "lora_r": (cfg.lora_r, adapter_config.get("r")),
        "lora_alpha": (cfg.lora_alpha, adapter_config.get("lora_alpha")),
        "lora_target_modules": (",".join(cfg.lora_target_modules), ",".join(sorted(adapter_targets))),
    }
    same = {"lora_r": cfg.lora_r == adapter_config.get("r"),
            "lora_alpha": cfg.lora_alpha == adapter_config.get("lora_alpha"),
            "lora_target_modules": recipe_targets == adapter_targets}
    return {k: v for k, v in differs.items() if k in cfg.explicit_keys and not same[k]}


def set_lora_dropout(model, p: float) -> None:
    """The continued adapter's dropout is the recipe's lora_dropout (default 0, so step 1 equals the reference),
    not the one the SFT stage trained with: dropout is a training knob, not part of the adapter."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name in module.lora_dropout:
                module.lora_dropout[name] = torch.nn.Dropout(p) if p > 0 else torch.nn.Identity()
    for peft_config in model.peft_config.values():
        peft_config.lora_dropout = p


def continue_adapter(base: torch.nn.Module, cfg: Config, source: ModelSource):
    """adapter_mode=continue: the SFT adapter loaded trainable on `base`; its rank, alpha and target modules
    stay, recipe LoRA keys set to other values are named in a warning."""
    check_no_adapter(base, f"the SFT adapter {source.adapter_path}")
    adapter_config = source.adapter
    conflicts = lora_conflicts(cfg, adapter_config, linear_module_names(base))
    if conflicts:
        log("warning: continuing the SFT adapter with its own LoRA settings; ignoring the recipe's "
            + ", ".join(f"{k}={mine} (adapter: {theirs})" for k, (mine, theirs) in conflicts.items())
            + ". To train a fresh adapter with them, set adapter_mode=new_on_merged")
    model = load_adapter(base, source.adapter_path, trainable=True)
    set_lora_dropout(model, cfg.lora_dropout)
    trained_with = adapter_config.get("lora_dropout")
    note = f"; it was trained with {trained_with}" if trained_with not in (None, cfg.lora_dropout) else ""
    log(f"adapter: continuing {source.adapter_path} (r={adapter_config.get('r')}, "
        f"alpha={adapter_config.get('lora_alpha')}, lora_dropout={cfg.lora_dropout} from the recipe{note})")
    return model


def merge_adapter(base: torch.nn.Module, source: ModelSource) -> torch.nn.Module:
    """adapter_mode=new_on_merged: the SFT adapter merged into `base`'s (unquantized) weights, in place; returns
    the plain transformers model, which carries no adapter afterwards."""
    check_no_adapter(base, f"the SFT adapter {source.adapter_path}")
    model = load_adapter(base, source.adapter_path, trainable=False)
    merged = model.merge_and_unload()
    merged.__dict__.pop("peft_config", None)  # peft leaves its config on the unloaded model; no adapter is left
    for p in merged.parameters():
        p.requires_grad_(False)
    log(f"adapter: merged {source.adapter_path} into the base; training a fresh adapter on the merged model "
        "(to use the result, merge the SFT adapter into the base first, then load this adapter)")
    return merged


def sft_policy(base: torch.nn.Module, cfg: Config, source: ModelSource):
    """The policy when the source has an SFT adapter: with adapter_mode=continue, that adapter trainable on
    `base` (returned); with new_on_merged, None after merging it into `base` in place (the caller adds the fresh
    adapter). None as well without an SFT adapter."""
    if source.adapter_path is None:
        return None
    if cfg.adapter_mode == "continue":
        return continue_adapter(base, cfg, source)
    merge_adapter(base, source)
    return None
