"""Mutation checks: break one line where a silent bug costs users most, run
only the tests that claim to guard it, and report whether they noticed.

Each mutant replaces one exact piece of source (it must occur exactly once)
and names its tests; the file is restored after each run, whatever happens.
A mutant is "killed" when its tests fail, "survived" when they pass.

    .venv/bin/python scripts/mutants.py             # every mutant (about 8 minutes)
    .venv/bin/python scripts/mutants.py cancel-noop accept-all-draft
    .venv/bin/python scripts/mutants.py --list

Tests marked slow run too (``--run-slow``): some guards are long by nature.
Run it on a tree without uncommitted changes to the mutated files. Exit
status 1 when any mutant survived.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple


MUTANTS = [
    Mutant("cancel-noop", "mlx_lm_server/serving/scheduler.py",
           "        self.intake.put(partial(self._drop, handle))",
           "        pass",
           ("tests/server/test_server.py::test_cancel_half_of_the_streams",
            "tests/server/test_server_robustness.py::test_disconnect_mid_prefill_and_non_streaming_timeout")),
    Mutant("accept-all-draft", "mlx_lm_server/spec_decode/verifier.py",
           "accept = mx.where(mx.isnan(p_d) | mx.isnan(q_d), False, accept)",
           "accept = mx.ones(p_d.shape, mx.bool_)",
           ("tests/model/test_mixed_proposer.py::"
            "test_sampled_rows_keep_the_target_distribution_from_either_proposer",)),
    Mutant("accept-all-ngram", "mlx_lm_server/spec_decode/verifier.py",
           "accept = uniforms < p_d", "accept = uniforms < 2.0",
           ("tests/pure/test_rejection_sampler.py",
            "tests/model/test_spec_engine.py::test_sampled_tokens_follow_the_filtered_distribution")),
    Mutant("greedy-accept-all", "mlx_lm_server/spec_decode/verifier.py",
           "match = (draft == target_ids[:, :-1]) & valid_mask(draft, num_drafts)",
           "match = valid_mask(draft, num_drafts)",
           ("tests/pure/test_verifier.py",)),
    Mutant("kv-trim-off-by-one", "mlx_lm_server/kv/dispatch.py",
           "rollback(caches, [pass_length - 1 - n for n in accepted])",
           "rollback(caches, [pass_length - 2 - n for n in accepted])",
           ("tests/model/test_spec_engine.py::test_greedy_parity_batch_1",)),
    Mutant("draft-kv-trim-off-by-one", "mlx_lm_server/spec_decode/proposer/draft_model.py",
           "drops.append((K - 1) - kept[-1])", "drops.append((K - 2) - kept[-1])",
           ("tests/model/test_draft_model.py::test_smollm2_as_its_own_draft_accepts_nearly_everything",)),
    Mutant("queue-limit", "mlx_lm_server/serving/intake.py",
           "if self.num_queued >= self.max_queued_requests:",
           "if self.num_queued > self.max_queued_requests:",
           ("tests/server/test_server_robustness.py::test_the_queue_limit_is_exact",
            "tests/server/test_server_robustness.py::test_queue_full_is_429_with_retry_after")),
    Mutant("seed-ignored", "mlx_lm_server/decoding/sampling.py",
           "return None if params.seed is None else mx.random.key((params.seed + stream) % 2**64)",
           "return None",
           ("tests/model/test_spec_engine.py::test_seeded_sampling_is_reproducible_with_fixed_speculation",
            "tests/server/test_server.py::test_seed_makes_sampling_reproducible")),
    Mutant("stop-string-missed", "mlx_lm_server/serving/request_output.py",
           "stop_at = find_stop(self.text, self.sent, self.stops) if self.stops else -1",
           "stop_at = -1",
           ("tests/model/test_spec_engine.py::test_eos_max_tokens_and_stop_inside_drafts",
            "tests/server/test_server.py::test_stop_string")),
    Mutant("logprobs-wrong-position", "mlx_lm_server/spec_decode/plan.py",
           "None if row_logprobs is None else row_logprobs[j - 1])",
           "None if row_logprobs is None else row_logprobs[j])",
           ("tests/server/test_spec_metrics.py::test_logprobs_of_accepted_drafts_are_their_own_positions",
            "tests/server/test_server.py::test_logprobs_are_correct")),
    Mutant("usage-count", "mlx_lm_server/serving/request_output.py",
           "self.completion_tokens += 1",
           "self.completion_tokens += 1 + (self.completion_tokens == 3)",
           ("tests/server/test_server.py::test_max_tokens_one_at_64_way_concurrency",
            "tests/server/test_server.py::test_openai_client_sync")),
    Mutant("metrics-counter", "mlx_lm_server/http/prometheus.py",
           '"that were emitted", value=c.num_accepted_tokens)',
           '"that were emitted", value=c.num_draft_tokens)',
           ("tests/server/test_spec_metrics.py::test_metrics_are_consistent_and_exclude_tokens_after_a_stop",)),
    Mutant("controller-stuck-off", "mlx_lm_server/spec_decode/control/controller.py",
           "if best_gain >= 1.0 + margin:", "if False:",
           ("tests/pure/test_controller.py",)),
    Mutant("controller-stuck-on", "mlx_lm_server/spec_decode/control/controller.py",
           "if best_gain >= 1.0 + margin:", "if True:",
           ("tests/pure/test_controller.py",)),
    Mutant("batch-size-fallback", "mlx_lm_server/spec_decode/control/controller.py",
           "return cap is not None and batch_size >= cap", "return False",
           ("tests/pure/test_controller.py::test_batch_cap_is_hard",
            "tests/model/test_spec_engine.py::test_disable_by_batch_size_falls_back_to_plain_steps")),
    Mutant("tokenizer-compat-skipped", "mlx_lm_server/spec_decode/proposer/draft_model.py",
           "def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:\n",
           "def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:\n"
           "    return\n",
           ("tests/model/test_draft_model.py::test_incompatible_tokenizer_is_refused",)),
    Mutant("grammar-unmasked-verify", "mlx_lm_server/spec_decode/engine.py",
           "logits = apply_row_masks(logits, [i for i, _ in d.constrained], grammar_masks)",
           "pass",
           ("tests/server/test_structured.py::test_sampled_constrained_output_keeps_the_exact_distribution",)),
    Mutant("batch-cap", "mlx_lm_server/serving/batch.py",
           "completion_batch_size=self.max_batch_size,",
           "completion_batch_size=2 * self.max_batch_size,",
           ("tests/server/test_server_robustness.py::test_the_batch_cap_holds_while_saturated",)),
    Mutant("tp-follower-ignores-leaves", "mlx_lm_server/serving/batch.py",
           "            self.leave(list(op.uids), op.store)",
           "            pass",
           ("tests/processes/test_tensor_parallel.py::test_lockstep_through_joins_cancels_stops_and_long_prompts",)),
    Mutant("tp-unseeded-sampling", "mlx_lm_server/parallel/follower.py",
           "    if sampling.greedy or sampling.seed is not None:",
           "    if True:",
           ("tests/processes/test_tensor_parallel.py::test_lockstep_through_joins_cancels_stops_and_long_prompts",)),
    Mutant("tp-follower-own-pending", "mlx_lm_server/spec_decode/engine.py",
           "pending = mx.array(plan.pending, dtype=mx.int32)",
           "pending = (mx.array(plan.pending, dtype=mx.int32) if self.link.leader else "
           "mx.zeros(len(plan.pending), mx.int32))",
           ("tests/processes/test_tensor_parallel.py::test_lockstep_through_joins_cancels_stops_and_long_prompts",)),
    Mutant("tp-plan-overflow-dropped", "mlx_lm_server/parallel/distributed.py",
           "if n > HEADER_BYTES - 8:", "if False:",
           ("tests/processes/test_tensor_parallel.py::test_lockstep_through_joins_cancels_stops_and_long_prompts",)),
    Mutant("tp-failure-leaves-streams-open", "mlx_lm_server/serving/scheduler.py",
           "        self.intake.close_all(ErrorEvent(f\"tensor parallel stopped: {reason}\",\n"
           "                                         code=\"distributed_failure\"))",
           "        pass",
           ("tests/processes/test_tensor_parallel.py::test_a_killed_rank_ends_streams_with_an_error_and_every_rank_exits",)),
    Mutant("cap-overshoot-while-prefilling", "mlx_lm_server/runtime/mlx_lm_adapter/accessors.py",
           "    if len(waiting) <= n:", "    if True:",
           ("tests/model/test_upstream_adapter.py::test_the_batch_cap_holds_while_prompts_are_prefilled",)),
    Mutant("fault-fails-requests", "mlx_lm_server/spec_decode/engine.py",
           "                return self._fault(batch, caches, checkpoint, K + 1)",
           "                raise",
           ("tests/server/test_server_robustness.py::test_a_failing_speculative_step_decodes_plainly",)),
    Mutant("draft-row-kept-after-leave", "mlx_lm_server/spec_decode/proposer/draft_model.py",
           "        if uid in self.uids:  # its cache row goes now", "        if False:  # its cache row goes now",
           ("tests/processes/test_soak.py::test_cancel_soak_leaves_nothing_behind[draft]",)),
    Mutant("idle-memory-kept", "mlx_lm_server/serving/scheduler.py",
           "            if self._stepped and not self._seqs:", "            if False:",
           ("tests/processes/test_soak.py::test_cancel_soak_leaves_nothing_behind[ngram]",)),
    Mutant("draft-past-its-context", "mlx_lm_server/spec_decode/proposer/draft_model.py",
           "        if len(fit) < B:", "        if False:",
           ("tests/model/test_draft_model.py::test_a_sequence_past_the_drafts_context_is_decoded_plainly",)),
    Mutant("top-p-rounds-to-zero", "mlx_lm_server/decoding/sampling.py",
           "        if 0 < self.top_p < TINY:", "        if False:",
           ("tests/server/test_request_fields.py::test_values_float32_cannot_carry_are_taken_at_their_limit",)),
    Mutant("verify-ignores-top-p-min-p", "mlx_lm_server/spec_decode/target_probs.py",
           "sampling_logits(rows[members[0]].params, log_softmax(rows_logits),",
           "sampling_logits(__import__('dataclasses').replace(rows[members[0]].params, "
           "top_p=1.0, min_p=0.0), log_softmax(rows_logits),",
           ("tests/model/test_spec_engine.py::test_sampled_tokens_follow_the_filtered_distribution",)),
    Mutant("penalty-context-not-grown", "mlx_lm_server/spec_decode/target_probs.py",
           "row = p(tokens[: len(context) + j], row)", "row = p(tokens[: len(context)], row)",
           ("tests/model/test_spec_engine.py::test_processors_see_the_context_grow_by_each_draft",)),
    Mutant("controller-never-tries-untimed-k", "mlx_lm_server/spec_decode/control/controller.py",
           "if self._explored.get(key, 0) >= self.explore_tries:", "if True:",
           ("tests/pure/test_controller.py",)),
    Mutant("realign-keeps-left-padding", "mlx_lm_server/kv/ragged.py",
           "        self.left_padding = self.left_padding + shift", "        pass",
           ("tests/model/test_kv.py::test_realigned_rows_decode_through_upstreams_path_and_stay_exact",)),
    Mutant("rollback-keeps-rope-positions", "mlx_lm_server/kv/rows.py",
           "        self.offset = self.offset - mx.array(num_drop)\n", "",
           ("tests/model/test_kv.py::test_ragged_rollback_matches_reference",
            "tests/tiny/test_hybrid_caches.py::test_rollback_leaves_each_row_as_plain_decoding_of_its_kept_tokens[gemma3_text]")),
    Mutant("recurrent-replay-keeps-every-token", "mlx_lm_server/kv/recurrent.py",
           "_put_back(cache, states, left_padding, mx.array(list(keep)))",
           "_put_back(cache, states, left_padding, None)",
           ("tests/tiny/test_hybrid_caches.py::test_rollback_leaves_each_row_as_plain_decoding_of_its_kept_tokens",)),
    Mutant("plain-step-left-ragged", "mlx_lm_server/spec_decode/engine.py",
           "        realign(batch.prompt_cache)", "        pass",
           ("tests/model/test_spec_engine.py::test_plain_steps_after_ragged_verification_run_on_aligned_rows",)),
    Mutant("shadow-waits-for-decision", "mlx_lm_server/spec_decode/control/shadow.py",
           "if n > reported:", "if False:",
           ("tests/model/test_shadow.py",)),
    Mutant("verification-not-charged-its-recovery", "mlx_lm_server/spec_decode/control/timing.py",
           "owed.seconds = owed.seconds + cycle - plain if clean and plain else None",
           "owed.seconds = owed.seconds if clean and plain else None",
           ("tests/model/test_step_timing.py::test_a_verification_is_charged_its_cycle_and_what_the_plain_steps_after_it_pay",)),
    Mutant("engine-never-says-it-verifies", "mlx_lm_server/spec_decode/engine.py",
           "            self.timer.verifying(K, charge=not first)\n", "",
           ("tests/model/test_step_timing.py::test_the_engine_times_every_step_from_its_start",)),
    Mutant("forced-pass-timed-as-plain", "mlx_lm_server/spec_decode/engine.py",
           "                self.timer.verifying(K, charge=False)\n", "",
           ("tests/model/test_step_timing.py::test_passes_over_grammar_forced_tokens_are_no_plain_steps",)),
    Mutant("calibration-table-in-order", "mlx_lm_server/spec_decode/control/calibration.py",
           "rounds = (ends, [k for k in sorted(ks) if k not in ends])",
           "rounds = (sorted(ks), [])",
           ("tests/server/test_verify_step.py::test_calibration_prices_the_ends_of_every_bucket_before_the_middle",)),
    Mutant("uncalibrated-bucket-priced-by-prior", "mlx_lm_server/spec_decode/control/costs.py",
           "            return borrowed or 1.0 + PRIOR_COST_PER_TOKEN * k",
           "            return 1.0 + PRIOR_COST_PER_TOKEN * k",
           ("tests/server/test_verify_step.py::test_a_bucket_the_calibration_missed_borrows_the_largest_smaller_ones_line",)),
    Mutant("cancelled-waiter-stays-waiting", "mlx_lm_server/serving/kv_budget.py",
           "            if id(handle) == handle_id:\n", "            if False:\n",
           ("tests/server/test_memory_budget.py::test_a_request_cancelled_while_waiting_for_room_leaves_and_never_runs",)),
    Mutant("xtc-left-out-of-verification", "mlx_lm_server/decoding/sampling.py",
           "    if params.xtc_probability > 0.0:\n        if xtc_draw is None:",
           "    if False:\n        if xtc_draw is None:",
           ("tests/server/test_request_fields.py::test_an_xtc_request_is_sampled_with_xtc_inside_verification_steps",)),
    Mutant("verify-groups-take-one-rows-filters", "mlx_lm_server/spec_decode/target_probs.py",
           "sampling_logits(rows[members[0]].params,", "sampling_logits(rows[indices[0]].params,",
           ("tests/pure/test_rejection_sampler.py::test_rows_that_filter_alike_are_verified_together_as_one_at_a_time",)),
    Mutant("seeded-draws-never-split-the-key", "mlx_lm_server/spec_decode/target_probs.py",
           "        key, sub = mx.random.split(key)\n        out.append(", "        sub = key\n        out.append(",
           ("tests/pure/test_rejection_sampler.py::test_rows_that_filter_alike_are_verified_together_as_one_at_a_time",)),
    Mutant("namespaced-call-loses-its-namespace", "mlx_lm_server/http/responses_answer.py",
           "            item.update(name=tool.name, namespace=tool.namespace)", "            pass",
           ("tests/server/test_agent_apis.py::test_a_namespaced_function_is_called_by_its_own_name",)),
    Mutant("custom-tool-called-as-function", "mlx_lm_server/http/responses_answer.py",
           "if tool is not None and tool.custom:", "if False:",
           ("tests/server/test_agent_apis.py::test_a_custom_tool_call_is_its_text",)),
    Mutant("uvicorn-bind-failure-aborts", "mlx_lm_server/server.py",
           "    except SystemExit:  # uvicorn", "    except KeyError:  # uvicorn",
           ("tests/server/test_server_robustness.py::test_a_port_in_use_is_an_error_and_exit_1",)),
    Mutant("probes-where-no-k-can-pay", "mlx_lm_server/spec_decode/control/controller.py",
           "if ceilings[ceiling_k] < 1.0 + self.margin_on \\", "if ceilings[ceiling_k] < 0 \\",
           ("tests/pure/test_controller.py",)),
    Mutant("no-k-can-pay-on-calibration", "mlx_lm_server/spec_decode/control/controller.py",
           "                    and self.costs.observed(B, ceiling_k) >= 3:",
           "                    and True:",
           ("tests/pure/test_controller.py",)),
    Mutant("probe-floor-on-calibration", "mlx_lm_server/spec_decode/control/probes.py",
           "if not self.budget or not self.costs.observed_any(batch_size):",
           "if not self.budget:",
           ("tests/pure/test_controller.py",)),
    Mutant("shadow-drafts-where-no-k-can-pay", "mlx_lm_server/spec_decode/engine.py",
           "            if not decision.cannot_pay:", "            if True:",
           ("tests/model/test_shadow.py::test_no_shadow_drafts_where_no_k_can_pay",)),
    Mutant("no-draft-step-priced-as-pass", "mlx_lm_server/spec_decode/control/gain.py",
           "return 1.0 + (1.0 - none_drafts) * (cost - 1.0)", "return cost",
           ("tests/pure/test_controller.py",)),
    Mutant("realisation-not-floored", "mlx_lm_server/spec_decode/control/gain.py",
           "return max(self.floor, self.value)", "return self.value",
           ("tests/pure/test_controller.py",)),
    Mutant("realisation-counts-prior-rows", "mlx_lm_server/spec_decode/control/controller.py",
           "if drafted > 0 and uid in d.own:", "if drafted > 0:",
           ("tests/pure/test_controller.py",)),
    Mutant("realisation-counts-rows-without-drafts", "mlx_lm_server/spec_decode/control/controller.py",
           "if drafted > 0 and uid in d.own:", "if uid in d.own:",
           ("tests/pure/test_controller.py",)),
    Mutant("shadow-settles-after-decision", "mlx_lm_server/spec_decode/engine.py",
           "        self._shadow.report_settled(self.controller, batch.uids, batch.tokens)\n"
           "        constrained = self._constraints(batch)\n"
           "        decision = self.controller.choose(batch.uids, self._shadow.matching(batch.uids),\n"
           "                                          grammar=bool(constrained),\n"
           "                                          prefilling=self._prompts_in_prefill())\n",
           "        constrained = self._constraints(batch)\n"
           "        decision = self.controller.choose(batch.uids, self._shadow.matching(batch.uids),\n"
           "                                          grammar=bool(constrained),\n"
           "                                          prefilling=self._prompts_in_prefill())\n"
           "        self._shadow.report_settled(self.controller, batch.uids, batch.tokens)\n",
           ("tests/model/test_shadow.py::test_a_shadow_draft_counts_in_the_very_next_decision",)),
    Mutant("matching-rows-unseen", "mlx_lm_server/spec_decode/engine.py",
           "self.controller.choose(batch.uids, self._shadow.matching(batch.uids),",
           "self.controller.choose(batch.uids, frozenset(),",
           ("tests/model/test_shadow.py::"
            "test_a_run_of_matching_text_verifies_before_the_acceptance_estimate_learns_of_it",)),
    Mutant("grammar-steps-priced-with-the-rest", "mlx_lm_server/spec_decode/engine.py",
           "grammar=bool(constrained),", "grammar=False,",
           ("tests/model/test_step_timing.py::"
            "test_passes_over_grammar_forced_tokens_are_no_plain_steps",)),
    Mutant("one-cost-table-for-grammar-steps", "mlx_lm_server/spec_decode/control/costs.py",
           "self._plain, self._verify = self._kinds[grammar]",
           "self._plain, self._verify = self._kinds[False]",
           ("tests/pure/test_controller.py::"
            "test_steps_with_a_grammar_row_are_timed_and_priced_apart",)),
    Mutant("prompts-in-prefill-held-behind-a-pass", "mlx_lm_server/spec_decode/control/controller.py",
           "if (fresh or prefilling) and decision.k", "if fresh and decision.k",
           ("tests/pure/test_controller.py::"
            "test_a_step_before_a_prefill_chunk_is_plain_where_a_pass_would_hold_that_prompt_back",)),
    Mutant("prompts-in-prefill-unseen", "mlx_lm_server/spec_decode/engine.py",
           "prefilling=self._prompts_in_prefill())", "prefilling=0)",
           ("tests/model/test_step_timing.py::"
            "test_each_step_is_chosen_knowing_the_prompts_whose_prefill_chunk_follows_it",)),
    Mutant("rows-without-drafts-unheard", "mlx_lm_server/spec_decode/control/gain.py",
           "return [k for k in ks if fair_gain(estimates, k, costs[k], rho) >= 1.0]",
           "return list(ks)",
           ("tests/pure/test_controller.py::"
            "test_a_pass_for_some_rows_only_is_held_to_what_it_costs_the_others",)),
    Mutant("one-plain-step-prices-a-bucket", "mlx_lm_server/spec_decode/control/costs.py",
           "return self.plain_count(batch_size) >= SETTLED_SAMPLES",
           "return self.plain_count(batch_size) > 0",
           ("tests/model/test_step_timing.py::"
            "test_a_verification_before_three_plain_steps_at_its_bucket_prices_nothing",
            "tests/pure/test_controller.py::test_each_batch_bucket_times_plain_steps_first")),
    Mutant("calibration-rescaled-per-k", "mlx_lm_server/spec_decode/control/costs.py",
           "if k in bare or (len(bare) > 1 and k > min(bare)) for s in t.samples]",
           "if k in bare and t.count >= SETTLED_SAMPLES for s in t.samples]",
           ("tests/pure/test_controller.py::"
            "test_the_calibration_is_rescaled_by_every_real_step_of_its_bucket_whatever_its_k",)),
    Mutant("matching-override-scaled-by-rho", "mlx_lm_server/spec_decode/control/controller.py",
           "self._gain(estimates, k, costs[k], rho=1.0)", "self._gain(estimates, k, costs[k])",
           ("tests/pure/test_controller.py",)),
    Mutant("matching-override-switches-on", "mlx_lm_server/spec_decode/control/controller.py",
           "        if gain < 1.0 + self.margin_on:\n            return None\n",
           "        if gain < 1.0 + self.margin_on:\n            return None\n"
           "        self.speculating = True\n",
           ("tests/pure/test_controller.py",)),
    Mutant("matching-override-on-calibration", "mlx_lm_server/spec_decode/control/controller.py",
           "or not self.costs.has_plain(B) or not self.costs.priced_by_real_steps(B):",
           "or not self.costs.has_plain(B):",
           ("tests/pure/test_controller.py",)),
    Mutant("matching-shared-by-every-row", "mlx_lm_server/spec_decode/control/estimates.py",
           "a = self._estimate(self.matching_of, self.matching_acceptance.value, uid,",
           "a = self._estimate({}, self.matching_acceptance.value, uid,",
           ("tests/pure/test_controller.py::"
            "test_a_row_is_priced_at_its_own_matching_drafts_once_it_has_two",)),
    Mutant("matching-learns-from-every-row", "mlx_lm_server/spec_decode/control/controller.py",
           "                if uid in matching:\n                    self.observe_matching(uid, drafted, n)",
           "                self.observe_matching(uid, drafted, n)",
           ("tests/pure/test_controller.py",)),
    Mutant("matching-shadow-rest-unlearned", "mlx_lm_server/spec_decode/control/shadow.py",
           "                if m:\n                    controller.observe_matching(uid, d, n)",
           "                pass",
           ("tests/model/test_shadow.py",)),
    Mutant("api-key-unchecked", "mlx_lm_server/http/guards.py",
           'scope["path"] in OPEN_PATHS or self._allowed(scope)',
           'scope["path"] in OPEN_PATHS or True',
           ("tests/server/test_api_key.py::test_without_the_key_every_route_is_a_401",)),
    Mutant("lone-surrogate-accepted", "mlx_lm_server/http/openai_schema.py",
           "    if path is not None:\n        where = ",
           "    if False:\n        where = ",
           ("tests/server/test_server_robustness.py::test_text_with_a_lone_surrogate_is_a_400_naming_the_field",)),
    Mutant("tool-calls-past-parallel-false", "mlx_lm_server/text/tool_calls.py",
           "if self.num_calls and not self.parallel:", "if False:",
           ("tests/server/test_tool_calls.py::test_streamed_and_whole_read_the_same",)),
    Mutant("tp-idle-follower-spins", "mlx_lm_server/parallel/liveness.py",
           "        self.link.doorbell = self\n", "",
           ("tests/processes/test_tensor_parallel.py::test_idle_ranks_sleep_and_the_next_request_wakes_them",)),
    Mutant("tp-orphaned-ranks", "mlx_lm_server/server.py",
           "            watch_parent(parent, _launcher_gone(parent))", "            pass",
           ("tests/processes/test_tensor_parallel.py::test_ranks_stop_when_mlx_launch_is_killed",)),
    Mutant("prompt-cache-exact-untrimmed", "mlx_lm_server/serving/prompt_cache.py",
           "            trim_prompt_cache(cache, 1)", "            pass",
           ("tests/server/test_prompt_cache.py::"
            "test_a_prompt_equal_to_a_stored_sequence_prefills_its_last_token_again",)),
    Mutant("suffix-index-never-forgets", "mlx_lm_server/spec_decode/proposer/suffix.py",
           "            old = self._sequences.popleft()\n            self._count(old, -1)",
           "            old = self._sequences.popleft()",
           ("tests/model/test_suffix_proposer.py::"
            "test_the_index_stays_within_its_bound_and_forgets_exactly_the_oldest",)),
    Mutant("suffix-global-never-drafts", "mlx_lm_server/spec_decode/proposer/suffix.py",
           "        if theirs and (not mine or expected > 1.0):",
           "        if False:",
           ("tests/model/test_suffix_proposer.py::"
            "test_repeated_work_drafts_from_earlier_outputs_with_greedy_output_unchanged",)),
    Mutant("mtp-verified-pairs-lost", "mlx_lm_server/spec_decode/engine.py",
           "[n + 1 for n in accepted])", "[1 for n in accepted])",
           ("tests/tiny/test_mtp_proposer.py::"
            "test_the_heads_cache_equals_a_fresh_pass_over_the_targets_pairs",)),
    Mutant("mtp-chained-guesses-kept", "mlx_lm_server/spec_decode/proposer/head.py",
           "    def observe_verification(self, uids, num_accepted) -> None:\n"
           "        self._drop_chained()",
           "    def observe_verification(self, uids, num_accepted) -> None:\n"
           "        self.chained = 0",
           ("tests/tiny/test_mtp_proposer.py::"
            "test_the_heads_cache_equals_a_fresh_pass_over_the_targets_pairs",)),
    Mutant("mtp-pairs-shifted", "mlx_lm_server/spec_decode/proposer/head.py",
           "return hidden, list(context[len(context) - m:])",
           "return hidden, list(context[len(context) - m - 1:-1])",
           ("tests/tiny/test_mtp_proposer.py::"
            "test_the_heads_cache_equals_a_fresh_pass_over_the_targets_pairs",)),
    Mutant("eagle3-reads-the-final-state", "mlx_lm_server/spec_decode/engine.py",
           "capture_hidden(model, proposer.hidden_layers)", "capture_hidden(model, None)",
           ("tests/server/test_eagle3_proposer.py::"
            "test_the_heads_cache_equals_a_fresh_pass_over_the_targets_aux_features",)),
    Mutant("eagle3-aux-layers-off-by-one", "mlx_lm_server/spec_decode/heads/eagle3.py",
           "return [max(int(i) - 1, 0) for i in ids]", "return [int(i) for i in ids]",
           ("tests/model/test_eagle3_head.py::test_the_capture_reads_the_configured_layers",)),
    Mutant("dflash-block-left-in-the-cache", "mlx_lm_server/spec_decode/proposer/dflash.py",
           "        rollback(self.cache, [K + 1] * len(ready))", "        pass",
           ("tests/server/test_dflash.py::test_the_drafters_cache_holds_only_the_targets_states",)),
    Mutant("dflash-padding-left-in-the-cache", "mlx_lm_server/spec_decode/proposer/dflash.py",
           "        rollback(self.cache, [width - h.shape[0] for h, _ in pairs])", "        pass",
           ("tests/server/test_dflash.py::test_the_drafters_cache_holds_only_the_targets_states",)),
    Mutant("dflash-block-sees-other-rows-padding", "mlx_lm_server/spec_decode/heads/dflash.py",
           "visible = (key >= cache.left_padding[:, None]) & (key < end)",
           "visible = key < end",
           ("tests/server/test_dflash.py::test_a_rows_drafts_in_a_batch_are_its_drafts_alone",)),
    Mutant("dflash-drafts-not-drawn-from-q", "mlx_lm_server/spec_decode/proposer/dflash.py",
           "            drafts.append(tokens)",
           "            drafts.append(logits.argmax(-1))",
           ("tests/server/test_dflash.py::test_sampled_tokens_keep_the_exact_distribution",)),
    Mutant("ttt-chained-keys-at-the-pairs-position", "mlx_lm_server/drafter/ttt.py",
           "q, k = attn.rope(q, offset=step), attn.rope(k, offset=step)",
           "q, k = attn.rope(q, offset=0), attn.rope(k, offset=0)",
           ("tests/model/test_drafter.py::test_the_unrolled_steps_are_the_heads_own_drafting",)),
    Mutant("drafter-resume-replays-no-batches", "mlx_lm_server/drafter/train.py",
           "    for _ in range(step):  # the same batches as an uninterrupted run\n"
           "        next(stream)",
           "    pass",
           ("tests/model/test_drafter.py::test_resume_continues_the_same_curve",)),
    Mutant("head-prompt-pairs-dropped", "mlx_lm_server/spec_decode/engine.py",
           "self._hidden.on_prefill = proposer.observe_target",
           "self._hidden.on_prefill = None",
           ("tests/tiny/test_mtp_proposer.py::"
            "test_the_heads_cache_equals_a_fresh_pass_over_the_targets_pairs",)),
    Mutant("draft-q-unfiltered", "mlx_lm_server/spec_decode/proposer/draft_sampling.py",
           "q_rows.append(mx.softmax(z, axis=-1))",
           "q_rows.append(mx.softmax(logprobs[i], axis=-1))",
           ("tests/tiny/test_mtp_proposer.py::test_sampled_tokens_keep_the_exact_distribution",
            "tests/tiny/test_hybrid_caches.py::"
            "test_sampled_tokens_keep_the_exact_distribution_on_a_hybrid")),
    Mutant("mixed-model-q-for-cheap-rows", "mlx_lm_server/spec_decode/drafts.py",
           "                     _q_or_one_hot(theirs.draft_probs, tokens, V, dtype))",
           "                     _q_or_one_hot(ours.draft_probs, tokens, V, dtype))",
           ("tests/model/test_mixed_proposer.py::"
            "test_sampled_rows_keep_the_target_distribution_from_either_proposer",)),
    Mutant("mixed-never-moves-to-the-model", "mlx_lm_server/spec_decode/proposer/mixed.py",
           "                and r.model.value > r.cheap.value)", "                and False)",
           ("tests/model/test_mixed_proposer.py::"
            "test_a_row_moves_to_the_draft_model_when_its_cheap_drafts_fail",)),
    Mutant("mixed-always-runs-the-model", "mlx_lm_server/spec_decode/proposer/per_row.py",
           "        if not use_model.any():", "        if False:",
           ("tests/model/test_mixed_proposer.py::"
            "test_a_step_where_every_row_copies_skips_the_draft_model",)),
]


def run(mutant: Mutant, timeout: float) -> tuple[str, float]:
    path = ROOT / mutant.path
    source = path.read_text()
    if source.count(mutant.old) != 1:
        return "stale (the source changed: update the mutant)", 0.0
    tic = time.perf_counter()
    try:
        path.write_text(source.replace(mutant.old, mutant.new))
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                   "--run-slow", *mutant.tests], cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout)
            status = "survived" if proc.returncode == 0 else "killed"
        except subprocess.TimeoutExpired:
            status = "killed (timed out)"
    finally:
        path.write_text(source)
    return status, time.perf_counter() - tic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name:26s} {m.path}\n{'':26s} {' '.join(m.tests)}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutants: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    survived = 0
    for m in chosen:
        status, seconds = run(m, args.timeout)
        survived += status != "killed" and not status.startswith("killed")
        print(f"{m.name:26s} {status:10s} {seconds:6.1f} s", flush=True)
    print(f"{len(chosen) - survived} of {len(chosen)} killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
