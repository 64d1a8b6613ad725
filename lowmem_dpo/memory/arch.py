"""A decoder's numbers for the memory model: its layers' real Linear shapes, parameter counts, heads and
vocabulary, read from the model transformers builds from a config.json on the meta device (no weights, any
architecture transformers has whose layers are alike and hold their weights in Linear layers), and what a LoRA
target spec adapts in it.

No weights are loaded. Where the config.json comes from (a local folder, a built-in, a shipped architecture-only
file, the hub): arch_source.py."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from dataclasses import dataclass

from lowmem_dpo.memory.arch_source import arch_config_path
from lowmem_dpo.model.logps import head_of
from lowmem_dpo.model.models import attention_heads, meta_model, text_config
from lowmem_dpo.runtime.errors import UserError

# The last name of an attention block's output projection, in the families transformers ships (Llama o_proj,
# GPT-2 c_proj, GPT-NeoX dense, ...): its input is the attention output, which attention keeps anyway.
OUT_PROJ_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "wo", "o", "out", "proj", "attn_out")
# A decoder layer whose Linear weights hold less than this share of its parameters is not one the memory model
# describes (e.g. mixture-of-experts layers keep their experts as fused parameters): it is refused, not guessed.
MIN_LINEAR_SHARE = 0.9


@dataclass(frozen=True)
class Linear:
    """One Linear (or GPT-2 Conv1D) of a decoder layer, named relative to the layer (e.g. self_attn.q_proj)."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    role: str  # attn_in (q/k/v, fused or not) | attn_out | mlp_in (gate/up, fc) | mlp_out (down) | other


@dataclass(frozen=True)
class Arch:
    """A decoder as the planner needs it, read from the model transformers builds on the meta device (no weights):
    one decoder layer's Linear layers and parameter count, the parameters outside the layers, and the attention
    numbers. Every decoder layer is the same (checked when read)."""

    name: str
    model_type: str
    hidden: int  # H
    layers: int  # L
    heads: int  # attention heads
    kv_heads: int  # key/value heads (GQA when below heads)
    head_dim: int
    vocab: int  # V
    tie_word_embeddings: bool
    layer_linears: tuple[Linear, ...]
    layer_params: int  # every parameter of one layer: the Linears' weights, their biases, norms
    outer_params: int  # parameters outside the layers and the (untied) LM head: embeddings, final norm
    norms_per_layer: int = 2
    norm_kind: str = "rms"  # rms | layer
    activation: str = "silu"  # the config's hidden_act (activation_function for GPT-2)
    softcapped_head: bool = False  # the LM head's logits are softcapped (logps.Head: Gemma2)
    # Linears (role "outer") and embeddings (role "embedding", in = rows) outside the layers, LM head excepted,
    # by full name: what a LoRA target may also match
    outer_linears: tuple[Linear, ...] = ()
    eager_attention: bool = False  # transformers picks eager attention, not SDPA (Gemma2: softcapped scores)
    attention_softcap: bool = False
    layers_prefix: str = "model.layers"  # the ModuleList holding the decoder layers
    lm_head: str = "lm_head"
    # modules outside the layers owning tensors, before and after the layer stack: what a CPU-offload device_map
    # keeps on the device
    resident: tuple[tuple[str, ...], tuple[str, ...]] = (("model.embed_tokens",),
                                                         ("model.rotary_emb", "model.norm", "lm_head"))
    mlp_block: str = "mlp"  # the layer's MLP module, which activations.tile_mlps runs in tiles ("": none, e.g. OPT)
    sliding_window: int | None = None  # attention sees this many tokens back (Mistral 7B v0.1: 4096); None: all
    context: int | None = None  # positions the model knows (max_position_embeddings); None: not said

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def role(self, role: str) -> list[Linear]:
        return [linear for linear in self.layer_linears if linear.role == role]

    @property
    def intermediate(self) -> int:
        """I: the MLP's inner width, the input of its down projection."""
        return max((linear.in_features for linear in self.role("mlp_out")), default=4 * self.hidden)

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU-style (gate and up, separate or fused: 2*I out of the MLP input) rather than fc -> act -> proj."""
        return sum(linear.out_features for linear in self.role("mlp_in")) == 2 * self.intermediate

    def distinct_inputs(self, linears) -> int:
        """Summed width of the distinct tensors `linears` read: H for the attention's input projections (q/k/v
        share the normed input), H for the MLP's (gate/up or fc), and each other Linear's own input; the
        attention output projection's input is the attention output, kept by attention anyway (0)."""
        roles = {linear.role for linear in linears}
        return ((self.hidden if "attn_in" in roles else 0) + (self.hidden if "mlp_in" in roles else 0)
                + sum(linear.in_features for linear in linears if linear.role in ("mlp_out", "other")))

    def quantized_inputs(self) -> int:
        """Summed width of the distinct inputs of all of a layer's Linears, the attention output projection's
        included (what LLM.int8 keeps per layer)."""
        return self.distinct_inputs(self.layer_linears) + sum(linear.in_features for linear in self.role("attn_out"))

    def linears(self) -> dict[str, tuple[int, int]]:
        """One decoder layer's Linear layers: name -> (in_features, out_features)."""
        return {linear.name: (linear.in_features, linear.out_features) for linear in self.layer_linears}

    def params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.vocab * self.hidden
        return self.outer_params + head + self.layers * self.layer_params

    def layer_extra_params(self) -> int:
        """One layer's parameters beside its Linear weights: norms and biases (kept in the dtype when quantized)."""
        return self.layer_params - sum(linear.in_features * linear.out_features for linear in self.layer_linears)

    def with_layers(self, layers: int) -> "Arch":
        return dataclasses.replace(self, name=f"{self.name} (first {layers} layers)", layers=layers)

    def describe(self) -> str:
        n = self.params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        return (f"{self.name}: {self.model_type}, {self.layers} layers, hidden {self.hidden}, intermediate "
                f"{self.intermediate}, heads {self.heads}/{self.kv_heads} kv, vocab {self.vocab}, {size} params")

    def module_names(self) -> list[tuple[str, Linear | None]]:
        """Every adaptable module's full name in the model, with its layer's Linear (the outer ones: with their
        full name; None for the LM head)."""
        out = [(f"{self.layers_prefix}.{i}.{linear.name}", linear) for i in range(self.layers)
               for linear in self.layer_linears]
        return out + [(linear.name, linear) for linear in self.outer_linears] + [(self.lm_head, None)]


def _linear_shape(module) -> tuple[int, int] | None:
    """(in, out) of an nn.Linear or a transformers Conv1D (GPT-2: weight stored (in, out)), else None."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.nf
    return None


def _decoder_layers(model) -> tuple[str, list]:
    """(prefix, layers): the ModuleList holding the most parameters, the decoder's layer stack."""
    import torch

    lists = [(n, module) for n, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module)]
    if not lists:
        raise UserError("no decoder layer stack (ModuleList) found")
    name, layers = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return name, list(layers)


def _roles(layer, hidden: int) -> tuple[Linear, ...]:
    """The layer's Linears with their role in the layer, from where they sit (an attention block or not) and
    their shapes: in an attention block, the output projection (by name, else the last Linear writing H) reads
    the attention output and the others the normed input; elsewhere, the Linears reading H feed the MLP's
    inner width and the one writing H from a wider input is the down projection."""
    found = [(n, module, _linear_shape(module)) for n, module in layer.named_modules()]
    found = [(n, module, sh) for n, module, sh in found if sh is not None]
    attn = [(n, module, sh) for n, module, sh in found
            if any(k in n.split(".")[0].lower() for k in ("attn", "attention"))]
    out_proj = next((n for n, _, sh in attn if n.split(".")[-1] in OUT_PROJ_NAMES and sh[1] == hidden), None)
    if out_proj is None and attn:
        out_proj = next((n for n, _, sh in reversed(attn) if sh[1] == hidden), None)
    attn_names = {n for n, _, _ in attn}
    out = []
    for n, module, (i, o) in found:
        if n in attn_names:
            role = "attn_out" if n == out_proj else "attn_in"
        elif i == hidden:
            role = "mlp_in"
        elif o == hidden:
            role = "mlp_out"
        else:
            role = "other"
        out.append(Linear(n, i, o, getattr(module, "bias", None) is not None, role))
    return tuple(out)


def _signature(layer) -> list[tuple]:
    return [(n, tuple(p.shape)) for n, p in layer.named_parameters()]


def arch_from_model(model, name: str) -> Arch:
    """Arch of a transformers CausalLM (instantiated on the meta device: only names and shapes are read).
    UserError when the model is not one the memory model describes."""

    config = text_config(model.config)
    hidden, vocab = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not all(isinstance(v, int) for v in (hidden, vocab, heads)):
        raise UserError(f"{config.model_type}: no integer hidden_size, vocab_size or num_attention_heads")
    prefix, layers = _decoder_layers(model)
    first = _signature(layers[0])
    if any(_signature(layer) != first for layer in layers[1:]):
        raise UserError(f"{config.model_type}: its decoder layers differ from each other")
    linears = _roles(layers[0], hidden)
    layer_params = sum(p.numel() for p in layers[0].parameters())
    if sum(linear.in_features * linear.out_features for linear in linears) < MIN_LINEAR_SHARE * layer_params:
        raise UserError(f"{config.model_type}: its layers keep most weights outside Linear layers (e.g. fused "
                        "experts), which the memory model does not describe")
    # Outside attention, one MLP: a block (mlp, ffn, feed_forward) or Linears on the layer itself (OPT's fc1/fc2).
    blocks = {linear.name.split(".")[0] if "." in linear.name else "" for linear in linears
              if not linear.role.startswith("attn")}
    mlp_block = next(iter(blocks), "")
    if len(blocks) > 1:
        raise UserError(f"{config.model_type}: its layers hold Linear layers in {', '.join(sorted(blocks))} beside "
                        "the attention (e.g. a Mamba mixer beside the MLP), which the memory model does not "
                        "describe")
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    head_name = next((n for n, module in model.named_modules() if module is head), "lm_head")
    total = sum(p.numel() for p in model.parameters())  # tied weights count once
    outer = total - len(layers) * layer_params - (0 if tied or head is None else head.weight.numel())
    norms = [type(module).__name__.lower() for module in layers[0].modules()
             if "norm" in type(module).__name__.lower()]
    # this module's readings first, then the model part's (attention_heads, head_of): a reader follows one way down
    resident, outer_linears = _resident(model, prefix), _outer_linears(model, prefix, head)
    sliding_window, context = _sliding_window(config), _context(config)
    _, kv_heads, head_dim = attention_heads(config)
    return Arch(name=name, model_type=str(config.model_type), hidden=hidden, layers=len(layers), heads=heads,
                kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
                tie_word_embeddings=tied, layer_linears=linears, layer_params=layer_params, outer_params=outer,
                norms_per_layer=len(norms), norm_kind="rms" if all("rms" in n for n in norms) else "layer",
                activation=str(getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
                               or getattr(config, "activation_function", "")),
                layers_prefix=prefix, lm_head=head_name, resident=resident, outer_linears=outer_linears,
                softcapped_head=bool(head_of(model.config)[0].softcap),
                eager_attention=getattr(config, "_attn_implementation", None) == "eager",
                attention_softcap=bool(getattr(config, "attn_logit_softcapping", None)),
                mlp_block=mlp_block if _one_input(getattr(layers[0], mlp_block, None)) else "",
                sliding_window=sliding_window, context=context)


def _context(config) -> int | None:
    """The longest sequence the model has positions for: max_position_embeddings (n_positions for GPT-2)."""
    found = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions", "max_sequence_length")]
    return next((v for v in found if isinstance(v, int) and v > 0), None)


def _one_input(mlp) -> bool:
    """Whether a layer's MLP block is a module whose forward takes the hidden states alone, which
    activations.tile_mlps tiles (Bloom's and MPT's take the residual too: they run whole, and count so)."""
    import torch

    if not isinstance(mlp, torch.nn.Module):
        return False
    required = [p for p in inspect.signature(mlp.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def _sliding_window(config) -> int | None:
    """The attention window transformers applies (a config may name one it does not use: Qwen2's
    use_sliding_window false)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def _outer_linears(model, prefix: str, head) -> tuple[Linear, ...]:
    """The Linears and embeddings outside the layer stack, the LM head excepted (arch.Arch.outer_linears)."""
    import torch

    out = []
    for n, module in model.named_modules():
        if module is head or n == prefix or n.startswith(prefix + "."):
            continue
        if isinstance(module, torch.nn.Embedding):
            out.append(Linear(n, module.num_embeddings, module.embedding_dim, False, "embedding"))
        elif (shape := _linear_shape(module)) is not None:
            out.append(Linear(n, *shape, getattr(module, "bias", None) is not None, "outer"))
    return tuple(out)


def _resident(model, prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules outside the layer stack that own tensors themselves (embeddings, rotary buffers, final norm,
    LM head), split into those before the stack and those after it, in model order."""
    before, after, seen_stack = [], [], False
    for n, module in model.named_modules():
        if n == prefix or n.startswith(prefix + "."):
            seen_stack = True
            continue
        if n and (any(True for _ in module.parameters(recurse=False))
                  or any(True for _ in module.buffers(recurse=False))):
            (after if seen_stack else before).append(n)
    return tuple(before), tuple(after)


@functools.lru_cache(maxsize=16)
def load_arch(spec: str) -> Arch:
    """The Arch of model_name_or_path: its config.json, instantiated by transformers on the meta device."""
    path = arch_config_path(spec)
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable config.json ({type(e).__name__}: {e})") from None
    return arch_from_model(meta_model(path.parent), spec)


@dataclass(frozen=True)
class Adapted:
    """The Linears a LoRA target spec adapts: in each decoder layer (names relative to the layer), and the LM head."""

    per_layer: tuple[tuple[str, ...], ...]
    lm_head: bool
    outer: tuple[str, ...] = ()  # adapted modules outside the layers (arch.outer_linears), by full name

    def shapes(self, arch: Arch) -> list[tuple[int, int]]:
        """(in, out) of every adapted Linear in the model (an embedding: (rows, width), as LoRA's A and B)."""
        lin = arch.linears()
        out = [lin[n] for names in self.per_layer for n in names]
        out += [(linear.in_features, linear.out_features) for linear in arch.outer_linears if linear.name in self.outer]
        return out + ([(arch.hidden, arch.vocab)] if self.lm_head else [])

    @property
    def count(self) -> int:
        return sum(len(n) for n in self.per_layer) + len(self.outer) + self.lm_head


@functools.lru_cache(maxsize=64)
def adapted(arch: Arch, targets: str | tuple[str, ...]) -> Adapted:
    """What peft adapts for `targets` (as LoraConfig takes them: a list of names matched as name suffixes, one
    regex matched against the full name, or all-linear: every Linear but the LM head), matched by peft's own
    check_target_module_exists on the model's module names. UserError when nothing matches."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    names = arch.module_names()
    if targets == "all-linear":
        hit = [n for n, linear in names if linear is not None and linear.role != "embedding"]
    else:
        config = LoraConfig(target_modules=targets if isinstance(targets, str) else list(targets))
        hit = [n for n, _ in names if check_target_module_exists(config, n)]
    hit = set(hit)
    if not hit:
        raise UserError(f"lora_target_modules={targets!r} matches no Linear of {arch.model_type} (its layer "
                        f"Linears: {', '.join(arch.linears())}; LM head: {arch.lm_head})")
    per_layer = tuple(tuple(linear.name for linear in arch.layer_linears
                            if f"{arch.layers_prefix}.{i}.{linear.name}" in hit) for i in range(arch.layers))
    outer = tuple(linear.name for linear in arch.outer_linears if linear.name in hit)
    return Adapted(per_layer, arch.lm_head in hit, outer)
