"""Speculative decoding for a continuously batched generator.

``make_engine`` builds the ``SpecDecodeEngine`` (``engine.py``) for a config:
its proposer (``proposer/``), controller (``control/``), the rollbackable
caches it verifies with (``kv/``) and the verifier (``verifier.py``,
``grammar.py``).
"""

from __future__ import annotations

import logging
from typing import Optional

from ..kv import cannot_speculate
from ..parallel.distributed import SOLO
from .config import SpecDecodeConfig
from .engine import SpecDecodeEngine
from .proposer import make_proposer
from .proposer.base import FollowerStandIn

log = logging.getLogger("mlx_lm_server.spec_decode")


def make_engine(model, config: SpecDecodeConfig, tokenizer=None,
                model_path: str = "target", link=SOLO) -> Optional[SpecDecodeEngine]:
    """The engine for ``config``, or None: speculation off, or a model with a
    layer kind that speculation cannot roll back (said in one line; the model
    is then served with plain decoding rather than failing every request).

    In tensor parallel every rank runs the check (its passes are collective)
    and takes rank 0's answer; only rank 0 has a proposer (and loads a draft
    model): the others receive its drafts.
    """
    if not config.enabled:
        return None
    reason = cannot_speculate(model)
    reason = link.decide(lambda: reason)
    if reason:
        log.warning("speculative decoding off for %s: %s; serving with plain decoding",
                    model_path, reason)
        return None
    proposer = (make_proposer(config, tokenizer, model_path, model) if link.leader
                else FollowerStandIn())
    return SpecDecodeEngine(model, config, proposer, link=link)
