"""Speculative decoding: n-gram proposals, and verification in the running batch that never
changes the output (tokens and logprobs), whatever the proposals, k or the batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from protos.params import FinishReason, SamplingParams
from tests.factories import VOCAB, greedy, make_engine, make_hf_model, make_prompts, ours_from_hf
from worker.engine.core import EngineCore
from worker.engine.spec_policy import SpeculationPolicy
from worker.engine.speculative import num_accepted, propose_ngram
from worker.model.llama import LlamaModel

Lookup = Callable[[Sequence[int], int], list[int]]


class LookupProposer:
    """Proposals from a function of the sequence's tokens (an oracle in these tests)."""

    def __init__(self, lookup: Lookup) -> None:
        self.lookup = lookup

    def propose(self, seqs: list[Any], ks: list[int]) -> list[list[int]]:
        return [self.lookup(s.prompt_ids + s.output_ids, k) for s, k in zip(seqs, ks, strict=True)]

    def retain(self, request_ids: Any) -> None:
        pass


@pytest.mark.parametrize(("token_ids", "k", "expected"), [
    ([1, 2, 3, 4, 1, 2, 3], 2, [4, 1]),  # the last 3 tokens occurred at 0
    ([1, 2, 3], 3, []),  # nothing repeats
    ([5, 6, 7, 5, 6, 8, 5, 6], 1, [8]),  # the latest occurrence, not the first (7)
    ([7, 1, 2, 3, 8, 2, 3, 5, 1, 2, 3], 2, [8, 2]),  # a longer match wins over a later shorter one
    ([1, 2, 1, 2], 4, [1, 2]),  # fewer than k tokens follow
    ([1, 2, 1], 4, []),  # one repeated token is no match (MIN_NGRAM)
    ([3, 3, 3], 2, [3]),
    ([1, 2, 1], 0, []),
    ([4], 3, []),
    ([], 3, []),
    ([9, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4], 3, [5, 0, 1]),  # n = 4
])
def test_propose_ngram(token_ids: list[int], k: int, expected: list[int]) -> None:
    assert propose_ngram(token_ids, k) == expected


@pytest.mark.parametrize(("draft", "target", "expected"), [
    ([], [5], 0), ([1, 2, 3], [1, 2, 4, 9], 2), ([1, 2], [1, 2, 7], 2), ([1], [2, 3], 0)])
def test_num_accepted(draft: list[int], target: list[int], expected: int) -> None:
    assert num_accepted(draft, target) == expected


# -- engine: the same output with and without speculation ----------------------------------------


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return ours_from_hf(make_hf_model())


def repetitive_prompts(n: int) -> list[list[int]]:
    """Random prompts that repeat a pattern, so the n-gram proposer finds matches."""
    return [p * 3 + q for p, q in zip(make_prompts(n, (5, 7, 4), seed=1), make_prompts(n, (3, 9), seed=2),
                                       strict=True)]


def run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
        **kw: Any) -> dict[str, list[tuple[int, float | None, Any]]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p, **kw)
    out: dict[str, list[tuple[int, float | None, Any]]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(2000):
        if not engine.has_unfinished():
            engine.kv.check()
            assert engine.kv.num_free_blocks == engine.kv.num_blocks  # rollback left nothing behind
            return out
        for o in engine.step():
            if o.token is not None:
                p = o.seq.params  # what the text engine reports: the request's own top_logprobs
                asked = p.num_logprobs is not None
                top = (o.token.top or [])[:p.top_logprobs] if asked else None
                lp = o.token.logprob if asked else None
                out.setdefault(o.seq.request_id, []).append((o.token.token_id, lp, top))
    raise AssertionError("engine did not finish")


def spec_engine(model: LlamaModel, k: int, lookup: Lookup | None = None, **kw: Any) -> EngineCore:
    """Speculation in every step and for every sequence, whatever its acceptance; proposals
    from `lookup` (default: n-gram)."""
    engine = make_engine(model, num_speculative_tokens=k, **kw)
    if lookup is not None:
        engine.proposer = LookupProposer(lookup)
    engine.spec = SpeculationPolicy(k, max_batch=1000)
    engine.spec.num_proposals = lambda state, num_decodes: k  # type: ignore[method-assign]
    return engine


def oracle(prompts: list[list[int]], refs: list[list[int]]) -> Lookup:
    """Proposes the plain run's continuation with every 4th token wrong: runs of accepted
    proposals, rejections at every offset, and the bonus token."""
    def propose(token_ids: Sequence[int], k: int) -> list[int]:
        for prompt, ref in zip(prompts, refs, strict=True):
            if list(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                wanted = ref[done:done + k]
                return [(t + 1) % VOCAB if (done + i) % 4 == 3 else t for i, t in enumerate(wanted)]
        raise AssertionError("unknown sequence")
    return propose


def ids(out: dict[str, list[tuple[int, float | None, Any]]]) -> dict[str, list[int]]:
    return {rid: [t for t, _, _ in toks] for rid, toks in out.items()}


def assert_same(got: dict[str, list[tuple[int, float | None, Any]]],
                want: dict[str, list[tuple[int, float | None, Any]]]) -> None:
    assert ids(got) == ids(want)
    for rid, toks in want.items():
        for (_, lp, top), (_, lp2, top2) in zip(toks, got[rid], strict=True):
            assert (lp is None) == (lp2 is None) and (top is None) == (top2 is None)
            if lp is not None and lp2 is not None:
                assert lp2 == pytest.approx(lp, abs=1e-4)
            if top is not None and top2 is not None:
                assert [i for i, _ in top2] == [i for i, _ in top]
                assert [v for _, v in top2] == pytest.approx([v for _, v in top], abs=1e-4)


PARAMS = {
    "greedy": greedy(16),
    "greedy-logprobs": greedy(16, logprobs=True, top_logprobs=3),
    "temperature-top-p": SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1),
    "top-k-logprobs": SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=2, logprobs=True),
    "min-p": SamplingParams(max_tokens=16, temperature=0.7, min_p=0.1, seed=3),
    "penalties": SamplingParams(max_tokens=16, temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.3, seed=4),
    "greedy-penalties": greedy(16, repetition_penalty=1.5, frequency_penalty=0.5),
}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", [n for n in PARAMS if n != "greedy"])  # greedy-logprobs covers it
def test_same_output_with_oracle_proposals(model: LlamaModel, name: str, k: int) -> None:
    prompts, params = make_prompts(4), [PARAMS[name]] * 4
    want = run(make_engine(model), prompts, params)
    engine = spec_engine(model, k, oracle(prompts, [[t for t, _, _ in want[f"r{i}"]] for i in range(4)]))
    assert_same(run(engine, prompts, params), want)
    assert engine.num_spec_accepted_tokens > 0
    assert engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens  # rejections too


@pytest.mark.parametrize("k", [3])
def test_same_output_in_mixed_batches_with_ngram_proposals(model: LlamaModel, k: int) -> None:
    """Chunked prefills, plain decodes and verified runs in the same steps; more requests than
    slots; every sampling setting at once."""
    prompts = repetitive_prompts(7)
    params = [list(PARAMS.values())[i % len(PARAMS)] for i in range(7)]
    kw = {"num_seqs": 4, "max_prefill_tokens": 8}
    want = run(make_engine(model, **kw), prompts, params)
    engine = spec_engine(model, k, **kw)
    assert_same(run(engine, prompts, params), want)
    assert engine.num_spec_drafts > 0


def test_same_output_on_the_torch_decode_path() -> None:
    """The CUDA path's attention (torch, no C kernels) for the verify rows, on CPU."""
    torch_model = ours_from_hf(make_hf_model(), native=False)
    prompts, params = make_prompts(4), [PARAMS["top-k-logprobs"]] * 4
    want = run(make_engine(torch_model), prompts, params)
    refs = [[t for t, _, _ in want[f"r{i}"]] for i in range(4)]
    engine = spec_engine(torch_model, 3, oracle(prompts, refs))
    assert_same(run(engine, prompts, params), want)
    assert engine.num_spec_accepted_tokens > 0


def test_stops_inside_an_accepted_run(model: LlamaModel) -> None:
    """Stop ids, EOS and max_tokens hit in the middle of a run of accepted proposals: the
    rest is dropped, exactly as plain decoding stops."""
    prompts = make_prompts(3)
    ref = run(make_engine(model), prompts, [greedy(20, ignore_eos=True)] * 3)
    refs = [[t for t, _, _ in ref[f"r{i}"]] for i in range(3)]
    perfect = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}

    def lookup(token_ids: Sequence[int], k: int) -> list[int]:
        return next(r[len(token_ids) - len(p):][:k] for p, r in perfect.items()
                    if tuple(token_ids[:len(p)]) == p)

    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"stop_token_ids": (refs[0][5],)}, {}),
        ({}, {"eos": frozenset({refs[1][6]})}),
        ({"max_tokens": 7}, {}),
    ]
    for params_kw, engine_kw in cases:
        params = [SamplingParams(**{"max_tokens": 20, "temperature": 0.0, **params_kw})] * 3
        want = run(make_engine(model, **engine_kw), prompts, params)
        engine = spec_engine(model, 8, lookup, **engine_kw)
        got = run(engine, prompts, params)
        assert ids(got) == ids(want)
        assert engine.num_spec_accepted_tokens > 0
    assert len(ids(got)["r0"]) == 7


class StopAt:
    """A text-level stop (`Sequence.stop_text`, as TextEngine's stop strings) matching at token n."""

    def __init__(self, n: int) -> None:
        self.n, self.num_calls = n, 0

    def __call__(self, token_id: int, reason: FinishReason | None) -> FinishReason | None:
        self.num_calls += 1
        return FinishReason.STOP if self.num_calls == self.n else reason


def test_a_text_stop_inside_an_accepted_run_ends_it_there_as_in_plain_decoding(model: LlamaModel) -> None:
    """The text-level stop is one of the engine's stop checks: a match at token n (inside a run
    of accepted proposals) ends the request there, frees its blocks and drops the rest."""
    prompts, params = make_prompts(3), greedy(20, ignore_eos=True)
    ref = ids(run(make_engine(model), prompts, [params] * 3))
    refs = [ref[f"r{i}"] for i in range(3)]
    for engine in (make_engine(model), spec_engine(model, 8, oracle(prompts, refs))):
        stops = [StopAt(3), StopAt(6), StopAt(99)]
        for i, (prompt, stop) in enumerate(zip(prompts, stops, strict=True)):
            seq = engine.new_sequence(f"r{i}", prompt, params)
            seq.stop_text = stop
            engine.submit(seq)
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.token is not None:
                    tokens.setdefault(o.seq.request_id, []).append(o.token.token_id)
                if o.finish_reason is not None:
                    reasons[o.seq.request_id] = o.finish_reason
        assert tokens == {"r0": refs[0][:3], "r1": refs[1][:6], "r2": refs[2]}
        assert reasons == {"r0": FinishReason.STOP, "r1": FinishReason.STOP, "r2": FinishReason.LENGTH}
        assert [s.num_calls for s in stops] == [3, 6, 20]  # once per token, none after a stop
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.num_spec_accepted_tokens > 0


def test_preempted_and_resumed_requests_continue_identically(model: LlamaModel) -> None:
    prompts = make_prompts(4, (9, 17))
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=7 + i, logprobs=True) for i in range(4)]
    want = run(make_engine(model), prompts, params)
    refs = [[t for t, _, _ in want[f"r{i}"]] for i in range(4)]
    engine = spec_engine(model, 4, oracle(prompts, refs), num_blocks=24)  # room for ~2 of the 4 sequences
    assert_same(run(engine, prompts, params), want)
    assert engine.scheduler.num_preemptions > 0
    resumed = spec_engine(model, 4, oracle(prompts, refs))  # another worker goes on after 5 streamed tokens
    for i in range(4):
        resumed.add_request(f"r{i}", prompts[i], params[i], seed=7 + i, resume_ids=refs[i][:5])
    got = run(resumed, [], [])
    for i in range(4):
        assert refs[i][:5] + [t for t, _, _ in got[f"r{i}"]] == refs[i]


# -- reporting -------------------------------------------------------------------------------------


def test_usage_and_metrics_report_proposed_and_accepted_tokens() -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from protos.convert import usage_from_pb, usage_to_pb
    from protos.params import Usage
    from worker.io.metrics import WorkerMetrics

    usage = Usage(completion_tokens=9, num_draft_tokens=12, num_accepted_tokens=5)
    pb = usage_to_pb(usage)
    assert (pb.num_draft_tokens, pb.num_accepted_tokens) == (12, 5) and usage_from_pb(pb) == usage
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "m", "w")
    stats = SimpleNamespace(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_preemptions=0,
                            num_prefix_cache_query_tokens=0, num_prefix_cache_hit_tokens=0,
                            num_spec_drafts=3, num_spec_draft_tokens=12, num_spec_accepted_tokens=5)
    metrics.update(stats, 0)
    stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens = 4, 16, 9
    metrics.update(stats, 0)
    labels = {"model": "m", "worker": "w"}
    assert [registry.get_sample_value(f"tokenrelay_spec_decode_num_{name}_total", labels)
            for name in ("drafts", "draft_tokens", "accepted_tokens")] == [4, 16, 9]
