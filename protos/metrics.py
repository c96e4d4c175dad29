"""Prometheus metrics shared by the gateway and the worker: the endpoint, the buckets, and
the vLLM-compatible names.

Every process owns one `CollectorRegistry` (several gateways and workers can then run in
one test process) served on its own plain HTTP port by a prometheus-client thread, so a
scrape never runs on the gateway's event loop or the worker's engine loop. Names use the
``tokenrelay_`` prefix with vLLM's meanings and buckets; with ``compat_vllm`` every
family is also exported under vLLM's ``vllm:`` name, its ``model`` label renamed
``model_name``, so existing vLLM dashboards, alerts and KEDA/HPA queries work unchanged.
Labels are `model` everywhere and `worker` on worker series; never a label per request or
per tenant on a histogram.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "tokenrelay_"
VLLM_PREFIX = "vllm:"
DEFAULT_GATEWAY_PORT = 9400
DEFAULT_WORKER_PORT = 9401
METRICS_COMPAT = ("none", "vllm")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Engine steps are milliseconds to seconds on a CPU, tens of microseconds on a GPU.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def check_metrics_options(port: int, compat: str) -> None:
    """ValueError unless port is 0 (off) or a TCP port and compat one of METRICS_COMPAT."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be 0 (off) or a TCP port, got {port}")
    if compat not in METRICS_COMPAT:
        raise ValueError(f"metrics_compat must be one of {', '.join(METRICS_COMPAT)}, got {compat!r}")


class VllmCompat(Collector):
    """Every family of `registry` twice: as it is, and renamed tokenrelay_* -> vllm:*."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            yield family
            if family.name.startswith(PREFIX):
                yield _renamed(family)


def _renamed(family: Metric) -> Metric:
    def rename(name: str) -> str:
        return VLLM_PREFIX + name[len(PREFIX):]

    copy = Metric(rename(family.name), family.documentation, family.type, family.unit)
    for s in family.samples:
        labels = {("model_name" if k == "model" else k): v for k, v in s.labels.items()}
        copy.add_sample(rename(s.name), labels, s.value, s.timestamp, s.exemplar)
    return copy


class MetricsServer:
    """One registry and its /metrics endpoint on `port` (0 = off: nothing listens)."""

    def __init__(self, port: int, *, compat_vllm: bool = False, host: str = "0.0.0.0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.port, self.host, self.compat_vllm = port, host, compat_vllm
        self._server: Any = None

    @property
    def is_enabled(self) -> bool:
        return self.port != 0

    def start(self) -> None:
        if not self.is_enabled:
            return
        served: CollectorRegistry | Collector = self.registry
        if self.compat_vllm:
            compat = CollectorRegistry(auto_describe=False)
            compat.register(VllmCompat(self.registry))
            served = compat
        try:
            self._server, _ = start_http_server(self.port, self.host, registry=served)  # type: ignore[arg-type]
        except OSError as e:  # serving matters more than its metrics: say so loudly, go on
            log.error("no /metrics: cannot listen on %s:%d (%s); pass another --metrics-port", self.host,
                      self.port, e)
            return
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
