"""LoRA adapters loaded and unloaded at run time (protos/keys.py, "Models").

What a worker serves is its --adapter flags plus the hash ``{p}:adapters:{model}`` (name ->
path on the workers' disk), which operators write (`tokenrelay adapter load|unload`) and then
announce on ``{p}:control:{model}``. Every worker of the model re-reads the hash on that
message, at each (re)subscription and on SIGHUP, between two engine steps: it loads what is new
and unloads what left the hash. An unload refuses new requests for the adapter at once and
frees its weights once the requests using it finished (the engine's `unload_adapter`), so
nothing in flight is dropped; the heartbeat then stops naming it, and gateways stop admitting
it. A file that cannot be loaded is logged and skipped: the other adapters are still served.
"""

from __future__ import annotations

import logging
from typing import Protocol, cast

import redis

from worker.config import WorkerConfig

log = logging.getLogger(__name__)


class AdapterEngine(Protocol):
    @property
    def adapters(self) -> tuple[str, ...]: ...
    def load_adapter(self, name: str, path: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...


class AdapterSync:
    """Keeps the engine's run-time adapters equal to the hash. Only what it loaded itself is ever
    unloaded: adapters given at start (--adapter, or an engine built with them) stay."""

    def __init__(self, client: redis.Redis, config: WorkerConfig, engine: AdapterEngine) -> None:
        self._client, self._config, self._engine = client, config, engine
        self._loaded: dict[str, str] = {}  # name -> path, of what the hash made it load

    def sync(self) -> bool:
        """Load what the hash has that the engine lacks, unload what this loaded and the hash
        dropped (or moved to another path: loaded again); False if Redis did not answer."""
        keys, engine = self._config.keys, self._engine
        try:
            found = cast(dict[bytes, bytes], self._client.hgetall(keys.adapters(keys.model)))
        except redis.RedisError as e:
            log.warning("adapters not re-read: %s", e)
            return False
        wanted = {k.decode(): v.decode() for k, v in found.items()}
        for name, path in sorted(self._loaded.items()):
            if wanted.get(name) != path:
                log.info("unloading adapter %s (once its running requests finished)", name)
                engine.unload_adapter(name)
                del self._loaded[name]
        for name, path in sorted(wanted.items()):
            if name in engine.adapters:
                continue
            try:
                engine.load_adapter(name, path)
                self._loaded[name] = path
                log.info("loaded adapter %s from %s", name, path)
            except (ValueError, OSError) as e:
                log.error("adapter %s not loaded from %s: %s", name, path, e)
        return True
