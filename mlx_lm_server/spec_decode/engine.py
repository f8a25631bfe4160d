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

import logging
import time
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from .. import upstream
from ..sampling import VERIFIER_STREAM, SamplingParams, request_key, sampling_logits
from ..structured import (GrammarProcessor, allowed_counts, apply_masks, constrain_drafts,
                          draft_masks, grammar_of)
from ..distributed import SOLO
from .cache_utils import key_length, longest_row, make_rollbackable, realign, rollback
from .config import SpecDecodeConfig, k_buckets, padded_k
from .controller import DynamicSpecController, StepReport, batch_bucket
from .metrics import StepCounts
from .proposer.base import PLACEHOLDER_TOKEN, BaseProposer, Context, ProposalResult
from .recurrent import Checkpoint, install_recorders
from .shadow import ShadowDrafts
from .verifier import SampledRows, draw_noise, threshold_verify, verify


log = logging.getLogger("mlx_lm_server.spec_decode")

# A plain step is timed (synchronously) once in this many per batch bucket
# until the bucket's cost window is full, then once in SETTLED_...: each timing
# drains the pipeline (on a GPU the device idles while the host emits), and a
# settled median needs only to follow slow drift (a growing context).
PLAIN_TIMING_INTERVAL = 8
SETTLED_PLAIN_TIMING_INTERVAL = 64


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
    first_of_shape: bool = False


@dataclass
class StepPlan:
    """What every rank needs for one verification step (shared in tensor parallel)."""

    pending: list  # [B] tokens sampled, not yet fed
    drafts: np.ndarray  # [B, K] drafts, padded with placeholders to a k bucket
    num_drafts: list  # [B] real drafts per row
    forced_only: bool  # only grammar-forced drafts (speculation itself off)


@dataclass
class _Decided:
    """Rank 0's side of a plan: what only the deciding rank needs."""

    decision: object
    ks: list
    draft_probs: Optional[mx.array]
    completes: list
    constrained: list
    contexts: list


@dataclass
class _Row:
    params: SamplingParams
    key: Optional[mx.array]
    logprobs: bool = False  # the request asked for per-token logprobs
    max_k: Optional[int] = None  # per-request cap on drafts (0: no speculation)


class SpecDecodeEngine:
    def __init__(
        self,
        model,
        config: SpecDecodeConfig,
        proposer: BaseProposer,
        controller: Optional[DynamicSpecController] = None,
        link=SOLO,
    ):
        self.model = model
        # Tensor parallel: rank 0's decisions reach the other ranks through it.
        self.link = link
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
        self.steps = StepCounts()
        self._plain_steps: dict[int, int] = {}  # per batch bucket
        self._rows: dict[int, _Row] = {}
        self._constrained: set = set()  # uids with a grammar
        self._gen = None
        self._open_period: Optional[_VerifyPeriod] = None
        self._pending_host: tuple = (None, None)
        self._shapes_seen: set = set()
        self._shadow = ShadowDrafts()
        install_recorders(model)
        # Return a finished sequence's caches and tokens (for a prompt cache).
        self.keep_finished_caches = False

    # ---- sequence registry (called by the scheduler) ---------------------

    def add_sequence(self, uid: int, params: SamplingParams, prompt_len: int, *,
                     logprobs: bool = False, max_k: Optional[int] = None,
                     constrained: bool = False) -> None:
        if constrained:  # its grammar is among its logits processors
            self._constrained.add(uid)
        key = request_key(params, VERIFIER_STREAM)
        if not params.speculable:  # see SamplingParams.speculable
            max_k = 0
        self._rows[uid] = _Row(params, key, logprobs, max_k)
        self.proposer.add_sequence(uid, prompt_len, params)

    def remove_sequence(self, uid: int) -> None:
        self._constrained.discard(uid)
        self._shadow.forget(uid)
        self._rows.pop(uid, None)
        self.proposer.remove_sequence(uid)
        self.controller.remove_sequence(uid)

    def install(self, gen) -> None:
        self._gen = gen
        self._open_period = None
        upstream.install_generation_step(gen, self.speculative_step)

    def calibrate(self, max_batch_size: int) -> None:
        """Compile and time the pass shapes at each batch bucket (within the
        configured budget) and seed the controller's costs with them."""
        budget = self.config.calibration_seconds
        if budget <= 0 or not self.controller.dynamic:
            return
        from .calibration import calibrate

        sizes = sorted({batch_bucket(b) for b in range(1, max_batch_size + 1)})
        ks = k_buckets(self.config.num_speculative_tokens)
        for B, (plain, verify) in calibrate(self.model, sizes, ks, budget,
                                            share=self.link.decide).items():
            self.controller.costs.calibrate(B, verify, plain)

    def _first_of_shape(self, shape: tuple) -> bool:
        """Whether a pass of this shape runs for the first time (compiling:
        its time says nothing about the next one)."""
        new = shape not in self._shapes_seen
        self._shapes_seen.add(shape)
        return new

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
        if period is None or period.first_of_shape:
            return
        if self._prompt_tokens() != period.prompt_tokens:
            return
        if not period.uids.issuperset(batch.uids):
            return
        self.controller.observe(StepReport(period.batch_size, k=period.k,
                                           seconds=now - period.start))

    # ---- one step ----------------------------------------------------------

    def _plain(self, batch) -> list:
        self.steps.plain_steps += 1
        # Rows a verification step left ragged would make this and every
        # later plain step scatter into the whole cache: align them once.
        realign(batch.prompt_cache)
        constrained = self._constraints(batch)
        if constrained:
            # The grammars take the tokens this step feeds now, so that
            # their masks fill while the forward runs (see GrammarProcessor).
            pending = self._pending_list(upstream.pending_tokens(batch))
            for i, c in constrained:
                c.sync(batch.tokens[i][c.prompt_len:] + [pending[i]])
        B = len(batch.uids)
        bucket = batch_bucket(B)
        n = self._plain_steps[bucket] = self._plain_steps.get(bucket, -1) + 1
        costs = self.controller.costs
        settled = costs.plain_count(B) >= costs.window
        if n % (SETTLED_PLAIN_TIMING_INTERVAL if settled else PLAIN_TIMING_INTERVAL) \
                or not self.link.leader:
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
        self.controller.observe(StepReport(B, k=0, seconds=time.perf_counter() - tic))
        return out

    def speculative_step(self, batch) -> list:
        entry = time.perf_counter()
        if self.link.leader:
            self._close_period(batch, entry)
        if not batch.uids:
            return []
        if self.link.size > 1:
            # Rank 0 decides (controller, proposer, grammars); the other ranks
            # receive its plan and never consult their own. Any failure here
            # is fatal to every rank (the scheduler stops them all).
            plan = self.link.decide(lambda: self._plan(batch))
            return self._plain(batch) if plan is None else self._verify_step(batch, plan, entry)
        # One process: a failure before any token is emitted costs only this
        # step's speculation (the design's rule): the batch decodes plainly.
        try:
            plan = self._plan(batch)
        except Exception:
            log.exception("proposing failed; this step decodes plainly")
            return self._fault(batch)
        if plan is None:
            return self._plain(batch)
        return self._verify_step(batch, plan, entry)

    def _fault(self, batch, caches=None, checkpoint=None, passed: int = 0) -> list:
        """Abandon a speculative step (its pass, of ``passed`` tokens per
        row, already run into the caches) and decode the batch plainly."""
        self.steps.fault_steps += 1
        self._open_period = None
        if passed:
            rollback(caches, [passed] * len(batch.uids))
            checkpoint.restore()
        try:
            self.proposer.observe_verification(batch.uids, [0] * len(batch.uids))
        except Exception:
            log.exception("the proposer could not take back its drafts")
        return self._plain(batch)

    def _plan(self, batch) -> Optional["StepPlan"]:
        """This step's drafts, or None for a plain step (rank 0 only)."""
        B = len(batch.uids)
        self._settle_shadow_drafts(batch)
        decision = self.controller.choose(batch.uids)
        self.steps.decided(decision)
        constrained = self._constraints(batch)
        # Speculation off this step, but grammars may force tokens: those
        # alone are verified (they are always kept) when there are at least
        # as many as rows, since a pass over them costs little more than a
        # plain step. Neither the proposer nor the controller takes part.
        forced_only = decision.k == 0 and bool(constrained)
        if decision.k == 0 and not forced_only:
            if not decision.cannot_pay:
                self._shadow_drafts(batch)
            return None
        self._shadow.clear()

        pending_list = self._pending_list(upstream.pending_tokens(batch))
        tic = time.perf_counter()
        contexts = [Context(batch.tokens[i], pending_list[i]) for i in range(B)]
        if forced_only:
            ks = self._draft_lengths(batch, decision, self.config.num_speculative_tokens)
            proposal = ProposalResult.from_lists([[] for _ in range(B)], 1)
        else:
            ks = self._draft_lengths(batch, decision)
            proposal = self.proposer.propose(batch.uids, contexts, ks)
        draft_np, num_proposed = proposal.draft_tokens, proposal.num_proposed.tolist()
        completes = []
        if constrained:
            draft_np, num_proposed, completes = self._grammar_drafts(
                batch, constrained, pending_list, draft_np, num_proposed, ks,
                one_hot=proposal.draft_probs is None)
        self.steps.time_propose += time.perf_counter() - tic
        if forced_only and sum(num_proposed) < B:
            return None
        if not any(num_proposed):
            self.controller.observe(StepReport(B, tuple(batch.uids), tuple(ks),
                                               tuple(num_proposed)))
            return None
        # Padded to a bucket: a bounded set of pass shapes; padding is never accepted.
        K = padded_k(max(num_proposed), self.config.num_speculative_tokens)
        self._decided = _Decided(decision, ks, proposal.draft_probs, completes, constrained,
                                 contexts)
        return StepPlan(pending_list, _pad_columns(draft_np, K), num_proposed, forced_only)

    def _verify_step(self, batch, plan: "StepPlan", entry: float) -> list:
        """The pass over ``[pending, drafts]``, rank 0's verdict, rollback, emit."""
        B = len(batch.uids)
        K = plan.drafts.shape[1]
        tic = time.perf_counter()
        draft = mx.array(plan.drafts)
        num_drafts = mx.array(plan.num_drafts, dtype=mx.int32)
        pending = mx.array(plan.pending, dtype=mx.int32)
        inputs = mx.concatenate([pending[:, None], mx.maximum(draft, 0)], axis=1)
        caches = make_rollbackable(batch.prompt_cache)
        first = self._first_of_shape((B, K + 1, key_length(longest_row(caches) + K + 1)))
        with Checkpoint(caches) as checkpoint:
            logits = self.model(inputs, cache=caches)  # [B, K+1, V]
        verdict = None
        if self.link.size > 1:
            if self.link.leader:
                logits, verdict = self._judge(batch, plan, logits, draft, num_drafts)
            else:
                mx.eval(logits)  # its all-reduces before the verdict's, as on rank 0
        else:
            try:
                logits, verdict = self._judge(batch, plan, logits, draft, num_drafts)
            except Exception:
                log.exception("verification failed; this step decodes plainly")
                return self._fault(batch, caches, checkpoint, K + 1)
        out_rows, accepted = self.link.decide(lambda: verdict)
        self.steps.time_verify += time.perf_counter() - tic
        num_proposed = plan.num_drafts

        tic = time.perf_counter()
        rollback(caches, [K - n for n in accepted])
        checkpoint.rollback([n + 1 for n in accepted], K + 1)
        self.steps.time_rollback += time.perf_counter() - tic
        if plan.forced_only:
            self.steps.forced_steps += 1
        elif self.link.leader:
            d = self._decided
            self.proposer.observe_verification(batch.uids, accepted)
            self._open_period = _VerifyPeriod(entry, B, K, set(batch.uids),
                                              self._prompt_tokens(), first)
            self.controller.observe(StepReport(B, tuple(batch.uids), tuple(d.ks),
                                               tuple(num_proposed), tuple(accepted),
                                               d.decision))
        self.steps.verify_steps += 1
        self.steps.bonus_tokens += sum(n == d > 0 for n, d in zip(accepted, num_proposed))

        old_logprobs = upstream.pending_logprobs(batch)
        next_list = [out_rows[i][accepted[i]] for i in range(B)]
        new_pending = mx.array(next_list, dtype=mx.uint32)
        # Lazy: evaluated only by whoever reads them (upstream's next plain step).
        new_logprobs = _log_softmax(logits[mx.arange(B), mx.array(accepted)])  # [B, V]
        upstream.set_pending(batch, new_pending, list(new_logprobs))
        self._pending_host = (new_pending, next_list)
        return self._emit(batch, plan.pending, out_rows, accepted, old_logprobs, logits,
                          num_proposed)

    def _judge(self, batch, plan: "StepPlan", logits, draft, num_drafts):
        """Rank 0's verdict on the pass: (processed logits, (ids [B][K+1], kept [B]))."""
        d = self._decided
        K = plan.drafts.shape[1]
        grammar_masks = None
        if d.constrained:
            # Filled on the host while the device runs the pass.
            mx.async_eval(logits)
            grammar_masks = draft_masks([c for _, c in d.constrained],
                                        [plan.drafts[i, :plan.num_drafts[i]].tolist()
                                         for i, _ in d.constrained], K, d.completes)
        logits = self._process(batch, logits, d.contexts, plan.drafts)
        if d.constrained:
            logits = _apply_row_masks(logits, [i for i, _ in d.constrained], grammar_masks)
        draft_probs = d.draft_probs
        if draft_probs is not None and draft_probs.shape[1] < K:
            draft_probs = mx.pad(draft_probs, [(0, 0), (0, K - draft_probs.shape[1]), (0, 0)])
        output, num_accepted = self._verify(batch, logits, draft, num_drafts, draft_probs)
        # The step's one host synchronisation: [B, K+1] ids and [B] counts.
        mx.eval(output, num_accepted)
        out_rows = output.tolist()
        accepted = num_accepted.tolist()
        for r, (i, c) in enumerate(d.constrained):
            c.consume(out_rows[i][: accepted[i]])
            # The emitted positions only: counting costs a pass over their masks.
            c.forced += int((allowed_counts(grammar_masks[r, : accepted[i] + 1]) == 1).sum())
        return logits, (out_rows, accepted)

    def _settle_shadow_drafts(self, batch) -> None:
        """What the tokens emitted since the last step say of the open shadow
        drafts (see ``shadow.py``), told before this step is decided."""
        settled = self._shadow.settle(batch.uids, batch.tokens)
        if settled:  # acceptance only: the proposals were counted when asked
            uids, drafted, kept = zip(*settled)
            self.controller.observe(StepReport(len(batch.uids), uids, (0,) * len(uids),
                                               drafted, kept))

    def _shadow_drafts(self, batch) -> None:
        """While off, what a cheap proposer's drafts would have kept (see
        ``shadow.py``). Drafts start after the fed tokens: the pending token
        is on the device, and reading it would cost a sync."""
        c = self.controller
        B = len(batch.uids)
        if not self.proposer.cheap or not c.dynamic or c.capped(B):
            return
        proposals = self._shadow.ask(batch.uids, batch.tokens,
                                     self.config.num_speculative_tokens, self.proposer.propose)
        if proposals:
            uids, asked, got = zip(*proposals)
            self.controller.observe(StepReport(B, uids, asked, got))

    def _pending_list(self, pending: mx.array) -> list:
        """The pending tokens on the host; known without a sync after a verify step."""
        cached, values = self._pending_host
        if cached is pending:
            return values
        return pending.tolist()  # waits for a plain step's pass still running

    def _draft_lengths(self, batch, decision, k: Optional[int] = None) -> list:
        """Per row: the controller's k (or ``k``), capped by the request's own
        cap and by what the row may still emit after its pending token."""
        ks = []
        for i, uid in enumerate(batch.uids):
            row_k = decision.per_sequence_k.get(uid, decision.k) if k is None else k
            row_cap = self._row(uid).max_k
            if row_cap is not None:
                row_k = min(row_k, row_cap)
            ks.append(max(0, min(row_k, upstream.tokens_left(batch, i) - 1)))
        return ks

    def _constraints(self, batch) -> list:
        """(row, Constraint) for every row with a grammar (none looked for
        while no sequence has one)."""
        if not self._constrained:
            return []
        return [(i, c) for i, ps in enumerate(batch.logits_processors)
                if ps and (c := grammar_of(ps)) is not None]

    def _grammar_drafts(self, batch, constrained, pending_list, draft_np, num_proposed, ks,
                        one_hot: bool):
        """Each constrained row's drafts walked through its grammar (see
        ``structured.constrain_drafts``), its grammar first brought to the
        tokens fed so far and the pending token."""
        rows, completes = {}, []
        for i, c in constrained:
            c.sync(batch.tokens[i][c.prompt_len:] + [pending_list[i]])
            drafts = draft_np[i, :num_proposed[i]].tolist()
            rows[i], done = constrain_drafts(c, drafts, ks[i], one_hot)
            completes.append(done)
        width = max([draft_np.shape[1]] + [len(d) for d in rows.values()])
        out = _pad_columns(draft_np, width).copy()
        num_proposed = list(num_proposed)
        for i, d in rows.items():
            out[i] = PLACEHOLDER_TOKEN
            out[i, : len(d)] = d
            num_proposed[i] = len(d)
        return out, num_proposed, completes

    def _process(self, batch, logits, contexts, draft_np) -> mx.array:
        """Logits after each row's logits processors (grammars apart: their
        masks are computed for all positions at once). Normalising is left to
        the rows and positions that need it (sampled rows, asked-for
        logprobs): at temperature 0 nothing vocabulary-sized is computed
        beyond the argmax."""
        processors_of = [[p for p in ps if not isinstance(p, GrammarProcessor)]
                         for ps in batch.logits_processors]
        if any(processors_of):
            rows = []
            for i, processors in enumerate(processors_of):
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
        return logits

    def _row(self, uid: int) -> _Row:
        row = self._rows.get(uid)
        if row is None:
            raise KeyError(f"sequence {uid} is in the batch but was never added to the "
                           "engine (add_sequence): its sampling parameters are unknown")
        return row

    def _noise(self, rows: list, draws: list) -> list:
        """Random draws for these rows (see ``verifier.draw_noise``), advancing their keys."""
        out, keys = draw_noise([r.key for r in rows], draws)
        for r, key in zip(rows, keys):
            r.key = key
        return out

    def _xtc_draws(self, rows: list, indices) -> dict:
        """Each XTC row's draw for the one token it samples this step (such
        rows never have drafts, so only their first position is used)."""
        out = {}
        for i in indices:
            if rows[i].params.xtc_probability > 0:
                (u,) = self._noise([rows[i]], [("uniform", (1,))])
                out[i] = u[0, 0]
        return out

    def _verify(self, batch, logits, draft, num_drafts, draft_probs=None):
        B, K1, V = logits.shape
        K = K1 - 1
        rows = [self._row(uid) for uid in batch.uids]
        # Upstream's greedy step takes the argmax of log-probabilities; the
        # shift by logsumexp keeps the order (it can only round a near-tie
        # into a tie), so the raw logits give the same choice without
        # normalising [B, K+1, V].
        greedy_ids = mx.argmax(logits, axis=-1).astype(mx.int32)  # [B, K+1]
        # Draws have a fixed shape per row (the most drafts a step can have),
        # so a seeded row's randomness does not depend on its batch.
        max_k = self.config.num_speculative_tokens
        if self.config.verify_mode == "threshold":
            return self._verify_threshold(rows, logits, greedy_ids, draft, num_drafts)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if self.config.verify_mode == "greedy" or not sampled:
            return verify(greedy_ids, draft, num_drafts)
        draws = self._xtc_draws(rows, sampled)
        probs = mx.stack([
            mx.softmax(sampling_logits(rows[i].params, _log_softmax(logits[i]), draws.get(i)),
                       axis=-1)
            for i in sampled])
        uniforms, gumbels = self._noise([rows[i] for i in sampled],
                                        [("uniform", (max_k,)), ("gumbel", (V,))])
        q = None
        if draft_probs is not None:
            q = _fit_vocab(draft_probs[mx.array(sampled)][:, :K], V)
        return verify(greedy_ids, draft, num_drafts,
                      SampledRows(sampled, probs, uniforms[:, :K], gumbels, q))

    def _verify_threshold(self, rows, logits, greedy_ids, draft, num_drafts):
        """Lossy, asked for by name: a draft the target finds likely enough is kept."""
        K1, V = logits.shape[1:]
        K = K1 - 1
        max_k = self.config.num_speculative_tokens
        target_ids, probs = [], []
        for i, row in enumerate(rows):
            if row.params.greedy:
                target_ids.append(greedy_ids[i])
                probs.append(mx.softmax(logits[i].astype(mx.float32), axis=-1))
            else:
                row_logits = sampling_logits(row.params, _log_softmax(logits[i]),
                                             self._xtc_draws(rows, [i]).get(i))
                (g,) = self._noise([row], [("gumbel", (max_k + 1, V))])
                target_ids.append(mx.argmax(row_logits + g[0, :K1], axis=-1).astype(mx.int32))
                probs.append(mx.softmax(row_logits, axis=-1))
        probs = mx.stack(probs)
        p_draft = mx.take_along_axis(probs[:, :K], mx.maximum(draft, 0)[..., None], axis=2)[..., 0]
        return threshold_verify(mx.stack(target_ids), p_draft, draft, num_drafts,
                                self.config.verify_threshold)

    def _emit(self, batch, pending, out_rows, accepted, old_logprobs, logits, num_proposed):
        """Emit the pending token and the accepted drafts, honouring stops mid-run."""
        responses, keep = [], []
        for i, uid in enumerate(list(batch.uids)):
            tokens = [pending[i]] + out_rows[i][: accepted[i]]
            finish = None
            # Normalising and slicing [V] rows per token: only when asked for.
            row_logprobs = _log_softmax(logits[i]) if self._row(uid).logprobs else None
            for j, token in enumerate(tokens):
                lp = old_logprobs[i] if j == 0 else (
                    None if row_logprobs is None else row_logprobs[j - 1])
                finish = upstream.count_and_match(batch, i, token)
                responses.append(SpecResponse(
                    uid=uid, token=token, logprobs=lp, finish_reason=finish,
                    prompt_cache=None, all_tokens=None,
                    draft_position=None if j == 0 else j - 1,
                    num_drafted=num_proposed[i] if j == 0 else 0,
                ))
                if finish is not None:
                    break
            upstream.record_fed_tokens(batch, i, tokens)
            if finish is None:
                keep.append(i)
            elif self.keep_finished_caches:  # holds exactly the tokens fed
                responses[-1].prompt_cache = [c.extract(i) for c in batch.prompt_cache]
                responses[-1].all_tokens = list(batch.tokens[i])
        if len(keep) < len(batch.uids):
            batch.filter(keep)
        return responses


def _log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities in float32 (sampling filters and probabilities need the precision)."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _apply_row_masks(logits: mx.array, rows: list, masks) -> mx.array:
    """``logits`` [B, K+1, V] with rows' grammar masks [R, K+1, words] applied."""
    masked = apply_masks(logits[mx.array(rows)], masks)
    if len(rows) == logits.shape[0]:
        return masked
    out = list(logits)
    for r, i in enumerate(rows):
        out[i] = masked[r]
    return mx.stack(out)


def _pad_columns(draft_np, K: int):
    """[B, k] drafts padded with placeholders to [B, K]."""
    B, k = draft_np.shape
    if k >= K:
        return draft_np[:, :K]
    return np.concatenate([draft_np, np.full((B, K - k), PLACEHOLDER_TOKEN, draft_np.dtype)], 1)


def _fit_vocab(q: mx.array, V: int) -> mx.array:
    """The draft's vocabulary axis padded or cut to the target's logits width."""
    if q.shape[-1] == V:
        return q
    if q.shape[-1] > V:
        return q[..., :V]
    return mx.concatenate([q, mx.zeros(q.shape[:-1] + (V - q.shape[-1],), q.dtype)], axis=-1)


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
    from .proposer import make_proposer
    from .proposer.base import Followed
    from .support import cannot_speculate

    reason = cannot_speculate(model)
    reason = link.decide(lambda: reason)
    if reason:
        log.warning("speculative decoding off for %s: %s; serving with plain decoding",
                    model_path, reason)
        return None
    proposer = make_proposer(config, tokenizer, model_path) if link.leader else Followed()
    return SpecDecodeEngine(model, config, proposer, link=link)
