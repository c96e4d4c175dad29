"""The worker's Prometheus metrics (protos/metrics.py has the endpoint and the buckets).

Gauges and the engine's cumulative counters are updated once per loop from the same
`EngineStats` the heartbeat is built from; step times are observed around
`engine.step()`; per-request prefill and decode times when a request finishes. All of it
is a few dictionary updates per step, far below a step's milliseconds.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protos.metrics import ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, STEP_BUCKETS
from protos.params import Usage


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model: str, worker_id: str,
                 max_adapters: int = 0) -> None:
        """max_adapters: the engine's most adapters per step; 0 = LoRA off (lora_requests_info then
        shows max_lora "0" and no adapter)."""
        labels = {"model": model, "worker": worker_id}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenrelay_{name}", doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenrelay_{name}", doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(f"tokenrelay_{name}", doc, names, buckets=buckets, registry=registry)
            return family.labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the batch.")
        self.waiting = gauge("num_requests_waiting", "Requests admitted, waiting for KV blocks or prefill.")
        self.parked = gauge("num_requests_parked", "Requests nobody follows, parked for a resume.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks held by requests, 0..1.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # vLLM's names (spec_decode_*), in our tokenrelay_ namespace
        self.spec_drafts = counter("spec_decode_num_drafts", "Decodes that verified speculative proposals.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Speculative tokens accepted (equal to the model's own).")
        self.grammar_hits = counter("grammar_cache_hits", "Response formats found compiled in the cache.")
        self.grammar_misses = counter("grammar_cache_misses", "Response formats compiled (cache misses).")
        self.grammar_compile_time = histogram("grammar_compile_seconds", "Time to compile one response "
                                              "format (on the grammar thread).", STEP_BUCKETS)
        self.grammar_mask_time = histogram("grammar_mask_seconds", "Time to fill the constrained rows' "
                                           "masks (while the model computes) and apply them in one engine "
                                           "step (steps with any).", STEP_BUCKETS)
        self.redis_errors = counter("redis_errors", "Redis commands or pipelines that failed.")
        self.taken_over = counter("requests_taken_over", "Requests this worker dropped when it found itself "
                                  "fenced (a sweeper judged it dead and queued them again).")
        self._step = Histogram("tokenrelay_engine_step_seconds", "Time of one engine step, by what it ran.",
                               [*names, "kind"], buckets=STEP_BUCKETS, registry=registry)
        self._step_labels = labels
        self.iteration_tokens = histogram("iteration_tokens", "Tokens computed in one engine step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from admission to the first "
                                      "token.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from the first to the last token.",
                                     REQUEST_LATENCY_BUCKETS)
        # vLLM's lora_requests_info: the adapters with running requests in a label, the value the
        # unix time of the update (one series at a time: the last one is removed when they change).
        self._lora_info = Gauge("tokenrelay_lora_requests_info", "Running LoRA adapters (in the labels) and "
                                "the most per step; the value is when they were read.",
                                [*names, "max_lora", "running_lora_adapters"], registry=registry)
        self._lora_labels = {**labels, "max_lora": str(max_adapters)}
        self._lora_running = ""
        self._totals = {"preemptions": 0, "queries": 0, "hits": 0, "drafts": 0, "draft_tokens": 0,
                        "accepted_tokens": 0, "grammar_hits": 0, "grammar_misses": 0, "grammar_compiles": 0}

    def update(self, stats: Any, num_parked: int) -> None:
        """From the engine's `EngineStats`: gauges, and the growth of its cumulative counts."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.parked.set(num_parked)
        self.kv_usage.set(stats.kv_cache_usage)
        for key, counter, total in (("preemptions", self.preemptions, stats.num_preemptions),
                                    ("queries", self.prefix_queries, stats.num_prefix_cache_query_tokens),
                                    ("hits", self.prefix_hits, stats.num_prefix_cache_hit_tokens),
                                    ("drafts", self.spec_drafts, stats.num_spec_drafts),
                                    ("draft_tokens", self.spec_draft_tokens, stats.num_spec_draft_tokens),
                                    ("accepted_tokens", self.spec_accepted_tokens,
                                     stats.num_spec_accepted_tokens),
                                    ("grammar_hits", self.grammar_hits,
                                     getattr(stats, "num_grammar_cache_hits", 0)),
                                    ("grammar_misses", self.grammar_misses,
                                     getattr(stats, "num_grammar_cache_misses", 0))):
            if total > self._totals[key]:
                counter.inc(total - self._totals[key])
                self._totals[key] = total
        self._update_lora(getattr(stats, "num_running_by_adapter", {}))
        num_new = getattr(stats, "num_grammar_compiles", 0) - self._totals["grammar_compiles"]
        if num_new > 0:  # the newest compilations' times (the engine keeps the latest 64)
            for seconds in stats.grammar_compile_seconds[-num_new:]:
                self.grammar_compile_time.observe(seconds)
            self._totals["grammar_compiles"] = stats.num_grammar_compiles

    def _update_lora(self, running_by_adapter: dict[str, int]) -> None:
        running = ",".join(sorted(name for name, n in running_by_adapter.items() if n > 0))
        if running != self._lora_running:
            with contextlib.suppress(KeyError):  # none before the first update
                self._lora_info.remove(*self._lora_labels.values(), self._lora_running)
            self._lora_running = running
        self._lora_info.labels(**self._lora_labels, running_lora_adapters=running).set(time.time())

    def observe_step(self, seconds: float, num_prefill_tokens: int, num_decode_tokens: int,
                     mask_seconds: float = 0.0) -> None:
        if not num_prefill_tokens and not num_decode_tokens:
            return  # nothing ran (only aborts were applied)
        if mask_seconds > 0:
            self.grammar_mask_time.observe(mask_seconds)
        kind = "mixed" if num_prefill_tokens and num_decode_tokens else \
            "prefill" if num_prefill_tokens else "decode"
        self._step.labels(**self._step_labels, kind=kind).observe(seconds)
        self.iteration_tokens.observe(num_prefill_tokens + num_decode_tokens)

    def observe_finished(self, usage: Usage) -> None:
        self.prefill_time.observe(max(0.0, usage.time_to_first_token_s - usage.queue_time_s))
        self.decode_time.observe(usage.decode_time_s)
