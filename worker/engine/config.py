"""Engine configuration: one frozen object, validated once at start-up."""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0")
SPECULATIVE = ("none", "ngram", "draft")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "flashinfer")  # worker/model/attn_backends.py
ENGINE_KINDS = ("model", "sim")  # sim: worker/engine/sim.py, no model and no torch
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a LoRA adapter's name (requests and metrics use it)
MAX_LORA_RANK_LIMIT = 512
CPU_MAX_PREFILL_TOKENS = 512  # max_prefill_tokens' default on CPU
CUDA_MAX_NUM_BATCHED_TOKENS = 8192  # max_num_batched_tokens' default on CUDA (vLLM's with chunked prefill)


@dataclass(frozen=True)
class EngineConfig:
    # GGUF file or Hugging Face folder; None = the default SmolLM2-135M-Instruct.
    model: str | None = None
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"
    # Most sequences batched together. Not a memory reservation: KV blocks are
    # taken as sequences grow, so many short requests run where few long ones would.
    max_num_seqs: int = 128
    max_model_len: int | None = None  # tokens per sequence; None = min(model context, 2048)
    # Size of the KV block pool, allocated once. None: on CPU 10% of physical RAM
    # (DEFAULT_CPU_KV_SHARE), on CUDA what gpu_memory_utilization of the device leaves
    # beside the weights and the worst step's activations (worker/memory_plan.py); never
    # more than max_num_seqs full-length sequences need, never less than one.
    kv_cache_memory_mb: int | None = None
    gpu_memory_utilization: float = 0.9  # the share of the GPU this worker may use
    # Decode steps as CUDA graphs per batch-size bucket (worker/model/static_decode.py). None: on
    # for CUDA unless LoRA is on.
    cuda_graphs: bool | None = None
    # Tokens per KV block. 16 on every device: small enough that the last,
    # partly filled block of a sequence wastes little, large enough that a block
    # (16 positions x head dim, per kv head) is a few KB of contiguous reads for
    # the CPU decode kernel; the CUDA path gathers blocks for torch's SDPA, which
    # takes any size.
    block_size: int = 16
    # K/V storage: None = the model's dtype. float16/bfloat16 halve the cache
    # (its memory and, at long contexts, most of a decode step's reads) also on
    # CPU, where the C decode kernel reads them directly.
    kv_cache_dtype: str | None = None
    # Prompt tokens computed per step; longer prompts are prefilled in chunks over
    # several steps. Bounds how long prompts stall the running streams (~1 s for
    # 512 on a 2-core CPU); larger is a little more efficient for prefill.
    # None: CPU_MAX_PREFILL_TOKENS on CPU, the step's token budget on CUDA.
    max_prefill_tokens: int | None = None
    # All tokens one step computes (decodes with their proposals, then prompt chunks), vLLM's
    # max_num_batched_tokens: bounds a step's time and activation memory whatever its mix.
    # None: no budget shared with the decodes on CPU, CUDA_MAX_NUM_BATCHED_TOKENS on CUDA.
    max_num_batched_tokens: int | None = None
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    # Share the K/V of full blocks whose prefix is the same (running requests with one
    # system prompt, the next turn of a chat); finished requests leave theirs cached.
    enable_prefix_caching: bool = True
    # CPU fp32 decode attention and RMSNorm in C kernels compiled on first use (worker/model/native.py).
    enable_native_kernels: bool = True
    # Linear weights on CPU: "auto" keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks as they are (other
    # GGUF types become Q8_0) and runs the C kernels on them; a safetensors model stays fp32.
    # "q8_0"/"q4_0" quantize any model's linears at load; "none" is the fp32 path.
    quantization: str = "auto"
    # The attention backend (worker/model/attn_backends.py): auto = cpu with the C kernels,
    # flashinfer on CUDA where flashinfer-python is installed, else torch.
    attention_backend: str = "auto"
    # Speculative decoding: "ngram" proposes the tokens that followed the latest earlier
    # occurrence of the last 1-4 tokens (prompt lookup) and verifies them in the running
    # batch; the output is token for token that of plain decoding (worker/engine/speculative.py).
    # "draft" has `draft_model` (a smaller model with the same tokenizer) draft them
    # (worker/engine/draft.py).
    speculative: str = "none"
    num_speculative_tokens: int = 4  # proposals verified per step and sequence
    draft_model: str | None = None  # GGUF file or Hugging Face folder, for speculative="draft"
    # LoRA adapters (PEFT folders: worker/model/lora.py) served next to the base model, as
    # (name, path) pairs loaded at start; a request names one (its `adapter`) or none (the base).
    # LoRA is on when `enable_lora` is set or any adapter is given; only then can adapters be
    # loaded at run time. With LoRA on, every step runs per op, without the fused C layers
    # (LlamaModel.enable_lora says why, benchmarks/lora.py what it costs); off, nothing changes.
    adapters: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    # Most distinct adapters in one step (vLLM's --max-loras): a request of a further adapter
    # waits, and no later request is admitted before it (so it cannot starve), until one of the
    # running adapters has no request left.
    max_adapters: int = 4
    max_lora_rank: int = 64  # adapters of a larger r are refused

    def step_budgets(self, is_cuda: bool) -> tuple[int, int | None]:
        """(max_prefill_tokens, max_num_batched_tokens) with the device's defaults for unset ones."""
        batched = self.max_num_batched_tokens
        if batched is None and is_cuda:
            batched = max(CUDA_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        prefill = self.max_prefill_tokens
        if prefill is None:
            prefill = batched if is_cuda and batched is not None else CPU_MAX_PREFILL_TOKENS
        return prefill, batched

    @property
    def is_lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.adapters)

    def __post_init__(self) -> None:
        self._check_lora()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("speculative 'draft' needs draft_model and draft_model needs speculative "
                             f"'draft'; got {self.speculative!r} and {self.draft_model!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ValueError(f"kv_cache_memory_mb must be >= 1, got {self.kv_cache_memory_mb}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}): every running request decodes a token "
                             "each step")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def _check_lora(self) -> None:
        for pair in self.adapters:
            is_pair = isinstance(pair, tuple) and len(pair) == 2
            if not (is_pair and all(isinstance(p, str) and p for p in pair)):
                raise ValueError(f"adapters must be (name, path) pairs of non-empty strings, got {pair!r}")
            if not ADAPTER_NAME.fullmatch(pair[0]):
                raise ValueError(f"adapters: name {pair[0]!r} must match {ADAPTER_NAME.pattern}")
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"adapters: names must be unique, got {', '.join(twice)} more than once")
        if not 1 <= self.max_adapters <= 64:
            raise ValueError(f"max_adapters must be in [1, 64], got {self.max_adapters}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {self.max_lora_rank}")


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine (worker/engine/sim.py): how long a step takes and which tokens it emits.

    A step sleeps step_ms + ms_per_token * (decode rows + prompt tokens prefilled), the shape of
    a GPU step (a fixed launch/weights-read cost plus a per-token cost), so one sim worker
    stands for a GPU worker with max_num_seqs streams at a chosen rate.
    """

    step_ms: float = 20.0
    ms_per_token: float = 0.05
    # Mixed into every token id: workers with different salts emit different tokens for one
    # request, so a stream spliced from two workers' generations shows in a test.
    salt: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.step_ms <= 60_000:
            raise ValueError(f"sim step_ms must be in [0, 60000], got {self.step_ms}")
        if not 0 <= self.ms_per_token <= 1_000:
            raise ValueError(f"sim ms_per_token must be in [0, 1000], got {self.ms_per_token}")
