"""Talk to a trained run or a merged model: one answer, a conversation on a terminal, or an answer per piped line.

    lowmem-dpo chat RUN_OR_MERGED [--prompt TEXT] [--max-new-tokens N] [--plain] [--device auto|cpu|cuda|mps]
    lowmem-dpo chat runs/my-run --prompt "Write a haiku about rain."      # or: python -m lowmem_dpo.chat ...

RUN_OR_MERGED is a run's output_dir (its final adapter), one of its checkpoints/checkpoint-STEP folders, a folder
written by `lowmem-dpo export` (or any transformers model folder), or any PEFT LoRA adapter. An adapter goes on the
base its run trained on, as export finds it (the run's config.yaml, a checkpoint's trainer_state.json; an adapter
trained with adapter_mode=new_on_merged on that base with its SFT adapter merged in), loaded as train loads it:
the run's device, dtype and quantization, by the same device rules.

With --prompt, the answer to TEXT is printed and chat exits. Without it, on a terminal: a conversation, each
answer kept in the history the next turn sees; `clear` starts a new one, `exit`, `quit`, Ctrl-D or Ctrl-C ends it.
Without it, with stdin piped or redirected: each non-empty line is a prompt answered on its own (no history), each
answer printed on one line, in order (its line breaks written as \\n, a backslash as \\\\).

Each prompt is a user turn through the chat template of the run's tokenizer (saved beside its adapter), as
conversational training rows are rendered; with --plain, or when the tokenizer has no template (said once), the
text is tokenized as written, as plain-text rows are (the demo's), and each prompt is answered on its own.
Answers are greedy, as the samples in samples.jsonl (training/samples.py): at most the run's max_new_tokens
tokens (a model folder: that key's default), or --max-new-tokens. Writes nothing.
"""

# A stage on the top floor: it reads a run or a model folder and imports no other stage. Which base an adapter
# belongs on is provenance.merge_chain's (export's) answer; generating is the training samples' samples.greedy.

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo import data
from lowmem_dpo.config.cli import StageParser, run_cli
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.config.schema import FIELD_DEFAULTS, Config
from lowmem_dpo.model import adapters, models
from lowmem_dpo.runtime import devices, folders
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint, provenance, samples

USAGE = "RUN_OR_MERGED [--prompt TEXT] [--max-new-tokens N] [--plain] [--device auto|cpu|cuda|mps]"
ARGUMENT = "RUN_OR_MERGED"
WHAT_TO_PASS = ("pass a run's output_dir, one of its checkpoints/checkpoint-STEP folders, or a folder written by "
                "lowmem-dpo export")
ENDS = ("exit", "quit")  # a terminal line that ends the conversation (as Ctrl-D does)
CLEAR = "clear"  # a terminal line that starts a new conversation
# The run's keys that decide how it loads. Not memory_budget: it sizes training (the planner's choices); an answer
# holds the weights and a KV cache.
LOADED_KEYS = ("device", "dtype", "quantization")


@dataclass(frozen=True)
class Source:
    """What RUN_OR_MERGED is: a model folder, or a base with the adapters to put on it, in order."""

    base: Path  # a transformers model folder (RUN_OR_MERGED itself for a merged model)
    adapters: list[Path]  # [], [adapter], or [SFT adapter (merged first), adapter] for adapter_mode=new_on_merged
    tokenizer: Path  # the folder whose tokenizer renders the prompts
    chat_template: str | None  # the run's chat_template key, where `tokenizer` is not the run's own saved one
    record: dict | None  # the config of the run that trained the adapter (None: a model folder, a foreign adapter)


def locate(folder: Path) -> Source:
    """What RUN_OR_MERGED names; anything that is neither a model nor an adapter is a UserError saying which."""
    where = f"{ARGUMENT}={str(folder)!r}"
    if not folder.exists():
        raise UserError(f"{where}: no such folder ({folder.absolute()} does not exist); {WHAT_TO_PASS}")
    if not folder.is_dir():
        raise UserError(f"{where} is a file; {WHAT_TO_PASS}")
    if (folder / models.ADAPTER_CONFIG).is_file():
        return adapter_source(folder)
    if (folder / "config.json").is_file():
        models.weight_files(folder)  # a UserError naming the folder when it holds no weights
        if not models.tokenizer_files(folder):
            raise UserError(f"{where}: a model folder without tokenizer files (tokenizer.json, "
                            "tokenizer_config.json, ...); copy its base's tokenizer files into it")
        return Source(folder, [], folder, None, None)
    raise UserError(f"{where}: {not_a_model(folder)}")


def not_a_model(folder: Path) -> str:
    """Why a folder without adapter_config.json or config.json cannot be chatted with, and what to pass instead."""
    kind = (folders.read_marker(folder) or {}).get("kind")
    if kind in ("dpo run", "sft run") or (folder / provenance.RUN_CONFIG).is_file():
        steps = sorted((p for p in folder.glob(f"{checkpoint.FOLDER}/checkpoint-*") if p.name[11:].isdigit()),
                       key=lambda p: int(p.name[11:]))
        if steps:
            return (f"a run without its final adapter yet (train has not finished, or was stopped): chat with a "
                    f"checkpoint, e.g. {steps[-1]}, or rerun train to finish it (it resumes)")
        return "a run without an adapter or a checkpoint yet: let train save one first (save_steps), or finish it"
    if kind is not None:
        return f"this tool's {kind}, not a run or a model; {WHAT_TO_PASS}"
    return f"neither a run (no {models.ADAPTER_CONFIG}) nor a model folder (no config.json); {WHAT_TO_PASS}"


def adapter_source(folder: Path) -> Source:
    """An adapter's base and adapters as export merges them: its run's record when it has one, else the base its
    adapter_config.json names."""
    record, where, _ = provenance.run_record(folder)
    if record is None:
        base = models.adapter_base(folder, ARGUMENT)
        log(f"chat: {folder} holds no lowmem_dpo run record: putting it, as a plain PEFT adapter, on the base it "
            f"names, {base}")
        tokenizer = folder if models.tokenizer_files(folder) else base
        return Source(base, [folder], tokenizer, None, None)
    spec, sft = record.get("model_name_or_path"), record.get("sft_adapter")
    try:
        models.model_source(str(spec), sft)
    except UserError as e:  # before merge_chain, whose message speaks of the export
        raise UserError(f"{ARGUMENT}={str(folder)!r} was trained (per {where}) on model_name_or_path={spec!r}"
                        + (f" and sft_adapter={sft!r}" if sft else "") + f", which cannot be used from here ({e}). "
                        "Run chat from the folder the training ran in, or restore those paths") from None
    chain = provenance.merge_chain(folder)
    return Source(chain.base, chain.adapters, chain.tokenizer, chain.chat_template, record)


def settings(record: dict | None, device: str | None) -> Config:
    """The run's keys that decide how the model loads (LOADED_KEYS), --device over its own; a model folder: their
    defaults (auto, none)."""
    values = {k: (record or {}).get(k) for k in LOADED_KEYS}
    if device is not None:
        values["device"] = device
    return build_config({k: v for k, v in values.items() if v is not None})


# -- the model and its answers ---------------------------------------------------------------------------------
def prompt_ids(tokenizer, messages: list[dict], templated: bool) -> list[int]:
    """The ids a conversation (user and assistant turns) is answered from: through the chat template with the
    generation prompt, as a conversational training row's prompt; or, plain, the last user turn's text as a
    plain-text row's prompt is tokenized (the tokenizer's default special tokens)."""
    if not templated:
        return list(tokenizer(messages[-1]["content"])["input_ids"])
    import jinja2

    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise UserError(f"the chat template cannot render this conversation ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}); pass --plain to give the prompt as plain text") from None


@dataclass
class Chat:
    """A loaded model and how it answers."""

    model: object  # a transformers causal LM, or a PeftModel on one
    tokenizer: object
    templated: bool  # prompts through the chat template (else plain text, each on its own)
    max_new_tokens: int
    resolved: devices.Resolved

    def answer(self, messages: list[dict]) -> str:
        """The greedy answer to a conversation whose last turn is the user's, decoded as the samples are."""
        ids = prompt_ids(self.tokenizer, messages, self.templated)
        (out,) = samples.greedy(self.model, [ids], self.max_new_tokens, self.tokenizer.eos_token_id,
                                data.pad_token_id(self.tokenizer), self.resolved.device, self.resolved.dtype)
        return self.tokenizer.decode(out, skip_special_tokens=True)


def load(folder: Path, device: str | None = None, max_new_tokens: int | None = None, plain: bool = False) -> Chat:
    """RUN_OR_MERGED loaded for answering: base (the run's dtype and quantization, by the device rules), the SFT
    adapter merged in for new_on_merged, the adapter on top, frozen, in eval mode."""
    source = locate(folder)
    tokenizer = models.load_tokenizer(source.tokenizer, source.chat_template, source.base)
    try:
        resolved = devices.resolve(settings(source.record, device))
    except UserError as e:  # its advice names the config keys; here the device is the run's, or --device
        raise UserError(f"{e} (chat loads on the run's device: --device overrides it)") from None
    model = models.load_model(source.base, resolved.device, resolved.dtype, resolved.quantization)
    for merged in source.adapters[:-1]:  # new_on_merged: the base the adapter trained on had this one merged in
        model = adapters.load_adapter(model, merged, trainable=False).merge_and_unload()
    if source.adapters:
        model = adapters.load_adapter(model, source.adapters[-1], trainable=False)
    model.eval()
    templated = bool(getattr(tokenizer, "chat_template", None)) and not plain
    if not templated and not plain:
        log(f"note: the tokenizer of {source.tokenizer} has no chat template: each prompt is given to the model as "
            "plain text, on its own (no history)")
    record_tokens = (source.record or {}).get("max_new_tokens") or FIELD_DEFAULTS["max_new_tokens"]
    chat = Chat(model, tokenizer, templated, max_new_tokens or record_tokens, resolved)
    what = " + ".join([str(source.base), *map(str, source.adapters)])
    quantized = f", quantization={resolved.quantization}" if resolved.quantization != "none" else ""
    log(f"chat: {what} on {resolved.device} in {devices.dtype_name(resolved.dtype)}{quantized}; greedy, at most "
        f"{chat.max_new_tokens} new tokens, {'through the chat template' if templated else 'plain text'}")
    return chat


# -- the three ways to ask ---------------------------------------------------------------------------------------
def converse(chat: Chat, read=input, write=print) -> None:
    """A conversation on a terminal: each line a user turn, each answer kept for the next (templated); `clear`
    starts over; `exit`, `quit`, end of input (Ctrl-D) or Ctrl-C ends it."""
    log(f"chat: type a message and press Enter; {CLEAR} starts a new conversation; {', '.join(ENDS)}, Ctrl-D or "
        "Ctrl-C ends it")
    messages: list[dict] = []
    while True:
        try:
            line = read("> ")
        except EOFError:
            write("")
            return
        except KeyboardInterrupt:
            write("")
            return
        if line.strip().lower() in ENDS:
            return
        if line.strip().lower() == CLEAR:
            messages = []
            continue
        if not line.strip():
            continue
        turn = [*messages, {"role": "user", "content": line}] if chat.templated else [{"role": "user",
                                                                                       "content": line}]
        try:
            reply = chat.answer(turn)
        except KeyboardInterrupt:  # while it generates: that answer is dropped, the conversation ends
            write("")
            return
        write(reply + "\n")
        messages = [*turn, {"role": "assistant", "content": reply}]


def escaped(text: str) -> str:
    """An answer on one line: a backslash as \\\\, a line break as \\n (a carriage return as \\r)."""
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


def answer_lines(chat: Chat, lines, write=print) -> int:
    """Each non-empty line a prompt on its own, its answer on one line (escaped); returns how many."""
    n = 0
    for line in lines:
        line = line.rstrip("\r\n")
        if line.strip():
            write(escaped(chat.answer([{"role": "user", "content": line}])))
            n += 1
    return n


def main(argv: list[str]) -> int:
    parser = StageParser("lowmem-dpo chat", USAGE)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default=None)
    a = parser.parse_args(argv)
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {a.max_new_tokens}: expected a number of tokens >= 1")
    if a.prompt is not None and not a.prompt.strip():
        raise UserError("--prompt is empty: give the text to answer, or leave --prompt out to type prompts")
    try:
        chat = load(a.folder, a.device, a.max_new_tokens, a.plain)
        if a.prompt is not None:
            print(chat.answer([{"role": "user", "content": a.prompt}]))
        elif sys.stdin is not None and sys.stdin.isatty():
            # Ctrl-C ends a conversation, whatever this process inherited: one started with SIGINT ignored or
            # blocked (a script's background job, a test runner's worker) would not see the key
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            converse(chat)
        elif sys.stdin is None or not answer_lines(chat, sys.stdin):
            raise UserError("no --prompt, and stdin held no prompt (not a terminal, and no non-empty line): pass "
                            "--prompt TEXT, pipe one prompt a line, or run it in a terminal to type them")
    except KeyboardInterrupt:
        raise KeyboardInterrupt("chat writes nothing") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "chat", __doc__, usage=USAGE))
