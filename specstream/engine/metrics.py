"""Prometheus metrics of one engine, in a registry of its own (no process globals): specstream_*
series named after vLLM's where the meaning is the same, and VllmSeries, the vllm:* series that
routers built for vLLM read, under vLLM's own names."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specstream.memory.prefix_cache import PrefixCache, PrefixCacheStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class CacheConfigInfo:
    """The KV pool's geometry, labelled on vllm:cache_config_info as vLLM's CacheConfig names it."""

    block_size: int
    num_gpu_blocks: int  # every block of the pool, whatever the device (vLLM's name)
    enable_prefix_caching: bool
    cache_dtype: str


class EngineMetrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, *, model_name: str = "", cache: CacheConfigInfo | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # The latest observation of the batch, read by VllmSeries at scrape time.
        self.running, self.waiting, self.kv_cache_usage = 0, 0, 0.0
        self.prefix_totals = PrefixCacheStats()
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
            "Draft tokens accepted, by draft position and proposer (suffix, ngram, eagle, draft, prediction).",
            ["position", "method"],
            registry=r,
        )
        self.num_draft_tokens_per_pos = Counter(
            "specstream_spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified, by draft position and proposer.",
            ["position", "method"],
            registry=r,
        )
        self.rounds_by_method = Counter(
            "specstream_spec_decode_rounds",
            "Decoding rounds, by the proposer that drafted them (suffix, ngram, eagle, draft, prediction: a request's predicted "
            "output; none: plain decoding).",
            ["method"],
            registry=r,
        )
        self.tokens_by_method = Counter(
            "specstream_spec_decode_emitted_tokens",
            "Tokens emitted by decoding rounds, by the proposer that drafted them (none: plain decoding).",
            ["method"],
            registry=r,
        )
        self.forward_cost = Gauge(
            "specstream_forward_cost_seconds",
            "What the speculation policy prices a forward over this many tokens at: timed at start-up, "
            "corrected by every step the engine runs.",
            ["tokens"],
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
        self.vllm = VllmSeries(self, model_name, cache)
        r.register(self.vllm)

    def observe_batch(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        """The scheduler's running and waiting counts and the KV pool's usage, after a change."""
        self.running, self.waiting, self.kv_cache_usage = running, waiting, kv_cache_usage
        self.num_running.set(running)
        self.num_waiting.set(waiting)
        self.kv_usage.set(kv_cache_usage)

    def observe_cost(self, cost) -> None:
        """The policy's forward-time curve (calibration.CostModel), at its timed sizes."""
        for n in cost.tokens:
            self.forward_cost.labels(tokens=str(n)).set(cost(n))

    def observe_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Advance the prefix-cache counters to the cache's running totals."""
        if cache is None:
            return
        stats, seen = cache.stats, self.prefix_totals
        self.prefix_cache_queries.inc(stats.queries - seen.queries)
        self.prefix_cache_hits.inc(stats.hits - seen.hits)
        self.prefix_totals = PrefixCacheStats(stats.queries, stats.hits)

    def record_round(
        self, num_drafted: int, num_accepted: int, num_tokens: int, method: str = "", num_forced: int = 0, decoding: bool = True
    ) -> None:
        self.generation_tokens.inc(num_tokens)
        if decoding:
            label = (method or "forced") if num_drafted else "none"
            self.rounds_by_method.labels(method=label).inc()
            self.tokens_by_method.labels(method=label).inc(num_tokens)
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


class VllmSeries:
    """The series that routers built for vLLM score pods by (the Gateway API Inference Extension's
    endpoint picker; vLLM's production-stack router), with vLLM's names, types, labels and meanings
    (vllm/v1/metrics/loggers.py), so either routes to specstream as to vLLM:

    - vllm:num_requests_running, vllm:num_requests_waiting: sequences in the running batch, and
      requests queued for admission (not those still being tokenized);
    - vllm:kv_cache_usage_perc, and vllm:gpu_cache_usage_perc (its older name, still read by the
      production-stack router): the fraction of KV blocks in use, 0..1; blocks the prefix cache
      keeps but no sequence holds count as free, as in vLLM;
    - vllm:prefix_cache_queries and _hits, and the older vllm:gpu_prefix_cache_queries and _hits:
      counters in tokens, prompt tokens looked up at a request's first admission and those found;
    - vllm:cache_config_info: gauge 1 whose labels carry block_size and num_gpu_blocks (the
      endpoint picker's prefix scorer sizes its index from them).

    A prometheus collector over EngineMetrics' latest observations: model_name (vLLM's label: the
    served model name) may be set after the engine starts, and no stale label set is left behind.
    """

    def __init__(self, metrics: EngineMetrics, model_name: str, cache: CacheConfigInfo | None) -> None:
        self.metrics, self.model_name, self.cache = metrics, model_name, cache

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        # vLLM labels each series with the served model and its engine core's index (one here).
        labels = {"model_name": self.model_name, "engine": "0"}

        def series(kind, name: str, doc: str, value: float) -> Metric:
            metric = kind(name, doc, labels=list(labels))
            metric.add_metric(list(labels.values()), value)
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        usage = "KV-cache usage. 1 means 100 percent usage."
        yield series(gauge, "vllm:num_requests_running", "Number of requests in model execution batches.", m.running)
        yield series(gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", m.waiting)
        yield series(gauge, "vllm:kv_cache_usage_perc", usage, m.kv_cache_usage)
        yield series(gauge, "vllm:gpu_cache_usage_perc", usage + " (vLLM's older name)", m.kv_cache_usage)
        queries, hits = m.prefix_totals.queries, m.prefix_totals.hits
        for prefix in ("vllm:", "vllm:gpu_"):
            yield series(counter, f"{prefix}prefix_cache_queries", "Prefix cache queries, in tokens.", queries)
            yield series(counter, f"{prefix}prefix_cache_hits", "Prefix cache hits, in tokens.", hits)
        if self.cache is not None:
            c = self.cache
            info = {
                "block_size": str(c.block_size),
                "num_gpu_blocks": str(c.num_gpu_blocks),
                "num_cpu_blocks": "0",
                "enable_prefix_caching": str(c.enable_prefix_caching),
                "cache_dtype": c.cache_dtype,
                "engine": "0",
            }
            config = gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info))
            config.add_metric(list(info.values()), 1)
            yield config
