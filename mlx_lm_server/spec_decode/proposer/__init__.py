"""Drafter kinds: the one place that lists them, says what each needs and
builds each. ``--spec-decode``'s modes and checks (``../config.py``), its
``--help`` (``cli.py``) and ``auto`` (``../auto.py``) follow from ``PROPOSERS``.

The base module knows no proposer; each proposer imports the base; this
registry imports a proposer when it builds one, so the config and the CLI
read the table without loading model code (and ``mixed.py``, through the
controller, imports the config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .base import BaseProposer

# What a kind drafts with, which says what it needs.
TEXT = "text"  # the request's text (or earlier outputs): no model; first in a mix
DRAFT_MODEL = "draft model"  # a model of its own, read from --draft-model
TARGET_LAYER = "target layer"  # a layer the target carries (or a split copy in --draft-model)
HEAD = "head"  # a head on the target's hidden states, read from --draft-model


@dataclass(frozen=True)
class DrafterKind:
    """One ``--spec-decode`` kind. What the config checks, which mixes it is
    in and what ``auto`` recognises follow from these fields."""

    name: str  # the --spec-decode mode
    drafts_with: str  # TEXT, DRAFT_MODEL, TARGET_LAYER or HEAD
    build: Callable[..., BaseProposer]  # (config, target_tokenizer, target_path, target)
    help: str  # what --help says it drafts from
    folder: str = ""  # what --draft-model holds for it ("": it reads none)
    # auto: whether a --draft-model folder's config is this kind (None: never;
    # a folder no kind recognises is a draft model).
    recognises: Optional[Callable[[dict], bool]] = None

    @property
    def needs_folder(self) -> bool:
        return self.drafts_with in (DRAFT_MODEL, HEAD)

    @property
    def needs_target(self) -> bool:
        return self.drafts_with in (TARGET_LAYER, HEAD)


def _ngram(config, target_tokenizer, target_path, target) -> BaseProposer:
    from .ngram import NGramProposer

    return NGramProposer(config.ngram_min, config.ngram_max, config.prompt_lookup,
                         tree_paths=config.tree_width)


def _suffix(config, target_tokenizer, target_path, target) -> BaseProposer:
    from .suffix import SuffixProposer

    return SuffixProposer(config.ngram_min, config.ngram_max, config.prompt_lookup,
                          max_tokens=config.suffix_cache_tokens,
                          index_prompts=config.suffix_index_prompts, tree_width=config.tree_width)


def _draft(config, target_tokenizer, target_path, target) -> BaseProposer:
    from .draft_model import load_draft_proposer

    return load_draft_proposer(config.draft_model_path, target_tokenizer, target_path,
                               config.draft_model_quantize, config.tree_width)


def _mtp(config, target_tokenizer, target_path, target) -> BaseProposer:
    from ...runtime import mlx_lm_adapter
    from ..heads.mtp import load_mtp_head
    from .head import HeadProposer

    head = load_mtp_head(target, target_path, config.draft_model_path)
    return HeadProposer(head, mlx_lm_adapter.token_embedding(target),
                        head.projection(mlx_lm_adapter.output_projection(target)),
                        tree_width=config.tree_width)


def _is_split_mtp(config: dict) -> bool:
    from ..heads.mtp import SPLIT_MODEL_TYPES

    return config.get("model_type") in SPLIT_MODEL_TYPES


def _eagle3(config, target_tokenizer, target_path, target) -> BaseProposer:
    from ...runtime import mlx_lm_adapter
    from ..heads.eagle3 import load_eagle3_head
    from .head import HeadProposer

    head, layers, embed = load_eagle3_head(target, config.draft_model_path)
    return HeadProposer(head, embed or mlx_lm_adapter.token_embedding(target), head.logits,
                        hidden_layers=layers, tree_width=config.tree_width)


def _is_eagle3(config: dict) -> bool:
    from ..heads.eagle3 import is_eagle3

    return is_eagle3(config)


def _dflash(config, target_tokenizer, target_path, target) -> BaseProposer:
    from ...runtime import mlx_lm_adapter
    from ..heads.dflash import load_dflash_head
    from .dflash import DFlashProposer

    head, layers, embed = load_dflash_head(target, config.draft_model_path)
    return DFlashProposer(head, embed or mlx_lm_adapter.token_embedding(target),
                          mlx_lm_adapter.output_projection(target), hidden_layers=layers)


def _is_dflash(config: dict) -> bool:
    from ..heads.dflash import is_dflash

    return is_dflash(config)


PROPOSERS = {kind.name: kind for kind in (
    DrafterKind("ngram", TEXT, _ngram, "prompt lookup: the request's own text, no extra model"),
    DrafterKind("suffix", TEXT, _suffix,
                "prompt lookup, else what earlier requests' outputs continued with"),
    DrafterKind("draft", DRAFT_MODEL, _draft,
                "a draft model sharing the target's tokenizer, in --draft-model",
                folder="the draft model's folder"),
    DrafterKind("mtp", TARGET_LAYER, _mtp,
                "the checkpoint's own multi-token-prediction layer: Qwen3.5/3.6, Qwen3-Next, "
                "the nextn layer of DeepSeek-V3 and GLM-4.5; or a split MTP drafter "
                "(model_type qwen3_5_mtp) in --draft-model",
                folder="a split MTP drafter's folder", recognises=_is_split_mtp),
    DrafterKind("eagle3", HEAD, _eagle3,
                "an EAGLE-3 head in the speculators format, in --draft-model",
                folder="the EAGLE-3 head's folder", recognises=_is_eagle3),
    DrafterKind("dflash", HEAD, _dflash,
                "a DFlash block drafter (z-lab format) in --draft-model: K drafts in one pass",
                folder="the DFlash drafter's folder", recognises=_is_dflash),
)}


def drafting_modes() -> tuple[str, ...]:
    """Every kind alone, each kind that runs a model followed by its mixes:
    a ``TEXT`` kind first, drafting for every row, the model for the rows
    where it keeps more tokens (``mixed.py``): ``ngram,draft``."""
    lookups = [kind.name for kind in PROPOSERS.values() if kind.drafts_with == TEXT]
    modes = []
    for kind in PROPOSERS.values():
        modes.append(kind.name)
        if kind.drafts_with != TEXT:
            modes += [f"{lookup},{kind.name}" for lookup in lookups]
    return tuple(modes)


def make_proposer(config, target_tokenizer=None, target_path: str = "target",
                  target=None) -> BaseProposer:
    """The proposer for a ``SpecDecodeConfig``: per row, a request's
    predicted output first, then the mode's kinds (``per_row.py``); a mix
    (``ngram,draft``) puts the cheap proposer and the model that drafts side
    by side, per row (``mixed.py``). ``target``: the served model (a head
    drafts from its hidden states; an MTP head shares its embedding and
    output projection)."""
    from .per_row import PerRowProposer

    if config.mode not in drafting_modes():
        raise ValueError(f"no proposer for --spec-decode {config.mode!r}")
    kinds = [PROPOSERS[n] for n in config.mode.split(",")]
    for kind in kinds:
        if kind.needs_target and target is None:
            raise ValueError(f"--spec-decode {kind.name} drafts from the target "
                             f"({kind.drafts_with}): no target given")
    # A mode is one kind, or a TEXT kind then a model's (``drafting_modes``).
    lookup = model = None
    names = {}
    for kind in kinds:
        built = kind.build(config, target_tokenizer, target_path, target)
        if kind.drafts_with == TEXT:
            lookup, names["lookup_name"] = built, kind.name
        else:
            model, names["model_name"] = built, kind.name
    return PerRowProposer(lookup, model, mode=config.mode, **names)
