"""Talk to a trained run or a merged model: one answer, a conversation on a terminal, or an answer per piped line.

    lowmem-dpo chat RUN_OR_MERGED [--prompt TEXT] [--max-new-tokens N] [--plain | --template] [--system TEXT]
                    [--temperature T] [--top-p P] [--seed N] [--device auto|cpu|cuda|mps]
    lowmem-dpo chat runs/my-run --prompt "Write a haiku about rain."      # or: python -m lowmem_dpo.chat ...
    lowmem-dpo chat runs/my-run --temperature 0.7 --top-p 0.9 --seed 1    # sampled, the same answers each time

RUN_OR_MERGED is a run's output_dir (its final adapter), one of its checkpoints/checkpoint-STEP folders, a folder
written by `lowmem-dpo export` (or any transformers model folder), or any PEFT LoRA adapter. An adapter goes on the
base its run trained on, as export finds it (the run's config.yaml, a checkpoint's trainer_state.json; an adapter
trained with adapter_mode=new_on_merged on that base with its SFT adapter merged in), loaded as train loads it:
the run's device, dtype and quantization, by the same device rules.

With --prompt, the answer to TEXT is printed and chat exits. Without it, on a terminal: a conversation, each
answer kept in the history the next turn sees; `clear` starts a new one, `exit`, `quit`, Ctrl-D or Ctrl-C ends it.
Without it, with stdin piped or redirected: each non-empty line is a prompt answered on its own (no history), each
answer printed on one line, in order (its line breaks written as \\n, a backslash as \\\\).

Prompts are given as the run's training prompts were (its trainer_state.json records their format). A run trained
on conversations, or with apply_chat_template=true: each prompt a user turn through the chat template of the run's
tokenizer (saved beside its adapter), after the run's system_prompt as a system turn. A run trained on plain text
(the demo's): each prompt tokenized as written, answered on its own (no history). A model folder, a foreign
adapter, or a run written before the format was recorded: the template when the tokenizer has one (--plain for
one trained on plain text). --template or --plain forces either; the log line says which and why. --system TEXT
is the system turn instead of the run's (--system "": none); plain text has no system turn, so --system is refused
there (as training refuses system_prompt on plain-text rows).

Answers are greedy, as the samples in samples.jsonl (training/samples.py). --temperature T above 0 samples them
instead, from the fewest tokens whose probabilities add up to --top-p P (default 1: all); --seed N draws each
answer the same way on every run. At most the run's max_new_tokens tokens (a model folder: that key's default), or
--max-new-tokens. Writes nothing.
"""

# A stage on the top floor: it reads a run or a model folder and imports no other stage. What RUN_OR_MERGED holds
# is training/located.py's answer (which base an adapter belongs on: provenance.merge_chain's, export's);
# generating is the training samples' (samples.sample, beside their greedy).

from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo import data
from lowmem_dpo.config.cli import StageParser, run_cli
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.config.schema import FIELD_DEFAULTS, Config
from lowmem_dpo.model import adapters, models
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import provenance, samples
from lowmem_dpo.training.located import Source, locate
from lowmem_dpo.training.samples import Drawing, Placement

USAGE = ("RUN_OR_MERGED [--prompt TEXT] [--max-new-tokens N] [--plain | --template] [--system TEXT] "
         "[--temperature T] [--top-p P] [--seed N] [--device auto|cpu|cuda|mps]")
ENDS = ("exit", "quit")  # a terminal line that ends the conversation (as Ctrl-D does)
CLEAR = "clear"  # a terminal line that starts a new conversation
# The run's keys that decide how it loads. Not memory_budget: it sizes training (the planner's choices); an answer
# holds the weights and a KV cache.
LOADED_KEYS = ("device", "dtype", "quantization")


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
        system = ', or --system "" to leave the system turn out' if messages[0]["role"] == "system" else ""
        raise UserError(f"the chat template cannot render this conversation ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}); pass --plain to give the prompt as plain text"
                        f"{system}") from None


@dataclass
class Chat:
    """A loaded model and how it answers."""

    model: object  # a transformers causal LM, or a PeftModel on one
    tokenizer: object
    templated: bool  # prompts through the chat template (else plain text, each on its own)
    max_new_tokens: int
    resolved: devices.Resolved
    system: str | None = None  # the system turn before each conversation (templated only)
    drawing: Drawing = Drawing()

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids a conversation is answered from (prompt_ids), after the system turn."""
        turns = [{"role": "system", "content": self.system}, *messages] if self.system else messages
        return prompt_ids(self.tokenizer, turns, self.templated)

    def answer(self, messages: list[dict]) -> str:
        """The answer to a conversation whose last turn is the user's, decoded as the samples are."""
        (out,) = samples.sample(self.model, [self.prompt(messages)], self.max_new_tokens, self.tokenizer.eos_token_id,
                                data.pad_token_id(self.tokenizer), Placement(self.resolved.device, self.resolved.dtype),
                                self.drawing)
        return self.tokenizer.decode(out, skip_special_tokens=True)


def rendering(source: Source, tokenizer, plain: bool = False, template: bool = False) -> tuple[bool, str]:
    """(whether prompts go through the chat template, why): --plain or --template, else as the run's training
    prompts were (Source.formats), else (not recorded) the template when the tokenizer has one."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if template and not has:
        raise UserError(f"--template: the tokenizer of {source.tokenizer} has no chat template to apply; leave "
                        "--template out to give each prompt as plain text")
    if plain or template:
        return template, f"--{'template' if template else 'plain'}"
    formats = source.formats or []
    if "conversation" in formats and has:
        also = ", and on plain-text ones: --plain gives those" if "text" in formats else ""
        return True, f"the run trained on prompts rendered by the chat template{also}"
    if formats == ["text"]:
        return False, "the run trained on plain-text prompts"
    if not has:
        return False, f"the tokenizer of {source.tokenizer} has no chat template"
    if source.record is not None and source.record.get("apply_chat_template"):
        return True, "the run set apply_chat_template=true"
    whose = ("the run, trained by an older lowmem_dpo, does not record its prompts' format" if source.record
             is not None else "a model folder does not record how its prompts were trained")
    return True, f"{whose}, and the tokenizer has one; --plain gives plain text"


def system_turn(source: Source, templated: bool, system: str | None) -> tuple[str | None, str]:
    """(the system turn or None, what the log line says of it): --system (SYSTEM) over the run's system_prompt.
    --system with plain text is a UserError: it has nowhere to go, as training's system_prompt on plain-text rows."""
    if system and not templated:
        raise UserError("--system gives a system turn, which only the chat template renders, and this chat gives "
                        "prompts as plain text (as training refuses system_prompt on plain-text rows): pass "
                        "--template to chat through the template, or leave --system out")
    turn, whence = ((system, "--system") if system is not None
                    else ((source.record or {}).get("system_prompt"), "the run's system_prompt"))
    if not templated:
        return None, "; the run's system_prompt is left out: plain text has no system turn" if turn else ""
    if not turn:
        return None, ", no system prompt" + (' (--system "")' if system is not None else "")
    short = " ".join(turn.split())  # one line, at most 60 characters
    return turn, f", system prompt {short if len(short) <= 60 else short[:57] + '...'!r} ({whence})"


def opening(chat: Chat, source: Source, why: str, system: str) -> str:
    """The log line that says what answers: the model, its device and precision, how tokens are drawn, and how
    prompts are given and why (`system`: what system_turn says of the system turn)."""
    what = " + ".join([str(source.base), *map(str, source.adapters)])
    resolved = chat.resolved
    quantized = f", quantization={resolved.quantization}" if resolved.quantization != "none" else ""
    mode = "through the chat template" if chat.templated else "plain text, each prompt on its own"
    return (f"chat: {what} on {resolved.device} in {devices.dtype_name(resolved.dtype)}{quantized}; {chat.drawing}, "
            f"at most {chat.max_new_tokens} new tokens; {mode} ({why}){system}")


def load(folder: Path, device: str | None = None, max_new_tokens: int | None = None, plain: bool = False,
         template: bool = False, system: str | None = None, drawing: Drawing = Drawing()) -> Chat:
    """RUN_OR_MERGED loaded for answering: base (the run's dtype and quantization, by the device rules), the SFT
    adapter merged in for new_on_merged, the adapter on top, frozen, in eval mode; prompts given as the run's were
    (rendering), after its system turn (system_turn)."""
    source = locate(folder)
    tokenizer = models.load_tokenizer(source.tokenizer, source.chat_template, source.base)
    templated, why = rendering(source, tokenizer, plain, template)
    turn, said = system_turn(source, templated, system)
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
    record_tokens = (source.record or {}).get("max_new_tokens") or FIELD_DEFAULTS["max_new_tokens"]
    chat = Chat(model, tokenizer, templated, max_new_tokens or record_tokens, resolved, turn, drawing)
    log(opening(chat, source, why, said))
    if source.record is not None and (warned := provenance.run_warnings(folder, "chat")):
        log(warned)
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


def arguments(argv: list[str]):
    """The parsed arguments, each checked: a bad value is a UserError (exit 2) naming the range."""
    parser = StageParser("lowmem-dpo chat", USAGE)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    rendered = parser.add_mutually_exclusive_group()
    rendered.add_argument("--plain", action="store_true")
    rendered.add_argument("--template", action="store_true")
    parser.add_argument("--system", default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), default=None)
    a = parser.parse_args(argv)
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {a.max_new_tokens}: expected a number of tokens >= 1")
    if a.prompt is not None and not a.prompt.strip():
        raise UserError("--prompt is empty: give the text to answer, or leave --prompt out to type prompts")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise UserError(f"--temperature {a.temperature}: expected a number >= 0 (0: greedy)")
    if not 0 < a.top_p <= 1:
        raise UserError(f"--top-p {a.top_p}: expected a number above 0 and at most 1 (1: every token)")
    if a.seed is not None and not 0 <= a.seed < 2 ** 63:
        raise UserError(f"--seed {a.seed}: expected a whole number >= 0")
    if a.temperature == 0 and (a.top_p != 1 or a.seed is not None):
        log("note: --top-p and --seed act only on sampled answers: pass --temperature above 0 to sample (0, the "
            "default, is greedy)")
    return a


def main(argv: list[str]) -> int:
    a = arguments(argv)
    try:
        chat = load(a.folder, a.device, a.max_new_tokens, a.plain, a.template, a.system,
                    Drawing(a.temperature, a.top_p, a.seed))
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
