"""TextEngine on the real SmolLM2 GGUF: parity with transformers, streaming text, stops."""

from __future__ import annotations

from typing import Any

import pytest

from protos.params import ChatMessage, FinishReason, PromptInput, SamplingParams
from worker.engine.outputs import RequestOutput
from worker.engine.text_engine import TextEngine

PROMPTS = [
    "Once upon a time, there was a little girl named Lily who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "Voici une recette simple de crêpes : ",
    "1, 1, 2, 3, 5, 8, 13,",
]


@pytest.fixture
def engine(smollm_engine: TextEngine) -> TextEngine:
    """The session's shared SmolLM2 engine (max_model_len 512, 8 slots)."""
    assert smollm_engine.max_model_len == 512
    return smollm_engine


def run(engine: TextEngine, requests: dict[str, tuple[PromptInput, SamplingParams]]
        ) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def ids_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_greedy_64_tokens_equal_transformers_generate(smollm_fp32_engine: TextEngine,
                                                       hf_smollm2: Any) -> None:
    """The fp32 path (--quantization none); tests/test_quant_parity.py holds the default,
    quantized one to this path."""
    import torch

    engine = smollm_fp32_engine
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = run(engine, {f"p{i}": (PromptInput(prompt=p), greedy) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ids_of(outs[f"p{i}"]) == ref[0, len(ids):].tolist(), prompt


def test_chat_answer_and_streamed_text_equals_full_decode(engine: TextEngine) -> None:
    chat = PromptInput(messages=(ChatMessage("user", "What is the capital of France?"),))
    outs = run(engine, {"c": (chat, SamplingParams(max_tokens=40, temperature=0.0))})["c"]
    final = outs[-1]
    assert final.finish_reason is FinishReason.EOS and final.usage is not None
    assert "Paris" in text_of(outs)
    assert text_of(outs) == engine.tokenizer.decode(ids_of(outs), skip_special_tokens=True)
    assert final.usage.completion_tokens == len(ids_of(outs))
    assert final.usage.prompt_tokens > 10 and final.usage.time_to_first_token_s > 0


def test_stop_string_is_cut_and_frees_the_request(engine: TextEngine) -> None:
    p = PromptInput(prompt=PROMPTS[0])
    full = text_of(run(engine, {"a": (p, SamplingParams(max_tokens=30, temperature=0.0))})["a"])
    stop = "toy car"
    assert stop in full
    outs = run(engine, {"b": (p, SamplingParams(max_tokens=30, temperature=0.0, stop=(stop,)))})["b"]
    assert outs[-1].finish_reason is FinishReason.STOP
    assert text_of(outs) == full[: full.index(stop)]
    assert engine.stats().num_running == 0


def test_logprobs_are_returned_per_token(engine: TextEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3)
    outs = run(engine, {"l": (PromptInput(prompt=PROMPTS[2]), params)})["l"]
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        for lp, tok in zip(o.logprobs, o.token_ids, strict=True):
            assert lp.chosen.token_id == tok and lp.chosen.logprob <= 0
            assert len(lp.top) == 3 and lp.top[0].token_id == tok  # greedy picks the top one
            assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_too_long_prompt_is_rejected_unless_truncation_is_asked(engine: TextEngine) -> None:
    long_prompt = PromptInput(prompt="word " * 600)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("x", long_prompt, SamplingParams(max_tokens=8))
    outs = run(engine, {"t": (long_prompt, SamplingParams(max_tokens=8, truncate_prompt=True))})["t"]
    usage = outs[-1].usage
    assert usage is not None and usage.prompt_tokens == 512 - 8 and usage.truncated_prompt_tokens > 0


def test_chat_truncation_keeps_the_system_message(engine: TextEngine) -> None:
    history = [ChatMessage("system", "You are terse."),
               *[ChatMessage("user" if i % 2 == 0 else "assistant", f"message {i} " + "blah " * 40)
                 for i in range(20)],
               ChatMessage("user", "Say hi.")]
    params = SamplingParams(max_tokens=4, temperature=0.0, truncate_prompt=True)
    seen: list[list[int]] = []
    original = engine.engine.new_sequence

    def spy(request_id: str, prompt_ids: list[int], *a: Any, **kw: Any) -> Any:
        seen.append(prompt_ids)
        return original(request_id, prompt_ids, *a, **kw)

    engine.engine.new_sequence = spy  # type: ignore[method-assign]
    try:
        outs = run(engine, {"s": (PromptInput(messages=tuple(history)), params)})["s"]
    finally:
        engine.engine.new_sequence = original  # type: ignore[method-assign]
    text = engine.tokenizer.decode(seen[0])
    assert "You are terse." in text and "Say hi." in text and "message 0 " not in text
    assert len(seen[0]) <= 512 - 4 and outs[-1].usage and outs[-1].usage.truncated_prompt_tokens > 0


# -- resuming a request another worker started (crash recovery) ----------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.3),
    SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
], ids=["seeded-sampled", "greedy-penalised"])
def test_a_resumed_request_continues_exactly_where_it_stopped(
        engine: TextEngine, params: SamplingParams) -> None:
    from worker.engine.outputs import Resume

    prompt = PromptInput(prompt="Voici une recette simple de crêpes : ")
    full = run(engine, {"alone": (prompt, params)})["alone"]
    done = ids_of(full)
    assert len(done) == 16
    seed = full[-1].usage.seed if full[-1].usage else -1
    admitted = engine.add_request("resumed", prompt, params, resume=Resume(tuple(done[:6]), seed))
    assert admitted.seed == seed
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert ids_of(outs) == done[6:]  # penalties saw the resumed tokens, the RNG is at step 6
    assert admitted.text + text_of(outs) == text_of(full)  # the text state was rebuilt exactly
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 16


@pytest.mark.parametrize(("stop", "max_tokens", "reason"), [
    ((), 5, FinishReason.LENGTH), (("a",), 16, FinishReason.STOP)])
def test_a_resumed_request_that_had_already_ended_only_gets_its_final(
        engine: TextEngine, stop: tuple[str, ...], max_tokens: int, reason: FinishReason) -> None:
    from worker.engine.outputs import Resume

    prompt = PromptInput(prompt="Once upon a time, there was a little girl named Lily who")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop)
    full = run(engine, {"alone": (prompt, params)})["alone"]
    assert full[-1].finish_reason is reason
    admitted = engine.add_request("resumed", prompt, params, resume=Resume(tuple(ids_of(full)), 1))
    assert admitted.text == text_of(full)
    outs = engine.step()
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [([], "", reason)]
    assert outs[0].usage is not None and outs[0].usage.completion_tokens == len(ids_of(full))
    assert not engine.has_unfinished()


def test_a_chat_follow_up_is_served_from_the_prefix_cache(engine: TextEngine) -> None:
    history = (ChatMessage("system", "You are a helpful assistant who answers in one sentence."),
               ChatMessage("user", "What is the capital of France?"))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    turn1 = run(engine, {"t1": (PromptInput(messages=history), params)})["t1"]
    assert turn1[-1].usage is not None
    follow_up = (*history, ChatMessage("assistant", text_of(turn1)), ChatMessage("user", "And of Italy?"))
    turn2 = run(engine, {"t2": (PromptInput(messages=follow_up), params)})["t2"]
    usage = turn2[-1].usage
    assert usage is not None
    # the whole first prompt (and the answer, as far as it re-tokenizes the same) was not recomputed
    assert turn1[-1].usage.prompt_tokens <= usage.cached_prompt_tokens < usage.prompt_tokens
    assert "Rome" in text_of(turn2)


def test_stats_say_which_weights_and_kernels_run(engine: TextEngine, smollm_fp32_engine: TextEngine) -> None:
    from worker.model.native import load_native_kernels

    kernels = load_native_kernels()
    assert kernels is not None
    assert engine.stats().weights == f"Q4_1, Q8_0 weights, {kernels.quant.isa} kernels"  # the GGUF's own
    assert smollm_fp32_engine.stats().weights == "float32 weights"


def test_a_resumed_seeded_request_continues_with_the_same_tokens(engine: TextEngine) -> None:
    """A resume prefills the prompt and the tokens already streamed, then samples on: with the
    quantized default that recomputation is bit for bit the original one, so nothing changes."""
    from worker.engine.outputs import Resume

    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1005, ignore_eos=True)
    prompt = PromptInput(prompt="Tell me a story about the moon's day off.")
    full = ids_of(run(engine, {"full": (prompt, params)})["full"])
    for k in (5, 15, 19):
        engine.add_request(f"resume-{k}", prompt, params, resume=Resume(tuple(full[:k]), 1005))
        rest: list[int] = []
        while engine.has_unfinished():
            rest += [t for o in engine.step() for t in o.token_ids]
        assert full[:k] + rest == full, k
