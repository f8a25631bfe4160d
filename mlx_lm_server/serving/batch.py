"""The running batch of one rank: upstream's ``BatchGenerator`` with the
speculative engine in its decode step and the prompt cache beside it.

It changes only through ``join``, ``leave`` and ``step``. Rank 0's scheduler
records each join and leave as an op; a tensor-parallel follower applies the
same ops in the same order (``apply``) and so holds the same batch.

A prompt with images is prefilled by the model's vision tower
(``vision/tower.py``) into one sequence's caches as it joins, then handed to
the generator with its last token, as a prompt cache hit is; the prompt
cache keys it by its images' hashes (``GenerationRequest.cache_key``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from ..decoding.sampling import make_processors, make_sampler
from ..decoding.structured import Constraint, GrammarProcessor, GrammarTokenizer
from ..parallel.distributed import LockstepError
from ..runtime.mlx_lm_adapter import next_within_cap, sequences_in_generator
from .request import GenerationRequest


def prompts_within(step: int, budget: int) -> Callable[[list, list], int]:
    """How many waiting prompts (in order) join the prefill: while the next
    prefill step, its prompts padded to the longest chunk of ``step`` tokens
    among them, holds at most ``budget`` tokens; one at least when nothing
    is being prefilled. Where a step's time grows with its tokens (a CPU),
    prompts prefilled together give every one of them its first token when
    the last is done: four code-edit prompts of 1.4k-1.9k tokens together
    gave first tokens after 45.6 s (median), one after another by 24.7 s.
    Short prompts still go together (one step for a wave of chat prompts,
    where four apart cost chat 7%)."""

    def admit(prefilling: list, waiting: list) -> int:
        rows, width, taken = len(prefilling), max((min(n, step) for n in prefilling), default=0), 0
        for n in waiting:
            wider = max(width, min(n, step))
            if rows and (rows + 1) * wider > budget:
                break
            rows, width, taken = rows + 1, wider, taken + 1
        return taken

    return admit


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
                 grammar_tokenizer: GrammarTokenizer, vision=None):
        self.model = model
        # The model's vision tower (None: a text model, or its images refused).
        self.vision = vision
        # uid -> (prompt length, cache key) of the rows whose prompts held images.
        self.image_keys: dict = {}
        self.tokenizer = tokenizer
        self.eos_tokens = [[t] for t in sorted(tokenizer.eos_token_ids)]
        self.max_batch_size = max_batch_size
        # Upstream decodes max(completion, prefill batch size) at once: a
        # prefill batch above the cap would lift it.
        self.prefill_batch_size = min(prefill_batch_size, max_batch_size)
        self.prefill_step_size = prefill_step_size
        # A CPU prefills prompts one step's tokens at a time (``prompts_within``);
        # a GPU as upstream does, up to ``prefill_batch_size`` prompts a step.
        self.admit = (prompts_within(prefill_step_size, prefill_step_size)
                      if mx.default_device() == mx.cpu else None)
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
            cache, cached = self.prompt_cache.fetch(req.cache_key)
        fed = cached  # prompt tokens in the cache handed to the generator
        if req.images is not None and cached < req.images.end:
            if self.vision is None:
                raise RuntimeError("a prompt with images reached a batch without a vision tower")
            cache = cache if cache is not None else make_prompt_cache(self.model)
            self.vision.prefill(self.model, cache, req.prompt_tokens, req.images, cached,
                                self.prefill_step_size)
            fed = len(req.prompt_tokens) - 1
        (uid,) = self.gen.insert(
            [req.prompt_tokens[fed:]],
            max_tokens=[req.max_tokens],
            caches=[cache],
            all_tokens=[req.prompt_tokens[:fed]],
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
        if req.images is not None:
            self.image_keys[uid] = (len(req.prompt_tokens), tuple(req.cache_key))
        self.live.add(uid)
        self.ops.append(Join(uid, cached, req))
        return uid, cached, constraint

    def leave(self, uids: list, store: bool) -> None:
        """Take ``uids`` out of the batch (those upstream finished itself are
        out already: see ``finished``)."""
        if store and self.prompt_cache is not None:
            for uid, (cache, tokens) in self.gen.extract_cache(uids).items():
                self.prompt_cache.store(self._key(uid, tokens), cache)
        self.gen.remove(uids)
        self.forget(uids)
        self.ops.append(Leave(tuple(uids), store))

    def finished(self, response) -> None:
        """Upstream ended this sequence itself (EOS or ``max_tokens``) and
        removed it from its batch: keep its cache, forget its engine row."""
        if self.prompt_cache is not None:
            self.prompt_cache.store(self._key(response.uid, response.all_tokens),
                                    response.prompt_cache)
        self.forget([response.uid])

    def _key(self, uid: int, tokens) -> list:
        """What a finished row's cache is stored under: its tokens, the
        prompt's images named by their hashes."""
        if uid not in self.image_keys:
            return tokens
        num_prompt, key = self.image_keys[uid]
        return [*key, *list(tokens)[num_prompt:]]

    def forget(self, uids) -> None:
        self.live.difference_update(uids)
        for uid in uids:
            self.image_keys.pop(uid, None)
        if self.engine is not None:
            for uid in uids:
                self.engine.remove_sequence(uid)

    def step(self) -> list:
        """One ``next()`` of the generator (prefill, then a decode step):
        its responses."""
        _, responses = next_within_cap(self.gen, self.admit)
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
