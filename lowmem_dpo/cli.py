"""Command-line plumbing: user errors (exit code 2, one message, no traceback), --help, log lines."""

from __future__ import annotations

import sys
from typing import Callable

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input: say what, where, and what to do. Never shown with a traceback."""


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None, stage: str, doc: str) -> int:
    """Shared entry point of the `python -m lowmem_dpo.STAGE` commands: --help, exit codes, no tracebacks for
    user errors."""
    from lowmem_dpo.config import help_text

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        try:
            print(help_text(stage, doc))
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
    try:
        return main(argv) or 0
    except UserError as e:
        print(f"lowmem_dpo.{stage}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"lowmem_dpo.{stage}: interrupted; finished shards/checkpoints are kept.", file=sys.stderr)
        return 130


def log(msg: str) -> None:
    """One line to stderr that does not break a running progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)
