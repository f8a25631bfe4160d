"""The running batch of one rank: upstream's ``BatchGenerator`` with the
speculative engine in its decode step and the prompt cache beside it.

It changes only through ``join``, ``leave`` and ``step``. Rank 0's scheduler
records each join and leave as an op; a tensor-parallel follower applies the
same ops in the same order (``apply``) and so holds the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.generate import BatchGenerator

from ..decoding.sampling import make_processors, make_sampler
from ..decoding.structured import Constraint, GrammarProcessor, GrammarTokenizer
from ..parallel.distributed import LockstepError
from ..runtime.mlx_lm_adapter import next_within_cap, sequences_in_generator
from .request import GenerationRequest


@dataclass(frozen=True)
class Join:
    """A request entered the batch as ``uid``, ``cached`` prompt tokens
    taken from the prompt cache."""

    uid: int
    cached: int
    request: GenerationRequest


@dataclass(frozen=True)
class Leave:
    """Requests left the batch; their caches go to the prompt cache when
    ``store`` (they finished, they were not cancelled)."""

    uids: tuple
    store: bool


class RunningBatch:
    """Upstream's generator, the engine and the prompt cache, changed together."""

    def __init__(self, model, tokenizer, *, max_batch_size: int, prefill_batch_size: int,
                 prefill_step_size: int, engine=None, prompt_cache=None,
                 grammar_tokenizer: GrammarTokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_tokens = [[t] for t in sorted(tokenizer.eos_token_ids)]
        self.max_batch_size = max_batch_size
        # Upstream decodes max(completion, prefill batch size) at once: a
        # prefill batch above the cap would lift it.
        self.prefill_batch_size = min(prefill_batch_size, max_batch_size)
        self.prefill_step_size = prefill_step_size
        self.engine = engine
        self.prompt_cache = prompt_cache
        self.grammar_tokenizer = grammar_tokenizer
        self.ops: list = []  # joins and leaves since the last plan (rank 0)
        self.live: set = set()  # uids in the batch
        self.gen = self._new()

    def _new(self) -> BatchGenerator:
        gen = BatchGenerator(
            self.model,
            stop_tokens=self.eos_tokens,
            completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
        )
        if self.engine is not None:
            self.engine.install(gen)
        return gen

    def reset(self) -> None:
        """A fresh generator (the old one may be mid-step and inconsistent)."""
        try:
            self.gen.close()
        except Exception:
            pass
        self.gen = self._new()
        self.forget(list(self.live))

    def close(self) -> None:
        self.gen.close()
        if self.prompt_cache is not None:
            self.prompt_cache.close()  # its entries still waiting for the disk are written

    def counts(self) -> dict:
        return sequences_in_generator(self.gen)

    def join(self, req: GenerationRequest) -> tuple:
        """Put ``req`` into the batch: (uid, prompt tokens taken from the
        prompt cache, its grammar's Constraint or None)."""
        processors, constraint = make_processors(req.sampling), None
        upstream_processors = list(processors)
        if req.grammar is not None:
            constraint = Constraint(self.grammar_tokenizer, req.grammar, len(req.prompt_tokens))
            # Upstream's plain step applies it like any processor; the
            # engine keeps it apart (one mask per draft position).
            upstream_processors.append(GrammarProcessor(constraint))
        cache, cached = None, 0
        if self.prompt_cache is not None:
            cache, cached = self.prompt_cache.fetch(req.prompt_tokens)
        (uid,) = self.gen.insert(
            [req.prompt_tokens[cached:]],
            max_tokens=[req.max_tokens],
            caches=[cache],
            all_tokens=[req.prompt_tokens[:cached]],
            samplers=[make_sampler(req.sampling)],
            logits_processors=[upstream_processors],
        )
        if self.engine is not None:
            self.engine.add_sequence(uid, req.sampling, len(req.prompt_tokens),
                                     processors=processors,
                                     logprobs=req.top_logprobs is not None,
                                     max_k=req.max_draft_tokens, constraint=constraint,
                                     prediction=req.prediction or (),
                                     thinking=req.thinking)
        self.live.add(uid)
        self.ops.append(Join(uid, cached, req))
        return uid, cached, constraint

    def leave(self, uids: list, store: bool) -> None:
        """Take ``uids`` out of the batch (those upstream finished itself are
        out already: see ``finished``)."""
        if store and self.prompt_cache is not None:
            for cache, tokens in self.gen.extract_cache(uids).values():
                self.prompt_cache.store(tokens, cache)
        self.gen.remove(uids)
        self.forget(uids)
        self.ops.append(Leave(tuple(uids), store))

    def finished(self, response) -> None:
        """Upstream ended this sequence itself (EOS or ``max_tokens``) and
        removed it from its batch: keep its cache, forget its engine row."""
        if self.prompt_cache is not None:
            self.prompt_cache.store(response.all_tokens, response.prompt_cache)
        self.forget([response.uid])

    def forget(self, uids) -> None:
        self.live.difference_update(uids)
        if self.engine is not None:
            for uid in uids:
                self.engine.remove_sequence(uid)

    def step(self) -> list:
        """One ``next()`` of the generator (prefill, then a decode step):
        its responses."""
        _, responses = next_within_cap(self.gen)
        return responses

    def take_ops(self) -> list:
        ops, self.ops = self.ops, []
        return ops

    def apply(self, op, plan: int) -> None:
        """Rank 0's ``op`` on this rank (a follower): the same join must give
        the same uid and cache hit, or the ranks have diverged."""
        if isinstance(op, Join):
            uid, cached, _ = self.join(op.request)
            if (uid, cached) != (op.uid, op.cached):
                raise LockstepError(f"plan {plan}: rank 0 started request {op.uid} with "
                                    f"{op.cached} cached tokens, this rank {uid} with {cached}")
        else:
            self.leave(list(op.uids), op.store)
        self.ops.clear()  # a follower shares nothing
