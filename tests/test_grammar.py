"""Structured output in the engine core (worker/engine/grammar.py) on a tiny random Llama whose
128 token ids are the 128 ASCII bytes (id 2 is EOS): every output follows its format, and the
tokens do not depend on the batch, on speculation, on preemption or on a resume; a format compiling
does not hold up the streams already decoding."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jsonschema
import pytest
import torch

pytest.importorskip("transformers")
xgr = pytest.importorskip("xgrammar")

from protos.params import FinishReason, ResponseFormat, SamplingParams  # noqa: E402
from tests.factories import VOCAB, make_engine, make_hf_model, make_prompts, ours_from_hf  # noqa: E402
from worker.engine.core import EngineCore, EngineOutput  # noqa: E402
from worker.engine.grammar import Constraint, GrammarCompiler, apply_masks, choice_grammar  # noqa: E402
from worker.engine.spec_policy import SpeculationPolicy  # noqa: E402

EOS = 2
T = TypeVar("T")
EMAIL = r"[a-z]{3,6}@[a-z]{2,4}\.(com|org)"


def ascii_vocab() -> list[bytes]:
    return [b"" if i == EOS else bytes([i]) for i in range(VOCAB)]


@pytest.fixture(scope="module")
def model() -> Any:
    return ours_from_hf(make_hf_model())


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ascii_vocab(), VOCAB, [EOS])


@pytest.fixture
def new(model: Any, compiler: GrammarCompiler) -> Callable[..., EngineCore]:
    """A new engine over the module's model, with the module's compiler (and so its cache)."""
    def make(**kw: Any) -> EngineCore:
        engine = make_engine(model, eos=frozenset({EOS}), **kw)
        engine.grammar = compiler
        return engine
    return make


def text(ids: Iterable[int]) -> str:
    return bytes(i for i in ids if i != EOS).decode()


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Every request's tokens and finish reason."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    reasons: dict[str, FinishReason | None] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            return {r: (tokens[r], reasons.get(r)) for r in requests}
        for o in engine.step():
            if o.token is not None:
                tokens[o.seq.request_id].append(o.token.token_id)
            if o.finish_reason is not None:
                reasons[o.seq.request_id] = o.finish_reason
    raise AssertionError("engine did not finish")


def sampled(fmt: ResponseFormat, n: int, max_tokens: int = 40) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = make_prompts(n)
    return {f"r{i}": (prompts[i], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                                 response_format=fmt)) for i in range(n)}


def test_sampled_outputs_fully_match_the_regex_and_end_with_eos(new: Callable[..., EngineCore]) -> None:
    results = run(new(), sampled(ResponseFormat("regex", text=EMAIL), 6))
    for tokens, reason in results.values():
        assert reason is FinishReason.EOS and tokens[-1] == EOS
        assert re.fullmatch(EMAIL, text(tokens)), text(tokens)


def test_choice_and_grammar(new: Callable[..., EngineCore]) -> None:
    choices = ("red", "green", "blue \"b\"")
    for tokens, _ in run(new(), sampled(ResponseFormat("choice", choices=choices), 4)).values():
        assert text(tokens) in choices
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]*'
    for tokens, _ in run(new(), sampled(ResponseFormat("grammar", text=gbnf), 4)).values():
        assert re.fullmatch(r"\([1-9][0-9]*(,[1-9][0-9]*)*\)", text(tokens)), text(tokens)


def test_max_tokens_before_the_end_of_the_format_gives_length(new: Callable[..., EngineCore]) -> None:
    results = run(new(), sampled(ResponseFormat("regex", text="a{20}"), 1, max_tokens=5))
    assert results["r0"] == ([ord("a")] * 5, FinishReason.LENGTH)


def test_a_permissive_grammar_changes_no_greedy_token(new: Callable[..., EngineCore]) -> None:
    prompts = make_prompts(3)
    permissive = ResponseFormat("regex", text=r"[\x00-\x7f]*")
    plain = run(new(), {f"r{i}": (p, SamplingParams(max_tokens=12, temperature=0.0))
                                            for i, p in enumerate(prompts)})
    constrained = run(new(), {
        f"r{i}": (p, SamplingParams(max_tokens=12, temperature=0.0, response_format=permissive))
        for i, p in enumerate(prompts)})
    assert constrained == plain


def test_tokens_do_not_depend_on_the_batch(new: Callable[..., EngineCore]) -> None:
    requests = sampled(ResponseFormat("regex", text=EMAIL), 5)
    batched = run(new(), requests)
    for request_id, request in requests.items():
        assert run(new(), {request_id: request})[request_id] == batched[request_id]


def test_a_tiny_pool_preempts_and_constrained_outputs_stay_the_same(new: Callable[..., EngineCore]) -> None:
    requests = sampled(ResponseFormat("regex", text=EMAIL), 6, max_tokens=24)
    plain = run(new(num_seqs=6), requests)
    engine = new(num_seqs=6, num_blocks=16, max_prefill_tokens=16)
    assert run(engine, requests) == plain
    assert engine.scheduler.num_preemptions > 0


def test_a_resumed_request_continues_exactly(new: Callable[..., EngineCore]) -> None:
    (prompt, params), = sampled(ResponseFormat("regex", text=EMAIL), 1).values()
    full, _ = run(new(), {"r": (prompt, params)})["r"]
    engine = new()
    engine.add_request("r", prompt, params, resume_ids=full[:5])  # another worker streamed these
    rest = [o.token.token_id for _ in range(100) if engine.has_unfinished() for o in engine.step() if o.token]
    assert full[:5] + rest == full


class Oracle:
    """Proposes the next tokens of known answers, every third one replaced by '#' (which the
    formats here refuse): both accepted and grammar-refused proposals are verified."""

    def __init__(self, answers: dict[str, list[int]]) -> None:
        self.answers = answers

    def propose(self, seqs: list[Any], ks: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, ks, strict=True):
            n = len(seq.output_ids)
            drafts.append([ord("#") if (n + j) % 3 == 2 else t
                           for j, t in enumerate(self.answers[seq.request_id][n:n + k])])
        return drafts

    def retain(self, request_ids: Iterable[str]) -> None:
        pass


class AlwaysK(SpeculationPolicy):
    def best_k(self, p: float, num_decodes: int) -> int:
        return self.k


def test_speculation_gives_the_tokens_of_plain_constrained_decoding(new: Callable[..., EngineCore]) -> None:
    requests = sampled(ResponseFormat("regex", text=EMAIL), 3)
    plain = run(new(), requests)
    engine = new()
    engine.spec = AlwaysK(4)
    engine.proposer = Oracle({r: tokens for r, (tokens, _) in plain.items()})
    assert run(engine, requests) == plain
    assert 0 < engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens


def test_a_format_that_does_not_compile_fails_only_its_request(new: Callable[..., EngineCore]) -> None:
    bad = ResponseFormat("grammar", text='root ::= "a" |')
    engine = new()
    engine.add_request("ok", make_prompts(1)[0], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("bad", make_prompts(1)[0], SamplingParams(max_tokens=4, response_format=bad))
    outs = [o for _ in range(20) if engine.has_unfinished() for o in engine.step()]
    failed = [o for o in outs if o.seq.request_id == "bad"]
    assert [(o.finish_reason, o.token) for o in failed] == [(FinishReason.ERROR, None)]
    assert failed[0].seq.is_invalid_request
    assert "response_format.grammar does not compile" in str(failed[0].error)
    assert sum(1 for o in outs if o.seq.request_id == "ok" and o.token) == 4
    with pytest.raises(ValueError, match="does not compile"):  # known bad now: refused at once
        engine.add_request("again", make_prompts(1)[0], SamplingParams(max_tokens=4, response_format=bad))


def test_compilations_are_cached_by_format_in_a_bounded_lru() -> None:
    compiler = GrammarCompiler(ascii_vocab(), VOCAB, [EOS], max_cached=2)
    formats = [ResponseFormat("regex", text=f"a{{{n}}}") for n in (1, 2, 3)]
    for fmt in formats + formats[2:]:
        compiler.compile(fmt).result()
    assert (compiler.num_misses, compiler.num_hits) == (3, 1)
    compiler.compile(formats[0]).result()  # evicted by the third
    assert compiler.num_misses == 4 and len(compiler.recent_compile_seconds) == 4


def test_the_cpu_masks_equal_xgrammars_kernel_on_every_row_kind(compiler: GrammarCompiler) -> None:
    """apply_masks unpacks the bitmask itself on the CPU: same logits as xgrammar's kernel, for all
    rows constrained, some rows, and a sequence with proposals (rows after the first)."""
    fmt = ResponseFormat("regex", text=EMAIL)
    started = []
    for prefix in (b"", b"abc", b"abcd@x"):
        constraint = Constraint(compiler.compile(fmt))
        assert constraint.start(list(prefix))
        started.append(constraint)
    cases = [[(0, started[0], []), (1, started[1], []), (2, started[2], [])],  # every row
             [(1, started[1], []), (3, started[2], [])],  # some rows
             [(0, started[1], [ord("d"), ord("@")]), (4, started[0], [])]]  # proposals' rows
    gen = torch.Generator().manual_seed(0)
    for constraints in cases:
        num_rows = 5 if constraints[-1][0] >= 3 else 3
        logits = torch.randn(num_rows, VOCAB, generator=gen)  # (R, V)
        expected = logits.clone()
        bitmask = xgr.allocate_token_bitmask(num_rows, VOCAB)
        rows = [r for first, c, drafts in constraints for r in c.fill_rows(bitmask, first, drafts)]
        xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=VOCAB, indices=rows)
        apply_masks(logits, constraints)
        assert torch.equal(logits, expected)
        assert torch.isinf(logits).any()  # something was masked


def test_choice_grammar_escapes_quotes_and_newlines() -> None:
    assert choice_grammar(['a "b"', "c\nd"]) == r'root ::= "a \"b\"" | "c\nd"'


def test_a_request_for_a_format_without_a_compiler_is_refused(model: Any) -> None:
    engine = make_engine(model)
    with pytest.raises(ValueError, match="response_format"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=4,
                                                       response_format=ResponseFormat("json_object")))


# A step of this model takes milliseconds: the timeout only turns a step that waits for the held-back
# compilation (and so would never return) into a failure instead of a hang; no speed is asserted.
STEP_TIMEOUT_S = 60
RECORD = {  # bounded, so a random model completes it: every value's length is capped
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "tag": {"enum": ["red", "green", "blue"]},
                   "code": {"type": "string", "pattern": "^[a-z]{2,4}$"}},
    "required": ["id", "ok", "tag", "code"], "additionalProperties": False,
}


@pytest.fixture
def held_compiler() -> Iterator[tuple[GrammarCompiler, threading.Event]]:
    """A compiler whose one compile thread is busy until the test sets the event: a format it is
    asked for stays compiling until then. Set at teardown, so a failed test leaves no thread behind."""
    gate = threading.Event()
    compile_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="held-grammar")
    compile_thread.submit(gate.wait)
    compiler = GrammarCompiler(ascii_vocab(), VOCAB, [EOS], executor=compile_thread)
    yield compiler, gate
    gate.set()
    compiler.close()


def call_or_fail(call: Callable[..., T], *args: Any) -> T:
    """call(*args) on a thread of its own, so that an engine call blocked on a compilation fails the
    test (after STEP_TIMEOUT_S) instead of hanging it."""
    thread = ThreadPoolExecutor(max_workers=1)
    try:
        return thread.submit(call, *args).result(timeout=STEP_TIMEOUT_S)
    except TimeoutError:
        pytest.fail(f"{call.__name__} did not return in {STEP_TIMEOUT_S} s: it waits for the compilation")
    finally:
        thread.shutdown(wait=False)


def step_or_fail(engine: EngineCore) -> list[EngineOutput]:
    return call_or_fail(engine.step)


def collect(outputs: list[EngineOutput]) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Every request's tokens and finish reason, as `run` gives them."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    for o in outputs:
        tokens.setdefault(o.seq.request_id, []).extend([o.token.token_id] if o.token else [])
        if o.finish_reason is not None:
            reasons[o.seq.request_id] = o.finish_reason
    return {r: (ids, reasons.get(r)) for r, ids in tokens.items()}


def num_tokens(outputs: list[EngineOutput]) -> Counter[str]:
    return Counter(o.seq.request_id for o in outputs if o.token is not None)


def test_a_new_schema_compiling_does_not_stall_8_decoding_streams(
        new: Callable[..., EngineCore], held_compiler: tuple[GrammarCompiler, threading.Event]) -> None:
    """Issue 22, without a clock: the new schema's compilation is held back until the test lets it
    go. Meanwhile every step gives each of the 8 streams its next token and the new request none;
    the step after the schema is compiled admits it next to the 8; its output validates against
    the schema, and every request's tokens are those it gets alone."""
    compiler, gate = held_compiler
    engine = new(num_seqs=9, max_len=256)
    engine.grammar = compiler
    prompts = make_prompts(9)
    streams = {f"r{i}": (prompts[i], SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True))
               for i in range(8)}
    fmt = ResponseFormat("json_schema", text=json.dumps(RECORD), is_strict=True)
    request = (prompts[8], SamplingParams(max_tokens=160, temperature=1.0, seed=1, response_format=fmt))
    for request_id, (prompt, params) in streams.items():
        engine.add_request(request_id, prompt, params)
    outputs = step_or_fail(engine)
    assert num_tokens(outputs) == dict.fromkeys(streams, 1)  # prefilled: all 8 decode from now on

    seq = call_or_fail(engine.add_request, "new", *request)  # the worker's step loop calls it too
    assert seq.constraint is not None
    for _ in range(4):
        step = step_or_fail(engine)
        assert num_tokens(step) == dict.fromkeys(streams, 1)  # each of the 8 gains its token; "new" none
        outputs += step
    assert not seq.constraint.future.done() and engine.compiling == [seq]
    assert engine.scheduler.find("new") is None

    gate.set()
    seq.constraint.future.result(timeout=STEP_TIMEOUT_S)  # compiled: the next step must admit it
    step = step_or_fail(engine)
    assert num_tokens(step) == dict.fromkeys([*streams, "new"], 1)
    outputs += step
    for _ in range(200):
        if not engine.has_unfinished():
            break
        outputs += step_or_fail(engine)
    assert not engine.has_unfinished()

    results = collect(outputs)
    tokens, reason = results["new"]
    assert reason is FinishReason.EOS
    jsonschema.validate(json.loads(text(tokens)), RECORD)
    for request_id, alone in (streams | {"new": request}).items():
        assert run(new(max_len=256), {request_id: alone})[request_id] == results[request_id], request_id
