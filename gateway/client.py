"""Python client for tokenrelay, and the `tokenrelay-client` command.

    from gateway.client import TokenRelayClient

    with TokenRelayClient("127.0.0.1:50051") as client:
        for delta in client.stream_text(messages=[("user", "Hi!")], max_tokens=32, temperature=0):
            print(delta, end="", flush=True)

Parameters are named like `protos.params.SamplingParams` fields (max_tokens,
temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
frequency_penalty, seed, stop, stop_token_ids, ignore_eos, logprobs,
top_logprobs, truncate_prompt, and response_format: a `protos.params.ResponseFormat`,
e.g. `ResponseFormat("json_schema", text=json.dumps(schema))` or
`ResponseFormat("choice", choices=("yes", "no"))`); unset ones take the server's defaults.
Errors surface as `grpc.RpcError` with the status code and a message.

TLS: `secure=True` (or a `ca`) connects with TLS, trusting `ca` or the system's
roots; `cert` + `key` present a client certificate (mTLS). `token` is sent as
`authorization: Bearer <token>` on every call (gateways with --auth-tokens-file).

`resumable_stream` keeps a stream going across broken connections, gateway
crashes and Redis restarts: it resends the request with its request_id and
`resume_from_index` = the chunks it has, on the next gateway of a list.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gateway.tls import channel_credentials
from protos.convert import build_request, finish_reason_from_pb
from protos.params import FinishReason, ResponseFormat
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# Statuses after which resending the same request (with resume_from_index) can succeed:
# the stream broke (connection, gateway, Redis), the queue was full, or this try timed out.
RESUMABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})


def resumable_stream(targets: Sequence[str], request: generate_pb2.GenerateRequest, *, max_attempts: int = 10,
                     retry_delay_s: float = 0.2, attempt_timeout_s: float | None = None,
                     on_resume: Callable[[int, grpc.RpcError], Any] | None = None,
                     credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                     ) -> Iterator[generate_pb2.GenerateResponse]:
    """Every chunk of `request` exactly once, then the final, resuming after any resumable error.

    The request gets a request_id if it has none (the resume needs one). Each try goes to
    the next target; after `max_attempts` tries the last error is raised. on_resume(k,
    error) is called before each resend at chunk k. credentials: TLS (tls.channel_credentials);
    token: the bearer token.
    """
    request = _copy(request)
    request.request_id = request.request_id or uuid.uuid4().hex
    num_chunks = request.resume_from_index
    for attempt in range(max_attempts):
        request.resume_from_index = num_chunks
        with _channel(targets[attempt % len(targets)], credentials) as channel:
            stub = generate_pb2_grpc.TokenRelayStub(channel)
            try:
                for response in stub.Generate(request, timeout=attempt_timeout_s, metadata=bearer(token)):
                    if response.HasField("chunk"):
                        num_chunks += 1
                    yield response
                return
            except grpc.RpcError as e:
                if e.code() not in RESUMABLE_CODES or attempt + 1 == max_attempts:
                    raise
                if on_resume is not None:
                    on_resume(num_chunks, e)
        time.sleep(retry_delay_s)


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)


def _copy(request: generate_pb2.GenerateRequest) -> generate_pb2.GenerateRequest:
    copy = generate_pb2.GenerateRequest()
    copy.CopyFrom(request)
    return copy


@dataclass
class Completion:
    """A whole answer, as collected by `TokenRelayClient.complete`."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: generate_pb2.Usage | None = None
    worker_id: str = ""


class TokenRelayClient:
    def __init__(self, target: str = DEFAULT_TARGET, *, secure: bool = False, ca: str | None = None,
                 cert: str | None = None, key: str | None = None, token: str | None = None) -> None:
        is_tls = secure or bool(ca or cert or key)
        self.channel = _channel(target, channel_credentials(ca, cert, key) if is_tls else None)
        self.stub = generate_pb2_grpc.TokenRelayStub(self.channel)
        self.metadata = bearer(token)

    def generate(self, prompt: str | None = None, messages: Iterable[tuple[str, str]] | None = None, *,
                 timeout_s: float | None = None, request_id: str = "",
                 **params: Any) -> Iterator[generate_pb2.GenerateResponse]:
        """The raw response stream: chunks, then one final message."""
        request = build_request(prompt, messages, request_id=request_id, **params)
        return iter(self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata))

    def stream_text(self, prompt: str | None = None, messages: Iterable[tuple[str, str]] | None = None,
                    **kwargs: Any) -> Iterator[str]:
        """Only the text deltas, as they arrive."""
        for response in self.generate(prompt, messages, **kwargs):
            if response.HasField("chunk") and response.chunk.text:
                yield response.chunk.text

    def complete(self, prompt: str | None = None, messages: Iterable[tuple[str, str]] | None = None,
                 **kwargs: Any) -> Completion:
        """Wait for the whole answer."""
        result = Completion()
        for response in self.generate(prompt, messages, **kwargs):
            result.request_id = response.request_id
            if response.HasField("chunk"):
                result.token_ids.extend(response.chunk.token_ids)
            else:
                result.text = response.final.text
                result.finish_reason = finish_reason_from_pb(response.final.finish_reason)
                result.usage = response.final.usage
                result.worker_id = response.final.worker_id
        return result

    def server_info(self, timeout_s: float = 5.0) -> generate_pb2.ServerInfo:
        return self.stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=timeout_s,
                                       metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TokenRelayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_generation_args(p: argparse.ArgumentParser, *, with_model: bool = True) -> None:
    """Sampling/stopping flags shared by `tokenrelay-client` and `tokenrelay demo` (whose --model is
    the workers' model file: with_model=False)."""
    g = p.add_argument_group("generation (unset = the server's default)")
    if with_model:
        g.add_argument("--model", help="the served model (default: the deployment's default)")
        g.add_argument("--adapter", help="a LoRA adapter of the model (default: the base model)")
    g.add_argument("--max-tokens", type=int, help="most tokens to generate (server default 256)")
    g.add_argument("--temperature", type=float, help="0 = greedy; higher = more random (default 1.0)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default 0 = off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min_p x p(best) (default 0 = off)")
    g.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeats (default 1 = off)")
    g.add_argument("--presence-penalty", type=float, help="in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, help="in [-2, 2] (default 0)")
    g.add_argument("--seed", type=int, help="make sampling reproducible")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    g.add_argument("--stream-interval", type=int, metavar="N",
                   help="tokens per chunk after the first, in [0, 256] (default 1: every token at once)")
    f = p.add_argument_group("structured output (at most one; unset = free text)")
    x = f.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema file")
    x.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    x.add_argument("--regex", metavar="REGEX", help="the output fully matches this regular expression")
    x.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF/GBNF file (rule root)")
    x.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these; repeatable")
    f.add_argument("--strict", action="store_true", help="with --json-schema: no properties beyond its own")


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--target, TLS and token flags of a command that calls a gateway."""
    p.add_argument("--target", default=os.environ.get("TOKENRELAY_TARGET", DEFAULT_TARGET),
                   help=f"gateway host:port (env TOKENRELAY_TARGET, default {DEFAULT_TARGET})")
    c = p.add_argument_group("security")
    c.add_argument("--tls", action="store_true", help="connect with TLS (implied by --ca/--cert)")
    c.add_argument("--ca", default=os.environ.get("TOKENRELAY_CA"),
                   help="PEM CA that signed the gateway's certificate (default: the system's roots) "
                        "[env TOKENRELAY_CA]")
    c.add_argument("--cert", default=os.environ.get("TOKENRELAY_CERT"),
                   help="PEM client certificate for mTLS, with --key [env TOKENRELAY_CERT]")
    c.add_argument("--key", default=os.environ.get("TOKENRELAY_KEY"),
                   help="PEM private key of --cert [env TOKENRELAY_KEY]")
    c.add_argument("--token", default=os.environ.get("TOKENRELAY_TOKEN"),
                   help="bearer token of a gateway with --auth-tokens-file [env TOKENRELAY_TOKEN]")


def client_from_args(args: argparse.Namespace) -> TokenRelayClient:
    """ValueError naming the problem (a --cert without --key, an unreadable file)."""
    return TokenRelayClient(args.target, secure=args.tls, ca=args.ca, cert=args.cert, key=args.key,
                            token=args.token)


GENERATION_FLAGS = ("model", "adapter", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                    "ignore_eos", "stream_interval")


def generation_params(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as build_request's parameters; OSError if a --json-schema/--grammar file is unreadable."""
    params = {name: getattr(args, name, None) for name in GENERATION_FLAGS}
    return params | {"response_format": response_format(args)}


def response_format(args: argparse.Namespace) -> ResponseFormat | None:
    """ValueError for an empty one (the server's message); OSError for an unreadable file."""
    if args.json_schema:
        return ResponseFormat("json_schema", text=Path(args.json_schema).read_text(), is_strict=args.strict)
    if args.json_object:
        return ResponseFormat("json_object")
    if args.regex is not None:
        return ResponseFormat("regex", text=args.regex)
    if args.grammar:
        return ResponseFormat("grammar", text=Path(args.grammar).read_text())
    if args.choice:
        return ResponseFormat("choice", choices=tuple(args.choice))
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenrelay-client",
        description="Send one prompt to a tokenrelay gateway and print the answer as it streams in.",
        epilog="examples:\n"
               "  tokenrelay-client 'Once upon a time'\n"
               "  tokenrelay-client --chat --max-tokens 64 --temperature 0 'What is the capital of France?'\n"
               "  echo 'Tell me a joke' | tokenrelay-client --chat -\n"
               "  tokenrelay-client --chat --choice yes --choice no 'Is Paris in France?'\n"
               "  tokenrelay-client --chat --json-schema person.json 'Describe a person as JSON.'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the text to complete, or the user message with --chat; - reads stdin")
    add_connection_args(p)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user chat message (uses the model's chat template)")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--timeout", type=float, help="seconds before the call is cancelled (deadline)")
    p.add_argument("--quiet", action="store_true", help="do not print usage to stderr at the end")
    add_generation_args(p)
    return p


def print_stream(responses: Iterable[generate_pb2.GenerateResponse], *, quiet: bool = False) -> None:
    """Write text deltas to stdout as they arrive; usage to stderr at the end."""
    for response in responses:
        if response.HasField("chunk"):
            sys.stdout.write(response.chunk.text)
            sys.stdout.flush()
        else:
            sys.stdout.write("\n")
            if quiet:
                continue
            final, usage = response.final, response.final.usage
            reason = generate_pb2.FinishReason.Name(final.finish_reason).split("_", 2)[2].lower()
            sys.stderr.write(f"[{reason}] {usage.prompt_tokens} prompt + {usage.completion_tokens} generated "
                             f"tokens, first token after {usage.time_to_first_token_s * 1000:.0f} ms, "
                             f"worker {final.worker_id}\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        client = client_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = None
    if args.chat:
        messages = ([("system", args.system)] if args.system else []) + [("user", text)]
    try:
        params = generation_params(args)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    with client:
        try:
            responses = client.generate(None if args.chat else text, messages, timeout_s=args.timeout,
                                        **params)
            print_stream(responses, quiet=args.quiet)
        except grpc.RpcError as e:
            sys.stderr.write(f"\nerror: {e.code().name}: {e.details()}\n")
            return 1
        except KeyboardInterrupt:  # Ctrl-C cancels the call, which frees the worker's KV blocks
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
