"""Proposers by ``--spec-decode`` mode: the one place that maps a mode to its class.

The base module knows no proposer; each proposer imports the base; this
registry imports the proposers.
"""

from __future__ import annotations

from .base import BaseProposer
from .dflash import DFlashProposer
from .draft_model import load_draft_proposer
from .head import HeadProposer
from .mixed import MixedProposer
from .ngram import NGramProposer
from .suffix import SuffixProposer


def _ngram(config, target_tokenizer, target_path, target=None) -> BaseProposer:
    return NGramProposer(config.ngram_min, config.ngram_max, config.prompt_lookup)


def _suffix(config, target_tokenizer, target_path, target=None) -> BaseProposer:
    return SuffixProposer(config.ngram_min, config.ngram_max, config.prompt_lookup,
                          max_tokens=config.suffix_cache_tokens,
                          index_prompts=config.suffix_index_prompts)


def _draft(config, target_tokenizer, target_path, target=None) -> BaseProposer:
    return load_draft_proposer(config.draft_model_path, target_tokenizer, target_path,
                               config.draft_model_quantize)


def _mtp(config, target_tokenizer, target_path, target=None) -> BaseProposer:
    from ...runtime import mlx_lm_adapter
    from ..heads.mtp import load_mtp_head

    if target is None:
        raise ValueError("--spec-decode mtp drafts with the target's own layer: no target given")
    head = load_mtp_head(target, target_path, config.draft_model_path)
    return HeadProposer(head, mlx_lm_adapter.token_embedding(target),
                        head.projection(mlx_lm_adapter.output_projection(target)))


def _eagle3(config, target_tokenizer, target_path, target=None) -> BaseProposer:
    from ...runtime import mlx_lm_adapter
    from ..heads.eagle3 import load_eagle3_head

    if target is None:
        raise ValueError("--spec-decode eagle3 reads the target's hidden states: no target given")
    head, layers, embed = load_eagle3_head(target, config.draft_model_path)
    return HeadProposer(head, embed or mlx_lm_adapter.token_embedding(target), head.logits,
                        hidden_layers=layers)


def _dflash(config, target_tokenizer, target_path, target=None) -> BaseProposer:
    from ...runtime import mlx_lm_adapter
    from ..heads.dflash import load_dflash_head

    if target is None:
        raise ValueError("--spec-decode dflash reads the target's hidden states: no target given")
    head, layers, embed = load_dflash_head(target, config.draft_model_path)
    return DFlashProposer(head, embed or mlx_lm_adapter.token_embedding(target),
                          mlx_lm_adapter.output_projection(target), hidden_layers=layers)


PROPOSERS = {"ngram": _ngram, "suffix": _suffix, "draft": _draft, "mtp": _mtp,
             "eagle3": _eagle3, "dflash": _dflash}


def make_proposer(config, target_tokenizer=None, target_path: str = "target",
                  target=None) -> BaseProposer:
    """The proposer for a ``SpecDecodeConfig``; ``lookup,draft`` and
    ``lookup,mtp`` modes mix a cheap proposer with the model that drafts,
    per row (``mixed.py``). ``target``: the served model (an MTP head
    shares its embedding and output projection)."""
    names = config.mode.split(",")
    if any(n not in PROPOSERS for n in names):
        raise ValueError(f"no proposer for --spec-decode {config.mode!r}")
    built = [PROPOSERS[n](config, target_tokenizer, target_path, target) for n in names]
    if len(built) == 1:
        return built[0]
    return MixedProposer(built[0], built[1], lookup_name=names[0], model_name=names[1])
