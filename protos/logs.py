"""Log lines as text (the default) or one JSON object per line (`--log-format json`).

A JSON line has `time` (UTC, ISO 8601), `level`, `logger`, `message`, the process's own
fields (`process`, and its `gateway` or `worker` id), `exception` when there is one,
and, on every line about a request, `request_id` and `trace_id` (when the request has
a trace: the caller's traceparent or the gateway's span; see protos/tracing.py), on a
gateway's lines `tenant` (with --auth-tokens-file), and on a worker's lines `worker`.

How a line learns its request differs by side:
- The gateway is asyncio and grpc.aio runs each call in its own task: `bind_request`
  sets a contextvar for the rest of that task (and the tasks it spawns copy it), so
  every line logged while serving the call carries the request without passing it.
- The worker runs many requests on one loop thread, so a contextvar would name the
  wrong one: its lines about a request pass `extra=request_fields(...)` explicitly.
Explicit fields win over bound ones.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
REQUEST_FIELDS = ("request_id", "worker", "trace_id", "tenant")

_bound: ContextVar[Mapping[str, str] | None] = ContextVar("tokenrelay_log_request", default=None)


def check_log_format(log_format: str) -> None:
    """ValueError unless `log_format` is one of LOG_FORMATS."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def request_fields(request_id: str, *, worker: str = "", trace_id: str = "",
                   tenant: str = "") -> dict[str, str]:
    """The `extra=` of a line about one request (empty fields left out)."""
    fields = {"request_id": request_id, "worker": worker, "trace_id": trace_id, "tenant": tenant}
    return {k: v for k, v in fields.items() if v}


def bind_request(request_id: str, *, trace_id: str = "", tenant: str = "") -> None:
    """Name the request (and its tenant) in every line the current task logs from now on (see
    the module docstring: meant for a gateway call's own task, which ends with the call)."""
    _bound.set(request_fields(request_id, trace_id=trace_id, tenant=tenant))


class JsonFormatter(logging.Formatter):
    """One JSON object per record; `static` fields (the process's name and id) on every line."""

    def __init__(self, **static: str) -> None:
        super().__init__()
        self._static = static

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, **self._static,
            "message": record.getMessage(),
        }
        line.update(_bound.get() or {})
        for name in REQUEST_FIELDS:
            if value := getattr(record, name, None):
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def configure(level: str, log_format: str, process: str, **ids: str) -> None:
    """The process's logging on stderr: `process` names it in text lines ("gateway",
    "worker"); in JSON lines `process` and `ids` (e.g. worker=<worker_id>) are fields."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process=process, **ids))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
