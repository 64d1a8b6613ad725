"""Preference data, from the file to the forward pass:

    rows.py    load rows through `datasets`, after checking a local file's structure (file:line errors)
    encode.py  tokenize as TRL 1.16 does; skip (and count) the rows DPO cannot use
    lengths.py what tokenization kept and cut, the max_length that keeps rows whole (pure)
    batch.py   collate chosen and rejected of a micro-batch into one right-padded forward, or one packed row
               (padding_free); items longest first
    split.py   the eval hold-out of a dataset (eval_fraction), by a hash of each row's prompt
    mix.py     a mixture of sources: the rows each gives (fraction, rows, max_train_samples), tokenized per source,
               and their formats (text, conversation)
    implicit.py  a row's prompt from the shared start of chosen and rejected
    sides.py   the reference cache's model side: its components and digest, its two layouts in 16 bits, and
               which of them a run writes and reads (CacheLayout)
    cache.py   the reference cache's keys: sequence key, a run's values, what to say when rows lack one
    store.py   the reference cache's store: one SQLite file of values under (model side, row key)

The stages use the names below; each lives in the module that says so. The cache is data.cache's and
data.store's, imported by name.
"""

from lowmem_dpo.data.batch import (
                                   PACK_MIN_PADDING,
                                   Batch,
                                   Layout,
                                   Packed,
                                   by_length,
                                   collate,
                                   collate_completions,
                                   collate_shared,
                                   pack,
                                   pad_token_id,
)
from lowmem_dpo.data.encode import (
                                   SKIPS,
                                   TRUNCATIONS,
                                   Named,
                                   TokenizedCompletion,
                                   TokenizedData,
                                   TokenizedPair,
                                   check_skips,
                                   kept,
                                   skip_reasons,
                                   tokenize_completions,
                                   tokenize_rows,
)
from lowmem_dpo.data.lengths import Kept, losses_over, nearest_rank
from lowmem_dpo.data.mix import Mixture, load_mixture, tokenize_mixture
from lowmem_dpo.data.rows import REQUIRED, data_files, load_rows
from lowmem_dpo.data.split import held_out, holdout_rows, prompt_keys, shown_prompt

__all__ = ["Batch", "Layout", "PACK_MIN_PADDING", "Packed", "pack", "by_length", "collate", "collate_completions", "collate_shared", "pad_token_id", "SKIPS", "Named", "TRUNCATIONS", "TokenizedCompletion",
           "TokenizedData", "TokenizedPair", "check_skips", "kept", "skip_reasons", "Kept", "losses_over", "nearest_rank", "tokenize_completions", "tokenize_rows",
           "REQUIRED", "data_files", "load_rows", "held_out", "holdout_rows",
           "prompt_keys", "shown_prompt", "Mixture", "load_mixture", "tokenize_mixture"]
