"""`tokenrelay`: run the whole stack with one command.

    tokenrelay up                 Redis + gateway + workers until Ctrl-C
    tokenrelay demo               the same, stream one chat answer, shut down
    tokenrelay bench              load-test a running gateway (like `vllm bench serve`)
    tokenrelay adapter ...        load or unload a model's LoRA adapters at run time
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from redis.exceptions import RedisError

from gateway import adapter_admin, bench, redis_acl
from gateway.client import TokenRelayClient, add_generation_args, generation_params, print_stream
from gateway.launcher import Stack, StackConfig
from protos.metrics import DEFAULT_GATEWAY_PORT
from protos.redis_conn import redact_url

DEFAULT_DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def _add_stack_args(p: argparse.ArgumentParser, *, listen: str | None) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="use this Redis (redis://[:password@]host:port/db, rediss://, unix://) instead of "
                        "starting a private one [env REDIS_URL]")
    p.add_argument("--workers", type=int, default=1, help="worker processes to start (default 1)")
    if listen is not None:
        p.add_argument("--listen", default=listen, help=f"gateway host:port (default {listen})")
    w = p.add_argument_group("workers")
    w.add_argument("--model", help="GGUF file or Hugging Face folder (default: the bundled "
                                   "SmolLM2-135M-Instruct)")
    w.add_argument("--device", help="cpu (default), cuda, cuda:1, ...")
    w.add_argument("--max-num-seqs", type=int, help="requests each worker generates together (default 128)")
    w.add_argument("--num-threads", type=int, help="torch CPU threads per worker")
    p.add_argument("--max-queue-depth", type=int, help="gateway load-shedding limit (default 256)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenrelay",
        description="tokenrelay: streaming LLM serving over gRPC with a Redis queue between the API "
                    "(gateway) and the model (workers).",
        epilog="Each part also runs alone: tokenrelay-gateway, tokenrelay-worker, tokenrelay-client "
               "(see their --help).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="start Redis + gateway + workers and keep them running (Ctrl-C stops)",
                        description="Start Redis (a private one unless --redis-url), the gateway and "
                                    "--workers worker processes; Ctrl-C stops all of them cleanly.")
    _add_stack_args(up, listen="127.0.0.1:50051")
    up.add_argument("--metrics-port", type=int, default=DEFAULT_GATEWAY_PORT,
                    help="Prometheus /metrics of the gateway on this port, of worker i on this + 1 + i; "
                         f"0 = off (default {DEFAULT_GATEWAY_PORT})")
    demo = sub.add_parser(
        "demo", help="start everything, stream one answer, stop everything",
        description="Start a stack (a private Redis unless --redis-url), ask the model one chat question, "
                    "print the answer token by token, shut everything down and exit.")
    _add_stack_args(demo, listen=None)
    demo.add_argument("--prompt", default=DEFAULT_DEMO_PROMPT, help="the question to ask")
    add_generation_args(demo, with_model=False)  # the demo defaults to --max-tokens 128 --temperature 0
    load = sub.add_parser("bench", help="load-test a running gateway; print vllm-bench-style metrics",
                          description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(load)
    adapter = sub.add_parser("adapter", help="load, unload or list a model's LoRA adapters at run time",
                             description=adapter_admin.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    adapter_admin.add_arguments(adapter)
    acl = sub.add_parser("acl", help="print the Redis ACL rules of a per-worker user",
                         description=redis_acl.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    redis_acl.add_arguments(acl)
    return p


def _stack_config(args: argparse.Namespace, listen: str, log_level: str) -> StackConfig:
    worker_args: list[str] = []
    for flag in ("model", "device", "max_num_seqs", "num_threads"):
        if getattr(args, flag) is not None:
            worker_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    gateway_args = [] if args.max_queue_depth is None else ["--max-queue-depth", str(args.max_queue_depth)]
    return StackConfig(listen=listen, redis_url=args.redis_url, num_workers=args.workers,
                       worker_args=worker_args, gateway_args=gateway_args, log_level=log_level,
                       metrics_port=getattr(args, "metrics_port", 0))  # the demo exports none


def up(args: argparse.Namespace) -> int:
    with Stack(_stack_config(args, args.listen, "INFO")) as stack:
        info = stack.wait_ready()
        print(f"tokenrelay is up: gRPC on {stack.target}, Redis at {redact_url(stack.redis_url)}, "
              f"{len(info.workers)} worker(s). Try:\n  tokenrelay-client --target {stack.target} --chat "
              f"'Hello!'\nCtrl-C stops everything.", flush=True)
        stack.wait()
        down = stack.exited()
        if down:
            print(f"stopping: {', '.join(down)} exited", file=sys.stderr)
    return 0


def demo(args: argparse.Namespace) -> int:
    config = _stack_config(args, "127.0.0.1:0", "WARNING")  # any free port: gateway/launcher.py
    print("starting Redis, the gateway and a worker (loading the model)...", file=sys.stderr, flush=True)
    with Stack(config) as stack:
        info = stack.wait_ready()
        print(f"model {info.workers[0].model} ready.\n\n> {args.prompt}\n", file=sys.stderr, flush=True)
        params = generation_params(args)
        if params["max_tokens"] is None:
            params["max_tokens"] = 128
        if params["temperature"] is None:
            params["temperature"] = 0.0  # greedy: a 135M model answers best without sampling noise
        with TokenRelayClient(stack.target) as client:
            try:
                print_stream(client.generate(messages=[("user", args.prompt)], timeout_s=300, **params))
            except grpc.RpcError as e:
                print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
        print("\nshutting down...", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"up": up, "demo": demo, "bench": bench.bench, "adapter": adapter_admin.run,
                    "acl": redis_acl.run}
        return commands[args.command](args)
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError, RedisError) as e:
        print(f"tokenrelay {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # during start-up; the stack is already stopped
        return 130


if __name__ == "__main__":
    sys.exit(main())
