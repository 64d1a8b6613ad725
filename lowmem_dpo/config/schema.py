"""One typed config for every stage: the keys, their types, docs and bounds (checks.py: the checks across keys). A
recipe and its overrides become a Config in recipe.py:

    lowmem-dpo train RECIPE.yaml learning_rate=1e-4 max_prompt_length=null

Values are coerced by the declared type of the field (coerce.py), never by YAML's guess: `1e-4` is a float for
a float field (YAML 1.1 would read it as a string), `null`/`None`/`none` is None for an Optional field (never
the string "None"), `1.5` for an int field is an error. Every problem in a recipe is collected and reported at
once, as a `ConfigError` that the stage entry points turn into exit code 2 and one message.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import yaml

from lowmem_dpo.config import checks
from lowmem_dpo.config.coerce import AUTO, Switch
from lowmem_dpo.config.schedule import SCHEDULERS
from lowmem_dpo.config.sources import Source, yaml_form
from lowmem_dpo.objectives import KEYS, OBJECTIVES, Settings
from lowmem_dpo.objectives.metrics import EVAL_METRICS, LOSS


@dataclass(frozen=True)
class Above:
    """A key's exclusive lower bound (key's `min`): its value must be above this one (min=Above(0.0): positive)."""

    value: float


def key(default, doc: str, *, choices=None, min=None, max=None, reference=None, resumable=False):
    """A config field with its one-line doc, validation bounds, and what a change of its value changes.

    min, max: the value's bounds, included; min=Above(x): above x. (The field's metadata says "min" x and
      "min_exclusive", as coerce.check_bounds reads them.)
    reference: the key changes the reference log-probs: "value" by its value, "files" by the files it names
      (inputs.file_components; a checkpoint records their digests). None: it does not. (The cache itself is keyed
      by each sequence's token ids and the model side: data/cache.py.)
    resumable: the key may change between a run and its resumption from a checkpoint: it changes neither the
      numbers the run computes nor the data it sees (output places, logging, saving, guards). "length": the key
      sets how long the run is (max_steps, num_train_epochs): changing it continues the run, the schedule
      following the new total (resuming.follow_run_length). Any other key changed is refused on resume
      (recipe.config_changes).
    """
    assert not (reference and resumable), "a key that changes the reference changes the numbers"
    exclusive = isinstance(min, Above)
    meta = {"doc": doc, "choices": choices, "min": min.value if exclusive else min, "max": max,
            "min_exclusive": exclusive, "reference": reference, "resumable": resumable}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def objective_key(name: str):
    """The field of an objective's own key, as its Key in objectives.KEYS declares it (default, doc, bounds)."""
    declared = KEYS[name]
    return key(declared.default, declared.doc, choices=declared.choices, max=declared.max,
               min=Above(declared.min) if declared.min_exclusive else declared.min)


@dataclass
class Config:
    # -- model and data ----------------------------------------------------------------------------------------
    model_name_or_path: Optional[str] = key(None, "Base model (required): a local folder, a hub name (online), a "
                                           "built-in (lowmem_dpo:tiny-llama, the demo's); or a PEFT LoRA adapter folder "
                                           "(e.g. an SFT output_dir), whose adapter_config.json names the base.", reference="files")
    sft_adapter: Optional[str] = key(None, "A PEFT LoRA adapter folder from an SFT stage, on model_name_or_path (a "
                                    "base): the reference is base + adapter (its files are in the cache's "
                                    "model side) and train continues it (adapter_mode).", reference="files")
    dataset: Optional[list[Source]] = key(None, "Preference rows {prompt, chosen, rejected} (required; KTO: or "
                                         "{prompt, completion, label}): a .jsonl/.json/.parquet/.csv file, a datasets "
                                         "save_to_disk folder, a hub dataset name (online) or the demo's "
                                         "lowmem_dpo:tiny-prefs; or a mixture, a list of these or of {path, split, "
                                         "fraction | rows} (docs/data.md, Mixtures).", reference="files")
    dataset_split: str = key("train", "Split to read when the dataset has several (hub names, DatasetDict folders); "
                            "a mixture's source may name its own.", reference="files")
    prompt_column: Optional[str] = key(None, "The column holding the prompts when it is not called prompt (e.g. "
                                      "question), in dataset and eval_dataset. null: prompt, or implicit prompts.",
                                      reference="files")
    chosen_column: Optional[str] = key(None, "The column holding chosen when it is not called chosen.", reference="files")
    rejected_column: Optional[str] = key(None, "The column holding rejected when not called rejected.", reference="files")
    max_train_samples: Optional[int] = key(None, "Take at most this many rows of the dataset (of the mixture), "
                                          "chosen by seed and each row's content, before eval_fraction holds "
                                          "prompts out. null: all.", min=1, reference="files")
    output_dir: Optional[str] = key(None, "Where train and sft write config.yaml, metrics.jsonl, checkpoints and the "
                                   "adapter; null: runs/NAME for a recipe NAME.yaml. A folder holding anything but this "
                                   "tool's own run is refused (overwrite_output_dir).", resumable=True)
    overwrite_output_dir: bool = key(False, "Write into an output_dir that holds other files, beside them: refused "
                                    "still when one has a name the run writes (nothing is replaced).", resumable=True)
    ref_cache_dir: Optional[str] = key(None, "Where precompute writes the reference log-prob cache and train reads "
                                      "it; null: runs/NAME-ref-cache for a recipe NAME.yaml.", resumable=True)
    # -- precision and device ------------------------------------------------------------------------------------
    device: str = key("auto", "auto picks cuda when torch sees a GPU, else mps (Apple) when present, else cpu.",
                     choices=("auto", "cpu", "cuda", "mps"))
    dtype: str = key("auto", "Dtype of the policy's unquantized weights and of its compute (also the compute dtype "
                    "of a 4bit/8bit base). auto: bfloat16 on a GPU or CPU with native bf16, float16 (with dynamic "
                    "loss scaling) on a GPU without (T4, V100), else float32 (docs/devices-and-memory.md). bfloat16 on a GPU "
                    "without native bf16 is refused. Memory: float32 costs 2x the bytes of the 16-bit types.",
                    choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str = key("none", "Quantize the policy's frozen base weights with bitsandbytes (4bit: NF4 with "
                           "double quantization, ~0.56 bytes/param; 8bit: LLM.int8, ~1.06; none: 2 bytes/param in "
                           "16-bit). LoRA weights stay float32 (read as 16-bit copies).", choices=("none", "8bit", "4bit"))
    ref_quantization: Optional[str] = key(None, "Quantization of the reference in precompute (none|8bit|4bit); null: "
                                         "the same as quantization. E.g. none with a 4bit policy computes the "
                                         "reference at full precision.", choices=("none", "8bit", "4bit"),
                                         reference="value")
    ref_dtype: Optional[str] = key(None, "Dtype of the reference in precompute (auto|float32|bfloat16|float16); "
                                  "null: the same as dtype.", choices=("auto", "float32", "bfloat16", "float16"),
                                  reference="value")
    gradient_checkpointing: Switch = key(AUTO, "Recompute activations in backward: saves activation memory, costs "
                                     "~30% more compute. auto: on for a CUDA budget <= 24 GiB and mps, off for "
                                     "larger budgets and CPUs, and on wherever the planner says the run needs it "
                                     "(docs/devices-and-memory.md).")
    activation_offloading: Switch = key(AUTO, "Move what train's forward saves for backward (with checkpointing: each "
                                    "layer's input) to pinned CPU RAM, back a layer ahead in backward (CUDA). auto: "
                                    "where the planner needs it to fit (docs/devices-and-memory.md, Long sequences).",
                                    resumable=True)
    memory_budget: Optional[str] = key(None, "Memory the run may use on its device, e.g. 11.25GiB (what torch gets of "
                                      "a 12 GB card): enforced on CUDA, it picks the device rule, and the planner "
                                      "fits train and precompute to it. null: what torch can get of the GPU now, or "
                                      "physical RAM on a CPU.", resumable=True)
    fsdp: Switch = key(AUTO, "Several processes (torchrun): shard the frozen base over them with torch's FSDP2, each "
                       "process holding 1/N of it; false: data parallel, the whole model on each. auto: shard where "
                       "the planner says the run fits one card only sharded (docs/several-processes.md).",
                       resumable=True)
    fsdp_offload_params: Switch = key(AUTO, "With fsdp: the shards in CPU RAM, each layer's brought to the device "
                                      "for its forward and backward (FSDP2's CPUOffloadPolicy; accelerate's name). "
                                      "auto: where the planner needs it to fit.", resumable=True)
    memory_snapshot_on_oom: bool = key(False, "CUDA: at the first out-of-memory error, write torch's memory snapshot "
                                      "(memory_snapshot.pickle) into output_dir.", resumable=True)
    share_prompt: Switch = key(AUTO, "Each pair's prompt through the model once: rows [prompt, chosen, rejected], a "
                           "mask hiding chosen and rejected from each other. auto: the device rule (docs/"
                           "devices-and-memory.md), if the first batch agrees.")
    padding_free: Switch = key(AUTO, "A micro-batch's sequences in one row, without padding, each attending only to "
                               "itself (SDPA per sequence; TRL's name): the same numbers, no work on padding. auto: "
                               "where the model supports it and its first rows agree; true refuses a model that "
                               "cannot (docs/performance.md).")
    # -- tokenization (these change the reference numbers) -----------------------------------------------------
    max_length: int = key(512, "Each prompt+completion sequence keeps its first max_length tokens; rows whose "
                         "prompt alone reaches it are dropped. Activation memory grows linearly with it.",
                         min=2, reference="value")
    max_prompt_length: Optional[int] = key(None, "If set, the prompt is first cut from the left to this many tokens.",
                                          min=1, reference="value")
    chat_template: Optional[str] = key(None, "Jinja chat template for conversational rows, in place of the "
                                      "tokenizer's: a file (e.g. template.jinja) or the template text itself. A new "
                                      "template gives the rows new token ids: precompute computes them again.", reference="files")
    apply_chat_template: bool = key(False, "Plain-text rows as chat turns (prompt: user, completions: assistant) "
                                    "through the chat template; false: as written, as TRL.", reference="value")
    system_prompt: Optional[str] = key(None, "A system turn before each prompt the chat template renders that has "
                                      "none (docs/data.md). null: none.", reference="value")
    max_skipped_share: float = key(0.1, "Train, sft and precompute stop (exit 2) past this share of rows skipped, "
                                  "naming a max_length that keeps 95% whole; 1: any.", min=0, max=1, resumable=True)
    max_truncated_share: float = key(0.25, "Likewise past this share of the kept completions cut at max_length; 1: "
                                    "any.", min=0, max=1, resumable=True)
    strict: bool = key(False, "Refuse the data instead of skipping unusable rows (an empty value, chosen identical to "
                      "rejected, a prompt alone reaching max_length); docs/data.md, Data checks. Not a cache key: it only "
                      "turns skips into errors, the rows kept are the same.", resumable=True)
    # -- evaluation (docs/evaluation.md) --------------------------------------------------------------------------------
    eval_dataset: Optional[str] = key(None, "Held-out rows in the training data's format (any source `dataset` "
                                     "accepts), cached with the training rows. null: none, or eval_fraction.",
                                     reference="files")
    eval_split: str = key("test", "Split of eval_dataset to read (hub names, DatasetDict).", reference="files")
    eval_fraction: float = key(0.0, "Hold this share of dataset's prompts out of training and evaluate on them; "
                              "chosen by each prompt's text (a hash), so adding rows does not reshuffle it and "
                              "all pairs of one prompt fall on one side. 0: none.", min=0.0, max=0.5)
    eval_steps: Optional[int] = key(None, "Evaluate every this many optimizer steps and at the last step. null: at "
                                   "every checkpoint (save_steps), or only at the last step when save_steps is 0.",
                                   min=1, resumable=True)
    eval_on_start: bool = key(False, "Evaluate once before the first step too (step 0, transformers' name): the baseline "
                             "later evals are read against (eval_loss ln 2 for sigmoid).", resumable=True)
    eval_max_pairs: Optional[int] = key(None, "Evaluate the first this many eval rows; null: all.", min=1)
    metric_for_best_model: str = key(LOSS.eval, "The eval metric that picks the best checkpoint (its name in "
                                    "metrics.jsonl; the eval_ prefix may be left out).")
    greater_is_better: Optional[bool] = key(None, "Whether a larger metric_for_best_model is better; null: known "
                                           "from its name (objectives/metrics.py).")
    load_best_model_at_end: bool = key(False, "The best checkpoint's adapter as the final one.", resumable=True)
    eval_generations: Optional[int] = key(None, "Eval prompts answered (greedy) at step 0 and every eval, 16 at a "
        "time; the answers' signs judge them (32 on SmolLM2: ROUGE-L's change from step 0 within ±0.046, below its "
        "0.1 limit). null: 8 per 25 steps of the run, 8 to 32. 0: none.", min=0, resumable=True)
    max_new_tokens: int = key(64, "Most tokens a sample generation writes.", min=1, resumable=True)
    report_to: list = key([], "Trackers that get metrics.jsonl's scalars too, as transformers names them: tensorboard "
                         "(output_dir/runs), trackio (its local store), wandb (output_dir/wandb). []/none: none.",
                         choices=("none", "tensorboard", "trackio", "wandb"), resumable=True)
    run_name: Optional[str] = key(None, "The run's name in trackio and wandb; null: output_dir's name.", resumable=True)
    # -- DPO loss ------------------------------------------------------------------------------------------------
    beta: float = key(0.1, "The loss's scale (DPO: the pull to the reference).", min=Above(0.0))
    loss_type: list = key(["sigmoid"], "The objective, or a list whose terms are summed with loss_weights, as TRL "
                         "1.16's DPOConfig: sigmoid (DPO), sigmoid_norm, ipo, hinge, robust, sft, ..., kto on unpaired "
                         "rows (the table in docs/objectives.md); [sigmoid, sft] is RPO.", choices=tuple(OBJECTIVES))
    loss_weights: Optional[list[float]] = key(None, "One weight per loss_type entry; null: 1 each.", min=0.0)
    label_smoothing: float = key(0.0, "Assumed share of flipped labels, for the objectives it changes (cdpo, robust, "
                                "exo_pair, aot); as in TRL 1.16 it does not change sigmoid.", min=0.0, max=0.5)
    # The objectives' own keys (objectives.KEYS), in its order: each field's default, doc and bounds are its Key's; a
    # recipe names them flat, as TRL's configs do. A new objective's key is declared in its entry and named here
    # with its type (tests/config/test_config.py fails while the two differ).
    f_divergence_type: str = objective_key("f_divergence_type")
    f_alpha_divergence_coef: float = objective_key("f_alpha_divergence_coef")
    use_weighting: bool = objective_key("use_weighting")
    ld_alpha: Optional[float] = objective_key("ld_alpha")
    discopop_tau: float = objective_key("discopop_tau")
    simpo_gamma: float = objective_key("simpo_gamma")
    alpha: float = objective_key("alpha")
    desirable_weight: float = objective_key("desirable_weight")
    undesirable_weight: float = objective_key("undesirable_weight")
    # -- optimizer and schedule ----------------------------------------------------------------------------------
    learning_rate: float = key(5e-5, "Peak AdamW learning rate.", min=Above(0.0))
    lr_scheduler_type: str = key("linear", "transformers' schedule by its name (get_scheduler): the rate each step "
                                "applies is HF Trainer's. constant ignores warmup (constant_with_warmup has it); "
                                "cosine_with_min_lr and warmup_stable_decay take lr_scheduler_kwargs.",
                                choices=SCHEDULERS)
    lr_scheduler_kwargs: Optional[dict] = key(None, "The schedule's own arguments, as transformers' "
                                             "lr_scheduler_kwargs, e.g. {min_lr_rate: 0.1} for cosine_with_min_lr or "
                                             "{num_cycles: 2} for cosine_with_restarts.")
    warmup_steps: float = key(0, "Optimizer steps of linear warmup from 0; below 1, a ratio of the run's steps "
                             "(ceil(ratio x steps)), as transformers 5 reads it (warmup_ratio, transformers 4's "
                             "key, is read as this ratio). 0: none.", min=0.0)
    weight_decay: float = key(0.0, "AdamW weight decay on the LoRA parameters.", min=0.0)
    max_grad_norm: Optional[float] = key(1.0, "Clip the gradient norm to this; null disables clipping.",
                                        min=Above(0.0))
    per_device_train_batch_size: int = key(4, "Preference pairs per micro-batch (2x sequences in the forward). "
                                          "Activation memory grows linearly with it.", min=1)
    gradient_accumulation_steps: int = key(1, "Micro-batches per optimizer step (memory-free batch growth).", min=1)
    max_steps: int = key(-1, "Optimizer steps to run; -1 runs num_train_epochs. Raising it continues a finished or "
                        "interrupted run from its last checkpoint.", min=-1, resumable="length")
    num_train_epochs: float = key(1.0, "Passes over the data when max_steps is -1 (raising it continues the run, as "
                                 "max_steps).", min=Above(0.0), resumable="length")
    seed: int = key(42, "Seed for LoRA init and data order.", min=0)
    # -- LoRA ----------------------------------------------------------------------------------------------------
    lora_r: int = key(8, "LoRA rank. Trainable params (and their grads + 2 AdamW states) grow with it.", min=1)
    lora_alpha: float = key(16.0, "LoRA scaling numerator (scale = alpha / r).", min=Above(0.0))
    lora_dropout: float = key(0.0, "Dropout on the LoRA input. The base model's own dropout is always off, as "
                             "in TRL.", min=0.0, max=1.0)
    lora_target_modules: list = key(["all-linear"], "Module names to adapt, a list or comma-separated (matched "
                                   "as name suffixes, e.g. q_proj, c_attn, lm_head); all-linear = every linear "
                                   "layer but the LM head; a regex (e.g. '.*\\.(q|v)_proj'), as the only entry, is "
                                   "matched against full module names, as peft does.")
    adapter_mode: str = key("continue", "With an SFT adapter: continue trains that adapter (its own rank, alpha and "
                           "target modules; the lora_* keys but lora_dropout are ignored); new_on_merged merges it "
                           "into an unquantized base and trains a fresh adapter from the lora_* keys.",
                           choices=("continue", "new_on_merged"))
    # -- logging and saving --------------------------------------------------------------------------------------
    logging_steps: Optional[int] = key(None, "Log every this many optimizer steps (and at step 1 and the last "
        "step). null: about 20 lines over the run, every 1 to 10 steps.", min=1, resumable=True)
    save_steps: int = key(50, "Checkpoint every this many optimizer steps into output_dir/checkpoints/checkpoint-"
                         "STEP (adapter, optimizer, scheduler, RNG, data position, metrics; ~3x the adapter's size);"
                         " 0 never.", min=0, resumable=True)
    save_total_limit: int = key(2, "Checkpoints to keep (the newest, and the best); older ones go once a new one is "
                               "complete. 0 keeps all.", min=0, resumable=True)
    resume: str = key("auto", "auto: continue from the newest complete checkpoint in output_dir/checkpoints if there "
                     "is one (rerun the same command after a crash); never: start over; or the path of a "
                     "checkpoint-STEP folder.", resumable=True)
    # -- guards ----------------------------------------------------------------------------------------------------
    max_nonfinite_steps: int = key(3, "A non-finite loss or gradient skips that update; this many in a row stop the "
                                  "run as diverged (the last checkpoint stays).", min=1, resumable=True)
    early_stop_on_divergence: bool = key(False, "Stop (exit 2, last checkpoint kept) on a warning sign (docs/"
                                        "training.md, Guards and warning signs). Off: they are only logged as warnings.", resumable=True)
    # -- precompute ----------------------------------------------------------------------------------------------
    precompute_batch_size: int = key(8, "Pairs per reference forward in precompute (no grads: can exceed the "
                                    "training batch).", min=1, resumable=True)
    cache_shard_rows: int = key(64, "Sequences per commit to the reference cache: a killed precompute loses at "
                               "most this many, and a torchrun build hands out this many at a time.",
                               min=1, resumable=True)
    ref_source: str = key("cache", "cache: reference log-probs from ref_cache_dir. live: recomputed each step with "
                         "the adapter disabled (for verification; costs a forward).", choices=("cache", "live"))

    # Keys the recipe or an override set (build_config fills it), as opposed to defaults: warnings name only these.
    explicit_keys: ClassVar[frozenset] = frozenset()
    # Keys set from the recipe's name (recipe.load_config: output_dir runs/NAME, ref_cache_dir runs/NAME-ref-cache).
    derived_keys: ClassVar[frozenset] = frozenset()
    overrides: ClassVar[tuple] = ()  # the key=value overrides it was loaded with, for the commands messages give

    # ---------------------------------------------------------------------------------------------------------
    def validate(self) -> list[str]:
        """Cross-field checks (checks.py); per-field types and ranges are checked at coercion time."""
        return checks.validate(self)

    def no_effect(self) -> list[str]:
        """Keys set to values that change nothing in this run: the warnings train logs (checks.py)."""
        return checks.no_effect(self)

    @property
    def has_eval(self) -> bool:  # eval data: eval_dataset or eval_fraction
        return self.eval_dataset is not None or self.eval_fraction > 0

    @property
    def best_metric_name(self) -> str:
        """metric_for_best_model with its eval_ prefix (as transformers' Trainer adds it)."""
        name = self.metric_for_best_model
        return name if name in EVAL_METRICS else f"eval_{name}"

    @property
    def best_is_greater(self) -> bool:
        """Whether a larger best metric is better: greater_is_better, or the metric's known direction."""
        return EVAL_METRICS[self.best_metric_name] if self.greater_is_better is None else self.greater_is_better

    @property
    def loss_settings(self) -> Settings:
        """What the objectives' formulas read: beta, label_smoothing and their own keys."""
        return Settings(beta=self.beta, label_smoothing=self.label_smoothing, **{k: getattr(self, k) for k in KEYS})

    @property
    def loss_terms(self) -> list[tuple[str, float]]:
        """(loss type, weight) of each loss_type entry, in order."""
        return list(zip(self.loss_type, self.loss_weights or [1.0] * len(self.loss_type)))

    @property
    def peft_target_modules(self) -> str | list[str]:
        """lora_target_modules as peft's LoraConfig takes them: the string all-linear; one entry with regex
        characters, as a string (peft matches it against each module's full name); else the list of names
        (peft matches each as a name suffix)."""
        targets = self.lora_target_modules
        if targets == ["all-linear"] or (len(targets) == 1 and checks.REGEX_CHARS.intersection(targets[0])):
            return targets[0]
        return targets

    @property
    def reference_quantization(self) -> str:
        """The reference's quantization: ref_quantization, or quantization when it is null."""
        return self.quantization if self.ref_quantization is None else self.ref_quantization

    @property
    def reference_dtype(self) -> str:
        """The reference's dtype setting (may be auto): ref_dtype, or dtype when it is null."""
        return self.dtype if self.ref_dtype is None else self.ref_dtype

    def to_yaml(self) -> str:
        values = {f.name: yaml_form(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return yaml.safe_dump(values, sort_keys=False)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}

FIELD_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                  for f in dataclasses.fields(Config)}
HINTS = typing.get_type_hints(Config)


def keys_where(**meta) -> frozenset[str]:
    """The Config keys whose field metadata has these values, e.g. keys_where(resumable=True)."""
    return frozenset(f.name for f in dataclasses.fields(Config)
                     if all(f.metadata[k] == v for k, v in meta.items()))


# Keys that may change between a run and its resumption (recipe.config_changes); declared per field.
RESUMABLE = keys_where(resumable=True)
# Keys that set the run's length: changed on resume, the run continues to the new total (resuming.follow_run_length).
RUN_LENGTH = keys_where(resumable="length")

