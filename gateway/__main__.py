"""`tokenrelay-gateway` / `python -m gateway`: the gRPC front end.

Every flag has an environment variable (shown in --help); flags win. SIGHUP re-reads the
tenants file and the TLS files (a bad new file is logged and the old one stays in force).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import cast

from gateway.config import DEFAULT_LISTEN, EVENT_LOOPS, ROUTINGS, GatewayConfig
from gateway.limits import KEEPALIVE_TIMEOUT_MS, MAX_PING_STRIKES
from gateway.process import Gateway
from protos.keys import DEFAULT_PREFIX, default_instance_id
from protos.logs import configure
from protos.metrics import DEFAULT_GATEWAY_PORT
from protos.observability import add_observability_args
from protos.redis_conn import DEFAULT_REDIS_URL


def _env(name: str, default: object) -> str:
    """A string default: argparse converts it with the flag's type, so bad values get a clean error."""
    return os.environ.get(name, str(default))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenrelay-gateway",
        description="tokenrelay gateway: accepts gRPC Generate calls, queues them in Redis for the "
                    "workers and streams their tokens back.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--listen", default=_env("TOKENRELAY_LISTEN", DEFAULT_LISTEN),
                   help="host:port to serve gRPC on [env TOKENRELAY_LISTEN]")
    p.add_argument("--redis-url", default=_env("REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis to queue requests in: redis://[:password@]host:port/db, rediss://... for TLS, "
                        "or unix:///path.sock [env REDIS_URL]")
    p.add_argument("--key-prefix", default=_env("TOKENRELAY_KEY_PREFIX", DEFAULT_PREFIX),
                   help="prefix of every Redis key; gateways and workers must agree "
                        "[env TOKENRELAY_KEY_PREFIX]")
    p.add_argument("--gateway-id", default=os.environ.get("TOKENRELAY_GATEWAY_ID"),
                   help="unique name of this gateway (in logs and GetServerInfo); default host-pid-random "
                        "[env TOKENRELAY_GATEWAY_ID]")
    p.add_argument("--default-model", default=_env("TOKENRELAY_DEFAULT_MODEL", ""),
                   help="the model a request without `model` runs; default: the only one served "
                        "[env TOKENRELAY_DEFAULT_MODEL]")
    p.add_argument("--models", default=_env("TOKENRELAY_MODELS", ""),
                   help="comma-separated models to queue for even while no live worker serves them "
                        "(scale from zero); any other model is served only while a worker of it is "
                        "alive [env TOKENRELAY_MODELS]")
    p.add_argument("--max-queue-depth", type=int, default=_env("TOKENRELAY_MAX_QUEUE_DEPTH", 256),
                   help="waiting requests beyond which calls get RESOURCE_EXHAUSTED; low-priority "
                        "calls at half of it, high-priority ones at 1.5x [env TOKENRELAY_MAX_QUEUE_DEPTH]")
    p.add_argument("--retry-pushback-ms", type=int, default=_env("TOKENRELAY_RETRY_PUSHBACK_MS", 1000),
                   help="grpc-retry-pushback-ms trailer sent with RESOURCE_EXHAUSTED "
                        "[env TOKENRELAY_RETRY_PUSHBACK_MS]")
    p.add_argument("--result-ttl", type=float, default=_env("TOKENRELAY_RESULT_TTL_S", 300),
                   help="seconds a request's chunks and final stay retrievable after it ended: a resend with "
                        "its request_id gets them without generating again [env TOKENRELAY_RESULT_TTL_S]")
    p.add_argument("--max-redis-outage", type=float, default=_env("TOKENRELAY_MAX_REDIS_OUTAGE_S", 30),
                   help="seconds an in-flight call waits for Redis to come back before UNAVAILABLE "
                        "(new calls get UNAVAILABLE at once) [env TOKENRELAY_MAX_REDIS_OUTAGE_S]")
    p.add_argument("--shutdown-grace", type=float, default=_env("TOKENRELAY_SHUTDOWN_GRACE_S", 10),
                   help="seconds in-flight calls get to finish on SIGTERM [env TOKENRELAY_SHUTDOWN_GRACE_S]")
    _add_limit_args(p)
    s = p.add_argument_group("security")
    s.add_argument("--tls-cert", default=_env("TOKENRELAY_TLS_CERT", ""),
                   help="PEM certificate (chain) of the gRPC port; with --tls-key the port speaks TLS only. "
                        "It, the key and --tls-client-ca are read again on SIGHUP and when they change "
                        "(checked at each new connection): new connections get the new certificate, open "
                        "ones keep theirs; a bad new file is logged and the old one kept "
                        "[env TOKENRELAY_TLS_CERT]")
    s.add_argument("--tls-key", default=_env("TOKENRELAY_TLS_KEY", ""),
                   help="PEM private key of --tls-cert (unencrypted) [env TOKENRELAY_TLS_KEY]")
    s.add_argument("--tls-client-ca", default=_env("TOKENRELAY_TLS_CLIENT_CA", ""),
                   help="mTLS: PEM CA(s); every client must present a certificate one of them signed, "
                        "which the tenants file's client_identities can bind to a tenant "
                        "[env TOKENRELAY_TLS_CLIENT_CA]")
    s.add_argument("--auth-tokens-file", default=_env("TOKENRELAY_AUTH_TOKENS_FILE", ""),
                   help='JSON {"tenants": {NAME: {"tokens": [...], "client_identities": [...], '
                        '"max_concurrent": N, "tokens_per_minute": N, "max_priority": N}}}: callers must '
                        "send 'authorization: Bearer <token>', or (with --tls-client-ca) a client "
                        'certificate whose "CN=name", "DNS:name", "URI:uri" or "email:address" a tenant '
                        "lists; SIGHUP re-reads it; unset = no authentication "
                        "[env TOKENRELAY_AUTH_TOKENS_FILE]")
    s.add_argument("--reflection", action=argparse.BooleanOptionalAction,
                   default=_env("TOKENRELAY_REFLECTION", "0") not in ("", "0", "false"),
                   help="serve gRPC server reflection (unauthenticated: it lists the API, nothing else); "
                        "off by default [env TOKENRELAY_REFLECTION=1]")
    s.add_argument("--quota-slot-ttl", type=float, default=_env("TOKENRELAY_QUOTA_SLOT_TTL_S", 30),
                   help="seconds after which a max_concurrent slot of a gateway that died is free again "
                        "[env TOKENRELAY_QUOTA_SLOT_TTL_S]")
    p.add_argument("--routing", choices=ROUTINGS, default=_env("TOKENRELAY_ROUTING", "prefix"),
                   help="prefix: send a new request to the worker whose prefix cache most likely holds "
                        "its prompt's beginning (when one with room does); none: every worker takes "
                        "from the shared queue [env TOKENRELAY_ROUTING]")
    p.add_argument("--route-max-wait-ms", type=float, default=_env("TOKENRELAY_ROUTE_MAX_WAIT_MS", 2000),
                   help="a routed request its worker has not claimed within this moves to the shared "
                        "queue [env TOKENRELAY_ROUTE_MAX_WAIT_MS]")
    p.add_argument("--sweep-interval", type=float, default=_env("TOKENRELAY_SWEEP_INTERVAL_S", 1),
                   help="seconds between two sweeps for dead workers, whose requests are queued again "
                        "[env TOKENRELAY_SWEEP_INTERVAL_S]")
    p.add_argument("--worker-heartbeat-ttl", type=float, default=_env("TOKENRELAY_HEARTBEAT_TTL_S", 5),
                   help="the workers' --heartbeat-ttl: after a Redis outage the sweep waits this long "
                        "[env TOKENRELAY_HEARTBEAT_TTL_S, as the workers']")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default=_env("TOKENRELAY_EVENT_LOOP", "auto"),
                   help="asyncio event loop: uvloop (less CPU per token, faster refusals), the standard "
                        "asyncio one, or auto = uvloop when installed [env TOKENRELAY_EVENT_LOOP]")
    p.add_argument("--log-level", default=_env("TOKENRELAY_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR [env TOKENRELAY_LOG_LEVEL]")
    add_observability_args(p, default_metrics_port=DEFAULT_GATEWAY_PORT)
    return p


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """What one caller can make this process hold: gRPC transport limits and request caps."""
    d = GatewayConfig  # the defaults live in one place
    g = p.add_argument_group("limits", "bounded memory: gRPC transport limits, then caps on one request "
                             "(checked before anything reaches Redis; a refusal is INVALID_ARGUMENT "
                             "naming the field, the limit and its flag)")
    g.add_argument("--max-receive-message-bytes", type=int,
                   default=_env("TOKENRELAY_MAX_RECEIVE_MESSAGE_BYTES", d.max_receive_message_bytes),
                   help="largest gRPC request message; grpc refuses a larger one with RESOURCE_EXHAUSTED "
                        "[env TOKENRELAY_MAX_RECEIVE_MESSAGE_BYTES]")
    g.add_argument("--max-concurrent-rpcs", type=int,
                   default=_env("TOKENRELAY_MAX_CONCURRENT_RPCS", d.max_concurrent_rpcs),
                   help="calls open at once (health checks included); grpc refuses the next with "
                        "RESOURCE_EXHAUSTED [env TOKENRELAY_MAX_CONCURRENT_RPCS]")
    g.add_argument("--min-client-ping-interval-s", type=float,
                   default=_env("TOKENRELAY_MIN_CLIENT_PING_INTERVAL_S", d.min_client_ping_interval_s),
                   help="seconds a client's keepalive pings must be apart, with or without calls; a "
                        f"client pinging faster gets {MAX_PING_STRIKES} warnings, then GOAWAY "
                        "(too_many_pings) [env TOKENRELAY_MIN_CLIENT_PING_INTERVAL_S]")
    g.add_argument("--keepalive-time-s", type=float, default=_env("TOKENRELAY_KEEPALIVE_TIME_S",
                                                                  d.keepalive_time_s),
                   help="seconds of silence after which the server pings a connection; one that does "
                        f"not answer within {KEEPALIVE_TIMEOUT_MS // 1000} s is closed and its calls "
                        "cancelled [env TOKENRELAY_KEEPALIVE_TIME_S]")
    g.add_argument("--max-connection-age-s", type=float,
                   default=_env("TOKENRELAY_MAX_CONNECTION_AGE_S", d.max_connection_age_s),
                   help="seconds (+-10%% jitter) after which a connection gets GOAWAY, so clients "
                        "reconnect and a load balancer spreads them over new gateways; 0 = never "
                        "[env TOKENRELAY_MAX_CONNECTION_AGE_S]")
    g.add_argument("--max-connection-age-grace-s", type=float,
                   default=_env("TOKENRELAY_MAX_CONNECTION_AGE_GRACE_S", d.max_connection_age_grace_s),
                   help="seconds calls open at that GOAWAY get to finish before the connection is "
                        "closed (UNAVAILABLE, resumable) [env TOKENRELAY_MAX_CONNECTION_AGE_GRACE_S]")
    g.add_argument("--max-prompt-bytes", type=int, default=_env("TOKENRELAY_MAX_PROMPT_BYTES",
                                                                d.max_prompt_bytes),
                   help="UTF-8 bytes of a prompt, or of a chat's message contents together "
                        "[env TOKENRELAY_MAX_PROMPT_BYTES]")
    g.add_argument("--max-messages", type=int, default=_env("TOKENRELAY_MAX_MESSAGES", d.max_messages),
                   help="messages of a chat request [env TOKENRELAY_MAX_MESSAGES]")
    g.add_argument("--max-stop-strings", type=int, default=_env("TOKENRELAY_MAX_STOP_STRINGS",
                                                                d.max_stop_strings),
                   help="stopping.stop strings of a request, at most 16 (what workers accept) "
                        "[env TOKENRELAY_MAX_STOP_STRINGS]")
    g.add_argument("--max-stop-token-ids", type=int, default=_env("TOKENRELAY_MAX_STOP_TOKEN_IDS",
                                                                  d.max_stop_token_ids),
                   help="stopping.stop_token_ids of a request [env TOKENRELAY_MAX_STOP_TOKEN_IDS]")
    g.add_argument("--default-stream-interval", type=int, metavar="N",
                   default=_env("TOKENRELAY_DEFAULT_STREAM_INTERVAL", d.default_stream_interval),
                   help="tokens per chunk after the first for requests that set no stream_interval, in "
                        "[0, 256]; 0 = every token at once. Fewer messages: less gateway and Redis CPU per "
                        "token [env TOKENRELAY_DEFAULT_STREAM_INTERVAL]")
    g.add_argument("--max-queued-events", type=int, default=_env("TOKENRELAY_MAX_QUEUED_EVENTS",
                                                                 d.max_queued_events),
                   help="events queued in this gateway for one call; a call that reads slower than its "
                        "request generates is told to re-read the log instead (bounded memory) "
                        "[env TOKENRELAY_MAX_QUEUED_EVENTS]")


def config_from_args(argv: list[str] | None = None) -> tuple[GatewayConfig, str]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = GatewayConfig(
            listen=args.listen, redis_url=args.redis_url, key_prefix=args.key_prefix,
            gateway_id=args.gateway_id or default_instance_id(), max_queue_depth=args.max_queue_depth,
            default_model=args.default_model, models=tuple(m for m in args.models.split(",") if m),
            retry_pushback_ms=args.retry_pushback_ms, result_ttl_s=args.result_ttl,
            max_redis_outage_s=args.max_redis_outage, metrics_port=args.metrics_port,
            metrics_compat=args.metrics_compat, shutdown_grace_s=args.shutdown_grace,
            otlp_traces_endpoint=args.otlp_traces_endpoint, log_format=args.log_format,
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
            auth_tokens_file=args.auth_tokens_file, quota_slot_ttl_s=args.quota_slot_ttl,
            enable_reflection=args.reflection,
            max_receive_message_bytes=args.max_receive_message_bytes,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            min_client_ping_interval_s=args.min_client_ping_interval_s,
            keepalive_time_s=args.keepalive_time_s, max_connection_age_s=args.max_connection_age_s,
            max_connection_age_grace_s=args.max_connection_age_grace_s,
            max_prompt_bytes=args.max_prompt_bytes, max_messages=args.max_messages,
            max_stop_strings=args.max_stop_strings, max_stop_token_ids=args.max_stop_token_ids,
            max_queued_events=args.max_queued_events, event_loop=args.event_loop,
            default_stream_interval=args.default_stream_interval,
            routing=args.routing, route_max_wait_ms=args.route_max_wait_ms,
            sweep_interval_s=args.sweep_interval, worker_heartbeat_ttl_s=args.worker_heartbeat_ttl)
    except ValueError as e:
        parser.error(str(e))
    return config, args.log_level


async def serve(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then stop admitting and let calls finish; SIGHUP re-reads
    the tenants file and the TLS certificate, key and client CA."""
    gateway = Gateway(config)
    port = await gateway.start()
    print(f"tokenrelay gateway listening on {config.listen.rpartition(':')[0]}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:  # both, whether or not the first one's file is good
        gateway.reload_auth()
        gateway.reload_tls()

    loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down (grace %.1fs)", config.shutdown_grace_s)
    await gateway.stop()


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop `--event-loop` asks for (None: asyncio's own); SystemExit when it asks for
    uvloop and uvloop is not installed."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("tokenrelay-gateway: error: --event-loop uvloop: uvloop is not installed "
                             "(pip install uvloop)") from None
        return None
    return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)


def main(argv: list[str] | None = None) -> int:
    config, log_level = config_from_args(argv)
    configure(log_level, config.log_format, "gateway", gateway=config.gateway_id)
    factory = loop_factory(config.event_loop)
    logging.getLogger(__name__).info("event loop: %s", "uvloop" if factory else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
