"""Which request owns which KV cache slot (bookkeeping only: no torch).

The cache itself (worker/model/llama.py `KVCache`) is one tensor per K and V
holding `num_slots` sequences of up to `max_len` tokens. Slots are handed out
lowest-first so the running set stays packed at the bottom of the cache and
the decode step can read it as a contiguous view instead of a gathered copy.
A paged allocator (blocks + prefix hashes) can replace this behind the same
methods.
"""

from __future__ import annotations

import heapq


class KVCacheManager:
    def __init__(self, num_slots: int, max_len: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots))  # a heap: lowest slot first
        self._owner: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self._free) and num_tokens <= self.max_len

    def allocate(self, request_id: str) -> int:
        if request_id in self._owner:
            raise ValueError(f"request {request_id!r} already holds slot {self._owner[request_id]}")
        if not self._free:
            raise RuntimeError("no free KV cache slot (check can_allocate first)")
        slot = heapq.heappop(self._free)
        self._owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)
