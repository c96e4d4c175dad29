"""Engine configuration: one frozen object, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    # GGUF file or Hugging Face folder; None = the default SmolLM2-135M-Instruct.
    model: str | None = None
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"
    max_num_seqs: int = 16  # sequences decoded together (KV cache slots)
    max_model_len: int | None = None  # tokens per sequence; None = min(model context, 2048)
    kv_cache_memory_mb: int | None = None  # None = room for max_num_seqs full sequences
    # Prompt tokens computed per step; longer prompts are prefilled in chunks over
    # several steps. Bounds how long prompts stall the running streams (~1 s for
    # 512 on a 2-core CPU); larger is a little more efficient for prefill.
    max_prefill_tokens: int = 512
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    # Reuse the K/V a freed slot still holds for a new prompt with the same prefix.
    enable_prefix_caching: bool = True
    # CPU fp32 decode attention and RMSNorm in C kernels compiled on first use (worker/model/native.py).
    enable_native_kernels: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ValueError(f"kv_cache_memory_mb must be >= 1, got {self.kv_cache_memory_mb}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
