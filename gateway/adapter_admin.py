"""`tokenrelay adapter load|unload|list`: the LoRA adapters a model's workers load at run time.

    tokenrelay adapter load --model M NAME PATH    every worker of M loads PATH (a PEFT folder on
                                                   the workers' disk) as NAME, between two steps
    tokenrelay adapter unload --model M NAME       new requests for NAME get NOT_FOUND; running
                                                   ones finish, then its weights are freed
    tokenrelay adapter list --model M              what the hash holds (ServerInfo.served shows
                                                   what live workers actually loaded)

It writes the hash ``{p}:adapters:{model}`` and announces the change on ``{p}:control:{model}``
(protos/keys.py, "Models"; worker/io/adapters.py): a worker started later loads the same set.
Adapters given with the workers' --adapter flags are not in the hash and stay loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import cast

from gateway.models import check_adapter_name
from protos.keys import DEFAULT_PREFIX, Keys
from protos.redis_conn import DEFAULT_REDIS_URL, sync_client


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                   help="the deployment's Redis [env REDIS_URL]")
    p.add_argument("--key-prefix", default=os.environ.get("TOKENRELAY_KEY_PREFIX", DEFAULT_PREFIX),
                   help="prefix of every Redis key [env TOKENRELAY_KEY_PREFIX]")
    p.add_argument("--model", required=True, help="the served model (its workers' --served-model-name)")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    load = sub.add_parser("load", help="load an adapter on every worker of the model")
    load.add_argument("name", help="the adapter's name in GenerateRequest.adapter: 1-64 of [A-Za-z0-9._-]")
    load.add_argument("path", help="its PEFT folder (adapter_config.json, adapter_model.safetensors), "
                                   "as the workers see it")
    unload = sub.add_parser("unload", help="unload an adapter (requests using it finish first)")
    unload.add_argument("name")
    sub.add_parser("list", help="the adapters the hash holds")


def run(args: argparse.Namespace) -> int:
    """ValueError for a malformed name or model; redis's errors unchanged."""
    keys = Keys(args.key_prefix, args.model)
    if args.action != "list":
        check_adapter_name(args.name)
    with sync_client(args.redis_url, timeout_s=5.0) as client:
        hash_key = keys.adapters(args.model)
        if args.action == "load":
            client.hset(hash_key, args.name, args.path)
        elif args.action == "unload" and not client.hdel(hash_key, args.name):
            print(f"adapter {args.name} was not in the hash of model {args.model}", file=sys.stderr)
            return 1
        if args.action != "list":
            listeners = client.publish(keys.control(args.model), args.action)
            print(f"{args.action} {args.name}: told {listeners} worker(s) of model {args.model}")
            return 0
        for name, path in sorted(cast(dict[bytes, bytes], client.hgetall(hash_key)).items()):
            print(f"{name.decode()}\t{path.decode()}")
    return 0
