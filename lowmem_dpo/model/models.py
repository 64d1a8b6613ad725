"""Model and tokenizer loading: built-in tiny models, local folders, hub names (online)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo.model.tiny import BUILTIN_PREFIX, ensure_builtin
from lowmem_dpo.runtime import heap
from lowmem_dpo.runtime.devices import import_bitsandbytes
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.oom import out_of_memory_means

WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def resolve_model_path(spec: str) -> Path:
    """A local folder holding config.json, weights and tokenizer for `model_name_or_path`."""
    if spec.startswith(BUILTIN_PREFIX):
        return ensure_builtin(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and (path / ADAPTER_CONFIG).is_file():
            return adapter_base(path, "model_name_or_path")  # an adapter folder: its base (see model_source)
        if not (path / "config.json").is_file():
            raise UserError(f"model_name_or_path={spec!r}: the folder has no config.json; point it at a "
                            "transformers model folder")
        return path
    if path.exists():
        raise UserError(f"model_name_or_path={spec!r} is a file: point it at the model's folder (config.json, "
                        "weights and tokenizer files)")
    missing = f"no such folder ({path.absolute()} does not exist)"
    if spec.startswith((".", "/", "~")):
        raise UserError(f"model_name_or_path={spec!r}: {missing}; check the path (relative paths start from "
                        f"{Path.cwd()})")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja"]))
    except Exception as e:
        raise UserError(f"model_name_or_path={spec!r}: {missing}, and as a hub name it could not be fetched "
                        f"({type(e).__name__}); check the path, or download the model to a folder and pass that "
                        "path") from None


# -- which model: a base, an SFT adapter on a base, or a merged model -------------------------------------------
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ModelSource:
    """What `model_name_or_path` (and `sft_adapter`) name: a full model folder, plus the SFT LoRA adapter that is
    on it when there is one. With an adapter, the reference is base + adapter and train starts from it."""

    base_path: Path  # folder with config.json, weights and tokenizer
    adapter_path: Path | None  # a PEFT LoRA adapter folder, or None
    kind: str  # "base", "merged" (a full model whose model card names its base_model), "adapter", "sft_adapter"
    description: str  # the log line saying which

    @property
    def tokenizer_path(self) -> Path:
        """The adapter folder when it holds a tokenizer (SFT trainers may save one, e.g. with a chat template the
        SFT data was rendered with), else the base."""
        if self.adapter_path is not None and (self.adapter_path / "tokenizer_config.json").is_file():
            return self.adapter_path
        return self.base_path

    @property
    def adapter(self) -> dict | None:
        """The adapter's adapter_config.json, or None without an adapter."""
        return None if self.adapter_path is None else read_adapter_config(self.adapter_path, "adapter")


def read_adapter_config(path: Path, key: str) -> dict:
    """A LoRA adapter's adapter_config.json, or a UserError naming `key` (the config key that pointed at it)."""
    try:
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{key}={str(path)!r}: cannot read its {ADAPTER_CONFIG} ({type(e).__name__}); point it at "
                        "a PEFT adapter folder") from None
    if config.get("peft_type") != "LORA":
        raise UserError(f"{key}={str(path)!r} is a {config.get('peft_type')} adapter; lowmem_dpo continues LoRA "
                        "adapters only: merge it into the base (peft merge_and_unload) and pass the merged folder")
    return config


def adapter_files(path: Path) -> list[Path]:
    """adapter_config.json and the adapter's weights: the files its content is (for the cache's model side)."""
    weights = [path / n for n in ADAPTER_WEIGHTS if (path / n).is_file()]
    if not weights:
        raise UserError(f"adapter folder {str(path)!r} has {ADAPTER_CONFIG} but no "
                        f"{' or '.join(ADAPTER_WEIGHTS)}")
    return [path / ADAPTER_CONFIG, weights[0]]


def adapter_base(path: Path, key: str) -> Path:
    """The full model folder an adapter's adapter_config.json names as base_model_name_or_path."""
    base = read_adapter_config(path, key).get("base_model_name_or_path")
    hint = (f"pass the base as model_name_or_path=BASE and the adapter as sft_adapter={path}")
    if not base:
        raise UserError(f"{key}={str(path)!r}: its {ADAPTER_CONFIG} names no base_model_name_or_path; {hint}")
    base_dir = Path(base)
    if base_dir.is_dir() and (base_dir / ADAPTER_CONFIG).is_file():
        raise UserError(f"{key}={str(path)!r}: its base {base!r} is itself an adapter; lowmem_dpo keeps one adapter: "
                        "merge the first into its base (peft merge_and_unload), save it, and point the second at it")
    try:
        return resolve_model_path(base)
    except UserError as e:
        raise UserError(f"{key}={str(path)!r} is a LoRA adapter whose base could not be found ({e}); {hint}") from None


def _has_weights(path: Path) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES and not p.name.startswith("adapter_model") for p in path.iterdir())


def _card_base_model(path: Path) -> str | None:
    """The `base_model:` a model card (README.md front matter, the hub convention for fine-tuned and merged
    models) names, or None."""
    card = path / "README.md"
    if not card.is_file():
        return None
    text = card.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return None
    for line in text.split("---", 2)[1].splitlines():
        if line.startswith("base_model:") and line.partition(":")[2].strip():
            return line.partition(":")[2].strip()
    return None


def model_source(model_name_or_path: str, sft_adapter: str | None = None) -> ModelSource:
    """Detect what the recipe names: a base model, a PEFT LoRA adapter folder (whose adapter_config.json names the
    base), a merged model, or a base plus `sft_adapter`. One adapter at most: anything that would put a second
    adapter on a model that carries one is a UserError."""
    spec = model_name_or_path
    path = Path(spec) if Path(spec).is_dir() else resolve_model_path(spec)  # a built-in or a hub snapshot
    from_folder = (path / ADAPTER_CONFIG).is_file()
    if from_folder and (path / "config.json").is_file() and _has_weights(path):
        # transformers would load the base named in adapter_config.json with the adapter attached, and a new
        # adapter would then stack on it.
        raise UserError(f"model_name_or_path={spec!r} holds full model weights and an {ADAPTER_CONFIG}: unclear "
                        "which is meant. If the weights already include the adapter (merged), remove "
                        f"{ADAPTER_CONFIG} from the folder; otherwise move the adapter files to their own folder and "
                        "pass it as sft_adapter=FOLDER")
    if from_folder:
        if sft_adapter is not None:
            raise UserError(f"model_name_or_path={spec!r} is already a LoRA adapter and sft_adapter={sft_adapter!r} "
                            "names another: lowmem_dpo keeps one adapter. Drop sft_adapter, or set "
                            "model_name_or_path to the base model")
        base = adapter_base(path, "model_name_or_path")
        return ModelSource(base, path, "adapter", f"model: {spec} is a LoRA adapter ({_lora_summary(path)}) on "
                           f"base {base}: the reference is base + this adapter")
    base = resolve_model_path(str(path))
    if sft_adapter is not None:
        adapter = Path(sft_adapter)
        if not (adapter.is_dir() and (adapter / ADAPTER_CONFIG).is_file()):
            raise UserError(f"sft_adapter={sft_adapter!r}: not a PEFT adapter folder (no {ADAPTER_CONFIG}); point "
                            "it at the output_dir of the SFT stage")
        named = read_adapter_config(adapter, "sft_adapter").get("base_model_name_or_path")
        return ModelSource(base, adapter, "sft_adapter", f"model: base {spec} + sft_adapter {sft_adapter} "
                           f"({_lora_summary(adapter)}; trained on {named}): the reference is base + this adapter")
    card_base = _card_base_model(base)
    if card_base is not None:
        return ModelSource(base, None, "merged", f"model: {spec} is a full model whose model card names base_model "
                           f"{card_base} (fine-tuned or merged): it is the reference as it is")
    return ModelSource(base, None, "base", f"model: {spec} is a base model (no adapter): it is the reference as it is")


def target_names(adapter_config: dict) -> list[str]:
    """An adapter's target modules by short name, sorted (peft saves all-linear as the full module paths it
    matched); a string (all-linear, a regex) as a one-item list."""
    targets = adapter_config.get("target_modules") or []
    if isinstance(targets, str):
        return [targets]
    return sorted({t.rsplit(".", 1)[-1] for t in targets})


def _lora_summary(path: Path) -> str:
    c = read_adapter_config(path, "adapter")
    return f"LoRA r={c.get('r')}, alpha={c.get('lora_alpha')} on {','.join(target_names(c))}"


def weight_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise UserError(f"model folder {str(path)!r} has no .safetensors or .bin weights")
    return [path / "config.json"] + files


def meta_model(folder: Path):
    """The causal LM that `folder`'s config.json describes, built on the meta device: its modules' names, types and
    shapes, with no weights (no memory, no initialisation cost); a UserError when transformers cannot build it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:  # an architecture transformers does not know (remote code, a new model)
        raise UserError(f"{folder / 'config.json'}: transformers cannot build a causal LM from it ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


def tokenizer_files(path: Path) -> list[Path]:
    return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]


def chat_template_text(spec: str) -> str:
    """The Jinja text that the chat_template key names: a file's content, or the key's value itself when it is a
    template (it has {{ or {%); a UserError otherwise."""
    path = Path(spec)
    if "{{" not in spec and "{%" not in spec:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"chat_template={spec!r}: not a readable file ({type(e).__name__}) and not a Jinja "
                            "template (it has no {{ or {%); give the path of a .jinja file or the template "
                            "text") from None
    return spec


def load_tokenizer(path: Path, chat_template: str | None = None, model_path: Path | None = None):
    """The tokenizer in `path`; `chat_template` (the config key: a file or the template) replaces its template.
    Its model_max_length is raised to the positions of the model in `model_path` (default `path`) where it is
    smaller: a tokenizer saved with 4096 beside a model of 131,072 positions would warn of "indexing errors" on
    every long row, which max_length, not the tokenizer, bounds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tok.chat_template = chat_template_text(chat_template)
    positions = model_positions(Path(model_path if model_path is not None else path))
    if positions is not None and tok.model_max_length < positions:
        tok.model_max_length = positions
    return tok


def model_positions(path: Path) -> int | None:
    """The longest sequence the model in `path` has positions for (its config.json: max_position_embeddings, or
    GPT-2's n_positions; a multimodal config's text_config), None where it does not say."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(part.get(key), int):
                return part[key]
    return None


def disable_dropout(model: torch.nn.Module) -> None:
    """The base model's dropout is off for DPO, as in TRL: policy and reference must see the same function."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def quantization_config(quantization: str, compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig: 4bit is NF4 with double quantization (the quantization constants are
    quantized too: ~0.37 bits/param less), computing in `compute_dtype`; 8bit is LLM.int8 (outlier features
    above 6.0 in 16-bit). transformers keeps the LM head unquantized."""
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype)
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise AssertionError(f"no bitsandbytes config for quantization={quantization!r}")


def _one_numeric_path(model: torch.nn.Module) -> None:
    """Make a 4-bit base compute the same way in eval and in train mode.

    On CPUs with AVX512-BF16, bitsandbytes' Linear4bit repacks its weights the first time it runs in eval mode
    without grad, for an inference kernel that computes in bf16 whatever the compute dtype. Precompute runs the
    reference in eval mode and train runs the policy in train mode, so the two would compute differently and
    step 1 would not show ln 2; the repack also fails for layers whose input size is not a multiple of the
    64-element quantization block (the built-in models' MLP). Turning it off keeps the dequantize-then-matmul
    path in both stages."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def _own_unquantized_weights(model: torch.nn.Module) -> None:
    """Saves memory after a quantized load on a CPU: transformers memory-maps the safetensors shards, and the
    weights it does not quantize (embeddings, norms, LM head, biases) point into the mappings, which keeps every
    shard mapped, the whole unquantized model (14.5 GB of file pages in RSS at 7B), for the run. A copy of
    those weights (~0.5 GB at 7B) lets the mappings go; then the C heap returns the quantizer's freed buffers."""
    for p in model.parameters():  # each tied weight once
        if type(p) is torch.nn.Parameter and p.device.type == "cpu":  # not bitsandbytes' Params4bit/Int8Params
            p.data = p.data.clone()
    heap.release_freed_memory()


def load_device(device: torch.device, quantization: str, streamed_layers: int, sharded: bool = False) -> torch.device:
    """Where load_model puts the weights: `device`, except for an unquantized model whose trailing layers will be
    streamed (streaming.stream_layers): CPU RAM first, from where the rest moves to the device. bitsandbytes
    quantizes on the device as it loads, and streaming then moves the quantized layers out. sharded (fsdp): CPU
    RAM, from where each process's shards move to its device (a model sharded because it does not fit one card
    cannot load on one)."""
    return torch.device("cpu") if sharded or streamed_layers and quantization == "none" else device


def oom_loading(quantization: str) -> str:
    """What to do when the weights alone do not fit the device."""
    smaller = "Set quantization=4bit" if quantization != "4bit" else "Use a smaller model or a card with more memory"
    return (f"out of memory loading the model's weights onto the device: they alone do not fit. {smaller} "
            "(lowmem-dpo plan RECIPE.yaml shows what fits the budget), or free the GPU (nvidia-smi shows "
            "what else holds it)")



def load_model(path: Path, device: torch.device, dtype: torch.dtype, quantization: str = "none"):
    """The causal LM in eval mode with dropout off, its weights frozen, on `device`.

    `dtype` is the dtype of every unquantized weight and, with quantization=4bit/8bit, the compute dtype of the
    quantized layers too. Nothing is cast beyond that: embeddings, norms and LM head stay in `dtype` (peft's
    prepare_model_for_kbit_training would cast them to float32: +0.5 GB on a 7B model with a 32k
    vocabulary, +2.2 GB with 152k); the LoRA weights peft adds are float32. Out of memory while loading is exit
    2 with what to change."""
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if quantization != "none":
        import logging

        import_bitsandbytes(f"quantization={quantization}")
        # LLM.int8 logs a warning on every matmul whose input is not float16 (it casts by design): noise.
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
        kwargs["quantization_config"] = quantization_config(quantization, dtype)
        # Quantized weights are placed on the device as they load: they cannot be moved afterwards.
        kwargs["device_map"] = {"": str(device)}
    with out_of_memory_means(oom_loading(quantization)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        if quantization == "none":
            model.to(device)
    if quantization != "none":
        _one_numeric_path(model)
        if device.type == "cpu":
            _own_unquantized_weights(model)
    model.config.use_cache = False
    disable_dropout(model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def text_config(config):
    """The text model's config of a transformers config (a multimodal one nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_heads(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a text config: key/value heads default to the query heads,
    head_dim to hidden_size // heads."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def sdpa_card(device: torch.device) -> tuple[tuple[int, int], int | None]:
    """The CUDA card's compute capability and the runtime cuDNN's version: what SDPA's kernel choice reads."""
    return torch.cuda.get_device_capability(device), torch.backends.cudnn.version()


def repeat_kv_heads() -> str:
    """Make transformers repeat a grouped-query layer's k and v to every query head before SDPA (its path for a
    masked batch) for an unmasked batch too, instead of passing enable_gqa=True: on a card where SDPA then runs its
    math kernel, with float32 (N, heads, T, T) scores (memory.attention.expand_kv decides). For this process: the
    one model it loads. Returns the log line."""
    from transformers.integrations import sdpa_attention

    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False  # looked up at each call: this module's global
    return ("attention: k and v repeated to every query head before SDPA (without, this card would run SDPA's "
            "math kernel for grouped-query attention, with float32 T x T scores)")
