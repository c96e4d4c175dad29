"""The prefix cache's scope through the worker: from `QueuedRequest.cache_scope` (Redis) to the
engine's sequences, and through the scheduler's admission and preemption (no model). The KV
manager's own scope tests are in test_kv_manager.py; the engine's in test_engine.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from protos.convert import build_request
from protos.keys import STREAM_DATA_FIELD, Keys
from protos.params import ChatMessage, FinishReason, PromptInput, SamplingParams, Usage
from protos.tokenrelay.v1 import queue_pb2
from tests.consumer_factories import Replies
from tests.factories import CountingEngine
from tests.service import WorkerThread
from worker.config import DEFAULT_MODEL_NAME
from worker.engine.kv_manager import KVCacheManager
from worker.engine.outputs import Admitted
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.stopping import StoppingCriteria

SYSTEM = list(range(100, 140))  # 10 blocks of 4


def make_seq(request_id: str, prompt: list[int], cache_scope: bytes) -> Sequence:
    params = SamplingParams(max_tokens=64)
    return Sequence(request_id, prompt, params, seed=0, stopping=StoppingCriteria(params, frozenset(), 64),
                    cache_scope=cache_scope)


def make_scheduler(num_blocks: int = 200) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, max_model_len=1000)
    return Scheduler(kv, max_num_seqs=8, max_prefill_tokens=200)


def step(s: Scheduler) -> dict[str, int]:
    """One step as the engine runs it; the prefill chunks that ran, by request."""
    out = s.schedule()
    s.commit(out)
    for seq in [c.seq for c in out.prefills if c.is_last] + out.decodes:
        seq.output_ids.append(1)
    return {c.seq.request_id: c.num_tokens for c in out.prefills}


def test_an_identical_prompt_of_another_scope_is_neither_held_back_nor_shared() -> None:
    """Within one scope a request waits a step for a prefix being computed, then hits it; another
    scope's identical prompt is admitted at once and computes all of it."""
    s = make_scheduler()
    a1, a2, b = (make_seq(rid, SYSTEM + [7], scope)
                 for rid, scope in [("a1", b"tenant-a"), ("a2", b"tenant-a"), ("b", b"tenant-b")])
    s.add(a1)
    s.add(b)
    s.add(a2)
    assert step(s) == {"a1": 41, "b": 41}  # b does not wait behind a1's prefix; a2 does
    assert step(s) == {"a2": 1}
    assert (a1.num_cached_tokens, b.num_cached_tokens, a2.num_cached_tokens) == (0, 0, 40)
    s.kv.check()


def test_a_preempted_request_readmits_on_the_blocks_of_its_own_scope() -> None:
    s = make_scheduler(num_blocks=6)
    old, new = make_seq("old", list(range(8)), b"tenant-a"), make_seq("new", list(range(20, 28)), b"tenant-b")
    s.add(old)
    s.add(new)
    while not s.num_preemptions:  # both decode until 13 tokens need 4 blocks each: new (the newest) goes
        step(s)
    assert s.waiting[0] is new and s.num_preemptions == 1
    s.finish(old, FinishReason.EOS)
    assert step(s) == {"new": 5}  # its 8 prompt tokens from the blocks it computed in its scope
    s.kv.check()


class ScopeRecordingEngine(CountingEngine):
    """Streams like CountingEngine and records the cache scope each request was admitted with."""

    def __init__(self) -> None:
        super().__init__()
        self.scopes: list[bytes] = []

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, **kwargs: Any) -> Admitted:
        self.scopes.append(kwargs["cache_scope"])
        return super().add_request(request_id, prompt, params, **kwargs)


def test_a_queued_requests_cache_scope_reaches_the_engine(
        redis_url: str, prefix: str, start_worker: Callable[..., WorkerThread]) -> None:
    client, keys = redis.Redis.from_url(redis_url), Keys(prefix, DEFAULT_MODEL_NAME)
    engine = ScopeRecordingEngine()
    replies = Replies(client)
    replies.follow(keys, "scoped", "unscoped")
    for request_id, scope in [("scoped", b"group:tenant-a\x00salt"), ("unscoped", b"")]:
        queued = queue_pb2.QueuedRequest(request_id=request_id, request=build_request("hi", max_tokens=2),
                                         result_ttl_s=60, enqueued_unix=time.time(), tenant="tenant-a",
                                         cache_scope=scope)
        client.xadd(keys.requests, {STREAM_DATA_FIELD: queued.SerializeToString()})
    start_worker(engine)
    events = replies(2, timeout=30)
    assert all(evs[-1].WhichOneof("kind") == "final" for evs in events.values())
    assert sorted(engine.scopes) == [b"", b"group:tenant-a\x00salt"]
    replies.close()
    client.close()


@pytest.mark.slow
def test_usage_reports_cached_prompt_tokens_only_from_the_callers_own_scope(smollm_engine: Any) -> None:
    """What a caller sees (`Usage.cached_prompt_tokens`) tells it nothing of another scope's cache."""
    system = "You are a terse assistant for the accounts team of a small company. " * 6
    prompt = PromptInput(messages=(ChatMessage("system", system), ChatMessage("user", "Hello?")))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    usage: dict[str, Usage] = {}
    for request_id, scope in [("a1", b"tenant-a"), ("b", b"tenant-b"), ("a2", b"tenant-a")]:
        smollm_engine.add_request(request_id, prompt, params, cache_scope=scope)
        while smollm_engine.has_unfinished():
            usage |= {o.request_id: o.usage for o in smollm_engine.step() if o.usage is not None}
    cached = {rid: u.cached_prompt_tokens for rid, u in usage.items()}
    assert cached["a1"] == cached["b"] == 0 < cached["a2"]
