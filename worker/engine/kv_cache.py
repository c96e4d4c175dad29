"""Which request owns which KV cache slot, and what a free slot still holds (no torch).

The cache itself (worker/model/llama.py `KVCache`) is one tensor per K and V
holding `num_slots` sequences of up to `max_len` tokens. A freed slot keeps
its keys and values, and this manager remembers which tokens they belong to:
a new request whose prompt starts with those tokens takes that slot and skips
prefilling the shared prefix (prefix caching at slot granularity: a multi-turn
chat continues in the slot of its previous turn; requests with the same long
system prompt reuse it). Otherwise slots are handed out lowest-first, so the
running set stays packed at the bottom of the cache and the decode step can
read it as a contiguous view instead of a gathered copy. A paged allocator
(blocks + prefix hashes) can replace this behind the same methods.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

MIN_PREFIX_HIT = 16  # shorter shared prefixes are not worth scattering the running set


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVCacheManager:
    def __init__(self, num_slots: int, max_len: int, enable_prefix_caching: bool = True) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.enable_prefix_caching = enable_prefix_caching
        self._free = list(range(num_slots))  # a heap: lowest slot first
        self._owner: dict[str, int] = {}
        self._resident: dict[int, list[int]] = {}  # free slot -> tokens whose K/V it still holds
        self.num_cached_tokens = 0  # prompt tokens served from the cache since start (a statistic)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self._free) and num_tokens <= self.max_len

    def allocate(self, request_id: str, prompt_ids: Sequence[int] = ()) -> tuple[int, int]:
        """(slot, number of leading prompt tokens whose K/V that slot already holds).

        At least the last prompt token is always left to compute: its logits
        give the first output token.
        """
        if request_id in self._owner:
            raise ValueError(f"request {request_id!r} already holds slot {self._owner[request_id]}")
        if not self._free:
            raise RuntimeError("no free KV cache slot (check can_allocate first)")
        slot, hit = self._best_prefix(prompt_ids)
        if hit >= MIN_PREFIX_HIT:
            self._free.remove(slot)
            heapq.heapify(self._free)
        else:
            slot, hit = heapq.heappop(self._free), 0
        self._resident.pop(slot, None)
        self._owner[request_id] = slot
        self.num_cached_tokens += hit
        return slot, hit

    def free(self, request_id: str, resident_ids: Sequence[int] = ()) -> None:
        """Release the slot; `resident_ids` are the tokens whose K/V it holds, for reuse."""
        slot = self._owner.pop(request_id, None)
        if slot is None:
            return
        if self.enable_prefix_caching and resident_ids:
            self._resident[slot] = list(resident_ids)
        heapq.heappush(self._free, slot)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def _best_prefix(self, prompt_ids: Sequence[int]) -> tuple[int, int]:
        best_slot, best = -1, 0
        if not self.enable_prefix_caching or len(prompt_ids) < 2:
            return best_slot, best
        for slot, tokens in self._resident.items():
            hit = min(common_prefix_len(tokens, prompt_ids), len(prompt_ids) - 1)
            if hit > best or (hit == best and hit and slot < best_slot):
                best_slot, best = slot, hit
        return best_slot, best
