"""Vectorised next-token sampling for a batch of running requests (torch only; no redis, no grpc).

Pipeline, in the order HF and vLLM use:

    penalties → greedy rows: argmax → temperature → top-k → top-p → min-p → sample

Randomness is counter-based. The noise for vocab entry `v` of a row is a pure hash of
`(seed, step, v)` (`counter_based_uniform`), turned into a sample with the exponential race
`argmax(probs / E)`, `E = -log(u)` (equivalent to Gumbel-max). A request therefore draws the
same token from the same logits wherever it sits in the batch and whoever its neighbours are,
so a seeded request is reproducible across batch sizes, preemption and restarts. A shared
`torch.Generator` cannot give that: its stream is consumed in batch order.

Logprobs are `log_softmax` of the *raw* logits, before penalties, temperature and truncation
(vLLM v1's default): they describe the model's distribution, are comparable between requests
with different sampling settings, and the chosen token never reports -inf.

Penalty counts: built per step from each row's whole output (`_token_counts`), or kept per
request across steps and updated with each step's accepted tokens (`PenaltyCounts`,
penalties.py: what the model runner uses).

Host syncs: none here; the caller syncs once with `.tolist()` on the output.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from protos.params import SamplingParams
from worker.engine.input_batch import StagedRows
from worker.engine.penalties import PenaltyCounts, has_penalty

if TYPE_CHECKING:
    from worker.engine.sequence import Sequence as EngineSequence

_MASK32 = 0xFFFF_FFFF
# Arbitrary odd 32-bit keys that separate the hashed fields from each other.
_STEP_KEY = 0x9E37_79B9
_SEED_HI_KEY = 0x85EB_CA6B
_VOCAB_KEY = 0xC2B2_AE35


@dataclass
class SamplingRow:
    """One running request, as the sampler needs it."""

    params: SamplingParams
    seed: int  # the resolved seed: params.seed, or one the worker drew and reports
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; len == the step being sampled
    # The request these rows sample for, whose penalty counts a PenaltyCounts keeps across
    # steps (None: counted afresh from the lists), and how many leading output_token_ids are
    # its accepted output (the rest: proposals it verifies or drafts; -1: all of them).
    owner: EngineSequence | None = None
    num_accepted: int = -1

    def __post_init__(self) -> None:
        if self.num_accepted < 0:
            self.num_accepted = len(self.output_token_ids)


@dataclass
class SamplingBatch:
    """Per-step tensors for the running requests. Built once per step by `build_sampling_batch`."""

    temperatures: Tensor  # (B,) float32, 0 = greedy
    top_k: Tensor  # (B,) int64, 0 = off
    top_p: Tensor  # (B,) float32, 1 = off
    min_p: Tensor  # (B,) float32, 0 = off
    repetition_penalty: Tensor  # (B,) float32, 1 = off
    presence_penalty: Tensor  # (B,) float32, 0 = off
    frequency_penalty: Tensor  # (B,) float32, 0 = off
    seeds: Tensor  # (B,) int64: the uint64 seed's bits (two's complement)
    steps: Tensor  # (B,) int64, index of the token being sampled (0 = first generated token)
    prompt_mask: Tensor | None  # (B, V) bool, token is in the prompt; None unless a repetition penalty is on
    output_counts: Tensor | None  # (B, V) float32, occurrences in the output; None unless a penalty is on
    max_num_logprobs: int | None  # None = no row asked for logprobs; else max top_logprobs (may be 0)
    is_all_greedy: bool
    is_any_greedy: bool
    enable_top_k: bool
    max_top_k: int  # the largest k of the rows with top-k on (0 < k < V), known on the host: no sync
    enable_top_p: bool
    enable_min_p: bool
    enable_penalties: bool


@dataclass
class SamplerOutput:
    token_ids: Tensor  # (B,) int64
    logprobs: Tensor | None  # (B,) float32, raw logprob of the chosen token; None unless a row asked
    top_ids: Tensor | None  # (B, K) int64, K = max requested top_logprobs; None when K == 0
    top_logprobs: Tensor | None  # (B, K) float32, raw logprobs of top_ids, descending
    is_finite: Tensor  # (B,) bool; False: the row's logits had NaN/+inf (or were all -inf), fail it


@dataclass
class ParamStaging:
    """Buffers allocated once for a step's parameter columns (the sampler's on CUDA)."""

    floats: StagedRows  # (B, 6) float32
    ints: StagedRows  # (B, 3) int64

    @classmethod
    def on(cls, device: torch.device) -> ParamStaging:
        return cls(StagedRows(6, torch.float32, device), StagedRows(3, torch.int64, device))


def build_sampling_batch(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str,
    kept: PenaltyCounts | None = None, staging: ParamStaging | None = None,
) -> SamplingBatch:
    """Gather the per-request parameters into tensors (two small host→device copies + token counts).

    On CUDA the two are staged in pinned memory and copied without blocking the host: a pageable
    copy waits for the GPU to drain the step's queued work; with `staging` into buffers allocated
    once. kept: the penalty counts kept per request (every row then names its owner); None:
    counted from the rows' lists."""
    params = [row.params for row in rows]
    float_rows = [[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                   p.frequency_penalty] for p in params]
    int_rows = [[p.top_k, _as_int64(row.seed), len(row.output_token_ids)]
                for p, row in zip(params, rows, strict=True)]
    if staging is not None:
        floats, ints = staging.floats.stage(float_rows), staging.ints.stage(int_rows)  # (B, 6), (B, 3)
    else:
        pin = torch.device(device).type == "cuda"
        # reshape keeps the shape when B == 0
        floats = torch.tensor(float_rows, dtype=torch.float32, pin_memory=pin).reshape(len(rows), 6)
        ints = torch.tensor(int_rows, dtype=torch.int64, pin_memory=pin).reshape(len(rows), 3)
        floats, ints = floats.to(device, non_blocking=pin), ints.to(device, non_blocking=pin)
    float_cols, int_cols = floats.unbind(1), ints.unbind(1)  # (B,) each

    enable_repetition = any(p.repetition_penalty != 1.0 for p in params)
    enable_penalties = any(has_penalty(p) for p in params)
    output_counts = prompt_mask = None
    if enable_penalties and kept is not None:
        output_counts, prompt_mask = kept.gather(rows, enable_repetition)
    elif enable_penalties:
        output_counts = _token_counts([row.output_token_ids for row in rows], vocab_size, device)
        if enable_repetition:
            prompt_mask = _token_counts([row.prompt_token_ids for row in rows], vocab_size, device) > 0
    requested = [p.num_logprobs for p in params if p.num_logprobs is not None]
    return SamplingBatch(
        temperatures=float_cols[0],
        top_k=int_cols[0],
        top_p=float_cols[1],
        min_p=float_cols[2],
        repetition_penalty=float_cols[3],
        presence_penalty=float_cols[4],
        frequency_penalty=float_cols[5],
        seeds=int_cols[1],
        steps=int_cols[2],
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        max_num_logprobs=max(requested) if requested else None,
        is_all_greedy=all(p.is_greedy for p in params),
        is_any_greedy=any(p.is_greedy for p in params),
        enable_top_k=any(0 < p.top_k < vocab_size for p in params),
        max_top_k=max((p.top_k for p in params if 0 < p.top_k < vocab_size), default=0),
        enable_top_p=any(p.top_p < 1.0 for p in params),
        enable_min_p=any(p.min_p > 0.0 for p in params),
        enable_penalties=enable_penalties,
    )


def _token_counts(seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> Tensor:
    """(B, V) float32 count of each token id per sequence; ids outside [0, V) are ignored."""
    num_rows, width = len(seqs), vocab_size + 1  # column V collects out-of-range ids
    pin = torch.device(device).type == "cuda"  # staged in pinned memory: copies that do not block

    def to_device(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=pin)

    ids = to_device(list(itertools.chain.from_iterable(seqs)))  # (N,)
    lengths = to_device([len(s) for s in seqs])  # (B,)
    # output_size: the total is known here; without it repeat_interleave reads `lengths` back
    # from the device (a host sync on CUDA)
    row_ids = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths,
                                      output_size=ids.numel())  # (N,)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
    counts = torch.zeros(num_rows * width, dtype=torch.float32, device=device)  # (B * (V + 1),)
    # index_add_ rather than bincount: bincount syncs with the host on CUDA.
    counts.index_add_(0, row_ids * width + ids, torch.ones_like(ids, dtype=torch.float32))
    return counts.view(num_rows, width)[:, :vocab_size]  # (B, V)


# ---------------------------------------------------------------------------------------------
# Counter-based noise. 32-bit lanes live in int64 tensors; every intermediate stays < 2**63.


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32): split c into 16-bit halves so no product overflows int64."""
    low = x * (c & 0xFFFF)  # < 2**48
    high = ((x * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (low + high) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 (C. Wellons): a bijective 32-bit finaliser with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB_352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846C_A68B)
    return x ^ (x >> 16)


def _as_int64(seed: int) -> int:
    """A uint64 seed as the int64 with the same 64 bits (two's complement), which is what
    counter_based_uniform reads: seeds of 2**63 and above keep every bit of entropy."""
    return seed - 2**64 if seed >= 2**63 else seed


def counter_based_uniform(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """Uniform noise in (0, 1), shape (B, V); entry [b, v] is a pure function of (seeds[b], steps[b], v).

    Nothing depends on the batch position, the batch size or any other row, and no generator
    state is kept, so the same request gets the same noise in any batch, on any device.
    """
    seed_lo, seed_hi = seeds & _MASK32, (seeds >> 32) & _MASK32  # (B,) each: the low and high 32 bits
    step_keys = _mix32((steps & _MASK32) ^ _STEP_KEY)  # (B,)
    row_keys = _mix32(seed_lo ^ _mix32(seed_hi ^ _SEED_HI_KEY ^ step_keys))  # (B,)
    vocab_keys = _mix32(torch.arange(vocab_size, device=seeds.device) ^ _VOCAB_KEY)  # (V,)
    bits = _mix32(row_keys[:, None] ^ vocab_keys[None, :])  # (B, V), distinct within a row (bijections)
    # Top 23 bits: (n + 0.5) fits float32's 24-bit significand exactly, so u never rounds to 0 or 1
    # and E = -log(u) is finite and > 0.
    return ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)  # (B, V)


def sample_exponential_race(probs: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """argmax(probs / E), E ~ Exp(1) from counter-based noise: a draw from probs (need not sum to 1)."""
    exponentials = -torch.log(counter_based_uniform(seeds, steps, probs.shape[-1]))  # (B, V)
    return (probs / exponentials).argmax(dim=-1)  # (B,)


@functools.cache
def fused_exponential_race() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """sample_exponential_race as one fused kernel (torch.compile: Triton on CUDA, C++ on CPU):
    the hash, the log, the division and the argmax in one pass over each row, where the eager
    form makes ~30 passes over (B, V) int64 temporaries (at B = 256 and V = 128k, ~8 GB of
    memory traffic a step). Shapes are dynamic, so a new batch size does not compile again; the
    same function of (seed, step, v) per entry, so seeded output stays batch-invariant. Compiled
    at its first call (~30 s on a 2-core CPU); the sampler uses it on CUDA."""
    return torch.compile(sample_exponential_race, dynamic=True, fullgraph=True)


# ---------------------------------------------------------------------------------------------
# Logits processing.


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition (HF: tokens in prompt or output), then presence/frequency (OpenAI: output only)."""
    if not batch.enable_penalties:
        return logits
    counts = batch.output_counts  # (B, V)
    assert counts is not None, "build_sampling_batch sets output_counts whenever a penalty is on"
    if batch.prompt_mask is not None:
        seen = batch.prompt_mask | (counts > 0)  # (B, V)
        penalty = batch.repetition_penalty[:, None]  # (B, 1)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    presence = batch.presence_penalty[:, None] * (counts > 0)  # (B, V)
    return logits - presence - batch.frequency_penalty[:, None] * counts  # (B, V)


def apply_top_k_top_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    top-k keeps the k largest logits and any tied with the k-th (a tie's order would otherwise
    be arbitrary). top-p keeps the smallest prefix of the sorted distribution whose mass reaches
    p, and always the most likely token. Top-k alone takes `topk` of the batch's largest k, not a
    sort of the vocabulary (vLLM does the same): the rest of the row needs no order.
    """
    if not (batch.enable_top_k or batch.enable_top_p):
        return logits
    vocab_size = logits.shape[-1]
    if not batch.enable_top_p:
        is_on = (batch.top_k > 0) & (batch.top_k < vocab_size)  # (B,)
        k = torch.where(is_on, batch.top_k, 1)  # (B,)
        kth = logits.topk(batch.max_top_k, dim=-1).values.gather(-1, (k - 1)[:, None])  # (B, 1)
        return logits.masked_fill((logits < kth) & is_on[:, None], float("-inf"))  # (B, V)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (B, V) each
    if batch.enable_top_k:  # the k-th largest as the threshold, as above: ties with it kept
        k = torch.where((batch.top_k > 0) & (batch.top_k < vocab_size), batch.top_k, vocab_size)  # (B,)
        kth = sorted_logits.gather(-1, (k - 1)[:, None])  # (B, 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if batch.enable_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1)  # (B, V)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V), exactly 0 for rank 0
        # Rows with top_p == 1 are left alone: cumsum rounding could otherwise cut their tail.
        drop = (mass_before >= batch.top_p[:, None]) & (batch.top_p < 1.0)[:, None]  # (B, V)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)  # (B, V)


def logits_to_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature → top-k → top-p → softmax → min-p. Greedy rows (temperature 0) get temperature 1.

    min-p zeroes tokens whose probability is below min_p × the row's top probability; the result
    is not renormalised (the exponential race does not need it).
    """
    temperatures = torch.where(batch.temperatures > 0, batch.temperatures, 1.0)  # (B,)
    logits = apply_top_k_top_p(logits / temperatures[:, None], batch)  # (B, V)
    probs = logits.softmax(dim=-1)  # (B, V)
    if batch.enable_min_p:
        threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (B, 1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


class Sampler:
    """Turns a step's logits into one token per row. All randomness comes from the batch; the
    one state is the penalty counts kept per request (`kept`, None: counted afresh each step).

    greedy_argmax: a one-pass (ids, is_finite) of fp32 CPU rows (the C kernel in
    worker/model/kernels/cpu.c), used when every row is greedy with no penalties and no
    logprobs; it gives what the torch path gives, in ~0.02 ms instead of ~0.16 ms for one row
    of SmolLM2's 49152 logits (bench-kernel-limits' host overhead per batch-1 step)."""

    def __init__(self, greedy_argmax: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None,
                 kept: PenaltyCounts | None = None, staging: ParamStaging | None = None,
                 fused: bool = False) -> None:
        self.greedy_argmax = greedy_argmax
        self.kept = kept
        self.staging = staging  # None: the parameters in new tensors each step
        # the exponential race as one compiled kernel (fused_exponential_race; CUDA's default)
        self.race = fused_exponential_race() if fused else sample_exponential_race

    def sample(self, logits: Tensor, rows: Sequence[SamplingRow], device: torch.device | str,
               ) -> SamplerOutput:
        """The rows' tokens, building their SamplingBatch only when the C argmax cannot answer
        alone: building it (two small tensors, their columns) took ~54 us of a batch-1 step's
        0.33 ms host work (2-core AVX2 EPYC, 2026-12-06), more than the argmax itself."""
        params = [row.params for row in rows]
        if self._argmax_alone(logits, all(p.is_greedy for p in params),
                              any(has_penalty(p) for p in params),
                              any(p.num_logprobs is not None for p in params)):
            return self._argmax(logits)
        return self(logits, build_sampling_batch(rows, logits.shape[-1], device, self.kept, self.staging))

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if self._argmax_alone(logits, batch.is_all_greedy, batch.enable_penalties,
                              batch.max_num_logprobs is not None):
            return self._argmax(logits)
        logits = logits.float()  # (B, V); a no-op for float32
        # NaN/+inf (or no finite token at all) fails that request only; zeroing the row keeps
        # it from poisoning batch-wide reductions, and every other row samples as usual.
        is_finite = torch.isfinite(logits.sum(dim=-1))  # (B,): one pass settles every normal row
        if logits.device.type != "cpu" or not bool(is_finite.all()):  # (a host check is free on CPU)
            is_bad = logits.isnan() | (logits == float("inf"))  # (B, V)
            is_finite = ~is_bad.any(dim=-1) & (logits > float("-inf")).any(dim=-1)  # (B,)
            logits = torch.where(is_finite[:, None], logits, 0.0)  # (B, V)
        raw_logprobs = logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None  # (B, V)

        logits = apply_penalties(logits, batch)
        if batch.is_all_greedy:
            token_ids = logits.argmax(dim=-1)  # (B,)
        else:
            probs = logits_to_probs(logits, batch)  # (B, V)
            token_ids = self.race(probs, batch.seeds, batch.steps)  # (B,)
            if batch.is_any_greedy:
                token_ids = torch.where(batch.temperatures > 0, token_ids, logits.argmax(dim=-1))
        return _with_logprobs(token_ids, raw_logprobs, batch.max_num_logprobs, is_finite)

    def _argmax_alone(self, logits: Tensor, all_greedy: bool, penalties: bool, logprobs: bool) -> bool:
        return (self.greedy_argmax is not None and all_greedy and not penalties and not logprobs
                and logits.dtype == torch.float32 and logits.device.type == "cpu")

    def _argmax(self, logits: Tensor) -> SamplerOutput:
        assert self.greedy_argmax is not None
        token_ids, is_finite = self.greedy_argmax(logits)  # (B,) each
        return SamplerOutput(token_ids, None, None, None, is_finite)


def _with_logprobs(
    token_ids: Tensor, raw_logprobs: Tensor | None, max_num_logprobs: int | None, is_finite: Tensor
) -> SamplerOutput:
    """Rows that did not ask get values too (cheaper than masking); the caller drops them."""
    if raw_logprobs is None or max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, is_finite)
    chosen = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # (B,)
    if max_num_logprobs == 0:
        return SamplerOutput(token_ids, chosen, None, None, is_finite)
    k = min(max_num_logprobs, raw_logprobs.shape[-1])
    top_logprobs, top_ids = raw_logprobs.topk(k, dim=-1)  # (B, K) each
    return SamplerOutput(token_ids, chosen, top_ids, top_logprobs, is_finite)
