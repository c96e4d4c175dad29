"""The flags both processes take to be observed: metrics, traces, log format (the values
are validated by each process's config object)."""

from __future__ import annotations

import argparse
import os

from protos.logs import LOG_FORMATS
from protos.metrics import METRICS_COMPAT


def add_observability_args(p: argparse.ArgumentParser, *, default_metrics_port: int,
                           metrics_port_note: str = "") -> None:
    def env(name: str, default: object) -> str:
        return os.environ.get(name, str(default))  # a string: argparse converts it with the flag's type

    p.add_argument("--metrics-port", type=int, default=env("TOKENRELAY_METRICS_PORT", default_metrics_port),
                   help=f"port of the Prometheus /metrics endpoint; 0 turns it off{metrics_port_note} "
                        "[env TOKENRELAY_METRICS_PORT]")
    p.add_argument("--metrics-compat", choices=METRICS_COMPAT,
                   default=env("TOKENRELAY_METRICS_COMPAT", "none"),
                   help="vllm: also export every series under vLLM's vllm: names (model label as model_name) "
                        "[env TOKENRELAY_METRICS_COMPAT]")
    p.add_argument("--otlp-traces-endpoint", default=env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
                   help="OpenTelemetry collector (OTLP/gRPC) to send traces to: http://host:4317 (plaintext) "
                        "or https://...; empty: no tracing. Needs the tracing extra; OTEL_* variables "
                        "(service name, sampler, headers) apply [env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT]")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=env("TOKENRELAY_LOG_FORMAT", "text"),
                   help="json: one JSON object per line, with request_id, worker and trace_id on lines "
                        "about a request [env TOKENRELAY_LOG_FORMAT]")
