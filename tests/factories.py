"""Small factories shared by tests: tiny seeded Llama models and engines."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from protos.params import FinishReason, SamplingParams, Usage
from worker.engine.core import EngineCore
from worker.engine.outputs import Admitted, RequestOutput
from worker.engine.text_engine import EngineStats
from worker.model import native
from worker.model.config import ModelConfig
from worker.model.llama import ForwardBatch, KVCache, LlamaModel
from worker.model.native import NativeKernels, load_native_kernels
from worker.model.quant import QuantWeight, quantize

VOCAB = 128


def make_hf_model(num_heads: int = 4, num_kv_heads: int = 2, tie: bool = False,
                  rope_scaling: dict[str, Any] | None = None, seed: int = 0,
                  attention_bias: bool = False, num_layers: int = 2, vocab_size: int = VOCAB,
                  max_position_embeddings: int = 256) -> Any:
    """A seeded random transformers.LlamaForCausalLM small enough for unit tests."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie,
        rope_scaling=rope_scaling, attention_bias=attention_bias, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers starts biases at 0, which would hide a dropped one
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def ours_from_hf(hf: Any, dtype: torch.dtype = torch.float32, native: bool = True,
                 quantize_to: str | None = None, kernels: NativeKernels | None = None) -> LlamaModel:
    """Our model with hf's weights; native=False keeps decode attention in torch (the CUDA path);
    quantize_to "q8_0"/"q4_0" quantizes every matmul weight and the embedding table; `kernels`:
    a build of the C kernels other than this machine's default."""
    c = hf.config
    config = ModelConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0, rope_scaling=_rope_scaling(c),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
    )
    weights: dict[str, torch.Tensor | QuantWeight] = {
        k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if quantize_to is not None:
        weights = {k: quantize(v, quantize_to) if isinstance(v, torch.Tensor) and v.dim() == 2 else v
                   for k, v in weights.items()}
    if kernels is None and native and dtype == torch.float32:
        kernels = load_native_kernels()
    return LlamaModel(config, weights, dtype=dtype, kernels=kernels)


def _rope_scaling(c: Any) -> dict[str, Any] | None:
    rs = getattr(c, "rope_scaling", None) or getattr(c, "rope_parameters", None)
    if not rs or rs.get("rope_type", rs.get("type")) == "default":
        return None
    return dict(rs)


def make_engine(model: LlamaModel | None = None, num_seqs: int = 4, max_len: int = 128,
                max_prefill_tokens: int = 512, eos: frozenset[int] = frozenset(), *,
                num_blocks: int | None = None, block_size: int = 4, enable_prefix_caching: bool = True,
                kv_cache_dtype: torch.dtype | None = None, num_speculative_tokens: int = 0,
                static_decode: bool = False) -> EngineCore:
    """An engine over a tiny random Llama; the pool holds num_seqs full sequences unless num_blocks says."""
    return EngineCore(model or ours_from_hf(make_hf_model()),
                      num_blocks=num_blocks or num_seqs * -(-max_len // block_size), block_size=block_size,
                      max_model_len=max_len, max_num_seqs=num_seqs, max_prefill_tokens=max_prefill_tokens,
                      eos_token_ids=eos, kv_cache_dtype=kv_cache_dtype,
                      enable_prefix_caching=enable_prefix_caching,
                      num_speculative_tokens=num_speculative_tokens, static_decode=static_decode)


def make_prompts(n: int, lengths: tuple[int, ...] = (3, 9, 17, 30), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_to_completion(engine: EngineCore, max_steps: int = 1000) -> dict[str, list[int]]:
    """Step until idle; returns every request's generated ids."""
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            if o.token is not None:
                out.setdefault(o.seq.request_id, []).append(o.token.token_id)
    raise AssertionError("engine did not finish")


def make_stats(**fields: Any) -> EngineStats:
    """What `TextEngine.stats()` returns, for an idle engine of 64 blocks of 16 tokens; fields override."""
    defaults: dict[str, Any] = dict(
        model_name="fake", weights="float32 weights", num_running=0, num_waiting=0, max_num_seqs=8,
        max_model_len=256, block_size=16, num_blocks=64, num_free_blocks=64, kv_cache_usage=0.0,
        num_prefix_cache_hit_tokens=0, num_prefix_cache_query_tokens=0, num_preemptions=0,
        num_step_prefill_tokens=0, num_step_decode_tokens=0)
    return EngineStats(**(defaults | fields))


class CountingEngine:
    """Emits token 7 ("x") once per step per request until max_tokens: enough to stream. Every
    prompt counts as num_prompt_tokens; a step takes step_s at least."""

    def __init__(self, num_prompt_tokens: int = 1, step_s: float = 0.0) -> None:
        self._running: dict[str, tuple[int, int]] = {}  # request_id -> (max_tokens, generated)
        self.num_prompt_tokens, self.step_s = num_prompt_tokens, step_s

    adapters: tuple[str, ...] = ()  # no LoRA adapters

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, **kwargs: Any) -> Admitted:
        self._running[request_id] = (params.max_tokens, 0)
        return Admitted(seed=params.seed or 1, num_prompt_tokens=self.num_prompt_tokens)

    def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        outputs = []
        for request_id, (max_tokens, done) in list(self._running.items()):
            out = RequestOutput(request_id, token_ids=[7], text="x")
            self._running[request_id] = (max_tokens, done + 1)
            if done + 1 == max_tokens:
                out.finish_reason = FinishReason.LENGTH
                out.usage = Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=max_tokens)
                del self._running[request_id]
            outputs.append(out)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def stats(self) -> EngineStats:
        return make_stats(model_name="counting", num_running=len(self._running), max_model_len=512)


def write_model(folder: Path, *, seed: int, num_layers: int = 2, renamed: int | None = None,
                vocab_size: int = VOCAB) -> str:
    """A Hugging Face folder: a random Llama and a word-level tokenizer of tokens t0..t127
    (token `renamed` spelled differently)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    make_hf_model(seed=seed, num_layers=num_layers, vocab_size=vocab_size).save_pretrained(folder)
    vocab = {("x" if i == renamed else "t") + str(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    return str(folder)


_BUILT_IN: dict[str, Path] = {}  # flag -> the folder its build is cached in


def kernels_built_with(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NativeKernels:
    """The kernels built with one more compiler flag, loaded now (the ISA they pick follows the
    environment at load). Built once a session per flag, in the first caller's tmp_path (a build
    takes ~60 s on 2 cores; test_native and test_native_layers both use the AVX2 one)."""
    monkeypatch.setattr(native, "CFLAGS", (*native.CFLAGS, flag))
    load_native_kernels.cache_clear()
    try:
        built = load_native_kernels(_BUILT_IN.setdefault(flag, tmp_path))
    finally:
        load_native_kernels.cache_clear()
    assert built is not None
    return built


def forward_in_chunks(model: LlamaModel, ids: torch.Tensor, sizes: list[int],
                      block_size: int = 4) -> tuple[torch.Tensor, KVCache]:
    """ids (n,) as one sequence's prompt chunks of `sizes` tokens (the last repeats until the
    prompt is done), every token's logits kept: (n, V) logits and the cache."""
    n = ids.shape[0]
    num_blocks = -(-n // block_size)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))  # scattered blocks
    tables = order[None].to(torch.int32)  # (1, num_blocks)
    cache = KVCache(model.config, num_blocks, block_size, torch.float32, torch.device("cpu"))
    logits, a, k = [], 0, 0
    while a < n:
        b = min(n, a + sizes[min(k, len(sizes) - 1)])
        pos = torch.arange(a, b)
        slots = tables[0, pos // block_size].long() * block_size + pos % block_size
        batch = ForwardBatch(input_ids=ids[a:b], positions=pos, slot_mapping=slots, block_tables=tables,
                             context_lens=torch.tensor([b], dtype=torch.int32), query_start_loc=(0, b - a),
                             context_lens_host=(b,), num_prefills=1, logits_indices=torch.arange(b - a))
        logits.append(model.forward(batch, cache))
        a, k = b, k + 1
    return torch.cat(logits), cache
