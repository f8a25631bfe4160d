"""Proposers by ``--spec-decode`` mode: the one place that maps a mode to its class.

The base module knows no proposer; each proposer imports the base; this
registry imports the proposers.
"""

from __future__ import annotations

from .base import BaseProposer
from .draft_model import load_draft_proposer
from .mixed import MixedProposer
from .ngram import NGramProposer
from .suffix import SuffixProposer


def _ngram(config, target_tokenizer, target_path) -> BaseProposer:
    return NGramProposer(config.ngram_min, config.ngram_max, config.prompt_lookup)


def _suffix(config, target_tokenizer, target_path) -> BaseProposer:
    return SuffixProposer(config.ngram_min, config.ngram_max, config.prompt_lookup,
                          max_tokens=config.suffix_cache_tokens,
                          index_prompts=config.suffix_index_prompts)


def _draft(config, target_tokenizer, target_path) -> BaseProposer:
    return load_draft_proposer(config.draft_model_path, target_tokenizer, target_path,
                               config.draft_model_quantize)


PROPOSERS = {"ngram": _ngram, "suffix": _suffix, "draft": _draft}


def make_proposer(config, target_tokenizer=None, target_path: str = "target") -> BaseProposer:
    """The proposer for a ``SpecDecodeConfig``; ``lookup,draft`` modes mix
    a cheap proposer with the draft model per row (``mixed.py``)."""
    names = config.mode.split(",")
    if any(n not in PROPOSERS for n in names):
        raise ValueError(f"no proposer for --spec-decode {config.mode!r}")
    built = [PROPOSERS[n](config, target_tokenizer, target_path) for n in names]
    if len(built) == 1:
        return built[0]
    return MixedProposer(built[0], built[1], lookup_name=names[0])
