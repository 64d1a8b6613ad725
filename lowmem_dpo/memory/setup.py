"""What a run is, for the memory model: a Config resolved through the device rules (rules.RULES) into the
knobs a prediction depends on, and the memory budget it must fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lowmem_dpo.model.activations import MLP_TILE_TOKENS
from lowmem_dpo.runtime import devices, ram, rules
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.ranks import local_size
from lowmem_dpo.runtime.units import parse_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Setup:
    """The resolved knobs a prediction depends on (a Config plus the device rule's choices)."""

    device: str  # cuda | cpu | mps
    kind: str  # the rules.RULES key
    dtype: str  # the policy's weights and compute (also the compute dtype of a quantized base)
    quantization: str  # the policy's base: none | 8bit | 4bit
    ref_dtype: str  # the reference's, in precompute
    ref_quantization: str
    gradient_checkpointing: bool
    optimizer: str  # rules.ADAMW_TORCH | rules.PAGED_ADAMW_8BIT
    micro_batch: int  # preference pairs per micro-batch: 2x sequences per forward
    grad_accum: int
    precompute_batch: int  # pairs per precompute forward
    max_length: int
    lora_r: int
    lora_targets: str | tuple[str, ...]  # as peft takes them: names, one regex, or all-linear (arch.adapted)
    lora_dropout: float = 0.0
    seq_len: int | None = None  # padded tokens per sequence; None: max_length (the worst case)
    completion_tokens: int | None = None  # completion tokens per sequence; None: seq_len - 1 (the worst case)
    precompute_seq_len: int | None = None
    precompute_completion_tokens: int | None = None
    share_prompt: bool = False  # rows [prompt, chosen, rejected]: one sequence per pair (shapes)
    activation_offloading: bool = False  # train's saved tensors in pinned host memory (activations.py; CUDA only)
    prompt_tokens: int | None = None  # the data's prompts, when known (plan --prompt-tokens); None: the worst case
    share_forced: bool = False  # share_prompt=true: shared whatever the prompts' share of the tokens
    # train's MLP in tiles with checkpointing (activations.TiledMLP): the recompute's peak one tile's, the same two
    # passes per step; search.choose runs it whole where that fits (fewer, larger kernels), else in the largest
    # tiles that fit (each tile dequantizes a 4-bit base's weights again)
    mlp_tiles: bool = True
    mlp_tile_tokens: int = MLP_TILE_TOKENS
    processes: int = 1  # the run's processes, each on its own card (torchrun; plan --nproc)
    sharded: bool = False  # fsdp: the base sharded over them (weights.card_weight_bytes)
    shard_offload: bool = False  # fsdp_offload_params: the shards in CPU RAM

    @property
    def autocast(self) -> bool:
        """train and precompute autocast the forward to a 16-bit dtype (devices.autocast)."""
        return DTYPE_BYTES[self.dtype] == 2

    def shapes(self, stage: str) -> tuple[int, int]:
        """(T, completion tokens per sequence) for `stage`: as measured, or the longest the data allows. With P
        prompt tokens (prompt_tokens: the data's shortest prompt, else 1) and L = max_length: unshared, T = L with
        L - P of completion; shared, one row [prompt, chosen, rejected] of T = 2L - P with 2(L - P). share_prompt
        =auto shares every row once the data's prompts are SHARE_MIN_PROMPT_SHARE of its tokens in all, so one
        row may still have a one-token prompt: the worst case is P = 1 either way."""
        p = min(self.max_length - 1, self.prompt_tokens or 1)
        longest = 2 * self.max_length - p if self.share_prompt else self.max_length
        completion = 2 * (self.max_length - p) if self.share_prompt else self.max_length - p
        if stage == "precompute":
            t = self.precompute_seq_len or longest
            return t, self.precompute_completion_tokens or min(t - 1, completion)
        t = self.seq_len or longest
        return t, self.completion_tokens or min(t - 1, completion)

    def sequences(self, stage: str) -> int:
        """Sequences per forward: two per pair (chosen, rejected), or one shared row per pair."""
        pairs = self.precompute_batch if stage == "precompute" else self.micro_batch
        return pairs if self.share_prompt else 2 * pairs


def lora_targets(cfg) -> str | tuple[str, ...]:
    """lora_target_modules as peft takes them (Config.peft_target_modules), hashable."""
    spec = cfg.peft_target_modules
    return spec if isinstance(spec, str) else tuple(spec)


def device_kind_for(device: str, budget: int | None) -> str:
    """The rules.RULES key a run on `device` resolves to. CUDA: the tier of the budget (not the card's total), with
    this machine's card's bf16 support; a card this machine lacks is assumed bf16-capable."""
    if device == "cuda":
        if torch.cuda.is_available():
            return devices.device_kind(torch.device("cuda"), budget)
        if budget is None:
            raise UserError("device=cuda but no GPU here to read its memory from: pass --budget, e.g. 11.25GiB "
                            "(what torch gets of a 12 GB card)")
        return rules.cuda_kind(budget, native_bf16=True)
    return devices.device_kind(torch.device(device))


def planned_device(cfg) -> str:
    if cfg.device != "auto":
        return cfg.device
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def setup_from_config(cfg, budget: int | None = None, processes: int = 1) -> Setup:
    """Resolve a Config through the device rules (rules.RULES) the way train and precompute do, for the
    device the recipe names (cuda plans for a GPU even on a machine without one), on `processes` processes (fsdp
    true shards; auto is the search's: cards.on_cards)."""
    device = planned_device(cfg)
    kind = device_kind_for(device, budget)
    rule = rules.RULES[kind]
    dtype = rule.dtype if cfg.dtype == "auto" else cfg.dtype
    ref_dtype = cfg.reference_dtype
    ref_dtype = rule.dtype if ref_dtype == "auto" else ref_dtype
    ckpt = rule.gradient_checkpointing if cfg.gradient_checkpointing == "auto" else cfg.gradient_checkpointing is True
    return Setup(device=device, kind=kind, dtype=dtype, quantization=cfg.quantization, ref_dtype=ref_dtype,
                 ref_quantization=cfg.reference_quantization, gradient_checkpointing=ckpt, optimizer=rule.optimizer,
                 micro_batch=cfg.per_device_train_batch_size, grad_accum=cfg.gradient_accumulation_steps,
                 precompute_batch=cfg.precompute_batch_size, max_length=cfg.max_length, lora_r=cfg.lora_r,
                 lora_targets=lora_targets(cfg), lora_dropout=cfg.lora_dropout,
                 share_prompt=rule.share_prompt if cfg.share_prompt == "auto" else cfg.share_prompt is True,
                 share_forced=cfg.share_prompt is True,
                 activation_offloading=device == "cuda" and cfg.activation_offloading is True,
                 processes=processes, sharded=processes > 1 and cfg.fsdp is True,
                 shard_offload=processes > 1 and cfg.fsdp is True and cfg.fsdp_offload_params is True)


def with_prompts(setup: Setup, prompt_tokens: int) -> Setup:
    """`setup` for data whose prompts are at least `prompt_tokens` long, with the shapes that follow. Shared as the
    setup says: under share_prompt=auto whether the run shares depends on all its prompts, so the shared row (the
    larger) is the one to plan for."""
    return dataclasses.replace(setup, prompt_tokens=prompt_tokens)


def run_budget(cfg, device: str) -> int:
    """The budget train and precompute plan for: memory_budget, or the device's memory."""
    if cfg.memory_budget is not None:
        return parse_size(cfg.memory_budget, "memory_budget")
    return default_budget(device)


def default_budget(device: str) -> int:
    """What a run on `device` may use: on CUDA what torch can get of the card (rules.cuda_budget: free, plus what
    this process holds, less what CUDA loads later); on a CPU the RAM (in a container, its memory limit where that
    is less: runtime/ram.py), shared by the run's processes on this machine, each with its own model."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device=cuda but no GPU here to read its memory from: pass --budget, e.g. 11.25GiB "
                            "(what torch gets of a 12 GB card)")
        return rules.cuda_budget(*devices.cuda_memory(torch.device("cuda", torch.cuda.current_device())), None).budget
    return ram.total() // local_size()  # a container's memory limit where it is less than the machine's RAM
