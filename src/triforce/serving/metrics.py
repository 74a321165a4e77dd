"""Prometheus metrics of the server (prometheus-client), in a registry of their own (one per app).

Names follow vLLM's under the `triforce:` namespace, so dashboards made for vLLM need only the prefix
changed: counters are exposed with `_total`, histograms with `_bucket`/`_sum`/`_count`.

    triforce:requests{endpoint, status}                HTTP requests answered (429s and 400s included)
    triforce:request_success{finished_reason}          generations ended: stop, length, cancelled, timeout, error
    triforce:prompt_tokens / triforce:generation_tokens
    triforce:time_to_first_token_seconds               request arrival -> its first generated token
    triforce:inter_token_latency_seconds               per generated token (a round's time / its tokens)
    triforce:e2e_request_latency_seconds
    triforce:prefix_cache_hits / _misses               requests that reused / did not reuse a cached prefix
    triforce:prefix_cache_hit_tokens / triforce:prompt_tokens_prefilled
    triforce:prefix_cache_bytes / _blocks              (gauges, read at scrape time)
    triforce:spec_decode_num_drafts{level}             verification rounds of each verifying level
    triforce:spec_decode_num_draft_tokens{level}       tokens drafted for that level to verify
    triforce:spec_decode_num_accepted_tokens{level}    ... of which it accepted
    triforce:num_requests_waiting / _running           (gauges)
    triforce:kv_cache_usage_perc                       the running requests' KV caches / --kv-memory (0 to 1)
    triforce:iteration_tokens_total                    rows fed per batched forward (histogram)
    triforce:batch_size                                requests per batched forward (histogram)

The speculation counters add up the `levels` stats of completed generations (the `triforce.stats`
field of the responses): a cancelled or timed-out generation's rounds are not counted.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

NS = "triforce:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
BATCH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


class ServerMetrics:
    def __init__(self):
        disable_created_metrics()  # no `_created` series beside every counter (process-wide; vLLM does the same)
        r = self.registry = CollectorRegistry()
        self.requests = Counter(NS + "requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter(NS + "request_success", "Generations ended, by reason (stop, length, cancelled, "
                                "timeout, error)", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(NS + "prompt_tokens", "Prompt tokens of generations run", registry=r)
        self.generation_tokens = Counter(NS + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(NS + "time_to_first_token_seconds", "Request arrival to its first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(NS + "inter_token_latency_seconds", "Time per generated token after the first "
                             "(a speculation round's time divided by the tokens it committed)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(NS + "e2e_request_latency_seconds", "Request arrival to its last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prefix_hits = Counter(NS + "prefix_cache_hits", "Requests that reused a cached prompt prefix", registry=r)
        self.prefix_misses = Counter(NS + "prefix_cache_misses", "Requests that found no cached prompt prefix",
                                     registry=r)
        self.prefix_hit_tokens = Counter(NS + "prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the "
                                         "prefix cache", registry=r)
        self.prefilled_tokens = Counter(NS + "prompt_tokens_prefilled", "Prompt tokens prefilled (not from the "
                                        "prefix cache)", registry=r)
        self.prefix_bytes = Gauge(NS + "prefix_cache_bytes", "Bytes of K/V held by the prefix cache", registry=r)
        self.prefix_blocks = Gauge(NS + "prefix_cache_blocks", "Blocks held by the prefix cache", registry=r)
        self.num_drafts = Counter(NS + "spec_decode_num_drafts", "Verification rounds, by verifying level",
                                  ["level"], registry=r)
        self.draft_tokens = Counter(NS + "spec_decode_num_draft_tokens", "Tokens drafted for a level to verify",
                                    ["level"], registry=r)
        self.accepted_tokens = Counter(NS + "spec_decode_num_accepted_tokens", "Drafted tokens a level accepted",
                                       ["level"], registry=r)
        self.route_rounds = Counter(NS + "spec_decode_route_rounds", "Rounds the adaptive stack ran, by route (its "
                                    "levels and gammas, e.g. ngram,full@4; full: plain decoding)", ["route"],
                                    registry=r)
        self.route_changes = Counter(NS + "spec_decode_route_changes", "Times the adaptive stack changed route",
                                     registry=r)
        self.planner_seconds = Counter(NS + "spec_decode_planner_seconds", "Time the adaptive stack spent planning",
                                       registry=r)
        self.waiting = Gauge(NS + "num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge(NS + "num_requests_running", "Requests being generated (at most --max-batch)",
                             registry=r)
        self.kv_usage = Gauge(NS + "kv_cache_usage_perc", "Fraction of the KV budget (--kv-memory) the running "
                              "requests' caches hold (0 to 1)", registry=r)
        self.iteration_tokens = Histogram(NS + "iteration_tokens_total", "Token rows fed per batched forward (every "
                                          "running request's decode step, verification or draft in one forward)",
                                          buckets=BATCH_ROW_BUCKETS, registry=r)
        self.batch_size = Histogram(NS + "batch_size", "Requests per batched forward", buckets=BATCH_SIZE_BUCKETS,
                                    registry=r)

    def watch(self, waiting: Callable[[], int], running: Callable[[], int], prefix_stats: Callable[[], dict] | None,
              kv_usage: Callable[[], float] | None = None):
        """Gauges read at scrape time from the engine and the prefix cache."""
        self.waiting.set_function(waiting)
        self.running.set_function(running)
        if kv_usage is not None:
            self.kv_usage.set_function(kv_usage)
        if prefix_stats is not None:
            self.prefix_bytes.set_function(lambda: prefix_stats()["bytes"])
            self.prefix_blocks.set_function(lambda: prefix_stats()["blocks"])

    def speculation(self, stats: dict) -> None:
        """Add one completed generation's per-level stats (GenerationResult.stats)."""
        for lvl in stats.get("levels", []):
            if lvl.get("role") == "verify":
                name = str(lvl["level"])
                self.num_drafts.labels(name).inc(lvl.get("rounds", 0))
                self.draft_tokens.labels(name).inc(lvl.get("proposed", 0))
                self.accepted_tokens.labels(name).inc(lvl.get("accepted", 0))
        if (ad := stats.get("adaptive")) is not None:
            for route, rounds in ad["routes"].items():
                self.route_rounds.labels(route).inc(rounds)
            self.route_changes.inc(ad["route_changes"])
            self.planner_seconds.inc(ad["planner_seconds"])

    def batch(self, requests: int, rows: int) -> None:
        """One batched forward of `requests` requests' `rows` token rows (ForwardGate.on_batch)."""
        self.batch_size.observe(requests)
        self.iteration_tokens.observe(rows)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
