"""The LoRA adapters one engine serves: loaded by name, refused once unloading, freed once unused.

Loading and unloading happen between steps, on the thread that calls `step()`. An
unloaded adapter stops taking requests at once; its weights go once no running,
waiting or compiling sequence names it (`release_unused`, after every step), so
requests in flight finish with the adapter they started with.

Each load gets a cache scope of its own (`cache_scope`): a request's prompt blocks
are found only by requests of the same adapter and the same load of it, never by the
base model's or another adapter's (their K/V differ), nor by a later load of the same
name whose weights may have changed.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

from worker.engine.config import ADAPTER_NAME
from worker.model.llama import LlamaModel
from worker.model.lora import LoraAdapter, load_adapter

log = logging.getLogger(__name__)

# Scopes from the gateway are UTF-8 (protos' cache_scope); 0xff never occurs in UTF-8, so an
# adapter's scope can equal no other request's.
SCOPE_PREFIX = b"\xfflora\x00"


class AdapterRegistry:
    def __init__(self, model: LlamaModel, max_adapters: int, max_rank: int) -> None:
        if not model.is_lora_enabled:
            raise ValueError("LoRA adapters need a model built with enable_lora")
        self.model = model
        self.max_adapters = max_adapters  # most distinct adapters per step (the scheduler keeps it)
        self.max_rank = max_rank
        self._loaded: dict[str, LoraAdapter] = {}  # in load order
        self._load_ids: dict[str, int] = {}
        self._next_id = itertools.count()
        self._unloading: set[str] = set()

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters requests may name: loaded and not unloading."""
        return tuple(n for n in self._loaded if n not in self._unloading)

    @property
    def loaded(self) -> tuple[str, ...]:
        """Every adapter holding weights, unloading ones included."""
        return tuple(self._loaded)

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read a PEFT LoRA folder; ValueError naming the problem (the name, the file, the field)."""
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"adapter name {name!r} must match {ADAPTER_NAME.pattern}")
        if name in self._unloading:
            raise ValueError(f"adapter {name!r} is unloading (requests in flight still use it); "
                             f"load it again once they finish")
        if name in self._loaded:
            raise ValueError(f"adapter {name!r} is already loaded")
        cfg = self.model.config
        adapter = load_adapter(name, path, cfg, max_rank=self.max_rank, dtype=self.model.dtype,
                               device=self.model.device)
        self._loaded[name] = adapter
        self._load_ids[name] = next(self._next_id)
        log.info("LoRA adapter %s loaded from %s: r %d, scale %.4g, %s (%.1f MB)", name, path, adapter.rank,
                 adapter.scale, ", ".join(adapter.modules), adapter.nbytes / 2**20)
        return adapter

    def unload(self, name: str, in_use: set[str]) -> None:
        """Refuse new requests for `name` now; free it now if nothing in `in_use` names it, else
        once `release_unused` finds it unused. Unloading an unloading adapter is a no-op."""
        if name not in self._loaded:
            raise self.unknown(name)
        self._unloading.add(name)
        self.release_unused(in_use)

    def release_unused(self, in_use: set[str]) -> None:
        """Free the unloading adapters that no sequence in `in_use` names any more."""
        for name in sorted(self._unloading - in_use):
            self._unloading.discard(name)
            del self._loaded[name], self._load_ids[name]
            log.info("LoRA adapter %s unloaded", name)

    @property
    def is_unloading(self) -> bool:
        return bool(self._unloading)

    def check(self, name: str) -> None:
        """ValueError unless a new request may use adapter `name`."""
        if name not in self._loaded or name in self._unloading:
            raise self.unknown(name)

    def unknown(self, name: str) -> ValueError:
        state = "is unloading" if name in self._unloading else "is not loaded"
        return ValueError(f"adapter {name!r} {state}; loaded: {', '.join(self.names) or 'none'}")

    def get(self, name: str) -> LoraAdapter:
        """The weights of a loaded adapter (unloading ones too: their requests still run)."""
        return self._loaded[name]

    def cache_scope(self, name: str, scope: bytes) -> bytes:
        """The scope of a request of adapter `name` whose scope without it is `scope`."""
        return SCOPE_PREFIX + f"{name}\0{self._load_ids[name]}\0".encode() + scope
