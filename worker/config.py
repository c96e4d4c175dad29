"""Worker process configuration: one frozen object built once in `worker.__main__`."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from protos.keys import (
    DEFAULT_PREFIX,
    INCARNATION_LEN,
    Keys,
    check_model_name,
    check_name,
    default_instance_id,
)
from protos.logs import check_log_format
from protos.metrics import check_metrics_options
from protos.redis_conn import DEFAULT_REDIS_URL, check_redis_url
from protos.tracing import check_otlp_endpoint
from worker.engine.config import ENGINE_KINDS, EngineConfig, SimConfig

# The served name of the bundled default model (its GGUF file is SmolLM2-135M-Instruct.Q4_1.gguf).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    # "model" runs engine's model; "sim" a simulated engine with engine's max_num_seqs and
    # max_model_len and sim's step time (worker/engine/sim.py), no model and no torch.
    engine_kind: str = "model"
    sim: SimConfig = field(default_factory=SimConfig)
    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_PREFIX
    # The model's name in GenerateRequest.model and the streams it claims (protos/keys.py,
    # "Models"); "" = the model file's name (`model_name`).
    served_model_name: str = ""
    # The name reported in Final.worker_id and GetServerInfo.
    worker_id: str = field(default_factory=default_instance_id)
    # Drawn per process: with worker_id it names this process's consumer (`consumer_name`), so
    # a restart under the same worker_id is a new consumer and a zombie of the old one stays
    # fenced (protos/keys.py, "Fencing").
    incarnation: str = field(default_factory=lambda: secrets.token_hex(INCARNATION_LEN // 2))
    # On SIGTERM: how long running requests may take to finish. Then they are
    # left to another live worker to resume, or failed with UNAVAILABLE if none is alive.
    drain_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    # A worker whose heartbeat key expired is considered dead by the gateways.
    heartbeat_ttl_s: float = 5.0
    # How long an idle worker blocks in XREADGROUP before looking around again.
    claim_block_ms: int = 500
    # An idle worker woken by a request claims again after this pause, as long as
    # more keep arriving, so a burst is prefilled in one step, not one by one.
    claim_coalesce_ms: float = 5.0
    # A busy worker looks for new entries at most this often (3 XREADGROUPs, one per class):
    # about once per step of a GPU worker (10-50 ms), instead of once per loop of a fast one
    # (the simulator at 0.5 ms a step read the streams 3 times per token, 2/3 of its Redis
    # input). An idle worker blocks and wakes at once.
    claim_poll_ms: float = 10.0
    # How often the worker compares its pending list with what it holds (an XACK lost with
    # the last second of an AOF leaves an entry pending that nobody runs); an entry must be
    # idle at least this long to count as forgotten.
    reconcile_interval_s: float = 5.0
    # A request nobody follows any more (its caller cancelled or disconnected, its
    # gateway died) is parked this long, its KV cached, for a resume on any gateway;
    # then it is abandoned (a later resume starts a new attempt from its progress).
    reattach_grace_s: float = 10.0
    # Parked requests held at most; a park beyond it abandons the attempt at once (its
    # progress stays in the log, so a later resume continues from there): bounded memory
    # whatever number of callers leave.
    max_parked: int = 1024
    # A request handed out this often (its workers keep dying) fails with UNAVAILABLE.
    max_deliveries: int = 3
    # Socket timeout of every Redis command (must exceed claim_block_ms).
    redis_timeout_s: float = 5.0
    # Reconnect backoff after a Redis error grows up to this.
    max_backoff_s: float = 2.0
    # Port of the Prometheus /metrics endpoint; 0 = off (the CLI's default is 9401).
    metrics_port: int = 0
    # "vllm": also export every series under vLLM's `vllm:` names.
    metrics_compat: str = "none"
    # OTLP/gRPC collector of the traces (protos/tracing.py), http:// or https://; "" = off.
    otlp_traces_endpoint: str = ""
    # "text" or "json" (one object per line, protos/logs.py).
    log_format: str = "text"

    def __post_init__(self) -> None:
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine_kind must be one of {', '.join(ENGINE_KINDS)}, "
                             f"got {self.engine_kind!r}")
        Keys(self.key_prefix)  # validates the prefix
        check_model_name("served_model_name", self.model_name)
        check_redis_url(self.redis_url)
        check_name("worker_id", self.worker_id)
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be > 0 and < heartbeat_ttl_s, got "
                             f"{self.heartbeat_interval_s} and {self.heartbeat_ttl_s}")
        if self.claim_block_ms < 1:
            raise ValueError(f"claim_block_ms must be >= 1, got {self.claim_block_ms}")
        if self.claim_poll_ms < 0:
            raise ValueError(f"claim_poll_ms must be >= 0, got {self.claim_poll_ms}")
        if self.claim_coalesce_ms < 0:
            raise ValueError(f"claim_coalesce_ms must be >= 0, got {self.claim_coalesce_ms}")
        if self.redis_timeout_s * 1000 <= self.claim_block_ms:
            raise ValueError(f"redis_timeout_s ({self.redis_timeout_s}) must exceed claim_block_ms "
                             f"({self.claim_block_ms} ms)")
        if self.reconcile_interval_s <= 0:
            raise ValueError(f"reconcile_interval_s must be > 0, got {self.reconcile_interval_s}")
        if self.reattach_grace_s < 0:
            raise ValueError(f"reattach_grace_s must be >= 0, got {self.reattach_grace_s}")
        if self.max_parked < 0:
            raise ValueError(f"max_parked must be >= 0, got {self.max_parked}")
        if self.max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {self.max_deliveries}")
        check_metrics_options(self.metrics_port, self.metrics_compat)
        check_otlp_endpoint(self.otlp_traces_endpoint)
        check_log_format(self.log_format)
        if self.max_backoff_s <= 0:
            raise ValueError(f"max_backoff_s must be > 0, got {self.max_backoff_s}")

    @property
    def consumer_name(self) -> str:
        """This process's consumer in the group, its registry entry and its log."""
        return f"{self.worker_id}.{self.incarnation}"

    @property
    def model_name(self) -> str:
        """--served-model-name, else the model file's name (a GGUF's without .gguf, a Hugging Face
        folder's), "sim" for the simulator, DEFAULT_MODEL_NAME for the bundled model."""
        if self.served_model_name:
            return self.served_model_name
        if self.engine_kind == "sim":
            return "sim"
        if self.engine.model is None:
            return DEFAULT_MODEL_NAME
        path = Path(self.engine.model.rstrip("/"))
        return path.stem if path.suffix == ".gguf" else path.name

    @property
    def keys(self) -> Keys:
        """This worker's keys: the request streams of its model."""
        return Keys(self.key_prefix, self.model_name)
