"""Speculative decoding settings, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .proposer import DRAFT_MODEL, HEAD, PROPOSERS, TARGET_LAYER, DrafterKind, drafting_modes

# "none", every drafter kind alone and each mix of a cheap kind with a kind
# that runs a model (the registry's rule, proposer/__init__.py). "auto" stands
# for one of them, chosen by what the folders hold (auto.py), before anything
# is built.
MODES = ("none", "auto") + drafting_modes()

VERIFY_MODES = ("auto", "greedy", "threshold")


@dataclass(frozen=True)
class SpecDecodeConfig:
    mode: str = "none"
    num_speculative_tokens: int = 16
    ngram_min: int = 1
    ngram_max: int = 4
    prompt_lookup: bool = True
    # suffix: tokens of earlier requests' outputs held in the global index
    # (0: none, each request drafts from its own text only), and whether
    # their prompts are indexed too.
    suffix_cache_tokens: int = 32768
    suffix_index_prompts: bool = False
    draft_model_path: Optional[str] = None
    # Quantize the draft after loading (bits), e.g. for a float checkpoint on a GPU.
    draft_model_quantize: Optional[int] = None
    # Batches at least this large decode without speculation (None: no cap).
    disable_by_batch_size: Optional[int] = None
    acceptance_threshold: float = 0.0
    ema_alpha: float = 0.3
    dynamic: bool = True
    adaptive_k: bool = True
    # auto: exact match at temperature 0, rejection sampling above (lossless);
    # greedy: exact match only; threshold: accept a draft whose target
    # probability is at least ``verify_threshold`` (lossy, opt-in by name).
    verify_mode: str = "auto"
    verify_threshold: float = 0.1
    # Seconds spent at start-up timing (and compiling) the pass shapes per
    # batch bucket and k bucket; 0 skips it (the controller then times steps online only).
    calibration_seconds: float = 5.0
    # Continuations a row's tree of drafts may branch into (``tree.py``);
    # 1: chains. A tree's nodes: ``tree_budget`` per row, or (None, auto)
    # the controller's k, the chain's pass size.
    tree_width: int = 1
    tree_budget: Optional[int] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--spec-decode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(
                f"--spec-verify must be one of {', '.join(VERIFY_MODES)}, not {self.verify_mode!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(
                "--num-speculative-tokens must be between 1 and 64, "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.ngram_max > 16:
            raise ValueError(f"--ngram-max must be at most 16, got {self.ngram_max}")
        if not 0 <= self.suffix_cache_tokens <= 1 << 24:
            raise ValueError("--suffix-cache-tokens must be between 0 and 16777216, "
                             f"got {self.suffix_cache_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                "--spec-decode-disable-batch-size must be at least 1 "
                f"(leave it out for no cap), got {self.disable_by_batch_size}"
            )
        if not 0.0 <= self.acceptance_threshold <= 1.0:
            raise ValueError(
                "--spec-decode-acceptance-threshold must be between 0 and 1, "
                f"got {self.acceptance_threshold}"
            )
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"the EMA alpha must be in (0, 1], got {self.ema_alpha}")
        if not 0.0 < self.verify_threshold <= 1.0:
            raise ValueError(
                f"--spec-verify-threshold must be in (0, 1], got {self.verify_threshold}"
            )
        if not 0.0 <= self.calibration_seconds <= 600.0:
            raise ValueError(
                f"--spec-calibration-seconds must be between 0 and 600, got {self.calibration_seconds}"
            )
        if not 1 <= self.tree_width <= 8:
            raise ValueError(f"--spec-tree-width must be between 1 and 8, got {self.tree_width}")
        if self.tree_budget is not None:
            if not 1 <= self.tree_budget <= 64:
                raise ValueError("--spec-tree-budget must be auto or between 1 and 64, "
                                 f"got {self.tree_budget}")
            if self.tree_width == 1:
                raise ValueError("--spec-tree-budget needs --spec-tree-width above 1 "
                                 "(a width of 1 drafts chains of --num-speculative-tokens)")
        needs = [kind for kind in self.kinds if kind.needs_folder]
        if needs and not self.draft_model_path:
            raise ValueError(f"--spec-decode {self.mode} needs --draft-model {needs[0].folder}")
        if self.draft_model_path and self.mode != "auto" \
                and not any(kind.folder for kind in self.kinds):
            takes = ", ".join(f"{kind.name} ({kind.folder})"
                              for kind in PROPOSERS.values() if kind.folder)
            raise ValueError(f"--draft-model is only used with --spec-decode auto, {takes} "
                             "and their mixes")
        if self.draft_model_quantize not in (None, 4, 8):
            raise ValueError(
                f"--draft-model-quantize must be 4 or 8, got {self.draft_model_quantize}"
            )

    @property
    def priced_trees(self) -> bool:
        """Whether a tree's nodes are cut to what the pass's price pays for,
        as the controller chooses a chain's k (adaptive k, the budget auto)."""
        return self.adaptive_k and self.tree_budget is None

    @property
    def most_drafts(self) -> int:
        """The most draft tokens of a row in one pass: a chain's k or a tree's budget."""
        return max(self.num_speculative_tokens, self.tree_budget or 0)

    @property
    def kinds(self) -> tuple[DrafterKind, ...]:
        """The drafter kinds this mode runs (none for ``none`` and ``auto``)."""
        return tuple(PROPOSERS[name] for name in self.mode.split(",") if name in PROPOSERS)

    def _drafts_with(self, what: str) -> bool:
        return any(kind.drafts_with == what for kind in self.kinds)

    @property
    def uses_draft_model(self) -> bool:
        return self._drafts_with(DRAFT_MODEL)

    @property
    def uses_head(self) -> bool:
        """A drafter read from --draft-model that drafts from the target's states."""
        return self._drafts_with(HEAD)

    @property
    def uses_mtp(self) -> bool:
        return self._drafts_with(TARGET_LAYER)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"
