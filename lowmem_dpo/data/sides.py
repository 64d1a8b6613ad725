"""The reference cache's model side (cache.py keys the sequences under it): what a run's reference values depend on
besides the sequence, hashed once per build; in a 16-bit dtype its two layouts, and which of them a run writes and
reads (CacheLayout).

    model side    the base's weights and config, the SFT adapter's files, the reference's dtype and quantization,
                  how log-probs are computed (LOGPS_RULES), whether each token's log-prob is kept (LD-DPO's sums
                  weigh tokens by where the pair's shorter completion ends, which only the row knows), and in a
                  16-bit dtype the forward's layout. Hashed once per build (side_components, side_digest).
    layouts       in a 16-bit dtype the shared-prompt forward rounds differently from the plain one, so a side keeps
                  each layout's values under its own digest (Side, with its twin); in float32 one serves both.
    the choice    precompute computes and writes the layout its forward takes, unless one the settings allow is
                  already complete (then no model loads); train reads its forward's layout first and says when it
                  reads the other (CacheLayout). Both decide the forward on the same rows, so they agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from lowmem_dpo import objectives

FORMAT_VERSION = 3  # values per sequence; 2 was per pair, 1 was manifest.json and shards
# bump when logps.completion_logps gives other numbers for the same ids and weights (2: the LM head in tiles with an
# online logsumexp, each sequence summed in float64)
LOGPS_RULES = 2


def side_components(weights: dict, dtype: str, quantization: str, shared: bool, per_token: bool = False) -> dict:
    """The model side: `weights` (inputs.side_files: the base's and the SFT adapter's file digests), the
    reference's dtype and quantization, the log-prob rules, and the forward's layout where it changes rounding (a
    16-bit dtype: the shared-prompt forward rounds differently; in float32 the two agree to ~1e-6). per_token:
    each token's log-prob is kept beside the sum (LD-DPO: any ld_alpha, any pairing); a side of its own, so that
    the plain sides stay small."""
    out = {"format": FORMAT_VERSION, "logps": LOGPS_RULES, **weights, "dtype": dtype, "quantization": quantization}
    if per_token:
        out["per_token"] = True
    if dtype != "float32":
        out["layout"] = "shared" if shared else "unshared"
    return out


def side_digest(components: dict) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Side:
    """A model side of this run, in the layout it prefers, with its twin in the other layout (16-bit only)."""

    components: dict
    twin: dict | None = None  # the same side's components in the other layout; None in float32

    @property
    def digest(self) -> str:
        return side_digest(self.components)

    @property
    def shared(self) -> bool | None:
        layout = self.components.get("layout")
        return None if layout is None else layout == "shared"

    @property
    def per_token(self) -> bool:
        return bool(self.components.get("per_token"))

    @property
    def identity(self) -> str:
        """The side whatever the layout: what a checkpoint records of the reference it trained against."""
        return side_digest({k: v for k, v in self.components.items() if k != "layout"})

    def layouts(self) -> dict:
        """layout (None in float32, else whether shared) -> its components."""
        if self.twin is None:
            return {None: self.components}
        return {self.shared: self.components, not self.shared: self.twin}

    def preferring(self, shared: bool | None) -> "Side":
        """This side preferring layout `shared` (None: as it is)."""
        if shared is None or self.twin is None or shared == self.shared:
            return self
        return Side(self.twin, self.components)


def run_side(weights: dict, dtype: str, quantization: str, shared: bool = False, per_token: bool = False) -> Side:
    """A run's Side: in a 16-bit dtype both layouts, `shared` preferred; in float32 one."""
    components = side_components(weights, dtype, quantization, shared, per_token)
    twin = side_components(weights, dtype, quantization, not shared, per_token) if "layout" in components else None
    return Side(components, twin)


@dataclass(frozen=True)
class CacheLayout:
    """Which layout of a run's model side precompute writes and train reads, from the run's settings; a layout is
    None in float32 (one serves both), else whether shared."""

    two_layouts: bool  # a 16-bit side (Side.twin): each layout keeps its own values
    share_prompt: bool | str  # the setting: True, False or "auto"
    unpaired: bool = False  # the loss trains on unpaired rows (KTO, objectives.unpaired): one sequence a row

    @classmethod
    def of_run(cls, side: Side, cfg) -> "CacheLayout":
        """The choice of a run (`cfg`: its Config) under its model side."""
        return cls(side.twin is not None, cfg.share_prompt, objectives.unpaired(cfg.loss_type))

    @property
    def asked(self) -> bool | None:
        """The layout share_prompt asks for; None: either (auto, or float32's one)."""
        return None if not self.two_layouts or self.share_prompt == "auto" else self.share_prompt is True

    @property
    def reuse_twin(self) -> bool:
        """Whether precompute computes only what neither layout holds (RunCache.missing): KTO's, whose rows a DPO
        build mostly holds in the shared layout; train then reads the other layout's values."""
        return self.unpaired

    def complete(self, lacking: dict) -> list:
        """The layouts of `lacking` (RunCache.missing: layout -> the sequences it lacks) that lack none and that
        share_prompt allows, in its order: precompute takes the first and loads no model."""
        return [layout for layout, miss in lacking.items() if not miss and self.asked in (None, layout)]

    def of_forward(self, shared: bool) -> bool | None:
        """The layout precompute computes and writes, and train reads first: its forward's (headcheck.bring_up's
        Layout.shared, which both decide on the same rows) in 16 bits; None in float32."""
        return shared if self.two_layouts else None

    def note(self, read: bool | None, shared: bool, dtype: str, command: str) -> str | None:
        """What train says when the values it read (RefCache.shared: `read`) are of the layout other than its
        forward's (`shared`), in its `dtype`; `command`: the precompute that computes the run's own (rebuild_command).
        None when they are its own."""
        if not self.two_layouts or read == shared:
            return None
        return (f"note: reference values were computed {'with' if read else 'without'} share_prompt and "
                f"this run {'shares' if shared else 'does not share'} prompts: in "
                f"{dtype} the two forwards round differently, so step 1 may sit ~1e-3 "
                f"off ln 2; {command} share_prompt={str(shared).lower()} computes this "
                "run's own")
