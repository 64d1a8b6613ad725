"""The stages' first-batch checks of their forward against the model's own:

- an architecture logps.py does not know (its model_type is not in logps.HEADS): precompute, train and sft compare
  their log-probs with the model's own forward before computing anything, and stop (exit 2) when the two differ.
  For a known architecture it costs nothing;
- share_prompt (decide_sharing): precompute and train compare the shared-prefix forward with the unshared one on
  the first pairs, and share only when they agree;
- padding_free (decide_packing): precompute, train and sft compare a packed row's log-probs with the padded
  batch's on the first rows, and pack only when they agree;
- the attention kernel (attention_kernel): which of SDPA's kernels the first pair's forward runs, said in one line,
  with a warning where a long sequence would build its (T, T) scores.

`bring_up` runs the four, as every stage (and the benches) brings its model up."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.config.schema import Config
from lowmem_dpo.model import logps, packing, sdpa
from lowmem_dpo.model.head import FUSED, HEAD_TOKENS
from lowmem_dpo.runtime import devices, kernels, oom
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.rules import SHARE_MIN_PROMPT_SHARE

# check_head's per-token tolerance (nats) by the precision of the forward. In float32 the two sides agree to
# ~1e-6. In 16 bits the model rounds its own transform (x / c, tanh, x * c) to the logits' dtype: a few ulps of
# logits up to ~30 in size. A missing or wrong transform moves a real model's log-probs by whole nats.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.05, torch.bfloat16: 0.25}
CHECK_ROWS, CHECK_TOKENS = 2, 32  # check_head's forward: at most 2 x 32 tokens, cheap even on a 7B model


@dataclass
class HeadCheck:
    """The first batch's comparison of this module's log-probs with the model's own forward."""

    model_type: str
    head: logps.Head  # as logps.head_of read it from the config
    difference: float  # max |ours - theirs| of log p(next token) over the checked positions, nats
    plain_difference: float  # the same with a plain head (no transform)
    tolerance: float
    positions: int

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance


def _own_forward(lm, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, logits) of one forward of the CausalLM: the backbone's last hidden state (n, t, H) as its hook
    saw it, and the model's own logits (n, t, V). In eval mode (no dropout), restored after."""
    backbone = getattr(lm, lm.base_model_prefix)
    seen = []
    handle = backbone.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    try:
        with logps.eval_mode(lm):
            logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (n, t, V)
    finally:
        handle.remove()
    return seen[-1], logits


@torch.no_grad()
def check_head(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> HeadCheck | None:
    """For a model type not in HEADS (None for a known one): one forward of the model's own CausalLM on the first
    CHECK_ROWS rows' first CHECK_TOKENS tokens, and the largest difference between its log_softmax and this
    module's head applied to the hidden state that same forward fed it (a hook keeps it), at every real position.
    Only the head can differ: the same hidden state, the same lm_head call, the same dtype (run it under the
    autocast of the stage). input_ids, attention_mask: (N, T), right-padded."""
    lm = logps.causal_lm(model)
    head, known = logps.head_of(lm.config)
    if known:
        return None
    ids, mask = input_ids[:CHECK_ROWS, :CHECK_TOKENS], attention_mask[:CHECK_ROWS, :CHECK_TOKENS]  # (n, t)
    hidden, logits = _own_forward(lm, ids, mask)
    lm_head = lm.get_output_embeddings()
    device = lm_head.weight.device
    n, t = ids.shape
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1).to(device)  # (n, t): position s predicts s+1 (last: unused)
    keep = torch.zeros(n, t, dtype=torch.bool, device=device)  # (n, t)
    keep[:, :-1] = mask[:, 1:].bool()
    theirs = logits.float().log_softmax(-1).to(device).gather(-1, labels.unsqueeze(-1)).squeeze(-1)[keep]  # (P,)
    h = hidden.to(device).reshape(n * t, -1)  # (n*t, H): the shape lm_head saw inside the forward

    def difference(h_: logps.Head) -> float:  # through the head train and precompute run (tiles, or the fused one)
        ours = logps.chunked_head(lm_head, h_, h, labels.reshape(-1), None)[0].view(n, t)[keep]  # (P,)
        return float((ours - theirs).abs().max()) if ours.numel() else 0.0

    low = max((hidden.dtype, logits.dtype), key=lambda d: torch.finfo(d).eps)  # the coarser of the two
    return HeadCheck(str(lm.config.model_type), head, difference(head), difference(logps.Head()),
                     TOLERANCE.get(low, TOLERANCE[torch.bfloat16]), int(keep.sum()))


def describe(head: logps.Head) -> str:
    parts = (([f"logits x {head.scale:g}"] if head.scale != 1.0 else [])
             + ([f"softcap {head.softcap:g}"] if head.softcap else []))
    return ", ".join(parts) or "plain lm_head"


def verify(model, batch: data.Batch, device: torch.device, dtype: torch.dtype) -> None:
    """Raise UserError when the chunked log-probs of an unknown architecture differ from its own forward on
    `batch` (already on `device`; the stage's forward precision `dtype`); log a note when they agree."""
    with oom.out_of_memory_means(OOM_CHECK), devices.autocast(device, dtype):
        check = check_head(model, batch.input_ids, batch.attention_mask)
    if check is None:
        return
    t = check.model_type
    if not check.ok:
        hint = ""
        if check.head != logps.Head() and check.plain_difference <= check.tolerance:
            hint = f" A plain head matches it (difference {check.plain_difference:.2g}): add \"{t}\": _plain."
        raise UserError(
            f"model_type {t!r} is not in lowmem_dpo's table of LM heads (logps.HEADS), and on the first batch its "
            f"log-probs differ from the model's own forward by up to {check.difference:.3g} nats per token "
            f"(tolerance {check.tolerance:g} in {devices.dtype_name(dtype)}; head read from the config: "
            f"{describe(check.head)}). They would be wrong, so nothing was computed. Add {t!r} to HEADS in "
            f"lowmem_dpo/model/logps.py with what its ForCausalLM.forward does after self.lm_head(...).{hint}")
    log(f"model_type {t!r} is not in logps.HEADS; its head ({describe(check.head)}) matches the model's own "
        f"forward on the first batch (max difference {check.difference:.2g} nats per token over "
        f"{check.positions} positions, tolerance {check.tolerance:g})")


OOM_CHECK = ("out of memory in the first batch's checks (a forward of at most 2 pairs): the model's weights leave no "
             "room for activations. Set quantization=4bit or lower max_length (lowmem-dpo plan RECIPE.yaml "
             "shows what fits the budget)")


# decide_sharing's tolerance: the largest difference of a completion's mean log-prob per token (nats), shared
# against unshared. float32 agrees to ~1e-6 (another summation order); 16-bit kernels round differently for
# other shapes. A wrong mask or position (rejected seeing chosen) moves it by whole nats.
SHARE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 0.02, torch.bfloat16: 0.05}



# attention_kernel warns from this max_length on when the kernel builds (T, T) scores per head: at 4096 tokens a
# 32-head layer's float32 scores take 2 GiB per sequence.
LONG_SEQUENCE = 4096


@torch.no_grad()
def attention_kernel(model, batch: data.Batch, dtype: torch.dtype, max_length: int, train: bool = False) -> str:
    """Which attention kernel the model runs on `batch` (the stage's first pair, in its layout), as the line the
    stage logs: SDPA's flash or memory-efficient kernel never holds (T, T) scores; its math kernel and eager
    attention do (a warning from LONG_SEQUENCE tokens on). train: asked for tensors that need gradients, as train's
    are (torch's choice depends on it: flash's backward takes fewer head sizes on some cards)."""
    lm = logps.causal_lm(model)
    impl = getattr(lm.config, "_attn_implementation", None)
    calls = []
    if impl in (None, "sdpa", logps.PACKED_ATTENTION):  # another implementation does not call SDPA: nothing to probe
        with (sdpa.sdpa_calls(stop=True) as calls, logps.eval_mode(model),
              devices.autocast(batch.input_ids.device, dtype)):
            try:
                logps.completion_logps(model, batch)
            except sdpa.FirstCall:  # the first attention call's arguments are all the probe needs
                pass
    if not calls:
        kernel = f"{impl or 'its own'} attention"
        line = f"attention: {kernel} (not torch's SDPA)"
    else:
        c = calls[0]
        if train:
            c = {**c, **{k: c[k].detach().requires_grad_() for k in ("query", "key", "value")}}
        with torch.set_grad_enabled(train):  # torch looks at requires_grad only with gradients on
            kernel = sdpa.sdpa_kernel(**c)
        mask = c["attn_mask"]
        line = (f"attention: SDPA's {kernel} kernel" + (
            f", with the {'shared rows' if batch.shared else 'padding'} mask {tuple(mask.shape)} as a bias"
            if mask is not None else ", causal, no mask") + (
            ", once per sequence of a packed row (padding_free: no padding)" if batch.packed is not None else ""))
    if kernel in ("flash", "memory-efficient", "cuDNN"):
        return line + " (never the (T, T) scores)"
    if kernel == "unknown":
        return line + " (torch does not say which)"
    warn = max_length >= LONG_SEQUENCE
    return ("warning: " if warn else "") + line + (": it builds (batch, heads, T, T) scores, which at long max_length "
                                                   "take most of the memory" if warn else "")


def prompt_share(pairs: list) -> float:
    """The share of an unshared forward's tokens (prompt twice, chosen, rejected) that a second prompt is."""
    prompts = sum(len(p.prompt_ids) for p in pairs)
    total = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    return prompts / max(1, total)


def sharing_problem(model, max_length: int) -> str | None:
    """Why this model cannot take a shared-prefix batch, or None: its attention implementation takes no custom
    mask, or a sliding window shorter than a [prompt, chosen, rejected] row could be (a custom mask replaces
    the model's own, window included)."""
    config = logps.causal_lm(model).config
    impl = config._attn_implementation
    if impl not in logps.MASK_KINDS:
        return f"attention implementation {impl!r} takes no custom mask (only {', '.join(logps.MASK_KINDS)})"
    window = getattr(config, "sliding_window", None)
    if window and window < 2 * max_length:
        return f"its sliding window ({window} tokens) is shorter than a shared row can be (2 x max_length)"
    return None


@torch.no_grad()
def layout_difference(model, plain: data.Batch, other: data.Batch, dtype: torch.dtype) -> float:
    """The largest difference of a completion's mean log-prob per token between two layouts of the same sequences
    (padded, shared, packed), both on the model's device; in eval mode, so that LoRA dropout (a continued SFT
    adapter's B is not 0) draws no different noise into the two forwards."""
    with devices.autocast(plain.input_ids.device, dtype), logps.eval_mode(model):
        a, b = logps.completion_logps(model, plain), logps.completion_logps(model, other)
    if not torch.equal(a.n_tokens, b.n_tokens):
        return float("inf")
    return float(((a.logps - b.logps).abs() / a.n_tokens.clamp(min=1)).max())


def checked(model, plain: data.Batch, other: data.Batch, dtype: torch.dtype, what: str) -> str | None:
    """Why the layout `other` cannot stand in for `plain` on this model (what: its name in the message), or None:
    its forward fails, or its log-probs differ from the padded ones by more than SHARE_TOLERANCE."""
    try:
        with oom.out_of_memory_means(OOM_CHECK):
            difference = layout_difference(model, plain, other, dtype)
    except (TypeError, ValueError, RuntimeError) as e:  # a forward that takes no 4D mask, position_ids or bounds
        return f"its forward fails on a {what} batch ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    tolerance = SHARE_TOLERANCE.get(dtype, SHARE_TOLERANCE[torch.bfloat16])
    if difference > tolerance:
        return (f"on the first rows its {what} log-probs differ from the padded ones by up to {difference:.3g} "
                f"nats per token (tolerance {tolerance:g} in {devices.dtype_name(dtype)})")
    return None


def decide_sharing(model, pairs: list, pad_id: int, resolved: devices.Resolved, dtype: torch.dtype,
                   setting: bool | str, max_length: int) -> bool:
    """Whether the stage shares each prompt (share_prompt): the device's answer (resolved.share_prompt), when the
    model supports it and the first pairs (at most 2) give the unshared log-probs. `setting` (share_prompt: auto or
    a bool): true refuses a model that cannot (exit 2); auto falls back to the unshared forward with a note."""
    if not resolved.share_prompt:
        return False
    problem = sharing_problem(model, max_length)
    share = prompt_share(pairs)
    if problem is None and setting == "auto" and share < SHARE_MIN_PROMPT_SHARE:
        problem = (f"the repeated prompts are {share:.0%} of the tokens, below the "
                   f"{SHARE_MIN_PROMPT_SHARE:.0%} where sharing pays on this device (share_prompt=true forces it)")
    if problem is None:
        first = pairs[:CHECK_ROWS]
        problem = checked(model, data.collate(first, pad_id).to(resolved.device),
                          data.collate_shared(first, pad_id).to(resolved.device), dtype, "shared-prefix")
    if problem is None:
        return True
    if setting is True:
        raise UserError(f"share_prompt=true: this model cannot share the prompt: {problem}; set share_prompt=auto "
                        "or false (the unshared forward: each prompt twice)")
    log(f"share_prompt: the unshared forward (each prompt twice): {problem}")
    return False


def decide_packing(model, first: data.Batch, device: torch.device, dtype: torch.dtype, setting: bool | str,
                   max_length: int, shared: bool) -> bool:
    """Whether the stage runs each micro-batch as one packed row (padding_free: packing.py): when the model
    qualifies (packing.problem) and, with its attention switched to the packed one, the `first` rows (at most
    CHECK_ROWS items, collated as the stage lays them out: data.collate, collate_shared or collate_completions)
    give the padded log-probs. `setting` (padding_free: auto or a bool): false keeps the padded batches; true
    refuses a model that cannot (exit 2); auto falls back to padding with a note. The attention stays switched
    when packed."""
    if setting is False:
        return False
    lm = logps.causal_lm(model)
    problem = packing.problem(lm, max_length, shared)
    if problem is None:
        packing.enable(lm)
        problem = checked(model, first.to(device), dataclasses.replace(first, packed=data.pack(first)).to(device),
                          dtype, "packed")
        if problem is not None:
            packing.disable(lm)
    if problem is None:
        log(f"padding_free: a micro-batch whose padding is {data.PACK_MIN_PADDING:.0%} of its positions or more runs "
            "as one packed row, each sequence attending only to itself (the first rows gave the padded log-probs)")
        return True
    if setting is True:
        raise UserError(f"padding_free=true: this model cannot run packed rows: {problem}; set padding_free=auto or "
                        "false (padded micro-batches)")
    log(f"padding_free: padded micro-batches: {problem}")
    return False


def use_fused_head(device: torch.device) -> str | None:
    """Set the LM head's fused kernel for `device` (kernels.fused_head: TRL's Triton kernel on CUDA, where it is
    installed and its probe passes on this card), or none; on CUDA, the line that says which head runs."""
    kernel, why = kernels.fused_head(device)
    if kernel is None:
        FUSED.pop(device.type, None)
        return None if device.type != "cuda" else (f"LM head: {HEAD_TOKENS}-token tiles, online logsumexp, in torch "
                                                   f"ops (TRL's fused Triton kernel is not used: {why})")
    FUSED[device.type] = kernel
    return ("LM head: TRL 1.16's fused Triton kernel (4096-token x 32,768-entry tiles, online logsumexp; its probe "
            "on this card gave torch's log-probs and gradient)")


def bring_up(model, cfg: Config, resolved: devices.Resolved, pad_id: int, first: list, pairs: list | None = None,
             train: bool = False) -> data.Layout:
    """A stage's model, checked before its first real batch (precompute, train, sft, measure, the benches): its LM
    head against its own forward on the `first` rows (verify: an architecture logps.HEADS does not know); whether
    each prompt is shared, decided on `pairs` (decide_sharing; None: SFT's completions, never shared; KTO trains one
    sequence a row); whether micro-batches run packed (decide_packing); the attention kernel of the first rows in
    that layout, logged. train: the policy's dtype, else the reference's. The LM head's fused kernel, where the
    device has one (head.FUSED), is set and logged. Returns the layout."""
    dtype = resolved.dtype if train else resolved.ref_dtype
    fused = use_fused_head(resolved.device)
    if fused:
        log(fused)
    collate = data.collate_completions if pairs is None else data.collate
    verify(model, collate(first, pad_id).to(resolved.device), resolved.device, dtype)
    shared = pairs is not None and not objectives.unpaired(cfg.loss_type) and decide_sharing(
        model, pairs, pad_id, resolved, dtype, cfg.share_prompt, cfg.max_length)
    collate = data.collate_shared if shared else collate
    packed = decide_packing(model, collate((pairs or first)[:CHECK_ROWS], pad_id), resolved.device, dtype,
                            cfg.padding_free, cfg.max_length, shared)
    log(attention_kernel(model, collate(first, pad_id, packed=packed).to(resolved.device), dtype, cfg.max_length,
                         train=train))
    return data.Layout(shared, packed)
