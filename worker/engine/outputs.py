"""What goes in and out of the text engine besides text (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.params import FinishReason, Logprobs, Usage


@dataclass
class RequestOutput:
    """New tokens of one request from one step; the last one has `finished`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # generated this step
    text: str = ""  # text delta, UTF-8 safe, stop strings held back
    logprobs: list[Logprobs] | None = None  # one per token id when requested
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set on the final output
    error: str | None = None  # set with FinishReason.ERROR
    is_invalid_request: bool = False  # the error is the request's own (a format that does not compile)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Resume:
    """Where an earlier worker left a request (from `queue.Progress`)."""

    token_ids: tuple[int, ...]  # generated and already streamed
    seed: int
    first_token_unix: float = 0.0


@dataclass(frozen=True)
class Admitted:
    seed: int  # the sampling seed in use (drawn when the request gave none)
    text: str = ""  # text already streamed for the resumed tokens ("" for a new request)
    # The prompt's tokens after truncation: what its tenant is billed for (gateway/quotas.py).
    num_prompt_tokens: int = 0


@dataclass
class EngineStats:
    """An engine's load and capacity, read after each step (heartbeat fields, /metrics)."""

    model_name: str
    weights: str  # formats and kernels (LlamaModel.quantization_summary)
    num_running: int
    num_waiting: int  # admitted, waiting for KV blocks or prefill budget (preempted ones too)
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_blocks: int
    num_free_blocks: int  # held by no request; cached prefix blocks included (evicted when needed)
    kv_cache_usage: float  # share of blocks held by requests, 0..1
    num_prefix_cache_hit_tokens: int  # since start
    num_prefix_cache_query_tokens: int
    num_preemptions: int
    num_step_prefill_tokens: int  # prompt tokens the last step computed
    num_step_decode_tokens: int  # decode tokens the last step computed (proposals included)
    num_spec_drafts: int = 0  # since start: decodes that verified proposals
    num_spec_draft_tokens: int = 0  # proposed tokens verified
    num_spec_accepted_tokens: int = 0  # of those, accepted
    # Structured output (grammar.py) since start: format compilations and their cache.
    num_grammar_compiles: int = 0
    grammar_compile_seconds: tuple[float, ...] = ()  # of the latest compilations (at most 64), oldest first
    num_grammar_cache_hits: int = 0
    num_grammar_cache_misses: int = 0
    grammar_mask_seconds: float = 0.0  # masking the constrained rows' logits in the last step
    # LoRA: running requests of each loaded adapter (unloading ones too), the base model's not included
    num_running_by_adapter: dict[str, int] = field(default_factory=dict)


def context_overflow(prompt_tokens: int, max_tokens: int, context: int) -> ValueError:
    return ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context "
                      f"of {context} tokens; lower max_tokens or set truncate_prompt")
