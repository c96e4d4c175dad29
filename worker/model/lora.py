"""LoRA adapters in PEFT's layout, and their low-rank updates applied to a batch's rows.

A PEFT LoRA folder holds `adapter_config.json` (r, lora_alpha, target_modules, ...)
and `adapter_model.safetensors` with, per adapted linear of layer i,
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r); the adapted linear computes
x W^T + scale * (x A^T) B^T with scale = lora_alpha / r (lora_alpha / sqrt(r) with
`use_rslora`). Anything else PEFT can write (DoRA, biases, fan_in_fan_out,
per-module ranks, an embedding or head adapter) is refused with a ValueError
naming the file and field, rather than served as something it is not.

The model fuses q/k/v into one matmul and gate/up into another (llama.py), so an
adapter is kept per fused matmul (`LoraUpdate`): the A of its adapted modules side
by side, and their B^T (scale folded in) placed at each module's output columns,
zero elsewhere. One step then costs two small matmuls per fused linear and adapter.

`LoraRows.add` applies them like vLLM's punica kernels: the base matmul runs once
over all rows, then each adapter present adds its update to its own rows, so that a row's
result does not depend on how many rows, or which adapters, share the step (a plain
(n, in) @ (in, r) matmul picks its kernel by n, and its bits changed with n when tried).
On the C kernels that is one call per matmul for all rows (kernels/lora.c, which reads
only b_t's nonzero blocks through each adapter's `table` of addresses); elsewhere (CUDA,
half precision) a batch of one-row products, `torch.bmm` of (n, 1, in) rows against the
adapter's matrices broadcast to n: 16 decode rows over 4 rank-16 adapters of SmolLM2 took
~19 ms a step that way on the 2-core Xeon, 960 bmm calls that use one core each.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from worker.model.config import ModelConfig
from worker.model.native_lora import TABLE_FIELDS, LoraKernel, check_rows

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's fused matmuls and their modules, in the order of their output columns.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
GROUP_INDEX = {group: i for i, group in enumerate(GROUPS)}  # kernels/lora.c's order
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
DEFAULT_MAX_LORA_RANK = 64
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
Pairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B)
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoraUpdate:
    """One fused linear's update: out += (x @ a_t) @ b_t."""

    a_t: torch.Tensor  # (in, m * r): A^T of the m adapted modules of the group, side by side
    b_t: torch.Tensor  # (m * r, out): scale * B^T of each at its module's output columns, zero elsewhere
    columns: tuple[tuple[int, int], ...]  # (start, end) output columns of each adapted module, m of them


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scale: float
    modules: tuple[str, ...]  # the adapted target modules, in TARGET_MODULES order
    layers: tuple[dict[str, LoraUpdate], ...]  # per layer: GROUPS name -> its update (absent: none)
    # (L, 4, TABLE_FIELDS) int64: per layer and group (GROUP_INDEX), a_t's and b_t's addresses, in,
    # N, r, m and `columns` (0 where absent), for kernels/lora.c, valid while this adapter lives;
    # None unless the weights are fp32 on the CPU
    table: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for u in layer.values()
                   for t in (u.a_t, u.b_t))


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module's weight in this model."""
    C, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (q, C), "k_proj": (kv, C), "v_proj": (kv, C), "o_proj": (C, q), "gate_proj": (F, C),
            "up_proj": (F, C), "down_proj": (C, F)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, *, max_rank: int = DEFAULT_MAX_LORA_RANK,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraAdapter:
    """A PEFT LoRA folder for a model of `config`, its weights in `dtype` on `device` (the model's).
    ValueError naming the file and field of anything it cannot serve exactly."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"adapter {name!r}: {folder} is not a folder (a PEFT LoRA adapter's)")
    rank, scale, targets = _read_config(folder / CONFIG_FILE, max_rank)
    pairs = _read_pairs(folder / WEIGHTS_FILE, config, rank)
    if not pairs:
        raise ValueError(f"{folder / WEIGHTS_FILE}: no LoRA weights ({KEY.pattern})")
    modules = tuple(m for m in TARGET_MODULES if any(m == mod for _, mod in pairs))
    if targets is not None and set(modules) - set(targets):
        raise ValueError(f"{folder / WEIGHTS_FILE}: has weights of {sorted(set(modules) - set(targets))} "
                         f"that {CONFIG_FILE}'s target_modules {sorted(targets)} does not name")
    shapes = module_shapes(config)
    layers = []
    for i in range(config.num_layers):
        groups = {}
        for group, members in GROUPS.items():
            adapted = [m for m in members if (i, m) in pairs]
            if adapted:
                groups[group] = _fuse(members, adapted, pairs, i, shapes, scale, dtype, torch.device(device))
        layers.append(groups)
    table = _table(layers, rank) if dtype == torch.float32 and torch.device(device).type == "cpu" else None
    return LoraAdapter(name, rank, scale, modules, tuple(layers), table)


def _table(layers: list[dict[str, LoraUpdate]], rank: int) -> torch.Tensor:
    """The adapter's addresses and shapes for kernels/lora.c (LoraAdapter.table)."""
    table = torch.zeros(len(layers), len(GROUPS), TABLE_FIELDS, dtype=torch.int64)  # (L, 4, 12)
    for i, groups in enumerate(layers):
        for group, u in groups.items():
            fields = [u.a_t.data_ptr(), u.b_t.data_ptr(), u.a_t.shape[0], u.b_t.shape[1], rank,
                      len(u.columns), *(c for span in u.columns for c in span)]
            table[i, GROUP_INDEX[group], :len(fields)] = torch.tensor(fields)
    return table


def _read_config(file: Path, max_rank: int) -> tuple[int, float, tuple[str, ...] | None]:
    """(r, scale, target_modules or None when given as a pattern) of an adapter_config.json."""
    if not file.is_file():
        raise ValueError(f"{file}: missing (a PEFT LoRA adapter has {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg: dict[str, Any] = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: must be a JSON object")
    refused = {"peft_type": cfg.get("peft_type", "LORA") != "LORA", "use_dora": bool(cfg.get("use_dora")),
               "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")), "bias": cfg.get("bias", "none") != "none",
               "rank_pattern": bool(cfg.get("rank_pattern")), "alpha_pattern": bool(cfg.get("alpha_pattern")),
               "modules_to_save": bool(cfg.get("modules_to_save"))}
    for field, is_refused in refused.items():
        if is_refused:
            raise ValueError(f"{file}: {field} = {cfg[field]!r} is not supported (plain LoRA only: peft_type "
                             f"LORA, bias 'none', no DoRA, fan_in_fan_out, patterns or modules_to_save)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise ValueError(f"{file}: r must be an integer in [1, max_lora_rank = {max_rank}], got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"{file}: target_modules {unknown} are not supported "
                             f"(only {', '.join(TARGET_MODULES)})")
    elif not isinstance(targets, str | None):
        raise ValueError(f"{file}: target_modules must be a list of names or a pattern, got {targets!r}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale), tuple(targets) if isinstance(targets, list) else None


def _read_pairs(file: Path, config: ModelConfig, rank: int) -> Pairs:
    """(layer, module) -> (A (r, in), B (out, r)) fp32, checked against the model's shapes."""
    if not file.is_file():
        bin_note = " (adapter_model.bin is not read: a pickle can run code)" if file.with_suffix(
            ".bin").is_file() else ""
        raise ValueError(f"{file}: missing{bin_note}")
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = KEY.fullmatch(key)
        if m is None or m[3] not in TARGET_MODULES or PARENTS[m[3]] != m[2]:
            raise ValueError(f"{file}: tensor {key!r} is not a LoRA weight of a supported module "
                             f"({', '.join(TARGET_MODULES)})")
        if int(m[1]) >= config.num_layers:
            raise ValueError(f"{file}: tensor {key!r} is for layer {m[1]}; the model has {config.num_layers}")
        found.setdefault((int(m[1]), m[3]), {})[m[4]] = t
    shapes = module_shapes(config)
    pairs: Pairs = {}
    order = {m: j for j, m in enumerate(TARGET_MODULES)}
    for (i, module), ab in sorted(found.items(), key=lambda item: (item[0][0], order[item[0][1]])):
        out, inp = shapes[module]
        where = f"{file}: layer {i} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: has lora_{''.join(ab)} without lora_{'B' if 'A' in ab else 'A'}")
        for part, want in (("A", (rank, inp)), ("B", (out, rank))):
            if tuple(ab[part].shape) != want:
                raise ValueError(f"{where}: lora_{part} is {tuple(ab[part].shape)}; r = {rank} and the "
                                 f"model's ({out}, {inp}) weight need {want}")
            if not ab[part].is_floating_point() or not torch.isfinite(ab[part]).all():
                raise ValueError(f"{where}: lora_{part} must hold finite floats ({ab[part].dtype})")
        pairs[(i, module)] = (ab["A"].float(), ab["B"].float())
    return pairs


def _fuse(members: tuple[str, ...], adapted: list[str], pairs: Pairs,
          layer: int, shapes: dict[str, tuple[int, int]], scale: float, dtype: torch.dtype,
          device: torch.device) -> LoraUpdate:
    """The update of one fused linear from its adapted members' A and B."""
    r = pairs[(layer, adapted[0])][0].shape[0]
    offsets, width = {}, 0
    for m in members:  # output columns of each member in the fused matmul
        offsets[m], width = width, width + shapes[m][0]
    a_t = torch.cat([pairs[(layer, m)][0] for m in adapted]).T.contiguous()  # (in, m * r)
    b_t = torch.zeros(len(adapted) * r, width)  # (m * r, out)
    for j, m in enumerate(adapted):
        b = pairs[(layer, m)][1]  # (out_m, r)
        b_t[j * r:(j + 1) * r, offsets[m]:offsets[m] + b.shape[0]] = scale * b.T
    columns = tuple((offsets[m], offsets[m] + shapes[m][0]) for m in adapted)
    return LoraUpdate(a_t.to(device, dtype), b_t.to(device, dtype), columns)


class LoraRows:
    """One step's adapted rows, grouped by adapter: `rows` holds each adapter's rows in a span."""

    def __init__(self, slots: torch.Tensor, adapters: tuple[LoraAdapter, ...],
                 kernel: LoraKernel | None = None) -> None:
        """slots (T,): each row's index into `adapters`, -1 for the base model. `kernel`: the C
        update (native_lora.py) for fp32 CPU models with the C kernels; None keeps torch.bmm."""
        order = torch.argsort(slots, stable=True)  # (T,): base rows first, then adapter by adapter
        counts = torch.bincount(slots + 1, minlength=len(adapters) + 1).tolist()  # the step's host sync
        self.rows = order[counts[0]:]  # (n,) the adapted rows
        self.spans: list[tuple[LoraAdapter, int, int]] = []  # (adapter, start, end) in rows
        start = 0
        for adapter, count in zip(adapters, counts[1:], strict=True):
            if count:
                self.spans.append((adapter, start, start + count))
                start += count
        self._kernel = kernel
        if kernel is not None:  # what every C call of the step reads, built once
            if any(a.table is None for a in adapters):
                raise ValueError("the C LoRA update needs adapters loaded as fp32 on the CPU")
            self._row_slots = slots[self.rows].to(torch.int64)  # (n,) sorted
            self._tables = torch.tensor([a.table.data_ptr() for a in adapters if a.table is not None],
                                        dtype=torch.int64)  # (S,)
            self._keep = adapters  # the tables' addresses stay valid for the step
            check_rows(self.rows, self._row_slots, self._tables)

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A^T) @ (scale B)^T for each adapter's rows: x (T, in), out (T, N).

        On the C kernels, one call for all rows and adapters: 16 decode rows over 4 rank-16
        adapters of SmolLM2, all 120 calls of a step, ~6.6 ms with 2 threads (~10.4 with 1;
        about what reading the adapters' ~70 MB of fp32 costs) vs ~22 ms of torch bmm, same run.
        `make bench-lora` (2026-12-05, 2-core Xeon, AVX-512 VNNI, 3 alternated runs, nothing else
        running): lora 158.8 tok/s, base 172.5, fused 195.2; lora_vs_base_tps 0.921 (0.760 with
        the per-row bmm calls, recorded the same day).
        On torch, one gather and one scatter per call whatever the number of adapters (each was
        ~5 and ~10 us, SmolLM2's 30 layers x 4 matmuls x 4 adapters made that ~6 ms of a step)."""
        if self._kernel is not None:
            if self.spans:
                self._kernel(self._tables, layer, GROUP_INDEX[group], x, out, self.rows, self._row_slots)
            return
        spans = [(u, a, b) for adapter, a, b in self.spans if (u := adapter.layers[layer].get(group))]
        if not spans:
            return
        xs = x.index_select(0, self.rows)[:, None, :]  # (n, 1, in), adapter by adapter
        every = len(spans) == len(self.spans)
        # written in place, span by span, when every adapter has this update (a torch.cat took ~14 us)
        delta = x.new_empty(len(self.rows), 1, out.shape[1]) if every else None  # (n, 1, N)
        parts = []
        for update, a, b in spans:
            shrunk = torch.bmm(xs[a:b], update.a_t.expand(b - a, -1, -1))  # (n_a, 1, m * r)
            b_t = update.b_t.expand(b - a, -1, -1)  # (n_a, m * r, N)
            parts.append(torch.bmm(shrunk, b_t) if delta is None else torch.bmm(shrunk, b_t, out=delta[a:b]))
        if delta is None:
            rows = torch.cat([self.rows[a:b] for _, a, b in spans])  # (n',)
            delta = torch.cat(parts)  # (n', 1, N)
        else:
            rows = self.rows
        out.index_add_(0, rows, delta[:, 0])  # (n', N)
