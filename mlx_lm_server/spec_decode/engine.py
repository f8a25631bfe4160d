"""``SpecDecodeEngine``: a drop-in for the generation batch's one-token step.

Each step, for the whole batch at once: the proposer drafts up to k tokens per
sequence; the target runs once over ``[pending, d_1..d_k]``; the verifier keeps
a prefix of each row's drafts; every row's KV cache rolls back to exactly what
it kept; each row emits 1..k+1 tokens. The token left pending for the next step
(the recovered or bonus token) sits where upstream's pipelined step keeps its
sampled-but-unfed token, so upstream's plain step can take over at any time
(no proposals, speculation switched off).

One module because a step reads in order (plan, pass, verdict, commit,
emit) and its fault path must undo exactly what the steps before it did;
the pieces each step calls live in their own modules.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..decoding.sampling import VERIFIER_STREAM, SamplingParams, request_key
from ..decoding.structured import Constraint
from ..kv import (Checkpoint, commit, install_recorders, key_length, longest_row,
                  make_rollbackable, realign, rollback, set_tree)
from ..parallel.distributed import SOLO
from ..runtime import mlx_lm_adapter
from .config import SpecDecodeConfig
from .control.calibration import calibrate_controller
from .control.controller import DynamicSpecController
from .control.costs import k_buckets, padded_k
from .control.gain import forced_run_cap
from .control.shadow import ShadowDrafts
from .control.step import StepReport
from .control.timing import StepTimer
from .drafts import Context, ProposalResult, pad_columns
from .grammar import apply_row_masks, draft_masks, grammar_drafts, settle
from .metrics import SpecStats, StepCounts
from .plan import LeaderPlan, StepPlan, emit
from .proposer.base import BaseProposer
from .proposer.draft_tree import holds_positions
from .target_probs import log_softmax, process_logits
from .tree import layout, pad_links
from .tree_step import (TreeChoice, along, chain_rows, cut_chains, kept_ranks, shape_trees,
                        verification_pass)
from .verifier import verify_rows

log = logging.getLogger("mlx_lm_server.spec_decode")

@dataclass
class _Row:
    """The engine's record of one request: everything a step needs of it
    (the proposer and the controller keep their own per-row state, added
    and removed with it)."""

    params: SamplingParams
    key: Optional[mx.array]  # the verifier's random stream (seeded requests)
    processors: list  # logits processors, grammars apart
    constraint: Optional[Constraint] = None  # the request's grammar
    logprobs: bool = False  # the request asked for per-token logprobs
    max_k: Optional[int] = None  # per-request cap on drafts (0: no speculation)


class SpecDecodeEngine:
    """Orchestrates one speculative step for the whole batch (see the
    module's docstring); what it decides with lives in ``control/``, what
    it drafts with in ``proposer/``, how caches roll back in the KV
    helpers, how drafts are judged in ``verifier.py`` (against the p that
    ``target_probs.py`` and ``grammar.py`` make), what a step emits in
    ``plan.py``."""

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
        self.controller = controller or DynamicSpecController.from_config(config)
        self.steps = StepCounts()
        self.stats = SpecStats(config.mode, self.steps, proposer)
        self.timer = StepTimer(self.controller, compiles=mx.default_device() != mx.cpu)
        self._rows: dict[int, _Row] = {}
        self._num_constrained = 0  # rows with a grammar
        self._gen = None
        self._pending_host: tuple = (None, None)
        self._shadow = ShadowDrafts()
        # Trees only where every layer places a node at its depth (said once).
        width = config.tree_width if holds_positions(model, "the target") else 1
        self.trees = TreeChoice(width, fixed=not config.dynamic)
        self._decided: Optional[LeaderPlan] = None  # rank 0's side of the current plan
        install_recorders(model)
        mlx_lm_adapter.attend_through_caches(model)  # short passes on CUDA: kv/unfused.py
        # The target's hidden states, for a proposer that drafts from them.
        self._hidden = (mlx_lm_adapter.capture_hidden(model, proposer.hidden_layers)
                        if proposer.needs_hidden else None)
        if self._hidden is not None:  # prompts' features too: the head attends to them
            self._hidden.on_prefill = proposer.observe_target

    # ---- the one door in and out for a request ---------------------------

    def add_sequence(self, uid: int, params: SamplingParams, prompt_len: int, *,
                     processors=(), logprobs: bool = False, max_k: Optional[int] = None,
                     constraint: Optional[Constraint] = None, prediction=(),
                     thinking=None) -> None:
        key = request_key(params, VERIFIER_STREAM)
        max_k = max_k if params.speculable else 0  # see SamplingParams.speculable
        self._rows[uid] = _Row(params, key, list(processors), constraint, logprobs, max_k)
        self._num_constrained += constraint is not None
        self.proposer.add_sequence(uid, prompt_len, params)
        # Its predicted output, drafted first (from the answer, past its reasoning).
        self.proposer.predict(uid, prediction, thinking)

    def remove_sequence(self, uid: int) -> None:
        row = self._rows.pop(uid, None)
        if row is not None:
            self._num_constrained -= row.constraint is not None
        self._shadow.forget(uid)
        self.proposer.remove_sequence(uid)
        self.controller.remove_sequence(uid)

    def install(self, gen) -> None:
        self._gen = gen
        self.timer.forget()
        mlx_lm_adapter.install_generation_step(gen, self.speculative_step)

    def calibrate(self, max_batch_size: int) -> None:
        """Compile and time the pass shapes (see ``control/calibration.py``)."""
        calibrate_controller(self.controller, self.model, max_batch_size,
                             self.config.most_drafts,
                             self.config.calibration_seconds, share=self.link.decide)

    def _prompts_in_prefill(self) -> int:
        """Prompts whose next prefill chunk runs after this step, in the same
        call (upstream decodes, then prefills); those held back this call
        (no free row, or over the prefill's token budget) are not counted."""
        if self._gen is None:
            return 0
        seqs = mlx_lm_adapter.sequences_in_generator(self._gen)
        return seqs["waiting"] + seqs["prefilling"]

    def _prompt_tokens(self) -> int:
        return mlx_lm_adapter.prompt_tokens_processed(self._gen) if self._gen is not None else 0

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
            pending = self._pending_list(mlx_lm_adapter.pending_tokens(batch))
            for i, c in constrained:
                c.sync(batch.tokens[i][c.prompt_len:] + [pending[i]])
        if self._hidden is None:
            return mlx_lm_adapter.plain_step(batch)
        uids = list(batch.uids)  # the step may drop finished rows
        out = mlx_lm_adapter.plain_step(batch)
        self.proposer.observe_target(uids, self._hidden.take(), [1] * len(uids))
        return out

    def speculative_step(self, batch) -> list:
        if self.link.leader:
            self.timer.step(time.perf_counter(), batch.uids, self._prompt_tokens())
        if not batch.uids:
            return []
        if self.link.size > 1:
            # Rank 0 decides (controller, proposer, grammars); the other ranks
            # receive its plan and never consult their own. Any failure here
            # is fatal to every rank (the scheduler stops them all).
            plan = self.link.decide(lambda: self._plan(batch))
            return self._plain(batch) if plan is None else self._verify_step(batch, plan)
        # One process: a failure before any token is emitted costs only this
        # step's speculation (the design's rule): the batch decodes plainly.
        try:
            plan = self._plan(batch)
        except Exception:
            log.exception("proposing failed; this step decodes plainly")
            return self._fault(batch)
        if plan is None:
            return self._plain(batch)
        return self._verify_step(batch, plan)

    def _fault(self, batch, caches=None, checkpoint=None, passed: int = 0) -> list:
        """Abandon a speculative step (its pass, of ``passed`` tokens per
        row, already run into the caches) and decode the batch plainly."""
        self.steps.fault_steps += 1
        self.timer.forget()
        if passed:
            set_tree(caches, None)  # a tree pass's mask would shape the plain step's
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
        # Before the decision, so that it rests on every token emitted so far.
        self._shadow.report_settled(self.controller, batch.uids, batch.tokens)
        constrained = self._constraints(batch)
        prefilling = self._prompts_in_prefill()
        decision = self.controller.choose(batch.uids, self._shadow.matching(batch.uids),
                                          grammar=bool(constrained), prefilling=prefilling)
        self.steps.decided(decision)
        log.debug("step: B=%d k=%d %s%s", len(batch.uids), decision.k, decision.reason,
                  "; priced as a batch with grammars" if constrained else "")
        # Speculation off this step, but grammars may force tokens: those
        # alone are verified (they are always kept) when there are at least
        # as many as rows and a pass over them, its runs capped, emits more
        # tokens per plain step than a plain step (``forced_run_cap``).
        # Neither the proposer nor the controller's decision takes part.
        forced_only = decision.k == 0 and bool(constrained)
        if forced_only and not self._forced_priced(B):
            return None  # before reading the pending tokens (a sync) or walking grammars
        if decision.k == 0 and not forced_only:
            if not decision.cannot_pay:
                # Drafts start after the fed tokens: the pending token is on
                # the device, and reading it would cost a sync.
                self._shadow.draft_while_off(self.controller, self.proposer.shadow, batch.uids,
                                             batch.tokens, self.config.num_speculative_tokens)
            return None
        self._shadow.clear()

        pending_list = self._pending_list(mlx_lm_adapter.pending_tokens(batch))
        tic = time.perf_counter()
        chain_ks = None  # each row's k where a tree's budget was asked for
        contexts = [Context(batch.tokens[i], pending_list[i]) for i in range(B)]
        if forced_only:
            ks = self._draft_lengths(batch, decision, self.config.num_speculative_tokens)
            proposal = ProposalResult.from_lists([[] for _ in range(B)], 1)
        else:
            width = self.trees.width
            ks = self._draft_lengths(batch, decision)
            if width > 1 and self.config.tree_budget:
                chain_ks, ks = ks, self._tree_budgets(batch, decision, ks)
            k = max(ks, default=0)
            self.proposer.price_step(lambda: self.controller.costs.verify_seconds(B, k))
            self.proposer.set_tree_shape(width, self.config.tree_budget and decision.k or None)
            proposal = self.proposer.propose(batch.uids, contexts, ks)
        # Trees priced by the controller's costs unless fixed; chains as drafted.
        draft_np, num_proposed, parents = shape_trees(
            batch, [self._row(uid) for uid in batch.uids], proposal, self.config.verify_mode,
            self.config.priced_trees and (lambda n: self.controller.costs.cost(
                B, padded_k(n, self.config.most_drafts))) or None)
        if chain_ks is not None:  # a row asked for a tree that drafted a chain: k deep
            draft_np, num_proposed = cut_chains(draft_np, num_proposed, parents, chain_ks)
        completes = []
        if constrained:
            draft_np, num_proposed, completes = grammar_drafts(
                batch.tokens, constrained, pending_list, draft_np, num_proposed, ks,
                one_hot=proposal.draft_probs is None)
        self.steps.time_propose += time.perf_counter() - tic
        if forced_only:
            cap = self._forced_cap(B, num_proposed, prefilling) if sum(num_proposed) >= B else 0
            if not cap:
                return None
            completes = [done and num_proposed[i] <= cap
                         for (i, _), done in zip(constrained, completes)]
            num_proposed = [min(n, cap) for n in num_proposed]
        if not any(num_proposed):
            self.controller.observe(StepReport(B, tuple(batch.uids), tuple(ks),
                                               tuple(num_proposed)))
            return None
        # Padded to a bucket: a bounded set of pass shapes; padding is never accepted.
        K = padded_k(max(num_proposed), self.config.most_drafts)
        self._decided = LeaderPlan(decision, ks, proposal.draft_probs, completes, constrained,
                                 contexts, proposal.sources, tic)
        return StepPlan(pending_list, pad_columns(draft_np, K), num_proposed, forced_only,
                        pad_links(parents, K))

    def _verify_step(self, batch, plan: "StepPlan") -> list:
        """The pass over ``[pending, drafts]``, rank 0's verdict, rollback, emit."""
        B = len(batch.uids)
        K = plan.drafts.shape[1]
        tic = time.perf_counter()
        draft = mx.array(plan.drafts)
        num_drafts = mx.array(plan.num_drafts, dtype=mx.int32)
        pending = mx.array(plan.pending, dtype=mx.int32)
        inputs = mx.concatenate([pending[:, None], mx.maximum(draft, 0)], axis=1)
        caches = make_rollbackable(batch.prompt_cache)
        first = self.timer.first_of_shape((B, K + 1, key_length(longest_row(caches) + K + 1)))
        tree = layout(plan.parents, plan.num_drafts)  # None: chains
        with Checkpoint(caches) as checkpoint:
            logits = verification_pass(self.model, inputs, caches, tree)  # [B, K+1, V]
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
        out_rows, accepted, kept = self.link.decide(lambda: verdict)
        elapsed = time.perf_counter() - tic
        self.steps.time_verify += elapsed
        if first:
            self.steps.time_verify_first += elapsed
        num_proposed = plan.num_drafts

        tic = time.perf_counter()
        path = None if kept is None else mx.array(kept)
        commit(caches, checkpoint, accepted, K + 1, path)
        logits = along(logits, path)  # [B, D+1, V]: the kept entries' logits, in order
        self.steps.tree_pass(plan.num_drafts, accepted, kept_ranks(plan.parents, kept, accepted))
        self.steps.time_rollback += time.perf_counter() - tic
        if self._hidden is not None and self.link.leader:
            # The pending token and the kept drafts entered the cache.
            self.proposer.observe_target(batch.uids, along(self._hidden.take(), path),
                                         [n + 1 for n in accepted])
        if self.link.leader:
            # A pass over forced tokens alone is charged too: the grammar
            # table prices its runs (``forced_run_cap``), and a pass of its
            # shape costs what a speculative one does.
            self.timer.verifying(K, charge=not first)
        if plan.forced_only:
            self.steps.forced_steps += 1
        elif self.link.leader:
            d = self._decided
            self.proposer.observe_verification(batch.uids, accepted)
            self.controller.observe(StepReport(B, tuple(batch.uids), tuple(d.ks),
                                               tuple(num_proposed), tuple(accepted),
                                               d.decision))
            self.trees.observe(B + sum(accepted), time.perf_counter() - d.started)
        self.steps.verify_steps += 1
        self.steps.bonus_tokens += sum(n == d > 0 for n, d in zip(accepted, num_proposed))

        sources = self._decided.sources if self.link.leader and not plan.forced_only else None
        old_logprobs = mlx_lm_adapter.pending_logprobs(batch)
        next_list = [out_rows[i][accepted[i]] for i in range(B)]
        new_pending = mx.array(next_list, dtype=mx.uint32)
        # Lazy: evaluated only by whoever reads them (upstream's next plain step).
        new_logprobs = log_softmax(logits[mx.arange(B), mx.array(accepted)])  # [B, V]
        mlx_lm_adapter.set_pending(batch, new_pending, list(new_logprobs))
        self._pending_host = (new_pending, next_list)
        return emit(batch, plan.pending, out_rows, accepted, old_logprobs, logits, num_proposed,
                    [self._row(uid).logprobs for uid in batch.uids], sources)

    def _judge(self, batch, plan: "StepPlan", logits, draft, num_drafts):
        """Rank 0's verdict on the pass, on the host: (processed logits, (ids
        [B][K+1], kept [B], a tree's kept input positions [B][D+1] or None))."""
        d = self._decided
        K = plan.drafts.shape[1]
        grammar_masks = None
        if d.constrained:
            # Filled on the host while the device runs the pass.
            mx.async_eval(logits)
            grammar_masks = draft_masks([c for _, c in d.constrained],
                                        [plan.drafts[i, :plan.num_drafts[i]].tolist()
                                         for i, _ in d.constrained], K, d.completes)
        rows = [self._row(uid) for uid in batch.uids]
        logits = process_logits(logits, [r.processors for r in rows], d.contexts, plan.drafts,
                                plan.num_drafts)
        if d.constrained:
            logits = apply_row_masks(logits, [i for i, _ in d.constrained], grammar_masks)
        draft_probs = d.draft_probs
        if draft_probs is not None and draft_probs.shape[1] < K:
            draft_probs = mx.pad(draft_probs, [(0, 0), (0, K - draft_probs.shape[1]), (0, 0)])
        tree = layout(plan.parents, plan.num_drafts)
        verdict = verify_rows(rows, logits, draft, num_drafts, draft_probs, tree=tree,
                              parents=plan.parents,
                              mode=self.config.verify_mode, max_k=self.config.most_drafts,
                              threshold=self.config.verify_threshold)
        # The step's one host synchronisation: [B, K+1] ids, [B] counts, a tree's paths.
        path = verdict.path
        mx.eval(verdict.output, verdict.num_accepted, *([] if path is None else [path]))
        out_rows = verdict.output.tolist()
        accepted = verdict.num_accepted.tolist()
        if d.constrained:
            settle(d.constrained, grammar_masks, out_rows, accepted)
        return logits, (out_rows, accepted, None if path is None else path.tolist())

    def _pending_list(self, pending: mx.array) -> list:
        """The pending tokens on the host; known without a sync after a verify step."""
        cached, values = self._pending_host
        if cached is pending:
            return values
        return pending.tolist()  # waits for a plain step's pass still running

    def _tree_budgets(self, batch, decision, ks: list) -> list:
        """``--spec-tree-budget`` nodes for the rows that speculate and may
        branch; a row that must draft a chain (``chain_rows``: a model's
        sampled drafts in the batch, penalties, a grammar, layers that hold
        no tree) keeps its k, or a budget of 32 would be a 32-deep chain."""
        rows = [self._row(uid) for uid in batch.uids]
        sampled = self.proposer.draft_model is not None and not all(r.params.greedy for r in rows)
        chains = set(chain_rows(batch, rows, sampled, self.config.verify_mode))
        nodes = self._draft_lengths(batch, decision, self.config.tree_budget)
        return [k if i in chains or not k else n for i, (k, n) in enumerate(zip(ks, nodes))]

    def _forced_priced(self, B: int) -> bool:
        """Whether a pass over forced tokens alone may run at this batch
        size: not before its plain steps are timed (its price is a prior)
        nor where it is priced on a floor known to be low (``priced_low``),
        for such a pass pays only if its price is right. On a CPU, with
        speculation off, these passes ran JSON to a schema at 8 clients at
        0.96x plain decoding, 1.02x with none."""
        costs = self.controller.costs
        return costs.has_plain(B) and not costs.priced_low(B)

    def _forced_cap(self, B: int, forced: list, prefilling: int) -> int:
        """The longest forced run a pass verifying forced tokens alone takes
        (0: a plain step), priced by the controller's grammar table; held
        under the first-token rule while prompts wait in prefill."""
        most = self.config.most_drafts
        longest = padded_k(max(forced), most)
        ks = [k for k in k_buckets(most) if k <= longest]
        limit = 1.0 + self.controller.first_token_delay if prefilling else math.inf
        return forced_run_cap(forced, ks, lambda k: self.controller.cost(B, k), limit)

    def _draft_lengths(self, batch, decision, k: Optional[int] = None) -> list:
        """Per row: the controller's k (or ``k``), capped by the request's
        own cap and by what the row may still emit after its pending token."""
        ks = []
        for i, uid in enumerate(batch.uids):
            row_k = decision.per_sequence_k.get(uid, decision.k) if k is None else k
            row_cap = self._row(uid).max_k
            if row_cap is not None:
                row_k = min(row_k, row_cap)
            ks.append(max(0, min(row_k, mlx_lm_adapter.tokens_left(batch, i) - 1)))
        return ks

    def _constraints(self, batch) -> list:
        """(row, Constraint) for every row with a grammar (none looked for
        while no sequence has one)."""
        if not self._num_constrained:
            return []
        rows = [self._row(uid) for uid in batch.uids]
        return [(i, r.constraint) for i, r in enumerate(rows) if r.constraint is not None]

    def _row(self, uid: int) -> _Row:
        row = self._rows.get(uid)
        if row is None:
            raise KeyError(f"sequence {uid} is in the batch but was never added to the "
                           "engine (add_sequence): its sampling parameters are unknown")
        return row
