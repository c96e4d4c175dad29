"""Which models and LoRA adapters this deployment serves, and which one a request runs
(protos/keys.py, "Models").

A model is served while some live worker heart-beats it (WorkerInfo.model, its
--served-model-name), or when the gateway's --models names it: those are queued for even with
no worker alive, so KEDA can scale their workers from zero. An adapter is served while some live
worker of its model has it loaded. Anything else is refused with NOT_FOUND naming what is
served, so no request waits in a stream that no worker reads; while nothing at all is served
(no live worker, no --models) the answer is UNAVAILABLE, which a retry can get past. A model
this gateway saw served in the last SERVED_GRACE_S stays served while none of its workers is
live: after a Redis outage longer than the heartbeat TTL every heartbeat has expired until the
workers reconnect, and a rolling restart of a model's only worker leaves a gap; NOT_FOUND there
would end calls (and their resumes) that a few seconds' wait in the queue serves (a chaos run
lost a stream that way). The live workers' heartbeats are read at most every WORKERS_CACHE_S,
one round trip shared by every call in that window, and by the prefix router
(gateway/routing.py) and the context-length check (gateway/admission.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

from gateway.config import GatewayConfig
from gateway.errors import InvalidArgument, NotFound, Unavailable
from gateway.queue import RequestQueue
from protos.keys import check_model_name
from protos.tokenrelay.v1 import generate_pb2

WORKERS_CACHE_S = 0.5  # a worker's heartbeat is renewed every ~0.5 s anyway
SERVED_GRACE_S = 60.0  # a model seen served stays served this long after its last live worker
Worker = tuple[str, generate_pb2.WorkerInfo]  # (consumer name, its heartbeat)


def check_adapter_name(name: str) -> None:
    """ValueError unless `name` is 1-64 of [A-Za-z0-9._-] (as the workers' --adapter names)."""
    if len(name) > 64 or "/" in name:
        raise ValueError(f"adapter must be 1-64 characters of [A-Za-z0-9._-], got {name!r}")
    check_model_name("adapter", name)


class Models:
    def __init__(self, queue: RequestQueue, config: GatewayConfig) -> None:
        self._queue, self._config = queue, config
        self._workers: list[Worker] = []
        self._by_model: dict[str, list[Worker]] = {}  # the same workers by model, grouped per read
        self._read_at = -float("inf")
        self._seen: dict[str, float] = {}  # model -> when a read last found a live worker of it
        self._lock = asyncio.Lock()
        # each read calls these with the live workers by model
        self.on_read: list[Callable[[dict[str, list[Worker]]], None]] = []

    async def live(self, max_age_s: float = WORKERS_CACHE_S) -> list[Worker]:
        """Every live worker, at most max_age_s old (raises RedisError)."""
        if time.monotonic() - self._read_at > max_age_s:
            async with self._lock:  # one read serves every call waiting on it
                if time.monotonic() - self._read_at > max_age_s:
                    self._workers = await self._queue.consumers()
                    self._by_model = defaultdict(list)
                    for consumer, info in self._workers:
                        self._by_model[info.model].append((consumer, info))
                    self._read_at = time.monotonic()
                    self._seen.update(dict.fromkeys(self._by_model, self._read_at))
                    for callback in self.on_read:
                        callback(self._by_model)
        return self._workers

    async def of_model(self, model: str, max_age_s: float = WORKERS_CACHE_S) -> list[Worker]:
        await self.live(max_age_s)
        return self._by_model.get(model, [])

    async def _served(self, max_age_s: float = WORKERS_CACHE_S) -> dict[str, list[Worker]]:
        """model -> its live workers, for every model served, declared (--models) or served within
        SERVED_GRACE_S."""
        await self.live(max_age_s)
        recent = {m for m, at in self._seen.items() if self._read_at - at <= SERVED_GRACE_S}
        names = sorted({*self._by_model, *self._config.models, *recent} - {""})
        return {name: self._by_model.get(name, []) for name in names}

    async def resolve(self, request: generate_pb2.GenerateRequest) -> str:
        """The served model the request runs: its `model`, else the default. InvalidArgument for a
        malformed name or an empty one with several models and no --default-model; NotFound for a
        model or adapter nobody serves while others are; Unavailable while nothing is served at
        all (raises RedisError)."""
        try:
            if request.model:
                check_model_name("model", request.model)
            if request.adapter:
                check_adapter_name(request.adapter)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        by_model = await self._served()
        served = list(by_model)
        if not served:  # the deployment is down or starting (a gateway that started during a Redis
            # outage has seen no worker yet): a retry can help, so not NOT_FOUND
            raise Unavailable("no live worker serves a model yet, and the gateway's --models names none to "
                              "queue for; retry once a worker is up, or list the models in --models")
        name = request.model or self._config.default_model
        if not name:
            if len(served) > 1:
                raise InvalidArgument(f"model is required: this deployment serves {', '.join(served)} and "
                                      "its gateway has no --default-model")
            name = served[0]
        if name not in served:
            raise NotFound(f"model {name!r} is not served here: served are {', '.join(served) or 'none'} (a "
                           "live worker's --served-model-name, or the gateway's --models)")
        if request.adapter:
            adapters = sorted({a for _, w in by_model[name] for a in w.adapters})
            if request.adapter not in adapters:
                raise NotFound(f"adapter {request.adapter!r} of model {name!r} is not loaded on any live "
                               f"worker: loaded are {', '.join(adapters) or 'none'}")
        return name

    async def served(self, max_age_s: float = WORKERS_CACHE_S) -> list[generate_pb2.ServedModel]:
        """Every served model with its adapters and live workers, by name (raises RedisError)."""
        by_model = await self._served(max_age_s)
        default = self._config.default_model
        names = list(by_model)
        if not default and len(names) == 1:
            default = names[0]
        return [generate_pb2.ServedModel(
            name=name, adapters=sorted({a for _, w in by_model[name] for a in w.adapters}),
            num_workers=len(by_model[name]), is_default=name == default) for name in names]
