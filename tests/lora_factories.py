"""Factories for LoRA tests: PEFT adapter folders of random weights for the tiny test Llamas."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.factories import ours_from_hf
from worker.engine.core import EngineCore
from worker.model.lora import TARGET_MODULES, module_shapes
from worker.model.quant import quantize

PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def lora_key(layer: int, module: str, part: str) -> str:
    parent = PARENT.get(module, "self_attn")
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{part}.weight"


def adapter_tensors(hf: Any, *, r: int = 4, modules: tuple[str, ...] = TARGET_MODULES, seed: int = 0,
                    std: float = 0.15, is_zero: bool = False) -> dict[str, torch.Tensor]:
    """Random A and B (B = 0 with is_zero, as PEFT initialises it) for every layer of hf's model."""
    from worker.model.config import ModelConfig

    c = hf.config
    config = ModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
                         num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                         head_dim=c.hidden_size // c.num_attention_heads)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config.num_layers):
        for m in modules:
            out, inp = module_shapes(config)[m]
            tensors[lora_key(i, m, "A")] = torch.randn(r, inp, generator=g) * std
            b = torch.randn(out, r, generator=g) * std
            tensors[lora_key(i, m, "B")] = b * 0 if is_zero else b
    return tensors


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], *, r: int = 4, alpha: float = 8,
                  **config: Any) -> str:
    """A PEFT LoRA folder: adapter_config.json (fields overridden by `config`) and the tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = sorted({k.split(".")[-3] for k in tensors})
    cfg = dict(peft_type="LORA", r=r, lora_alpha=alpha, target_modules=modules, bias="none",
               fan_in_fan_out=False, use_dora=False, use_rslora=False, lora_dropout=0.0,
               base_model_name_or_path="tiny", task_type="CAUSAL_LM") | config
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return str(folder)


def merged_hf(hf: Any, tensors: dict[str, torch.Tensor], scale: float) -> Any:
    """A copy of hf with every adapted weight W replaced by W + scale * B @ A."""
    merged = copy.deepcopy(hf)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith("lora_A.weight"):
                b = tensors[key.replace("lora_A", "lora_B")]
                name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                params[name] += scale * b @ a
    return merged


def dequantized_hf(hf: Any, kind: str) -> Any:
    """A copy of hf whose linear weights are what `kind` quantization makes of them, in fp32."""
    copied = copy.deepcopy(hf)
    with torch.no_grad():
        for p in copied.parameters():
            if p.dim() == 2:
                p.copy_(quantize(p.detach(), kind).dequantize())
    return copied


def lora_engine(hf: Any, *, native: bool = True, quantize_to: str | None = None, max_adapters: int = 4,
                num_seqs: int = 8, max_len: int = 96, max_prefill_tokens: int = 512, block_size: int = 4,
                enable_prefix_caching: bool = True) -> EngineCore:
    """An engine over hf's weights with LoRA on (no adapter loaded yet); the pool holds num_seqs
    full sequences."""
    model = ours_from_hf(hf, native=native, quantize_to=quantize_to)
    model.enable_lora()
    return EngineCore(model, num_blocks=num_seqs * -(-max_len // block_size), block_size=block_size,
                      max_model_len=max_len, max_num_seqs=num_seqs, max_prefill_tokens=max_prefill_tokens,
                      eos_token_ids=frozenset(), enable_prefix_caching=enable_prefix_caching,
                      max_adapters=max_adapters)
