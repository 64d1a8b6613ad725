"""What every stage reads: the model folder, the tokenizer, the tokenized data, the digests of those inputs, and
the reference cache's model side and values for a run's rows. Shared by precompute, preflight and train so they
tokenize and look rows up the same way."""

from __future__ import annotations

import functools
import hashlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from lowmem_dpo import data, objectives
from lowmem_dpo.config.schema import Config, keys_where
from lowmem_dpo.config.sources import Source, label
from lowmem_dpo.data import cache, sides, unpaired
from lowmem_dpo.model import models
from lowmem_dpo.runtime import devices, distributed
from lowmem_dpo.runtime.devices import Resolved, dtype_name
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.files import files_digest

# cache_settings key -> its name in the fingerprint (a format-1 manifest's "components"), where the two differ: the
# cache has always called the reference's resolved precision "dtype" and "quantization".
COMPONENT_NAMES = {"ref_dtype": "dtype", "ref_quantization": "quantization"}
# The keys declared reference="files" (config.py), each read by file_components: a new one needs a line there.
FILE_KEYS = frozenset({"model_name_or_path", "sft_adapter", "dataset", "dataset_split", "max_train_samples",
                       "eval_dataset", "eval_split", "chat_template", "prompt_column", "chosen_column",
                       "rejected_column"})


@dataclass
class Inputs:
    model_path: Path  # the base model folder
    source: models.ModelSource  # the base and the SFT adapter on it, if any
    tokenizer: object
    fingerprint: dict  # fingerprint_components: the model side's weights (run_side), and what a checkpoint
    #                    records (run_inputs)


def data_component(spec: str, split: str, rows=None) -> dict:
    """The fingerprint of one dataset: its files' bytes (and the split of a save_to_disk folder), or a hub
    dataset's `datasets` content fingerprint (of `rows` when they are loaded)."""
    files = data.data_files(spec)
    if files:
        root = Path(spec) if Path(spec).is_dir() else None
        return {"files": files_digest(files, root), "split": split if root else None}
    rows = rows if rows is not None else data.load_rows(spec, split, required=())
    return {"hub": spec, "split": split, "fingerprint": rows._fingerprint}


def dataset_component(cfg: Config, mix: data.Mixture | None = None) -> dict:
    """The fingerprint of `dataset` (`mix`: its sources, when loaded). One source taken whole: its data_component,
    as before mixtures (a cache built then keeps its fingerprint). A mixture (several sources, a fraction or rows,
    max_train_samples): each source's data_component with its fraction and rows, max_train_samples, and the seed
    when a selection depends on it (data/mix.py)."""
    sources, cap = cfg.dataset, cfg.max_train_samples
    loaded = mix.loaded if mix is not None else [None] * len(sources)
    if len(sources) == 1 and not sources[0].selects and cap is None:
        return data_component(sources[0].path, sources[0].split or cfg.dataset_split, loaded[0])
    seeded = cap is not None or any(s.selects for s in sources)
    return {"sources": [{**data_component(s.path, s.split or cfg.dataset_split, rows), "fraction": s.fraction,
                         "rows": s.rows} for s, rows in zip(sources, loaded)],
            "max_train_samples": cap, "seed": cfg.seed if seeded else None}


def file_components(cfg: Config, model_path: Path, adapter_path: Path | None, tokenizer_path: Path,
                    mix: data.Mixture | None = None) -> dict:
    """The fingerprint of the keys declared reference="files" (model_name_or_path, sft_adapter, dataset,
    dataset_split, max_train_samples, eval_dataset, eval_split), by the content of the files they name: the
    base's weights and config, the SFT adapter's files (the reference is base + adapter; adapter_mode is not in
    it, see adapters.py), the tokenizer's files, and the datasets' bytes (dataset_component; `mix`: dataset's
    sources, when loaded). "eval_dataset" and "chat_template" are there only when set, so a cache built without
    them keeps its fingerprint; eval_fraction is not in it (the cache holds every row of dataset)."""
    dataset = dataset_component(cfg, mix)
    eval_dataset = None if cfg.eval_dataset is None else data_component(cfg.eval_dataset, cfg.eval_split)
    # the model's files (models.py names them), then their digests
    model_files = {"model": models.weight_files(model_path),
                   "adapter": None if adapter_path is None else models.adapter_files(adapter_path),
                   "tokenizer": models.tokenizer_files(tokenizer_path)}
    # the text it names, by content (a file's path may stay as its text changes)
    template = None if cfg.chat_template is None else models.chat_template_text(cfg.chat_template)
    out = {**{k: None if paths is None else files_digest(paths) for k, paths in model_files.items()},
           "dataset": dataset}
    if eval_dataset is not None:
        out["eval_dataset"] = eval_dataset
    if template is not None:
        out["chat_template"] = hashlib.sha256(template.encode()).hexdigest()
    for key in ("prompt_column", "chosen_column", "rejected_column"):  # which columns are read as which
        if getattr(cfg, key) is not None:
            out[key] = getattr(cfg, key)
    return out


def cache_settings(cfg: Config) -> dict:
    """The values of the keys declared reference="value" (config.py): what the reference log-probs depend on
    besides the content of the model, adapter, tokenizer and data files (reference="files"). ref_quantization and
    ref_dtype are resolved from quantization and dtype when null (fingerprint_components resolves auto)."""
    out = {name: getattr(cfg, name) for name in sorted(keys_where(reference="value"))}
    out.update(ref_quantization=cfg.reference_quantization, ref_dtype=cfg.reference_dtype)
    return out


def fingerprint_components(cfg: Config, resolved: Resolved, model_path: Path, adapter_path: Path | None = None,
                           tokenizer_path: Path | None = None) -> dict:
    """Everything the reference log-probs depend on, and nothing they don't: the keys Config declares
    reference="files" by content (file_components) and those declared reference="value" by value
    (cache_settings). `dtype` and `quantization` are the reference's resolved settings (ref_dtype and
    ref_quantization, which default to dtype and quantization; a dtype of auto as the device resolves it), not
    the policy's: a cache computed unquantized serves a 4-bit policy. With an SFT adapter (`adapter_path`) the
    reference is base + adapter; the tokenizer is read from `tokenizer_path` (default: the model folder)."""
    values = {**cache_settings(cfg), "ref_dtype": dtype_name(resolved.ref_dtype),  # auto: as the device resolves it
              "ref_quantization": resolved.ref_quantization}
    files = file_components(cfg, model_path, adapter_path, tokenizer_path or model_path)
    return {"format": cache.FINGERPRINT_FORMAT, **files, **{COMPONENT_NAMES.get(k, k): v for k, v in values.items()}}


def run_side(cfg: Config, resolved: Resolved, prepared: Inputs, shared: bool = False) -> sides.Side:
    """The model side (sides.py) of a run's reference: the base's weights and config, the SFT adapter's files, the
    reference's resolved dtype and quantization; `shared` the preferred layout in 16 bits."""
    weights = {k: prepared.fingerprint[k] for k in ("model", "adapter")}
    # LD-DPO weighs each token by where the pair's shorter completion ends: its side keeps the token log-probs
    return sides.run_side(weights, dtype_name(resolved.ref_dtype), resolved.ref_quantization, shared,
                          per_token=cfg.ld_alpha is not None)


def cached_reference(cfg: Config, prepared: Inputs, side: sides.Side, dataset: Data,
                     recipe: str | None = None) -> tuple:
    """(the dataset's rows' reference values, eval_dataset's or None) from the cache in ref_cache_dir, each row's
    sequences looked up by key under `side`; a UserError naming the rows without them and the command that
    computes them."""
    # each part's rows, their keys and how a message names a row, before the cache opens
    parts = [(part, tok, dataset.keys(part), functools.partial(dataset.name_row, part=part))
             for part, tok in dataset.cached_parts()]
    cache_dir = Path(cfg.ref_cache_dir)
    command = cache.rebuild_command(cfg, recipe)
    run_cache = cache.for_run(cache_dir, side, command=command)
    if run_cache is None:
        raise UserError(f"no reference cache in {str(cache_dir)!r}; build it with: {command}")
    refs = {}
    with run_cache:
        for part, tok, keys, name in parts:
            refs[part], lacking = run_cache.read(tok, name, keys, cfg.ld_alpha)
            if lacking:
                raise UserError(run_cache.missing_message(lacking, len(tok.pairs), name))
    return refs["train"], refs.get("eval")


def reference_of(cfg: Config) -> tuple:
    """cached_reference of a config, with no model loaded: what train would serve (tests and benchmarks)."""
    resolved = devices.resolve(cfg)
    prepared = prepare(cfg, resolved)
    dataset = load_data(cfg, prepared.tokenizer, progress=False)
    return cached_reference(cfg, prepared, run_side(cfg, resolved, prepared), dataset)


def prepare(cfg: Config, resolved: Resolved) -> Inputs:
    source = models.model_source(cfg.model_name_or_path, cfg.sft_adapter)  # the stages log source.description
    tokenizer = models.load_tokenizer(source.tokenizer_path, cfg.chat_template, source.base_path)
    return Inputs(source.base_path, source, tokenizer,
                  fingerprint_components(cfg, resolved, source.base_path, source.adapter_path, source.tokenizer_path))


def tokenized(cfg: Config, tokenizer, progress: bool = True) -> data.TokenizedData:
    """Every preference row of cfg.dataset, checked and tokenized (no eval split: load_data)."""
    return tokenized_mixture(cfg, tokenizer, progress)[1]


def tokenized_mixture(cfg: Config, tokenizer, progress: bool = True) -> tuple[data.Mixture, data.TokenizedData]:
    """(the rows of cfg.dataset, those rows tokenized): Mixture.row(pair.row) is a pair's row."""
    return _tokenize(cfg, tokenizer, cfg.dataset, cfg.dataset_split, progress, False, cfg.max_train_samples)


def mixture(cfg: Config) -> data.Mixture:
    """The rows of cfg.dataset (its sources loaded and taken, not tokenized): Mixture.row(pair.row) is a pair's
    row."""
    return data.load_mixture(cfg.dataset, cfg.dataset_split, cfg.seed, cfg.max_train_samples,
                             row_loader(cfg, data.REQUIRED))


@dataclass
class Data:
    """The rows a stage trains and evaluates on (load_data)."""

    tok: data.TokenizedData  # every row of cfg.dataset (of its mixture), tokenized (what precompute caches)
    train: list  # the items training uses: tok.pairs minus the held-out rows
    eval: list  # eval items, at most cfg.eval_max_pairs (the first in data order); [] without eval data
    eval_part: str | None  # the cache part of the eval items' reference log-probs: "train" (rows of dataset held
    #                        out by eval_fraction) or "eval" (rows of eval_dataset); None without eval data
    eval_tok: data.TokenizedData | None = None  # every row of eval_dataset, tokenized (what precompute caches)
    mixture: data.Mixture | None = None  # cfg.dataset's sources as loaded: file_components reads a hub one's
    #                                      fingerprint from them
    prompts: dict = field(default_factory=dict)  # eval item's row -> its prompt as the samples show it
    eval_mixture: data.Mixture | None = None  # eval_dataset's rows as loaded
    pair_keys: dict = field(default_factory=dict)  # part -> its pairs' cache.pair_keys, computed once (keys())

    def keys(self, part: str = "train") -> list[tuple[bytes, bytes]]:
        """The cache's sequence keys (chosen, rejected) of the dataset's pairs (part "train") or eval_dataset's
        ("eval"), in order."""
        if part not in self.pair_keys:
            tok = self.eval_tok if part == "eval" else self.tok
            self.pair_keys[part] = [cache.pair_keys(p) for p in tok.pairs] if tok is not None else []
        return self.pair_keys[part]

    def cached_parts(self) -> list[tuple[str, data.TokenizedData]]:
        """The parts the cache serves, each with its rows: "train" (every row of dataset) and, with eval_dataset,
        "eval"."""
        return [(part, tok) for part, tok in (("train", self.tok), ("eval", self.eval_tok)) if tok is not None]

    def all_pairs(self) -> tuple[list, list[tuple[bytes, bytes]]]:
        """Every pair the cache serves, the dataset's then eval_dataset's, and their keys (keys())."""
        parts = self.cached_parts()
        return [p for _, tok in parts for p in tok.pairs], [k for part, _ in parts for k in self.keys(part)]

    def sequences(self) -> dict:
        """Every sequence the rows of both parts read, once: its key -> data.TokenizedCompletion (named by the
        first row that reads it). A completion paired several ways is one sequence."""
        out = {}
        for p, keys in zip(*self.all_pairs()):
            for key, seq in zip(keys, cache.pair_sequences(p)):
                if seq.completion_ids:  # an empty one is never computed (cache.EMPTY)
                    out.setdefault(key, seq)
        return out

    unpaired: dict = field(default_factory=dict)  # KTO: part -> its data.unpaired rows, by their pairs' row

    def name_row(self, row: int, part: str = "train") -> str:
        """A row for messages: its file and line ("data/a.jsonl row 3 at line 4"); part "eval": eval_dataset's."""
        mix = self.eval_mixture if part == "eval" else self.mixture
        row = self.dataset_row(row, part)
        return mix.name(row) if mix is not None else f"row {row}"

    def dataset_row(self, row: int, part: str = "train") -> int:
        """The dataset row of an item's `row` (KTO's items are numbered in their part: unpaired_views)."""
        return self.unpaired[part][row].row if part in self.unpaired else row


def _tokenize(cfg: Config, tokenizer, sources: list[Source], split: str, progress: bool, sft: bool,
              cap: int | None = None) -> tuple[data.Mixture, data.TokenizedData]:
    """(mixture, TokenizedData) of a dataset's sources (split: the default split; cap: max_train_samples), taken
    (data/mix.py), checked and tokenized: SFT rows (prompt + completion or chosen) or pairs; messages name each
    row's source and its place there."""
    rows = not sft and objectives.unpaired(cfg.loss_type)  # KTO: unpaired rows, or pairs unpaired
    required = ("prompt",) if sft or rows else data.REQUIRED
    load = row_loader(cfg, required)
    tokenize = data.tokenize_completions if sft else unpaired.tokenize_unpaired if rows else data.tokenize_rows
    mix = data.load_mixture(sources, split, cfg.seed, cap, load)
    return mix, data.tokenize_mixture(mix, lambda rows, spec, where: tokenize(
        rows, tokenizer, cfg.max_length, cfg.max_prompt_length, spec=data.Named(spec, where), progress=progress,
        strict=cfg.strict))


def _held_out(cfg: Config, mix: data.Mixture, tok: data.TokenizedData) -> tuple[list, list]:
    """(train, eval) items of dataset (`mix`, tokenized as `tok`) split by eval_fraction (data.holdout_rows);
    UserError when either is empty."""
    keys = mix.prompt_keys()
    held = data.held_out(keys, cfg.eval_fraction)  # = data.holdout_rows(rows, ...), keys read once
    train = [p for p in tok.pairs if p.row not in held]
    evals = [p for p in tok.pairs if p.row in held]
    prompts = len(set(keys))
    if not evals:
        why = "selects none of its" if not held else f"selects {len(held)} rows, all skipped, of its"
        raise UserError(f"eval_fraction={cfg.eval_fraction} {why} {prompts} distinct prompts in dataset "
                        f"{label(cfg.dataset)!r} (the hold-out goes by prompt): raise eval_fraction, or name "
                        "held-out rows with eval_dataset")
    if not train:
        raise UserError(f"eval_fraction={cfg.eval_fraction} holds out every usable row of dataset "
                        f"{label(cfg.dataset)!r} ({prompts} distinct prompts), leaving none to train on: lower "
                        "eval_fraction, or name held-out rows with eval_dataset")
    log(f"eval: {len(evals)} {rows_noun(cfg, False)} held out of {label(cfg.dataset)} by eval_fraction={cfg.eval_fraction} "
        f"({len({keys[p.row] for p in evals})} of {prompts} prompts)")
    return train, evals


def row_loader(cfg: Config, required: tuple[str, ...]):
    """(path, split) -> the rows of one source as the recipe reads them: its columns (data_columns), plain text as
    chat turns (apply_chat_template, system_prompt)."""
    return lambda path, part: data.load_rows(path, part, required, data_columns(cfg), cfg.apply_chat_template,
                                             cfg.system_prompt)


def data_columns(cfg: Config) -> dict[str, str]:
    """The data's columns read as prompt, chosen and rejected where the recipe names others (their _column keys)."""
    return {k: getattr(cfg, f"{k}_column") for k in ("prompt", "chosen", "rejected") if getattr(cfg, f"{k}_column")}


def rows_noun(cfg: Config, sft: bool) -> str:
    """What a stage's eval items are, for the log."""
    return "rows" if sft or objectives.unpaired(cfg.loss_type) else "pairs"


def load_data(cfg: Config, tokenizer, progress: bool = True, sft: bool = False, limits: bool = True) -> Data:
    """dataset tokenized, split into training and eval items by eval_fraction, or eval_dataset tokenized beside
    it (split eval_split; the same data checks, its messages naming it). sft: SFT rows (tokenize_completions).
    limits: a UserError when either loses more than max_skipped_share or max_truncated_share (check_losses);
    False: the caller says so (preflight warns)."""
    progress = progress and distributed.is_main()  # several processes tokenize alike: one bar
    mix, tok = _tokenize(cfg, tokenizer, cfg.dataset, cfg.dataset_split, progress, sft, cfg.max_train_samples)
    if limits:
        check_losses(cfg, tok, label(cfg.dataset))
    if cfg.eval_dataset is not None:
        eval_mix, eval_tok = _tokenize(cfg, tokenizer, [Source(cfg.eval_dataset)], cfg.eval_split, progress, sft)
        if limits:
            check_losses(cfg, eval_tok, cfg.eval_dataset)
        log(f"eval: {len(eval_tok.pairs)} {rows_noun(cfg, sft)} from {cfg.eval_dataset}")
        dataset = Data(tok, tok.pairs, eval_tok.pairs, "eval", eval_tok, mix, eval_mixture=eval_mix)
    elif cfg.eval_fraction > 0:
        dataset = Data(tok, *_held_out(cfg, mix, tok), "train", mixture=mix)
    else:
        dataset = Data(tok, tok.pairs, [], None, mixture=mix)
    dataset.eval = dataset.eval[:cfg.eval_max_pairs]  # before KTO's KL sequences: they pair within what is evaluated
    if not sft and objectives.unpaired(cfg.loss_type):
        unpaired_views(cfg, dataset)
    dataset.prompts = shown_prompts(dataset, dataset.eval)
    return dataset


def losses(cfg: Config, tok: data.TokenizedData) -> str | None:
    """What tokenization lost of a dataset past max_skipped_share or max_truncated_share (data.losses_over)."""
    return data.losses_over(data.kept(tok), cfg.max_length, cfg.max_skipped_share, cfg.max_truncated_share,
                            data.skip_reasons(tok.skipped, cfg.max_length))


def check_losses(cfg: Config, tok: data.TokenizedData, name: str) -> None:
    """A UserError when tokenization lost more of dataset `name` than the limits allow (losses)."""
    lost = losses(cfg, tok)
    if lost is not None:
        raise UserError(f"dataset {name!r}: {lost}")


def unpaired_views(cfg: Config, dataset: Data) -> None:
    """KTO's rows in `dataset` as the pair code reads them (data.unpaired.TokenizedUnpaired.as_pair): each part's rows
    (the training rows, then the held-out ones) numbered in order, each with its KL sequence when the loss has
    one, paired within blocks of per_device_train_batch_size of its own part (TRL's)."""
    def views(tok: data.TokenizedData, groups: list[list]) -> list:
        for group in groups:
            if objectives.needs_kl(cfg.loss_type):
                unpaired.with_kl(group, cfg.per_device_train_batch_size, cfg.max_length)
        rows = [item for group in groups for item in group]
        tok.pairs, tok.num_rows, tok.dropped = [item.as_pair(i) for i, item in enumerate(rows)], len(rows), []
        return rows

    if objectives.needs_kl(cfg.loss_type) and cfg.per_device_train_batch_size < 2:
        raise UserError(f"loss_type={cfg.loss_type[0]} with per_device_train_batch_size="
                        f"{cfg.per_device_train_batch_size}: its KL estimate pairs each row with another row's "
                        "completion in the same micro-batch, so it needs 2 rows at least (as TRL's KTOTrainer); raise "
                        "it, or use loss_type=apo_zero_unpaired")
    train, evals = list(dataset.train), list(dataset.eval)
    if dataset.eval_part == "eval":
        dataset.unpaired = {"train": views(dataset.tok, [train]), "eval": views(dataset.eval_tok, [evals])}
        dataset.train, dataset.eval = dataset.tok.pairs, dataset.eval_tok.pairs
    else:
        dataset.unpaired = {"train": views(dataset.tok, [train, evals])}
        dataset.train, dataset.eval = dataset.tok.pairs[:len(train)], dataset.tok.pairs[len(train):]


def shown_prompts(dataset: Data, items: list) -> dict[int, str]:
    """Each eval item's row -> its prompt as the samples show it (data.shown_prompt of the row's prompt)."""
    mix = dataset.eval_mixture if dataset.eval_part == "eval" else dataset.mixture
    if mix is None:
        return {}
    return {item.row: data.shown_prompt(mix.row(dataset.dataset_row(item.row, dataset.eval_part)).get("prompt"))
            for item in items}


def tokens_digest(items: list) -> str:
    """One digest over tokenized items (data.TokenizedPair or TokenizedCompletion): each one's row and token ids.
    It changes with the tokenizer's files, the tokenizers/transformers library, max_length and the data."""
    h = hashlib.sha256()
    for item in items:
        for value in vars(item).values():  # row, then the id lists, in field order
            ids = value if isinstance(value, list) else [value]
            h.update(array("q", [len(ids), *ids]).tobytes())
    return h.hexdigest()


def run_inputs(files: dict, items: list) -> dict:
    """What a training run trains on, by digest, under the names a refused resume gives (checkpoint.check_inputs):
    `files` is file_components' (or fingerprint_components') dict, `items` the tokenized data. Train adds its
    "reference cache". With eval_dataset, its files too ("eval data": a resumed run evaluates on the same rows)."""
    out = {"data": files["dataset"], "model weights": files["model"], "adapter weights": files["adapter"],
           "tokenizer": files["tokenizer"], "tokenization": tokens_digest(items)}
    if files.get("eval_dataset") is not None:
        out["eval data"] = files["eval_dataset"]
    return out
