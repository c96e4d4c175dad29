"""Gateway process configuration: one frozen object built once in `gateway.__main__`."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.auth import load_tenants
from gateway.limits import MIB, RequestLimits
from gateway.tls import check_server_files
from protos.keys import DEFAULT_PREFIX, Keys, PriorityClass, check_model_name, check_name, default_instance_id
from protos.logs import check_log_format
from protos.metrics import check_metrics_options
from protos.params import MAX_STREAM_INTERVAL
from protos.redis_conn import DEFAULT_REDIS_URL, check_redis_url
from protos.tracing import check_otlp_endpoint

DEFAULT_LISTEN = "127.0.0.1:50051"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
ROUTINGS = ("prefix", "none")


@dataclass(frozen=True)
class GatewayConfig:
    # host:port the gRPC server binds; port 0 = any free port.
    listen: str = DEFAULT_LISTEN
    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_PREFIX
    # Names the gateway in logs, GetServerInfo and its own channel: unique per process.
    gateway_id: str = field(default_factory=default_instance_id)
    # Requests waiting in the queue (not yet claimed by a worker, summed over the priority
    # classes) beyond which new calls get RESOURCE_EXHAUSTED instead of joining the queue.
    # The limit depends on the call's class (`max_queue_depth_of`): LOW calls are refused
    # once half of it waits, NORMAL calls at max_queue_depth, HIGH calls at 1.5x, so at
    # overload the low-priority calls are shed first and high-priority ones still get in.
    max_queue_depth: int = 256
    # The model a request without GenerateRequest.model runs; "" = the only one served (a
    # request without a model fails with INVALID_ARGUMENT while several are).
    default_model: str = ""
    # Models queued for even while no live worker serves them (scale from zero, a rolling
    # restart of a model's only worker); others are served only while a live worker heart-beats
    # them. NOT_FOUND for the rest (protos/keys.py, "Models").
    models: tuple[str, ...] = ()
    # Sent as the `grpc-retry-pushback-ms` trailer with RESOURCE_EXHAUSTED.
    retry_pushback_ms: int = 1000
    # The queue depth is re-read from Redis at most this often; in between the
    # gateway adds what it enqueued itself, so a refusal needs no Redis round trip. At
    # 5 ms a 500-call burst re-read it ~50 times, each read holding the refusals behind
    # it, and the reads were ~1.3 Redis commands per request of 64 tokens at 256 streams
    # (bench-fleet, 2026-12-03); at 50 ms another gateway's enqueues and the workers'
    # claims are seen up to 50 ms later.
    depth_cache_ms: float = 50.0
    # Socket timeout of every Redis command: Redis unreachable -> UNAVAILABLE
    # after at most this long.
    redis_timeout_s: float = 2.0
    # A call that got no event for this long checks its request is still queued
    # or held by a live worker (a dead worker's entry is queued again); an entry
    # gone without a final ends the attempt and the call starts the next one.
    # Healthy long generations stream events and never wait.
    liveness_check_s: float = 5.0
    # Every gateway sweeps this often for dead workers, fences them and queues their requests
    # again (gateway/sweeper.py): a request of a worker that died waits about this long plus
    # the workers' --heartbeat-ttl.
    sweep_interval_s: float = 1.0
    # The workers' --heartbeat-ttl: after Redis failed or stalled the sweep waits this long, so
    # that every live worker has renewed its heartbeat before anyone is judged dead.
    worker_heartbeat_ttl_s: float = 5.0
    # A request's chunks and final stay in its record this long after it ended, so a
    # resend with its request_id is answered without generating again.
    result_ttl_s: float = 300.0
    # An in-flight call waits this long for an unreachable Redis to come back (it then
    # resubscribes and replays what it missed); new calls get UNAVAILABLE at once.
    max_redis_outage_s: float = 30.0
    # On SIGTERM, in-flight calls get this long to finish.
    shutdown_grace_s: float = 10.0
    max_backoff_s: float = 2.0
    # Port of the Prometheus /metrics endpoint; 0 = off (the CLI's default is 9400).
    metrics_port: int = 0
    # "vllm": also export every series under vLLM's `vllm:` names.
    metrics_compat: str = "none"
    # OTLP/gRPC collector of the traces (protos/tracing.py), http:// or https://; "" = off.
    otlp_traces_endpoint: str = ""
    # "text" or "json" (one object per line, protos/logs.py).
    log_format: str = "text"
    # PEM files of the gRPC port's TLS identity; "" = plaintext. With tls_client_ca (mTLS)
    # every client must present a certificate that CA signed. All three are read again on
    # SIGHUP and when they change (gateway/tls.py).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Tenants and their tokens and limits (gateway/auth.py); "" = no authentication.
    auth_tokens_file: str = ""
    # The asyncio event loop: "uvloop" (libuv), "asyncio" (the standard one), or "auto" = uvloop
    # when it is installed. With uvloop a gateway at 1,024 streams used 13% less CPU per token,
    # refused a 500-call burst 14-28% faster and added half the inter-token latency p99
    # (bench-fleet A/B, alternating, 2-core EPYC, 2026-12-03).
    event_loop: str = "auto"
    # "prefix": a new request goes to the live worker with room whose prefix cache most likely
    # holds its prompt's beginning, when one does (gateway/routing.py); "none": every request
    # goes to the shared stream, where the first worker with room takes it.
    routing: str = "prefix"
    # A routed request its worker has not claimed this long after it was enqueued moves to the
    # shared stream (routing is a preference, never a wait on a busy worker). A worker claims
    # between two engine steps, and on a CPU a step with a long prefill takes seconds
    # (`make bench-routing`, 4 one-thread workers on a 2-core Xeon: a 360-token first turn's
    # TTFT p50 ~3.5 s), and a shorter wait moves a chat's turn away from its cached history
    # while its worker is in the middle of a step. 2026-12-05: turns 2-4 found 0.65 of their
    # prompt tokens cached at 500 ms (with a worker's waiting requests then counted as full),
    # 0.83 at 2,000 ms with them counted as load (gateway/routing.py; both changed at once).
    route_max_wait_ms: float = 2000.0
    # gRPC server reflection (grpcurl without .proto files). Off by default: it answers
    # without a token; `tokenrelay up` and the demo turn it on.
    enable_reflection: bool = False
    # A call's max_concurrent slot in Redis expires this long after its last refresh
    # (gateway/quotas.py), so a gateway that died holding slots frees them.
    quota_slot_ttl_s: float = 30.0
    # Events queued for one call before it is sent RESYNC instead (it then re-reads the log):
    # what a call that reads slower than it generates can hold in this gateway's memory.
    max_queued_events: int = 1024
    # -- what one caller can make this process hold (gateway/limits.py) --
    # gRPC messages larger than this are refused by grpc (RESOURCE_EXHAUSTED) before parsing.
    max_receive_message_bytes: int = MIB
    # Calls open at once on this gateway (health checks included); grpc refuses the next
    # with RESOURCE_EXHAUSTED. Bounds the tasks, relay queues and subscriptions it holds.
    max_concurrent_rpcs: int = 4096
    # Keepalive: clients may ping at most once per this interval (faster ones get GOAWAY);
    # the server pings each connection after this long without activity.
    min_client_ping_interval_s: float = 10.0
    keepalive_time_s: float = 60.0
    # GOAWAY after this long, so clients reconnect and a load balancer spreads them over new
    # gateways; 0 = never. Calls open then get max_connection_age_grace_s more to finish
    # (a longer one is cut with UNAVAILABLE, and a resumable client resumes it).
    max_connection_age_s: float = 0.0
    max_connection_age_grace_s: float = 30.0
    # Caps on one request (RequestLimits), refused with INVALID_ARGUMENT before Redis sees it.
    max_prompt_bytes: int = RequestLimits.max_prompt_bytes
    max_messages: int = RequestLimits.max_messages
    max_stop_strings: int = RequestLimits.max_stop_strings
    max_stop_token_ids: int = RequestLimits.max_stop_token_ids
    # GenerateRequest.stream_interval of requests this gateway enqueues without one (vLLM's server-wide
    # --stream-interval); 0 = one chunk a step. Not part of the request's digest: a resend through
    # another gateway attaches all the same.
    default_stream_interval: int = 0

    def __post_init__(self) -> None:
        Keys(self.key_prefix)  # validates the prefix
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        check_redis_url(self.redis_url)
        check_name("gateway_id", self.gateway_id)
        if not 0 <= self.default_stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"default_stream_interval must be in [0, {MAX_STREAM_INTERVAL}], "
                             f"got {self.default_stream_interval}")
        for model in (*self.models, *([self.default_model] if self.default_model else [])):
            check_model_name("model", model)
        for name in ("max_queue_depth", "retry_pushback_ms", "max_queued_events",
                     "max_receive_message_bytes", "max_concurrent_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.depth_cache_ms < 0:
            raise ValueError(f"depth_cache_ms must be >= 0, got {self.depth_cache_ms}")
        for name in ("redis_timeout_s", "liveness_check_s", "sweep_interval_s", "worker_heartbeat_ttl_s",
                     "max_backoff_s", "result_ttl_s",
                     "max_redis_outage_s", "quota_slot_ttl_s", "min_client_ping_interval_s",
                     "keepalive_time_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.route_max_wait_ms <= 0:
            raise ValueError(f"route_max_wait_ms must be > 0, got {self.route_max_wait_ms}")
        check_metrics_options(self.metrics_port, self.metrics_compat)
        check_otlp_endpoint(self.otlp_traces_endpoint)
        check_log_format(self.log_format)
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        if self.auth_tokens_file:
            # the gateway loads it again; here only its errors count
            load_tenants(self.auth_tokens_file, can_verify_client_certs=bool(self.tls_client_ca))
        for name in ("shutdown_grace_s", "max_connection_age_s", "max_connection_age_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        limits = self.request_limits  # RequestLimits validates its caps
        if limits.max_prompt_bytes > self.max_receive_message_bytes:
            raise ValueError(f"max_prompt_bytes ({limits.max_prompt_bytes}) must not exceed "
                             f"max_receive_message_bytes ({self.max_receive_message_bytes}): grpc "
                             "refuses a larger message before the prompt is measured")

    def max_queue_depth_of(self, priority_class: PriorityClass) -> int:
        """The queue depth at which new calls of this class are refused (see max_queue_depth)."""
        if priority_class is PriorityClass.LOW:
            return max(1, self.max_queue_depth // 2)
        if priority_class is PriorityClass.HIGH:
            return self.max_queue_depth + max(1, self.max_queue_depth // 2)
        return self.max_queue_depth

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_prompt_bytes, self.max_messages, self.max_stop_strings,
                             self.max_stop_token_ids)

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)
