"""``SpecDecodeEngine``: a drop-in for the generation batch's one-token step.

Each step, for the whole batch at once: the proposer drafts up to k tokens per
sequence; the target runs once over ``[pending, d_1..d_k]``; the verifier keeps
a prefix of each row's drafts; every row's KV cache rolls back to exactly what
it kept; each row emits 1..k+1 tokens. The token left pending for the next step
(the recovered or bonus token) sits where upstream's pipelined step keeps its
sampled-but-unfed token, so upstream's plain step can take over at any time
(no proposals, speculation switched off).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from .. import upstream
from ..sampling import SamplingParams, sampling_logits
from .cache_utils import ensure_ragged, rollback
from .config import SpecDecodeConfig
from .controller import DynamicSpecController, batch_bucket
from .proposer.base import BaseProposer, Context
from .rejection_sampler import rejection_sample
from .verifier import greedy_verify, rejection_verify_onehot, threshold_verify


# A plain step is timed (synchronously) once in this many per batch bucket.
PLAIN_TIMING_INTERVAL = 8


@dataclass
class SpecStats:
    """Counters over emitted tokens only: nothing after a stop is counted."""

    steps: int = 0  # verification passes
    bonus_tokens: int = 0  # (sequence, step) pairs that kept every draft
    fallback_steps: int = 0  # plain one-token steps
    num_drafts: int = 0  # (sequence, step) pairs that had a proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)
    time_propose: float = 0.0
    time_verify: float = 0.0
    time_rollback: float = 0.0

    def count_position(self, pos: int) -> None:
        while len(self.accepted_per_pos) <= pos:
            self.accepted_per_pos.append(0)
        self.accepted_per_pos[pos] += 1


@dataclass
class SpecResponse(upstream.GenerationResponse):
    """One emitted token, with where it came from.

    ``draft_position`` is None for the first token of a sequence's run in a
    step (the pending token) and j for its j-th accepted draft (0-based);
    ``num_drafted`` (on the first token only) is how many drafts were verified
    for the sequence in that step.
    """

    draft_position: Optional[int] = None
    num_drafted: int = 0


@dataclass
class _VerifyPeriod:
    """A verification step whose cost is known once the next step starts."""

    start: float
    batch_size: int
    k: int
    uids: set
    prompt_tokens: int


@dataclass
class _Row:
    params: SamplingParams
    key: Optional[mx.array]


class SpecDecodeEngine:
    def __init__(
        self,
        model,
        config: SpecDecodeConfig,
        proposer: BaseProposer,
        controller: Optional[DynamicSpecController] = None,
    ):
        self.model = model
        self.config = config
        self.proposer = proposer
        self.controller = controller or DynamicSpecController(
            config.num_speculative_tokens,
            alpha=config.ema_alpha,
            dynamic=config.dynamic,
            adaptive_k=config.adaptive_k,
            acceptance_threshold=config.acceptance_threshold,
            disable_by_batch_size=config.disable_by_batch_size,
        )
        self.stats = SpecStats()
        self._plain_steps: dict[int, int] = {}  # per batch bucket
        self._rows: dict[int, _Row] = {}
        self._gen = None
        self._open_period: Optional[_VerifyPeriod] = None

    # ---- sequence registry (called by the scheduler) ---------------------

    def add_sequence(self, uid: int, params: SamplingParams, prompt_len: int) -> None:
        key = mx.random.key(params.seed + 1) if params.seed is not None else None
        self._rows[uid] = _Row(params, key)
        self.proposer.add_sequence(uid, prompt_len, params)

    def remove_sequence(self, uid: int) -> None:
        self._rows.pop(uid, None)
        self.proposer.remove_sequence(uid)
        self.controller.remove_sequence(uid)

    def install(self, gen) -> None:
        self._gen = gen
        self._open_period = None
        upstream.install_generation_step(gen, self.speculative_step)

    def _prompt_tokens(self) -> int:
        return upstream.prompt_tokens_processed(self._gen) if self._gen is not None else 0

    def _close_period(self, batch, now: float) -> None:
        """Time the last verification step from its start to this step's start.

        That period, not the pass alone, is what replacing a plain step with a
        verification step costs: it also holds the wait for the pipelined
        plain pass before it and the emitting after it, both hidden behind the
        next pass in a run of plain steps (on a CPU a fifth of a step; the pass
        alone made one-token verification look as cheap as a plain step). A
        period that also prefilled or let sequences join is not a step's cost
        and is dropped.
        """
        period, self._open_period = self._open_period, None
        if period is None or self._prompt_tokens() != period.prompt_tokens:
            return
        if not period.uids.issuperset(batch.uids):
            return
        self.controller.observe_verify_step(period.batch_size, period.k, now - period.start)

    # ---- one step ----------------------------------------------------------

    def _plain(self, batch) -> list:
        self.stats.fallback_steps += 1
        B = len(batch.uids)
        bucket = batch_bucket(B)
        n = self._plain_steps[bucket] = self._plain_steps.get(bucket, -1) + 1
        if n % PLAIN_TIMING_INTERVAL:
            return upstream.plain_step(batch)
        # Timed alone: wait for the previous step's pass before, and for this
        # step's own pass after. Where evaluation is asynchronous, a plain step
        # returns before its pass is done and the next step pays for it; on
        # MLX's CPU backend it returns only when the pass is nearly done.
        # Either way the time below is this step's. Only every few plain steps
        # are timed, so pipelining is kept for the others.
        mx.eval(upstream.pending_tokens(batch))
        tic = time.perf_counter()
        out = upstream.plain_step(batch)
        mx.eval(upstream.pending_tokens(batch))
        self.controller.observe_plain_step(B, time.perf_counter() - tic)
        return out

    def speculative_step(self, batch) -> list:
        entry = time.perf_counter()
        self._close_period(batch, entry)
        B = len(batch.uids)
        if B == 0:
            return []
        decision = self.controller.choose(batch.uids)
        if decision.k == 0:
            return self._plain(batch)

        pending = upstream.pending_tokens(batch)
        pending_list = pending.tolist()  # waits for a plain step's pass still running
        tic = time.perf_counter()
        contexts = [Context(batch.tokens[i], pending_list[i]) for i in range(B)]
        # A row never needs more drafts than it may still emit after the pending token.
        ks = [
            max(0, min(decision.per_sequence_k.get(uid, decision.k),
                       upstream.tokens_left(batch, i) - 1))
            for i, uid in enumerate(batch.uids)
        ]
        proposal = self.proposer.propose(batch.uids, contexts, ks)
        self.stats.time_propose += time.perf_counter() - tic
        num_proposed = proposal.num_proposed.tolist()
        for uid, asked, got in zip(batch.uids, ks, num_proposed):
            if asked > 0:
                self.controller.observe_proposal(uid, got > 0)
        if not proposal.any:
            return self._plain(batch)

        tic = time.perf_counter()
        K = int(proposal.num_proposed.max())
        draft_np = proposal.draft_tokens[:, :K]
        num_drafts = mx.array(proposal.num_proposed)
        draft = mx.array(draft_np)
        inputs = mx.concatenate([pending[:, None].astype(mx.int32), mx.maximum(draft, 0)], axis=1)
        caches = ensure_ragged(batch.prompt_cache)
        logits = self.model(inputs, cache=caches)  # [B, K+1, V]
        logprobs = self._process(batch, logits, contexts, draft_np)
        output, num_accepted = self._verify(batch, logprobs, draft, num_drafts,
                                            proposal.draft_probs)
        mx.eval(output, num_accepted)
        out_rows = output.tolist()
        accepted = num_accepted.tolist()
        self.stats.time_verify += time.perf_counter() - tic
        self.proposer.observe_verification(batch.uids, accepted)

        tic = time.perf_counter()
        rollback(caches, [K - n for n in accepted])
        self.stats.time_rollback += time.perf_counter() - tic
        self._open_period = _VerifyPeriod(entry, B, K, set(batch.uids), self._prompt_tokens())
        for uid, drafted, n in zip(batch.uids, num_proposed, accepted):
            self.controller.observe_acceptance(uid, drafted, n)
        self.controller.observe_realisation(self.controller.predicted_tokens(batch.uids, ks),
                                            B + sum(accepted))

        old_logprobs = upstream.pending_logprobs(batch)
        rows = mx.arange(B)
        n_arr = mx.array(accepted)
        new_pending = mx.array([out_rows[i][accepted[i]] for i in range(B)], dtype=mx.uint32)
        new_logprobs = logprobs[rows, n_arr]  # [B, V]
        upstream.set_pending(batch, new_pending, list(new_logprobs))
        mx.async_eval(new_pending, new_logprobs)
        self.stats.steps += 1
        return self._emit(batch, pending_list, out_rows, accepted, old_logprobs, logprobs,
                          num_proposed)

    def _process(self, batch, logits, contexts, draft_np) -> mx.array:
        """Log-probabilities after each row's logits processors, position by position."""
        logits = logits.astype(mx.float32)
        if any(batch.logits_processors):
            rows = []
            for i, processors in enumerate(batch.logits_processors):
                if not processors:
                    rows.append(logits[i])
                    continue
                positions = []
                base = contexts[i].tolist()
                for j in range(logits.shape[1]):
                    # The context grows by one draft token per position.
                    ctx = mx.array(base + [int(t) for t in draft_np[i, :j]], dtype=mx.int32)
                    row = logits[i, j][None]
                    for p in processors:
                        row = p(ctx, row)
                    positions.append(row[0])
                rows.append(mx.stack(positions))
            logits = mx.stack(rows)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _row(self, uid: int) -> _Row:
        row = self._rows.get(uid)
        if row is None:  # a sequence nobody registered: treat as greedy
            row = self._rows[uid] = _Row(SamplingParams(temperature=0.0), None)
        return row

    def _draw(self, row: _Row, shape, kind: str) -> mx.array:
        key = None
        if row.key is not None:
            row.key, key = mx.random.split(row.key)
        if kind == "uniform":
            return mx.random.uniform(shape=shape, key=key)
        return mx.random.gumbel(shape=shape, key=key)

    def _verify(self, batch, logprobs, draft, num_drafts, draft_probs=None):
        B, K1, V = logprobs.shape
        K = K1 - 1
        rows = [self._row(uid) for uid in batch.uids]
        greedy_ids = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # [B, K+1]
        mode = self.config.verify_mode
        # Draws have a fixed shape per row (the most drafts a step can have),
        # so a seeded row's randomness does not depend on its batch.
        max_k = self.config.num_speculative_tokens
        if mode == "threshold":
            target_ids, probs = [], []
            for i, row in enumerate(rows):
                if row.params.greedy:
                    target_ids.append(greedy_ids[i])
                    probs.append(mx.exp(logprobs[i]))
                else:
                    logits = sampling_logits(row.params, logprobs[i])
                    g = self._draw(row, (max_k + 1, V), "gumbel")[:K1]
                    target_ids.append(mx.argmax(logits + g, axis=-1).astype(mx.int32))
                    probs.append(mx.softmax(logits, axis=-1))
            probs = mx.stack(probs)
            p_draft = mx.take_along_axis(probs[:, :K], mx.maximum(draft, 0)[..., None], axis=2)[..., 0]
            return threshold_verify(mx.stack(target_ids), p_draft, draft, num_drafts,
                                    self.config.verify_threshold)

        out, n = greedy_verify(greedy_ids, draft, num_drafts)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if mode == "greedy" or not sampled:
            return out, n
        idx = mx.array(sampled)
        probs = mx.stack([mx.softmax(sampling_logits(rows[i].params, logprobs[i]), axis=-1)
                          for i in sampled])
        uniforms = mx.stack([self._draw(rows[i], (max_k,), "uniform")[:K] for i in sampled])
        gumbels = mx.stack([self._draw(rows[i], (V,), "gumbel") for i in sampled])
        if draft_probs is None:  # deterministic drafts: one-hot q
            s_out, s_n = rejection_verify_onehot(probs, draft[idx], num_drafts[idx],
                                                 uniforms, gumbels)
        else:
            q = _fit_vocab(draft_probs[idx][:, :K], V)
            s_out, s_n = rejection_sample(probs, q, draft[idx], num_drafts[idx], uniforms,
                                          gumbels)
        mask = mx.zeros((B,), mx.bool_)
        mask[idx] = True
        full_out = mx.zeros_like(out)
        full_out[idx] = s_out
        full_n = mx.zeros_like(n)
        full_n[idx] = s_n
        return mx.where(mask[:, None], full_out, out), mx.where(mask, full_n, n)

    def _emit(self, batch, pending, out_rows, accepted, old_logprobs, logprobs, num_proposed):
        """Emit the pending token and the accepted drafts, honouring stops mid-run."""
        responses, keep = [], []
        for i, uid in enumerate(list(batch.uids)):
            tokens = [pending[i]] + out_rows[i][: accepted[i]]
            finish = None
            emitted_drafts = 0
            for j, token in enumerate(tokens):
                lp = old_logprobs[i] if j == 0 else logprobs[i, j - 1]
                finish = upstream.count_and_match(batch, i, token)
                responses.append(SpecResponse(
                    uid, token, lp, finish, None, None,
                    draft_position=None if j == 0 else j - 1,
                    num_drafted=num_proposed[i] if j == 0 else 0,
                ))
                if j > 0:
                    emitted_drafts += 1
                if finish is not None:
                    break
            upstream.record_fed_tokens(batch, i, tokens)
            stats = self.stats
            stats.num_emitted_tokens += 1 + emitted_drafts
            if num_proposed[i] > 0:
                stats.num_drafts += 1
                stats.bonus_tokens += int(accepted[i] == num_proposed[i])
                stats.num_draft_tokens += num_proposed[i]
                stats.num_accepted_tokens += emitted_drafts
                for pos in range(emitted_drafts):
                    stats.count_position(pos)
            if finish is None:
                keep.append(i)
        if len(keep) < len(batch.uids):
            batch.filter(keep)
        return responses


def _fit_vocab(q: mx.array, V: int) -> mx.array:
    """The draft's vocabulary axis padded or cut to the target's logits width."""
    if q.shape[-1] == V:
        return q
    if q.shape[-1] > V:
        return q[..., :V]
    return mx.concatenate([q, mx.zeros(q.shape[:-1] + (V - q.shape[-1],), q.dtype)], axis=-1)


def make_engine(model, config: SpecDecodeConfig, tokenizer=None,
                model_path: str = "target") -> Optional[SpecDecodeEngine]:
    if not config.enabled:
        return None
    from .proposer.base import make_proposer

    return SpecDecodeEngine(model, config, make_proposer(config, tokenizer, model_path))

