"""Sample generations: what the policy writes for a few eval prompts, at step 0 (the reference) and at every eval.

    greedy     greedy completions of a causal LM or PeftModel (left-padded batch, KV cache, no gradients)
    sample     the same, sampled (temperature, top_p; a seed for the same draws): chat's answers
    generate   the same from tokenized eval items, decoded: Sample(prompt, completion, chosen, ids)
    append     one JSON line per sample to output_dir/samples.jsonl: {step, prompt, completion, chosen}
    keep_until a resumed run drops the lines written after its checkpoint
    log_line   the one line the log shows

The completions' token ids feed answers.repetition, the degeneration measure behind the collapse sign, and
answers.rouge_l against the chosen completions; kl_to_reference measures how far the policy's own answers are
from what the reference would write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo import data
from lowmem_dpo.model.logps import eval_mode
from lowmem_dpo.runtime import devices, files


@dataclass
class Sample:
    prompt: str  # as shown: a conversation's last user message (data.shown_prompt), a text prompt as it is
    completion: str  # the policy's greedy completion
    chosen: str  # the data's chosen completion (SFT: its completion)
    ids: list[int]  # the completion's token ids, without EOS (for answers.repetition)
    chosen_ids: list[int] | None = None  # the chosen completion's, without EOS (for answers.rouge_l)
    rejected: str | None = None  # the data's rejected completion (a pair's; None for SFT's and KTO's rows)


@dataclass(frozen=True)
class Placement:
    """Where generation runs the model: on `device`, its compute in `dtype` (autocast); synced (fsdp: each forward
    gathers from every process): every process runs forwards until all are done (generate's synced_gpus),
    whatever token each met its end at."""

    device: object  # a torch.device, or its name
    dtype: torch.dtype
    synced: bool = False


@dataclass(frozen=True)
class Drawing:
    """How an answer's tokens are chosen: greedy (temperature 0), or sampled (sample)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __str__(self) -> str:
        if self.temperature == 0:
            return "greedy"
        seed = "" if self.seed is None else f", seed {self.seed}"
        return f"sampling at temperature {self.temperature:g}, top_p {self.top_p:g}{seed}"


def _left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None, pad_id: int,
           placement: Placement) -> list[list[int]]:
    """Greedy completions of `prompts` (token ids), each cut before its first EOS, generated ids only.

    One left-padded batch through transformers' generate with the KV cache. The model runs in eval mode (no
    dropout; gradient checkpointing, which only acts in training mode, then leaves the cache on) and goes back to
    its previous mode afterwards."""
    return _completions(model, prompts, eos_id, pad_id, placement, do_sample=False, num_beams=1,
                        max_new_tokens=max_new_tokens)


def sample(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None, pad_id: int,
           placement: Placement, drawing: Drawing) -> list[list[int]]:
    """Sampled completions of `prompts`, as greedy's otherwise (the same batch, cache, mode and cuts): each token
    drawn from the next-token distribution at the drawing's temperature, within the smallest set of tokens whose
    probability reaches its top_p (1: every token; no top-k). temperature 0 is greedy. Its seed: the draws of
    torch's generator seeded so (the same seed, the same answers; the global random state is left as it was);
    None: drawn from torch's global generator as it stands."""
    if drawing.temperature == 0:
        return greedy(model, prompts, max_new_tokens, eos_id, pad_id, placement)
    draw = dict(do_sample=True, temperature=drawing.temperature, top_p=drawing.top_p, top_k=0, num_beams=1,
                max_new_tokens=max_new_tokens)
    if drawing.seed is None:
        return _completions(model, prompts, eos_id, pad_id, placement, **draw)
    on = torch.device(placement.device)
    cuda = [on.index if on.index is not None else torch.cuda.current_device()] if on.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # the seeded draws, then the global state as it was
        torch.manual_seed(drawing.seed)
        return _completions(model, prompts, eos_id, pad_id, placement, **draw)


def _completions(model, prompts: list[list[int]], eos_id: int | None, pad_id: int, placement: Placement,
                 **settings) -> list[list[int]]:
    """generate() of `prompts` under the GenerationConfig of `settings` alone (greedy's doc), each completion cut
    before its first EOS."""
    from transformers import GenerationConfig

    if not prompts:
        return []
    # generate() fills every setting left unset from the model's own generation config (a checkpoint's sampling
    # settings, a repetition_penalty that would hide the very repetition answers.repetition measures): for the
    # call, the model's is a bare one, so greedy is plain argmax (and sampling draws as asked) whatever the
    # checkpoint ships.
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PeftModel -> transformers
    config = GenerationConfig(use_cache=True, eos_token_id=eos_id, pad_token_id=pad_id, **settings)
    ids, mask = _left_padded(prompts, pad_id, placement.device)
    saved_config = hf_model.generation_config
    hf_model.generation_config = GenerationConfig()
    try:
        with torch.no_grad(), devices.autocast(placement.device, placement.dtype), eval_mode(model):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 synced_gpus=placement.synced)  # (B, T + new)
    finally:
        hf_model.generation_config = saved_config
    completions = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = row.index(eos_id) if eos_id in row else len(row)  # finished rows: EOS, then pad_id
        completions.append(row[:cut])
    return completions


def generate(model, items: list, tokenizer, max_new_tokens: int, placement: Placement,
             shown: list[str | None] | None = None) -> list[Sample]:
    """Greedy samples for `items` (data.TokenizedPair, or data.TokenizedCompletion whose completion stands as
    chosen), decoded without special tokens. `shown`: each item's prompt as the log shows it (a conversation's last
    user message: data.shown_prompt); None (or a None entry): the prompt's tokens decoded."""
    prompts = [item.prompt_ids for item in items]
    outs = greedy(model, prompts, max_new_tokens, tokenizer.eos_token_id, data.pad_token_id(tokenizer), placement)
    samples = []
    for item, ids, text in zip(items, outs, shown or [None] * len(items)):
        chosen = item.chosen_ids if isinstance(item, data.TokenizedPair) else item.completion_ids
        # cut at its end of turn, as the samples are (a chat template may put a newline after it: SmolLM2's does)
        eos = tokenizer.eos_token_id
        chosen_ids = list(chosen[:chosen.index(eos)] if eos in chosen else chosen)
        samples.append(Sample(prompt=text if text is not None else tokenizer.decode(item.prompt_ids,
                                                                                     skip_special_tokens=True),
                              completion=tokenizer.decode(ids, skip_special_tokens=True),
                              chosen=tokenizer.decode(chosen, skip_special_tokens=True), ids=ids,
                              chosen_ids=chosen_ids,
                              rejected=tokenizer.decode(item.rejected_ids, skip_special_tokens=True)
                              if isinstance(item, data.TokenizedPair) else None))
    return samples


def token_kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """KL(policy || reference) of each position's next-token distributions, in float32: (n, V) each -> (n,)."""
    p, q = torch.log_softmax(policy_logits.float(), -1), torch.log_softmax(reference_logits.float(), -1)  # (n, V)
    return (p.exp() * (p - q)).sum(-1)  # (n,)


def kl_to_reference(model, items: list, answers: list[list[int]], device, dtype) -> float | None:
    """The mean per-token KL of the policy's next-token distribution from the reference's (the model with its
    adapter disabled) along the policy's own answers, one answer at a time (only the answer's positions get
    logits); None without any answer token."""
    total, tokens = 0.0, 0
    with torch.no_grad(), devices.autocast(device, dtype), eval_mode(model):
        for item, answer in zip(items, answers):
            if not answer or not item.prompt_ids:
                continue
            ids = torch.tensor([item.prompt_ids + answer], device=device)  # (1, T)
            keep = len(answer) + 1  # the positions predicting the answer's tokens, and the last (dropped)
            policy = model(input_ids=ids, logits_to_keep=keep).logits[0, :-1]  # (n, V)
            with model.disable_adapter():
                reference = model(input_ids=ids, logits_to_keep=keep).logits[0, :-1]  # (n, V)
            total += token_kl(policy, reference).sum().item()
            tokens += len(answer)
    return total / tokens if tokens else None


def append(path: Path, step: int, samples: list[Sample], scores: dict[str, list] | None = None) -> None:
    """Append one JSON line per sample, {step, prompt, completion, chosen, rejected (a pair's), and each of
    `scores`' per-sample values under its name (rouge_l: its token ROUGE-L against chosen; repetition: its own
    seq-rep-4; tokens: its length)}, to `path` (created if absent)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for i, sample in enumerate(samples):
            line = {"step": step, "prompt": sample.prompt, "completion": sample.completion, "chosen": sample.chosen,
                    **({} if sample.rejected is None else {"rejected": sample.rejected}),
                    **{name: round(values[i], 6) for name, values in (scores or {}).items()}}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()


def scores_at(path: Path, step: int, names) -> dict[str, dict[str, float]]:
    """Each of `names`' per-prompt scores at `step` in samples.jsonl (append's scores, or any field of a line:
    completion), read once: {name: {prompt: value}} ({} for a name where the file, the step or the scores are
    absent)."""
    path = Path(path)
    lines = ([json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
             if path.is_file() else [])
    return {name: {x["prompt"]: x[name] for x in lines if x.get("step") == step and x.get(name) is not None}
            for name in names}


def keep_until(path: Path, step: int) -> None:
    """Keep only the lines of `path` with step <= `step`, atomically: on resume the samples a killed run wrote
    after its checkpoint go, so none repeats; step=-1 empties the file for a run that starts over. No file: no-op.
    A last line cut off by the kill (not JSON) goes too."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    files.atomic_write_bytes(path, "".join(kept).encode("utf-8"))


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())  # one line: newlines and runs of spaces become one space
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."


def log_line(step: int, sample: Sample, width: int = 160) -> str:
    """`sample at step 30: 'Write a positive review ...' -> 'The lamp is ...'`, both parts shortened to fit
    about `width` characters."""
    head = f"sample at step {step}: "
    room = max(width - len(head) - 10, 20)  # 10: the quotes and the arrow
    prompt_room = room // 3  # the completion is what the reader looks for
    return f"{head}{_short(sample.prompt, prompt_room)!r} -> {_short(sample.completion, room - prompt_room)!r}"
