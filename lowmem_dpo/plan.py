"""Memory planner: will a recipe fit? Peak memory of precompute and train from the model's config.json alone.

    lowmem-dpo plan RECIPE.yaml [key=value ...] [--budget 12GiB] [--json OUT] [--measure] [--slice N]
    lowmem-dpo plan RECIPE.yaml --nproc 2 --budget 11.25GiB     # per card, on 2 cards (fsdp or not)

No weights are loaded. The architecture comes from the config.json of a local model folder, of a built-in model
(lowmem_dpo:tiny-llama, lowmem_dpo:llama-25m), or of a shipped architecture-only file: lowmem_dpo:arch/NAME
(mistral-7b-v0.1, llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, qwen2.5-14b), also reached by its hub name
(mistralai/Mistral-7B-v0.1, meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-14B, ... and their -Instruct variants).

Prints the predicted peak of train and of precompute, term by term, for the recipe as given. If it does not fit
the budget, searches the knobs in the order of their cost and prints the first plan that fits, as key=value
overrides: halve per_device_train_batch_size and double gradient_accumulation_steps (the same pairs per step);
gradient checkpointing on; quantization=4bit; halve precompute_batch_size (first, when only precompute is over);
last, stream the trailing decoder layers from pinned CPU RAM (with the bytes copied per step and their time). Train
applies the micro-batch, checkpointing (when auto) and streaming by itself, precompute its batch and streaming;
quantization is advice (it changes the numbers and the cache). The formulas are small pure functions in
lowmem_dpo/memory/ (model.py: predict; search.py: choose), documented term by term. --measure runs the harness in
measure.py.

The device planned for is the recipe's (device=cuda plans for a GPU on any machine; auto is this machine's).

Exit status: 0 when the recipe or the printed plan fits the budget, 1 when nothing fits (so a script can run
`lowmem-dpo plan R.yaml && lowmem-dpo train R.yaml`), 2 for bad input.

options:
  --budget SIZE  memory torch may allocate on the device, e.g. 11.25GiB (what torch gets of a 12 GB card: the CUDA
                 context and the display take the rest), 12000MiB or bytes. GiB (or G alone) is 2^30 bytes, GB is
                 10^9: 12GB is 11.18 GiB. Default: the recipe's memory_budget, else what torch can get of this
                 machine's GPU now, or its RAM on a CPU.
  --json OUT     write {"train", "precompute", "plan", "budget_bytes", ...} to OUT.
  --measure      run real steps on this machine with the recipe as given (precompute's forward on its longest
                 batch, then train.setup and --steps optimizer steps) and report measured_peak_bytes beside the
                 prediction. Peak = live tensor memory (measure.PeakMeter): the same thing the prediction counts.
  --slice N      with --measure: measure a model with the recipe's architecture (layer sizes, vocabulary) cut to N
                 decoder layers and random weights, against the prediction for N layers: checks a 7B-width model
                 on a small machine.
  --steps K      optimizer steps --measure runs (default 2: the second has the optimizer state).
  --nproc N      plan for N processes (torchrun), one card each, with the budget per card: each card's peak
                 data parallel, with fsdp (the base sharded over them) and with its shards in CPU RAM, and which
                 the run takes (fsdp, fsdp_offload_params; docs/several-processes.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from lowmem_dpo import data, measure
from lowmem_dpo.config.cli import StageParser, run_cli
from lowmem_dpo.config.recipe import load_config, require
from lowmem_dpo.config.schema import Config
from lowmem_dpo.memory import cards
from lowmem_dpo.memory.arch import Arch, load_arch
from lowmem_dpo.memory.arch_source import is_arch_only
from lowmem_dpo.memory.host import host_problem, host_ram
from lowmem_dpo.memory.model import Prediction, StagePrediction, predict
from lowmem_dpo.memory.search import KNOBS, LENGTH_STEP, STAGES, Plan, longest_max_length, stage_stream
from lowmem_dpo.memory.setup import Setup, planned_device, run_budget, setup_from_config, with_prompts
from lowmem_dpo.memory.weights import card_host_bytes
from lowmem_dpo.model import adapters, models
from lowmem_dpo.objectives import needs_reference
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.ram import available as ram_available
from lowmem_dpo.runtime.units import fmt, parse_size, size_note

EXIT_NO_FIT = 1
ROWS = (("base_weights", "base weights"), ("lora_params", "LoRA params"), ("lora_grads", "LoRA grads"),
        ("optimizer_state", "optimizer state"), ("activations", "activations kept for backward"),
        ("peak_phase", "peak phase (layer or LM head)"), ("framework_overhead", "framework overhead"))


def _rows(shapes: dict) -> str:
    """The sequences a prediction is for: T, and whether each is a shared [prompt, chosen, rejected] row."""
    return f"T={shapes['seq_len']}" + (" (shared rows)" if shapes.get("shared") else "")


def describe_setup(setup: Setup, stage: str, shapes: dict) -> str:
    if stage == "precompute":
        return (f"{setup.ref_dtype}, quantization {setup.ref_quantization}, batch {setup.precompute_batch} pairs, "
                f"{_rows(shapes)}")
    return (f"{setup.dtype}, quantization {setup.quantization}, "
            f"checkpointing {'on' if setup.gradient_checkpointing else 'off'}"
            f"{', activation offloading' if setup.activation_offloading else ''}, "
            f"micro-batch {setup.micro_batch} pairs x {setup.grad_accum} accumulation, {_rows(shapes)}, "
            f"LoRA r={setup.lora_r} on "
            f"{setup.lora_targets if isinstance(setup.lora_targets, str) else ','.join(setup.lora_targets)}, "
            f"{setup.optimizer}")


def table(columns: list[tuple[str, StagePrediction]], budget: int, measured: list[int | None] | None = None) -> str:
    width, col = 31, 22
    lines = [f"{'':{width}}" + "".join(f"{name:>{col}}" for name, _ in columns)]
    for key, label in ROWS:
        lines.append(f"{label:{width}}" + "".join(f"{fmt(p.breakdown[key]) if p.breakdown[key] else '-':>{col}}"
                                                  for _, p in columns))
    lines.append(f"{'  phases: layer / LM head':{width}}"
                 + "".join(f"{fmt(p.phases['layer']) + ' / ' + fmt(p.phases['logits']):>{col}}" for _, p in columns))
    lines.append(f"{'peak':{width}}" + "".join(f"{fmt(p.peak_bytes):>{col}}" for _, p in columns))
    lines.append(f"{'fits ' + fmt(budget):{width}}"
                 + "".join(f"{'yes' if p.peak_bytes <= budget else 'NO':>{col}}" for _, p in columns))
    if measured:
        lines.append(f"{'measured (tensor peak)':{width}}"
                     + "".join(f"{fmt(peak) if peak is not None else '':>{col}}" for peak in measured))
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = StageParser("lowmem-dpo plan", "RECIPE.yaml [key=value ...] [--budget SIZE] [--json OUT] "
                     "[--measure] [--slice N] [--steps K] [--prompt-tokens P] [--nproc N]")
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--budget")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--slice", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=1)
    args = ap.parse_intermixed_args(argv)
    if args.nproc < 1:
        raise UserError("--nproc N needs N >= 1 (the processes torchrun starts, one card each)")
    if args.slice is not None and (args.slice < 1 or not args.measure):
        raise UserError("--slice N needs N >= 1 and --measure")
    if args.steps < 1:
        raise UserError("--steps K needs K >= 1")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise UserError("--prompt-tokens P needs P >= 1 (your data's prompt length in tokens)")
    return args


def planned_config(args: argparse.Namespace) -> Config:
    """The recipe as train plans it: with an SFT adapter train continues, its rank and target modules."""
    cfg = load_config(args.recipe, args.overrides)
    require(cfg, "plan --measure" if args.measure else "plan")
    if cfg.sft_adapter or Path(cfg.model_name_or_path).is_dir():
        cfg = adapters.planned_lora(cfg, models.model_source(cfg.model_name_or_path, cfg.sft_adapter))
    return cfg


def _error_pct(predicted: int, measured: int) -> float:
    return round(100 * (predicted - measured) / measured, 1)


def measured_columns(args, cfg: Config, arch: Arch, setup: Setup, budget: int, report: dict, columns: list):
    """--measure: run the harness (measure.py); returns (the table's columns, its measured row, the notes), and
    puts the measurements and the errors against the prediction at the measured shapes into `report`."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # a loss that reads no reference (needs_reference) has no precompute to measure
    stages = ("train", "precompute") if needs_reference(cfg.loss_type) else ("train",)
    if args.slice:
        result = measure.measure_slice(cfg, args.slice, args.steps)
        sliced, measured = result["prediction"], result["measured"]
        columns = [(f"train ({args.slice} layers)", sliced.train),
                   (f"precompute ({args.slice} layers)", sliced.precompute)][:len(stages)]
        report["slice"] = {"layers": args.slice, "arch": dataclasses.asdict(result["arch"])}
    else:
        measured = measure.measure(cfg, args.steps)
        sliced = predict(arch, measure.at_measured_shapes(setup, measured))
    row, notes = [], []
    for stage in stages:
        measurement, p = measured[stage], getattr(sliced, stage)
        entry = {**measurement, "predicted_at_measured_shapes": p.tensor_peak_bytes,
                 "error_pct": _error_pct(p.tensor_peak_bytes, measurement["measured_peak_bytes"])}
        if args.slice:
            report["slice"][stage] = {**p.to_json(budget), **entry}
        else:
            report[stage].update(entry)
        row.append(measurement["measured_peak_bytes"])
        notes.append(f"measured {stage}: {fmt(measurement['measured_peak_bytes'])} on {measured['device']} "
                     f"(T={measurement['seq_len']}, {measurement['completion_tokens']} completion tokens/sequence); "
                     f"predicted at those shapes {fmt(p.tensor_peak_bytes)}: {entry['error_pct']:+.1f}%")
    return columns, row + [None] * (len(columns) - len(row)), notes


def print_plan(chosen: Plan, budget: int, reference: bool = True) -> None:
    c = chosen.setup
    mlp = ((f" (the MLP in tiles of {c.mlp_tile_tokens} tokens)" if c.mlp_tiles else " (the MLP whole)")
           if c.gradient_checkpointing else "")
    print(f"plan: quantization={c.quantization} gradient_checkpointing={str(c.gradient_checkpointing).lower()}{mlp} "
          f"micro-batch {c.micro_batch} x {c.grad_accum} accumulation, "
          + (f"precompute batch {c.precompute_batch}, " if reference else "")
          + (f"stream {chosen.offload_layers} layers ({fmt(max(chosen.offload_bytes, chosen.precompute_offload_bytes))}"
             " of CPU RAM): " if chosen.offload_layers else "no streamed layers: ")
          + ("the recipe as given " if not chosen.overrides and not chosen.offload_bytes else "")
          + (f"fits {fmt(budget)}" if chosen.fits else f"DOES NOT FIT {fmt(budget)} even with every knob"))
    if chosen.overrides or chosen.offload_bytes or chosen.precompute_offload_bytes:
        for step in chosen.steps:
            print(f"  - {step}")
        if chosen.overrides:
            print("  overrides: " + " ".join(f"{k}={v}" for k, v in chosen.overrides.items()))


def print_cards(arch: Arch, cfg: Config, budget: int, processes: int, knobs, stages, prompt_tokens: int | None) -> None:
    """--nproc N: each card's peak for each way to run on N cards (memory/cards.py), each with its own knobs."""
    print(f"on {processes} cards, each card's peak (with the knobs each way needs):")
    problem = cards.unshardable(cfg, stages)
    if problem:
        print(f"  fsdp: not for this run: {problem}")
    for name, plan in cards.alternatives(arch, cfg, budget, processes, knobs, stages, prompt_tokens)[
            :1 if problem else None]:
        streamed = {stage: stream.device_peak for stage, stream in plan.streams.items()}  # streaming: the card's peak
        peaks = "  ".join(f"{stage} {fmt(streamed.get(stage, getattr(plan.prediction, stage).peak_bytes))}"
                          for stage in stages)
        shards = (f"; its shard {fmt(card_host_bytes(arch, plan.setup.dtype, plan.setup.quantization, processes))}"
                  + (" in CPU RAM" if plan.setup.shard_offload else " on the card")) if plan.setup.sharded else ""
        print(f"  {name:<15} {peaks}{shards}: " + ("fits" if plan.fits else "does not fit") + f" {fmt(budget)}")
    print()


def print_host_ram(arch: Arch, chosen: Plan, reference: bool = True, processes: int = 1) -> None:
    """The plan's host RAM beside its device memory (memory/host.py), against what this machine has available
    (processes: that many on this machine, each with its own)."""
    available, source = ram_available()
    each = f" per process ({processes} on one machine: {processes} times this)" if processes > 1 else ""
    for stage in ("train", "precompute") if reference else ("train",):
        host = host_ram(arch, chosen, stage)
        fits = "" if host_problem(host, available // processes, stage) is None else " - MORE THAN THIS MACHINE HAS"
        print(f"host RAM {stage}{each}: {host.describe()}{fits}")
    print(f"         this machine: {fmt(available)} {source}")


def print_lengths(arch: Arch, chosen: Plan, budget: int) -> None:
    """The longest max_length that fits, per micro-batch: the trade between pairs per forward and length."""
    setup = chosen.setup
    print(f"longest max_length that fits {fmt(budget)} ({setup.quantization} base, checkpointing, no streaming), by "
          "pairs per micro-batch" + (f", at most the model's context of {arch.context} positions:" if arch.context
                                     else ":"))
    for b in (1, 2, 4, 8):
        length, plan = longest_max_length(arch, setup, budget, b)
        if not length:
            print(f"  {b}: none")
            break
        knobs = " ".join(f"{k}={plan.overrides[k]}" for k in ("activation_offloading", "share_prompt")
                         if k in plan.overrides)
        capped = "  (the model's context)" if arch.context and length + LENGTH_STEP > arch.context else ""
        print(f"  {b}: {length:>6}  train peak {fmt(plan.prediction.train.peak_bytes)}" + (f"  with {knobs}" if knobs
                                                                                         else "") + capped)


LENGTH_SHARES = (0.5, 0.9, 0.95, 0.99)  # the data's length percentiles plan prints


def print_data_lengths(cfg: Config) -> None:
    """The tokens each row needs to stay whole (prompt and longest completion, tokenized as train tokenizes them:
    the chat template applied to conversations, apply_chat_template to text) at LENGTH_SHARES, and how many rows
    max_length keeps whole. Not shown, with the reason, when the model has no tokenizer here (architecture-only)
    or the data cannot be read: plan's numbers need neither."""
    from lowmem_dpo.training import inputs

    if is_arch_only(cfg.model_name_or_path):
        print(f"data     lengths not shown: {cfg.model_name_or_path} is architecture-only here (no tokenizer); point "
              "model_name_or_path at the model's folder for them")
        return
    try:
        source = models.model_source(cfg.model_name_or_path, cfg.sft_adapter)
        tokenizer = models.load_tokenizer(source.tokenizer_path, cfg.chat_template, source.base_path)
        tok = inputs.tokenized(cfg, tokenizer, progress=False)
    except (UserError, OSError, ValueError) as e:
        print(f"data     lengths not shown: {str(e).splitlines()[0]}")
        return
    if not tok.whole:
        return
    whole = sum(n <= cfg.max_length for n in tok.whole)
    shown = ", ".join(f"p{round(100 * share)} {data.nearest_rank(tok.whole, share)}" for share in LENGTH_SHARES)
    print(f"data     {tok.num_rows} rows, tokens to keep a row whole (prompt + longest completion, as tokenized): "
          f"{shown}, max {max(tok.whole)}; max_length={cfg.max_length} keeps {whole} of {len(tok.whole)} "
          f"({whole / len(tok.whole):.0%}) whole")


def print_prediction(arch: Arch, setup: Setup, pred: Prediction, budget: int, no_reference: str = "") -> None:
    print(f"model    {arch.describe()}")
    print(f"device   {setup.device} (rule {setup.kind}), budget {fmt(budget)}")
    print(f"train    {describe_setup(setup, 'train', pred.train.shapes)}")
    print(f"precomp. {no_reference or describe_setup(setup, 'precompute', pred.precompute.shapes)}")
    if setup.share_prompt and setup.prompt_tokens is None:
        print("         shared rows at their worst case, a one-token prompt (2 x max_length - 1 tokens); "
              "--prompt-tokens P plans for your data's shortest prompt")
    print()


def json_report(cfg: Config, arch: Arch, setup: Setup, pred: Prediction, chosen: Plan, budget: int,
                reference: bool = True) -> dict:
    """--json: the prediction of the recipe as given, the plan and the budget (precompute: null when the loss
    reads no reference)."""
    as_given_offload = stage_stream(arch, setup, pred, "train", budget).cpu_bytes
    return {"model": cfg.model_name_or_path, "arch": dataclasses.asdict(arch), "device": setup.device,
            "device_kind": setup.kind, "budget_bytes": budget, "setup": dataclasses.asdict(setup),
            "train": pred.train.to_json(budget, as_given_offload),
            "precompute": pred.precompute.to_json(budget) if reference else None, "plan": chosen.to_json(budget)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = planned_config(args)
    budget = parse_size(args.budget) if args.budget else run_budget(cfg, planned_device(cfg))
    arch = load_arch(cfg.model_name_or_path)
    if args.measure and not args.slice and is_arch_only(cfg.model_name_or_path):
        raise UserError(f"--measure needs weights: model_name_or_path={cfg.model_name_or_path} is architecture-only "
                        "here; add --slice N to measure its first N layers with random weights, or pass a model "
                        "folder")
    setup = setup_from_config(cfg, budget, args.nproc)
    if args.prompt_tokens:
        setup = with_prompts(setup, args.prompt_tokens)
    pred = predict(arch, setup)
    reference = needs_reference(cfg.loss_type)  # SimPO, ORPO: no precompute, no cache, nothing to plan for them
    knobs, stages = (KNOBS, STAGES) if reference else (tuple(k for k in KNOBS if k != "precompute_batch"), ("train",))
    chosen = cards.on_cards(arch, cfg, budget, args.nproc, knobs, stages, args.prompt_tokens)
    report = json_report(cfg, arch, setup, pred, chosen, budget, reference)
    print_prediction(arch, setup, pred, budget, "" if reference else
                     f"none: loss_type={cfg.loss_type} reads no reference (no precompute, no cache)")
    if arch.context and cfg.max_length > arch.context:
        print(f"warning: max_length={cfg.max_length} is beyond the model's context, {arch.context} positions (its "
              "config.json): tokens past it get positions the model never saw; set max_length to "
              f"{arch.context} or less\n")
    budget_note = size_note(args.budget or cfg.memory_budget)
    if budget_note is not None:
        print(f"note: budget {budget_note}\n")
    columns = [("train", pred.train), ("precompute", pred.precompute)]
    if chosen.overrides:
        columns += [("train (plan)", chosen.prediction.train), ("precompute (plan)", chosen.prediction.precompute)]
    columns = [c for c in columns if reference or not c[0].startswith("precompute")]
    measured_row, notes = None, []
    if args.measure:
        columns, measured_row, notes = measured_columns(args, cfg, arch, setup, budget, report, columns)
    print(table(columns, budget, measured_row))
    for note in notes:
        print(note)
    if "8bit" in (setup.quantization, setup.ref_quantization):
        print("note: 8bit's LLM.int8 buffers are modeled from CPU measurements (bitsandbytes' CUDA kernels differ): "
              "allow a margin on a GPU")
    print()
    if args.nproc > 1:
        print_cards(arch, cfg, budget, args.nproc, knobs, stages, args.prompt_tokens)
    print_plan(chosen, budget, reference)
    print_host_ram(arch, chosen, reference, args.nproc)
    print_lengths(arch, chosen, budget)
    print_data_lengths(cfg)
    if args.json_out:
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if chosen.fits else EXIT_NO_FIT


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "plan", __doc__))
