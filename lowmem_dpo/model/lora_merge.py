"""The arithmetic of merging a saved LoRA adapter into base weights, as peft's merge_and_unload does it: which
adapter config a merge can honour exactly, the adapter's (A, B, scale) per module, and W + scale * B @ A.

Pure functions: an adapter's config and tensors in, tensors out; reading and writing files is export.py's (and
weights.py's) business. A config or key this module cannot merge exactly is a UserError, never a guess.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from lowmem_dpo.runtime.errors import UserError

PREFIX = "base_model.model."  # peft's saved keys: PREFIX + the module's path in the model + the LoRA part
_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B"
                  r"|base_layer\.weight)")
LINEAR, CONV1D, EMBEDDING = "linear", "conv1d", "embedding"  # the layouts of a target's weight (see delta)

# adapter_config.json settings whose adapter is not W + scale * B @ A on the base as saved: (key, what it is).
NOT_PLAIN_LORA = (
    ("use_dora", "DoRA (a magnitude vector rescales each merged column)"),
    ("lora_bias", "a LoRA bias (lora_B carries a bias)"),
    ("modules_to_save", "modules_to_save (whole modules trained and saved beside the LoRA weights)"),
    ("trainable_token_indices", "trainable tokens (embedding rows trained beside the LoRA weights)"),
    ("layer_replication", "layer replication (the adapted model has more layers than the base)"),
    ("target_parameters", "LoRA on parameters (target_parameters) rather than modules"),
    ("alora_invocation_tokens", "activated LoRA (it acts only after its invocation tokens)"),
    ("use_qalora", "QA-LoRA (its A acts on pooled inputs)"),
    ("use_bdlora", "block-diagonal LoRA"),
    ("arrow_config", "Arrow routing between adapters"),
    ("kasa_config", "a KaSA adapter"),
    ("monteclora_config", "MonteCLoRA"),
    ("megatron_config", "Megatron parallel layers"),
)
# init_lora_weights values that leave the base as it was; the others (pissa, olora, corda, loftq, lora_ga, ...)
# subtract their initial A and B from the base weights, so the adapter is relative to a changed base.
PLAIN_INITS = (True, False, "gaussian", "eva")


@dataclass(frozen=True)
class LoraPair:
    """One adapted module of a saved adapter."""

    module: str  # its path in the model, e.g. model.layers.0.self_attn.q_proj
    A: torch.Tensor  # lora_A (r, in); an embedding's lora_embedding_A is (r, num_embeddings)
    B: torch.Tensor  # lora_B (out, r); an embedding's lora_embedding_B is (embedding_dim, r)
    scale: float  # lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), per rank_pattern/alpha_pattern
    embedding: bool  # saved as lora_embedding_A/B: peft's LoRA for an nn.Embedding
    # The module's whole weight as the adapter saved it beside A and B (peft's save_embedding_layers, on by default
    # for LoRA on embeddings and the head): loading the adapter puts it in place of the base's, so the merge
    # starts from it. None for the other modules.
    base_weight: torch.Tensor | None = None


def check_config(config: dict, where: str) -> None:
    """Refuse an adapter config whose adapter is not plain LoRA on the unchanged base (exit 2)."""
    found = [what for key, what in NOT_PLAIN_LORA if config.get(key)]
    if config.get("bias", "none") != "none":
        found.append(f"bias={config['bias']!r} (the base's biases were trained and saved beside the LoRA weights)")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        found.append(f"init_lora_weights={init!r} (its initialisation changed the base weights, so the adapter "
                     "is relative to a base that is not the saved one)")
    if found:
        raise UserError(f"{where}: cannot merge it exactly: it uses {'; '.join(found)}. lowmem_dpo.export merges "
                        "plain LoRA adapters only: merge this one with peft (merge_and_unload) on the model it was "
                        "trained on")


def pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern/alpha_pattern lookup: the first pattern that matches the end of the module's path at a
    dot (a regex), else `default`."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def scaling(config: dict, module: str, rank: int, where: str) -> float:
    """The factor of B @ A for `module`: alpha / r, or alpha / sqrt(r) with use_rslora (peft's LoraLayer)."""
    r = pattern_value(config.get("rank_pattern"), module, config.get("r"))
    alpha = pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha"))
    if r != rank or not isinstance(alpha, (int, float)):
        raise UserError(f"{where}: {module} has rank {rank} in the weights but the config says r={r} "
                        f"(lora_alpha={alpha}); the adapter's files disagree: re-save it")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def lora_pairs(state: dict[str, torch.Tensor], config: dict, where: str) -> list[LoraPair]:
    """The (A, B, scale) of every adapted module of a saved adapter (`state`: its tensors by saved key), sorted by
    module. A key that is not a LoRA weight, or an A without its B, is a UserError."""
    check_config(config, where)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise UserError(f"{where}: adapter key {key!r} is not a LoRA weight (lora_A/lora_B); lowmem_dpo.export "
                            "merges plain LoRA adapters only: merge this one with peft (merge_and_unload)")
        parts.setdefault(match.group(1), {})[match.group(2)] = tensor
    pairs = []
    for module, p in sorted(parts.items()):
        embedding = "lora_embedding_A" in p or "lora_embedding_B" in p
        a, b = (p.get("lora_embedding_A"), p.get("lora_embedding_B")) if embedding else (
            p.get("lora_A.weight"), p.get("lora_B.weight"))
        full = p.get("base_layer.weight")
        if a is None or b is None or len(p) != 2 + (full is not None) or a.dim() != 2 or b.dim() != 2 or (
                a.shape[0] != b.shape[1]):
            raise UserError(f"{where}: the LoRA weights of {module} are not one 2-D pair A (r, in), B (out, r) "
                            f"({', '.join(f'{k} {tuple(t.shape)}' for k, t in p.items())}); cannot merge them")
        pairs.append(LoraPair(module, a, b, scaling(config, module, a.shape[0], where), embedding, full))
    return pairs


def delta(pair: LoraPair, layout: str, rows: slice = slice(None)) -> torch.Tensor:
    """scale * B @ A in float32 in the layout of the target's weight (peft's get_delta_weight), rows `rows` of it
    (the merge goes block by block to bound memory): LINEAR (out, in); CONV1D (GPT-2's Conv1D, fan_in_fan_out)
    (in, out); EMBEDDING (num_embeddings, dim)."""
    a, b = pair.A.float(), pair.B.float()  # (r, in), (out, r)
    if layout == LINEAR:
        product = b[rows] @ a  # (rows, in)
    else:
        product = b @ a[:, rows]  # (out, rows): the weight's rows are A's columns; transposed below
    product.mul_(pair.scale)  # in place: saves a second float32 copy of the block (peft's values exactly)
    return product if layout == LINEAR else product.T  # (rows, out) for CONV1D and EMBEDDING


def merge(weight: torch.Tensor, pairs: list[tuple[LoraPair, str]], dtype: torch.dtype,
          rows: slice = slice(None)) -> torch.Tensor:
    """weight + each pair's delta (with its layout) in turn, in float32, cast to `dtype` once at the end (the
    adapters of an adapter_mode=new_on_merged run: the SFT adapter's first, then the DPO adapter's, as peft merges
    them in turn). `weight` may be a block of rows of the whole (`rows`). A pair that carries its own copy of the
    weight starts over from it, as loading it does."""
    out = weight.to(torch.float32, copy=True)  # a copy even in float32: += must not write into the base's tensor
    for pair, layout in pairs:
        if pair.base_weight is not None:
            out = pair.base_weight[rows].to(torch.float32, copy=True)
        d = delta(pair, layout, rows)
        if d.shape != out.shape:
            raise AssertionError(f"delta {tuple(d.shape)} does not fit the weight {tuple(out.shape)}")
        out += d
    return out.to(dtype)
