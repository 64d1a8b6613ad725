"""The `python -m lowmem_dpo.STAGE` entry point: --help, exit codes, no traceback for user errors."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from typing import Callable, Optional

import yaml

from lowmem_dpo.config.coerce import describe
from lowmem_dpo.config.recipe import SHOWN_DEFAULTS
from lowmem_dpo.config.schema import FIELD_DEFAULTS, HINTS, Config
from lowmem_dpo.config.sources import yaml_form
from lowmem_dpo.runtime import devices, oom
from lowmem_dpo.runtime.errors import EXIT_USAGE, ConfigError, UserError
from lowmem_dpo.runtime.ranks import world

OOM_ANYWHERE = ("out of memory: the run needs more memory than the device has free. Lower max_length or "
                "per_device_train_batch_size (or precompute_batch_size), set quantization=4bit, or set memory_budget "
                "to what the device really has free; lowmem-dpo plan RECIPE.yaml shows what fits")


def shown(value) -> str:
    """A default as a recipe writes it, on one line (YAML's flow style, without the end-of-document marker it puts
    after a lone scalar)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def help_text(stage: str, command_doc: str) -> str:
    """--help of a stage that takes a recipe: its command doc, then every Config key with type, default and doc."""
    lines = [command_doc.strip(), "", f"usage: lowmem-dpo {stage} RECIPE.yaml [key=value ...]", "",
             "keys (type, default: doc):"]
    for f in dataclasses.fields(Config):
        kind = describe(HINTS[f.name])
        if f.name in SHOWN_DEFAULTS:  # no null for these: required, or derived from the recipe's name
            kind, default = kind.removesuffix(" or null"), SHOWN_DEFAULTS[f.name]
        else:
            default = f"default {shown(yaml_form(FIELD_DEFAULTS[f.name]))}"
        lines.append(f"  {f.name} ({kind}, {default}"
                     f"{' ; choices ' + '|'.join(f.metadata['choices']) if f.metadata['choices'] else ''}): "
                     f"{f.metadata['doc']}")
    return "\n".join(lines)


BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "null", "none"}  # what may follow a boolean flag as its value


def flag_overrides(argv: list[str]) -> list[str]:
    """Overrides written as TRL's command line writes them, `--key value`, `--key=value`, or `--key` alone for a
    true boolean, as key=value; anything else (the recipe, key=value, a stage's own flags such as --prune) as it
    is. Only Config's keys are read this way."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        key = name.replace("-", "_")
        if key not in FIELD_DEFAULTS:
            out.append(argv[i])
        elif eq:
            out.append(f"{key}={value}")
        elif HINTS[key] in (bool, Optional[bool]) and (i + 1 == len(argv) or argv[i + 1].lower() not in BOOL_WORDS):
            out.append(f"{key}=true")  # a bare boolean: what follows is the next argument, not its value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{key}={argv[i + 1]}")
            i += 1
        else:
            raise ConfigError(f"{argv[i]}: expected a value after it (--{key} VALUE, or {key}=VALUE)")
        i += 1
    return out


FULL_PASS_EVERY = 1000  # second-generation passes per full garbage collection (Python's default: 10)


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None, stage: str, doc: str,
            usage: str | None = None) -> int:
    """Shared entry point of the `python -m lowmem_dpo.STAGE` commands: --help, exit codes, no tracebacks for
    user errors. `usage`: the arguments of a stage that takes no recipe (report: "OUTPUT_DIR"); --help then shows
    `doc` and that usage line instead of the recipe keys."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        try:
            print(help_text(stage, doc) if usage is None
                  else f"{doc.strip()}\n\nusage: lowmem-dpo {stage} {usage}")
        except BrokenPipeError:  # `--help | head`: the reader left; not an error
            sys.stdout = None
        return 0 if argv else EXIT_USAGE
    import logging
    import warnings

    # transformers' own deprecation notice, raised inside peft on every LoRA model: not the user's to act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # bitsandbytes (imported by peft) notes at import that an optional `kernels` package is missing; it serves
    # only the packed inference path that models.load_model turns off.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # peft, saving an adapter, looks for the base's config.json at base_model_name_or_path to see whether the
    # vocabulary changed; a built-in name (lowmem_dpo:tiny-llama, as sft writes it) is not a path. Nothing here
    # changes the vocabulary.
    warnings.filterwarnings("ignore", message="Could not find a config file in", category=UserWarning)
    devices.configure_allocator()  # before anything touches CUDA (unless the user set the variable)
    # Python's full garbage collections, to save time: by default one per 10 passes of the second generation (once
    # the objects that survived since the last are a quarter more). A stage's start imports transformers, peft and
    # bitsandbytes after torch, half a million long-lived objects, and each full pass walks them all (up to 0.45 s
    # each). The demo's commands at max_steps=20 on one thread of this CPU: precompute 13.8 s -> 12.0 s, train
    # 14.0 s -> 13.2 s. Young garbage is collected as before; in a long run the quarter rule already spaces full
    # passes; and the stages collect on purpose where memory must go (precompute's model, the out-of-memory
    # back-off).
    gc.set_threshold(*gc.get_threshold()[:2], FULL_PASS_EVERY)
    try:
        return main(flag_overrides(argv) if usage is None else argv) or 0
    except UserError as e:
        rank = world().rank  # several processes (torchrun, mpirun): a recipe error is every rank's
        if rank == 0 or not isinstance(e, ConfigError):
            print(f"lowmem_dpo.{stage}: error: {f'[rank {rank}] ' if rank else ''}{e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if not oom.is_out_of_memory(e):
            raise
        said = oom.torch_said(e)
        del e  # its traceback holds the tensors
        oom.dump_snapshot()
        print(f"lowmem_dpo.{stage}: error: {OOM_ANYWHERE} (torch: {said})", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # a stage may say what it keeps (precompute: the rows; train: the checkpoint)
        kept = e.args[0] if e.args else "committed cache rows and checkpoints are kept"
        print(f"lowmem_dpo.{stage}: interrupted: {kept}.", file=sys.stderr)
        return 130


class StageParser(argparse.ArgumentParser):
    """argparse for a stage's own arguments (plan, export, chat): a bad argument is one line ending with the usage,
    a UserError that run_cli turns into exit 2, where argparse would print its own and exit itself."""

    def __init__(self, prog: str, usage_line: str):
        super().__init__(prog=prog, add_help=False)
        self.usage_line = usage_line

    def error(self, message):
        raise UserError(f"{message}; usage: {self.prog} {self.usage_line}")
