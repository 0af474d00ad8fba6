"""Prometheus metrics of one engine, in a registry of its own (no process globals), named
after vLLM's where the meaning is the same."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specstream.memory.prefix_cache import PrefixCache, PrefixCacheStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "specstream_time_to_first_token_seconds", "Time from request arrival to its first chunk.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "specstream_inter_token_latency_seconds",
            "Time between consecutive chunks of a stream (a chunk carries every token accepted in one round).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "specstream_e2e_request_latency_seconds", "Time from request arrival to its last chunk.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.num_drafts = Counter("specstream_spec_decode_num_drafts", "Rounds in which a sequence verified drafts.", registry=r)
        self.num_draft_tokens = Counter("specstream_spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.num_accepted_tokens = Counter("specstream_spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "specstream_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position and proposer (eagle, ngram, draft).",
            ["position", "method"],
            registry=r,
        )
        self.num_draft_tokens_per_pos = Counter(
            "specstream_spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified, by draft position and proposer.",
            ["position", "method"],
            registry=r,
        )
        # [structured] grammar-forced drafts, counted in num_draft_tokens/num_accepted_tokens too
        self.num_forced_tokens = Counter("specstream_spec_decode_num_forced_tokens", "Draft tokens forced by a grammar.", registry=r)
        self.num_forced_accepted_tokens = Counter(
            "specstream_spec_decode_num_forced_accepted_tokens", "Grammar-forced draft tokens accepted.", registry=r
        )
        self.prompt_tokens = Counter("specstream_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("specstream_generation_tokens", "Tokens generated.", registry=r)
        self.num_running = Gauge("specstream_num_requests_running", "Sequences in the running batch.", registry=r)
        self.num_waiting = Gauge("specstream_num_requests_waiting", "Requests waiting for admission.", registry=r)
        self.kv_usage = Gauge("specstream_kv_cache_usage_perc", "Fraction of KV pool blocks in use (0..1).", registry=r)
        self.preemptions = Counter("specstream_num_preemptions", "Sequences preempted for KV space (recomputed later).", registry=r)
        self.finished = Counter("specstream_request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r)
        self.prefix_cache_queries = Counter(
            "specstream_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admissions).", registry=r
        )
        self.prefix_cache_hits = Counter(
            "specstream_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.", registry=r
        )
        self._prefix_seen = PrefixCacheStats()

    def observe_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Advance the prefix-cache counters to the cache's running totals."""
        if cache is None:
            return
        stats, seen = cache.stats, self._prefix_seen
        self.prefix_cache_queries.inc(stats.queries - seen.queries)
        self.prefix_cache_hits.inc(stats.hits - seen.hits)
        self._prefix_seen = PrefixCacheStats(stats.queries, stats.hits)

    def record_round(
        self, num_drafted: int, num_accepted: int, num_tokens: int, method: str = "", num_forced: int = 0
    ) -> None:
        self.generation_tokens.inc(num_tokens)
        if num_forced:  # [structured]
            self.num_forced_tokens.inc(num_forced)
            self.num_forced_accepted_tokens.inc(min(num_forced, num_accepted))
        if num_drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(num_drafted)
            self.num_accepted_tokens.inc(num_accepted)
            for pos in range(num_drafted):
                self.num_draft_tokens_per_pos.labels(position=str(pos), method=method).inc()
            for pos in range(num_accepted):
                self.num_accepted_tokens_per_pos.labels(position=str(pos), method=method).inc()
