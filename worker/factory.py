"""Build a ready TextEngine from an EngineConfig: weights, kernels, tokenizer, KV cache."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from worker.engine.config import EngineConfig
from worker.engine.core import EngineCore
from worker.engine.draft import DraftProposer
from worker.engine.grammar import GrammarCompiler, xgr
from worker.engine.kv_manager import KVCacheManager
from worker.engine.penalties import PenaltyCounts
from worker.engine.text_engine import TextEngine
from worker.memory_plan import MemoryBudget, WorstStep, kv_blocks, measure_peak_bytes
from worker.model.config import ModelConfig
from worker.model.llama import KVCache, LlamaModel
from worker.model.loader import default_model_path, load_model
from worker.model.memory import weights_loading
from worker.model.native import NativeKernels, load_native_kernels
from worker.model.static_decode import StaticDecode
from worker.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Default KV pool on CPU: this share of physical RAM. The pool is a zeroed mmap whose
# pages cost memory only once written, so it is what the cache may grow to, not what
# the worker takes at start-up. 10% of a 24 GB host is 2.4 GB: ~3,300 blocks of 16
# tokens for SmolLM2 in fp32, ~53k tokens.
DEFAULT_CPU_KV_SHARE = 0.10


@dataclass(frozen=True)
class CachePlan:
    max_model_len: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype


def build_model(config: EngineConfig) -> LlamaModel:
    """The model of `config.model` (the default SmolLM2 when None) with its weights and kernels."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = DTYPES[config.dtype]
    device = torch.device(config.device)
    path = model_path(config)
    kernels = native_kernels(config, device, dtype)
    with weights_loading():
        model_config, weights = load_model(path, dtype=dtype,
                                           quantize_to=quantize_to(config, path, device, dtype, kernels))
        model = LlamaModel(model_config, weights, dtype=dtype, device=device, kernels=kernels,
                           enable_lora=config.is_lora_enabled, attention=config.attention_backend)
        del weights
    log.info("model %s: %s", path.name, model.quantization_summary)
    return model


def quantize_to(config: EngineConfig, path: Path, device: torch.device, dtype: torch.dtype,
                kernels: NativeKernels | None) -> str | None:
    """What `load_model` keeps quantized: EngineConfig.quantization where it can run here."""
    if config.quantization == "none":
        return None
    runnable = device.type == "cpu" and dtype == torch.float32 and kernels is not None
    if config.quantization == "auto":
        if path.suffix == ".gguf" and not runnable:
            log.warning("GGUF weights dequantized to %s: the quantized kernels run on CPU in float32 with "
                        "the C kernels (device %s, native kernels %s)", dtype, device,
                        "loaded" if kernels else "unavailable")
        return "gguf" if path.suffix == ".gguf" and runnable else None
    if not runnable:
        raise ValueError(f"quantization {config.quantization} runs on CPU in float32 with the C kernels "
                         f"(device {device}, dtype {dtype}, native kernels "
                         f"{'loaded' if kernels else 'unavailable or disabled'})")
    return config.quantization


def model_path(config: EngineConfig) -> Path:
    return Path(config.model) if config.model else default_model_path()


def build_text_engine(config: EngineConfig) -> TextEngine:
    model = build_model(config)
    model_config, device, path = model.config, model.device, model_path(config)
    tokenizer = Tokenizer.load(path)
    draft = build_draft_model(config, model, tokenizer) if config.speculative == "draft" else None
    plan = plan_kv_cache(config, model_config, device, model, draft.config if draft else None)
    log.info("KV cache: %d blocks of %d tokens (%s, %.0f MB), max_model_len %d, max_num_seqs %d",
             plan.num_blocks, plan.block_size, str(plan.dtype).removeprefix("torch."),
             plan.num_blocks * KVCache.bytes_per_block(model_config, plan.block_size, plan.dtype) / 2**20,
             plan.max_model_len, config.max_num_seqs)
    eos = frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)
    num_spec = config.num_speculative_tokens if config.speculative != "none" else 0
    max_prefill, max_batched = config.step_budgets(model.device.type == "cuda")
    proposer = None
    if draft is not None:
        if draft.config.max_position_embeddings < plan.max_model_len:
            raise ValueError(f"draft model context ({draft.config.max_position_embeddings}) is shorter than "
                             f"max_model_len ({plan.max_model_len})")
        graphs = use_cuda_graphs(config, draft)  # its decode passes as CUDA graphs, as the target's
        draft_cache = draft.new_cache(plan.num_blocks + int(graphs), plan.block_size, plan.dtype)  # + scratch
        max_blocks = -(-plan.max_model_len // plan.block_size)
        static = None
        if graphs:
            static = StaticDecode(draft, draft_cache, config.max_num_seqs, max_blocks, capture=True)
        proposer = DraftProposer(draft, draft_cache,
                                 KVCacheManager(plan.num_blocks, plan.block_size, plan.max_model_len,
                                                enable_prefix_caching=False), max_prefill, static,
                                 config.max_num_seqs)
    engine = EngineCore(model, num_blocks=plan.num_blocks, block_size=plan.block_size,
                        max_model_len=plan.max_model_len, max_num_seqs=config.max_num_seqs,
                        max_prefill_tokens=max_prefill, max_num_batched_tokens=max_batched, eos_token_ids=eos,
                        kv_cache_dtype=plan.dtype, enable_prefix_caching=config.enable_prefix_caching,
                        num_speculative_tokens=num_spec, proposer=proposer,
                        grammar=build_grammar_compiler(tokenizer, model_config.vocab_size, eos),
                        max_adapters=config.max_adapters if config.is_lora_enabled else 0,
                        max_lora_rank=config.max_lora_rank, cuda_graphs=use_cuda_graphs(config, model))
    if engine.adapters is not None:
        for name, adapter_path in config.adapters:
            engine.adapters.load(name, adapter_path)
    weights = model.quantization_summary + (f"; draft {draft.quantization_summary}" if draft else "")
    return TextEngine(engine, tokenizer, model_name=path.stem if path.is_file() else path.name,
                      weights=weights)


def use_cuda_graphs(config: EngineConfig, model: LlamaModel) -> bool:
    """EngineConfig.cuda_graphs, or its default: on for CUDA where static decode steps can run."""
    if config.cuda_graphs is not None:
        return config.cuda_graphs
    return model.device.type == "cuda" and not model.is_lora_enabled


def build_grammar_compiler(tokenizer: Tokenizer, vocab_size: int,
                           eos: frozenset[int]) -> GrammarCompiler | None:
    """The compiler of response formats over this vocabulary (vocab_size: the logits' width);
    None without xgrammar (the structured extra), and then constrained requests are refused."""
    if xgr is None:
        log.warning("xgrammar is not installed: requests with a response_format will be refused")
        return None
    return GrammarCompiler(tokenizer.encoded_vocab()[:vocab_size], vocab_size, eos)


def build_draft_model(config: EngineConfig, target: LlamaModel, tokenizer: Tokenizer) -> LlamaModel:
    """The draft model of `config.draft_model`, which must share the target's token ids."""
    assert config.draft_model is not None, "EngineConfig checks that speculative='draft' has one"
    path = Path(config.draft_model)
    difference = tokenizer.vocab_difference(Tokenizer.load(path))
    draft = (build_model(replace(config, model=str(path), adapters=(), enable_lora=False))
             if difference is None else None)  # the target's adapters are not the draft's
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        difference = f"vocab_size {target.config.vocab_size} vs {draft.config.vocab_size}"
    if draft is None or difference is not None:
        raise ValueError(f"draft model {path} does not share the target's tokenizer: {difference}")
    log.info("draft model %s: %s", path.name, draft.quantization_summary)
    return draft


def native_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> NativeKernels | None:
    """The C kernels on CPU in fp32 (built here, on first use, not by the model)."""
    if not config.enable_native_kernels or device.type != "cpu" or dtype != torch.float32:
        return None
    return load_native_kernels()


def plan_kv_cache(config: EngineConfig, model: ModelConfig, device: torch.device,
                  llama: LlamaModel | None = None, draft: ModelConfig | None = None) -> CachePlan:
    """Context length, block size, number of blocks and K/V dtype from the config and the memory
    budget (see EngineConfig.kv_cache_memory_mb for the defaults). A draft model gets as many
    blocks of its own (the same tokens), inside the same budget."""
    context = model.max_position_embeddings
    max_len = config.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    if max_len > context:
        raise ValueError(f"max_model_len ({max_len}) exceeds the model's context ({context})")
    dtype = DTYPES[config.kv_cache_dtype or config.dtype]
    bs = config.block_size
    block_bytes = KVCache.bytes_per_block(model, bs, dtype)
    if draft is not None:
        block_bytes += KVCache.bytes_per_block(draft, bs, dtype)
    blocks_per_seq = -(-max_len // bs)
    if config.kv_cache_memory_mb is not None:
        num_blocks = config.kv_cache_memory_mb * 2**20 // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_mb ({config.kv_cache_memory_mb}) cannot hold one KV block "
                             f"of {bs} tokens ({block_bytes / 2**20:.2f} MB)")
    elif device.type == "cuda" and llama is not None:
        # the kept penalty counts, allocated whole on CUDA after this plan (the target's, the draft's)
        state = sum((config.max_num_seqs + 1) * PenaltyCounts.bytes_per_request(m.vocab_size)
                    for m in (model, draft) if m is not None)
        num_blocks = _plan_by_worst_step(config, llama, max_len, block_bytes, blocks_per_seq, state)
    else:
        budget = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_CPU_KV_SHARE)
        num_blocks = max(blocks_per_seq, min(budget // block_bytes, config.max_num_seqs * blocks_per_seq))
    return CachePlan(max_len, bs, num_blocks, dtype)


def _plan_by_worst_step(config: EngineConfig, llama: LlamaModel, max_len: int, block_bytes: int,
                        blocks_per_seq: int, state_bytes: int) -> int:
    """CUDA: run the worst step, then size the pool beside it and `state_bytes` the engine
    allocates later (worker/memory_plan.py)."""
    device = llama.device
    free, total = torch.cuda.mem_get_info(device)
    rows_per_seq = 1 + (config.num_speculative_tokens if config.speculative != "none" else 0)
    max_prefill, max_batched = config.step_budgets(is_cuda=True)
    num_decodes = config.max_num_seqs * rows_per_seq  # each decode's token and proposals, as rows
    if max_batched is not None:  # the shared budget bounds both
        num_decodes, max_prefill = min(num_decodes, max_batched), min(max_prefill, max_batched)
    step = WorstStep(num_decodes, max_len, max_prefill, config.block_size)
    peak = measure_peak_bytes(llama, step) + state_bytes
    budget = MemoryBudget(total, total - free, peak, config.gpu_memory_utilization)
    num_blocks = kv_blocks(budget, block_bytes, blocks_per_seq, config.max_num_seqs)
    log.info("worst step (%d decode rows at %d tokens + %d prefill tokens) peaks at %.0f MB with the "
             "sampler's state (%.0f MB); %d KV blocks fit in %.0f%% of %.0f MB", step.num_decodes, max_len,
             step.num_prefill_tokens, peak / 2**20, state_bytes / 2**20, num_blocks,
             config.gpu_memory_utilization * 100, total / 2**20)
    return num_blocks
