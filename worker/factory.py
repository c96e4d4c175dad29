"""Build a ready TextEngine from an EngineConfig: weights, tokenizer, KV cache."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.engine.config import EngineConfig
from worker.engine.core import Engine
from worker.engine.text_engine import TextEngine
from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel
from worker.model.loader import default_model_path, load_model
from worker.model.memory import weights_loading
from worker.text.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_text_engine(config: EngineConfig) -> TextEngine:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    path = Path(config.model) if config.model else default_model_path()
    dtype = DTYPES[config.dtype]
    with weights_loading():
        model_config, weights = load_model(path, dtype=dtype)
        model = LlamaModel(model_config, weights, dtype=dtype, device=config.device,
                           enable_native_kernels=config.enable_native_kernels)
        del weights
    tokenizer = Tokenizer.load(path)
    max_len, num_slots = cache_shape(config, model_config, dtype)
    eos = frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)
    engine = Engine(model, num_slots, max_len, config.max_prefill_tokens, eos,
                    enable_prefix_caching=config.enable_prefix_caching)
    return TextEngine(engine, tokenizer, model_name=path.stem if path.is_file() else path.name)


def cache_shape(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(tokens per slot, number of slots) from the config and the memory budget."""
    context = model.max_position_embeddings
    max_len = config.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    if max_len > context:
        raise ValueError(f"max_model_len ({max_len}) exceeds the model's context ({context})")
    bytes_per_slot = model.kv_bytes_per_token * max_len * dtype.itemsize // 4
    num_slots = config.max_num_seqs
    if config.kv_cache_memory_mb is not None:
        num_slots = min(num_slots, config.kv_cache_memory_mb * 2**20 // bytes_per_slot)
        if num_slots < 1:
            raise ValueError(
                f"kv_cache_memory_mb ({config.kv_cache_memory_mb}) cannot hold one sequence of "
                f"max_model_len {max_len} ({bytes_per_slot / 2**20:.1f} MB)")
    return max_len, num_slots
