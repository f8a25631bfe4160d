"""``GET /metrics`` in Prometheus text format.

Speculation counters use the names other servers and benchmark tools already
read (``spec_decode_num_drafts_total``, ...). They are read at
scrape time from the same ``SpecStats`` that ``/v1/spec_decode/metrics``
reads, so the two always agree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _SchedulerCollector:
    def __init__(self):
        self.scheduler = None
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def collect(self):
        s = self.scheduler
        stats = s.stats()
        yield GaugeMetricFamily("num_requests_running", "Requests producing tokens",
                                value=stats["active"])
        yield GaugeMetricFamily("num_requests_waiting", "Requests waiting for their first token",
                                value=stats["queued"])
        yield CounterMetricFamily("prompt_tokens", "Prompt tokens of finished requests",
                                  value=self.prompt_tokens)
        yield CounterMetricFamily("generation_tokens", "Generated tokens of finished requests",
                                  value=self.generation_tokens)
        success = CounterMetricFamily("request_success", "Finished requests",
                                      labels=["finished_reason"])
        for reason, n in sorted(self.finished.items()):
            success.add_metric([reason], n)
        yield success

        cache = s.prompt_cache
        yield CounterMetricFamily("prefix_cache_queries", "Prompt tokens looked up in the "
                                  "prompt cache", value=cache.queried_tokens if cache else 0)
        yield CounterMetricFamily("prefix_cache_hits", "Prompt tokens found in the prompt "
                                  "cache (not prefilled)", value=cache.hit_tokens if cache else 0)

        mem = stats["memory"]
        yield GaugeMetricFamily("kv_memory_budget_bytes", "The KV memory budget "
                                "(--max-kv-memory; 0: none)", value=mem["kv_budget"] or 0)
        yield GaugeMetricFamily("kv_memory_reserved_bytes", "KV bytes reserved for admitted "
                                "requests (each at its prompt + max_tokens)",
                                value=mem["kv_reserved"])
        yield GaugeMetricFamily("prompt_cache_bytes", "Bytes held by the prompt cache (they "
                                "count against the KV budget)", value=mem["prompt_cache"])
        yield GaugeMetricFamily("num_requests_waiting_for_memory", "Requests waiting for "
                                "room in the KV budget", value=mem["waiting_for_memory"])
        yield GaugeMetricFamily("mlx_active_memory_bytes", "MLX's allocated memory",
                                value=mem["active"])
        yield GaugeMetricFamily("mlx_peak_memory_bytes", "MLX's peak allocated memory",
                                value=mem["peak"])

        yield CounterMetricFamily("structured_output_requests", "Finished requests whose "
                                  "output a grammar constrained",
                                  value=s.structured_requests)
        yield CounterMetricFamily("structured_output_forced_tokens", "Generated tokens that "
                                  "were the only one their grammar allowed",
                                  value=s.forced_tokens)

        c = s.spec_stats.tokens
        yield CounterMetricFamily("spec_decode_num_drafts", "Verification passes with drafts, "
                                  "per sequence", value=c.num_drafts)
        yield CounterMetricFamily("spec_decode_num_draft_tokens", "Draft tokens verified",
                                  value=c.num_draft_tokens)
        yield CounterMetricFamily("spec_decode_num_accepted_tokens", "Accepted draft tokens "
                                  "that were emitted", value=c.num_accepted_tokens)
        per_pos = CounterMetricFamily("spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position",
                                      labels=["position"])
        for pos, n in enumerate(c.accepted_per_pos):
            per_pos.add_metric([str(pos)], n)
        yield per_pos
        yield GaugeMetricFamily("spec_decode_current_k", "Draft tokens per sequence this step",
                                value=s.spec_stats.current_k)
        steps = s.spec_stats.steps
        if steps is not None:
            yield CounterMetricFamily("spec_decode_tree_steps", "Verify steps over trees of "
                                      "drafts", value=steps.tree_steps)
            yield CounterMetricFamily("spec_decode_tree_rows", "Rows that drafted in tree "
                                      "steps", value=steps.tree_rows)
            yield CounterMetricFamily("spec_decode_tree_nodes", "Draft nodes of the rows of "
                                      "tree steps", value=steps.tree_nodes)
            yield CounterMetricFamily("spec_decode_tree_accepted_tokens", "Drafts kept by "
                                      "the rows of tree steps (their accepted depth)",
                                      value=steps.tree_accepted)
            by_rank = CounterMetricFamily("spec_decode_tree_accepted_by_sibling_rank",
                                          "Drafts kept in tree steps by rank among their "
                                          "siblings (0: the drafter's first guess; the rest "
                                          "a chain would have lost)", labels=["rank"])
            for rank, n in enumerate(steps.tree_accepted_by_rank):
                by_rank.add_metric([str(rank)], n)
            yield by_rank


class ServerMetrics:
    """A registry per server (tests run several in one process). The assembly
    hands ``observe_finished`` to the scheduler it builds, then ``watch``es
    that scheduler for the gauges and counters read at scrape time."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._collector = _SchedulerCollector()
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def watch(self, scheduler) -> "ServerMetrics":
        self._collector.scheduler = scheduler
        self.registry.register(self._collector)
        return self

    def observe_finished(self, prompt_tokens, completion_tokens, finish_reason, ttft, e2e):
        """Called on the inference thread."""
        c = self._collector
        c.prompt_tokens += prompt_tokens
        c.generation_tokens += completion_tokens
        c.finished[finish_reason] = c.finished.get(finish_reason, 0) + 1
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def render_models(metrics: dict[str, ServerMetrics]) -> bytes:
    """One page for several models: each family once, every series with a
    ``model`` label (each model keeps its own registry)."""

    class _Merged:
        def collect(self):
            families: dict[str, Metric] = {}
            for model, served in metrics.items():
                for family in served.registry.collect():
                    merged = families.get(family.name)
                    if merged is None:
                        merged = families[family.name] = Metric(
                            family.name, family.documentation, family.type, family.unit)
                    merged.samples += [s._replace(labels={"model": model, **s.labels})
                                       for s in family.samples]
            return iter(families.values())

    return generate_latest(_Merged())
