"""Block-quantized linear weights, as the C kernels read them (kernels/quant.c).

llama.cpp's Q4_0, Q4_1 and Q8_0 blocks hold 32 weights and fp16 scales. At load
they are repacked once into two runtime formats, rows of blocks with the values
of a row contiguous and the scales beside them, fp16 as in the file (the kernels
widen them with F16C: at batch 1 decode reads its weights from memory, and fp32
scales made SmolLM2's 96.5 MB a token 111.5 MB):
  * "q4": Q4_1 (w = d * u + m, u a nibble) and Q4_0 (w = d * (u - 8), kept as
    Q4_1 with m = -8 d: one kernel for both);
  * "q8": Q8_0 (w = d * q, q an int8).
Any other tensor type (F16, BF16, K-quants) is dequantized and requantized to
Q8_0 at load, as are safetensors weights with `quantization="q8_0"`.
Where the kernels run SIMD (AVX-512 VNNI, AMX, AVX-VNNI, AVX2), the weights are then stored as
"q4p" and "q8p": the same blocks in panels of 16 rows, interleaved so that a
batch-1 step needs no horizontal sums (`QuantWeight.panels`; kernels/quant.h
has the layout, kernels/quant_panel.h the measurements).

Also here: NumPy references of the activation quantization and of a quantized
linear, which the tests hold the C kernels to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gguf
import numpy as np
import torch

QK = 32  # weights per block
Q = gguf.GGMLQuantizationType
KEPT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # GGUF types kept in their own blocks
QUANTIZE_TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
PANEL = 16  # weight rows a panel (q4p, q8p) interleaves
PANELS = {"q4": "q4p", "q8": "q8p"}  # a row-major format -> its panels
_NIBBLE_SHIFTS = torch.tensor([0, 4, 8, 12], dtype=torch.int32)  # nibble j of a q4p word: bits 4 j


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight (N, C) in blocks of QK along C."""

    format: str  # "q4", "q8", or their panels "q4p", "q8p"
    source: str  # the file's type it came from: "Q4_1", "Q4_0", "Q8_0", or "F32->Q8_0", ...
    # q4: (N, C // 2) uint8, byte j of a block holds u_j (low) and u_{j+16}; q8: (N, C) int8;
    # q4p: (N // 16, C // QK, 256) uint8 and q8p: (N // 16, C // QK, 512) int8 (panels())
    qs: torch.Tensor
    d: torch.Tensor  # (N, C // QK) fp16 block scales; panels: (N // 16, C // QK, 16)
    m: torch.Tensor | None  # q4: (N, C // QK) fp16 block offsets; q4p: (N // 16, C // QK, 16); q8: None

    def __post_init__(self) -> None:
        """The C kernels read these tensors through raw pointers, so they must be what the
        fields say, checked once here rather than on every call: ValueError naming the part."""
        if self.format not in ("q4", "q8", "q4p", "q8p"):
            raise ValueError(f"weight format must be q4, q8, q4p or q8p, got {self.format!r}")
        qs_shape: tuple[int, ...]
        d_shape: tuple[int, ...]
        q4 = self.format in ("q4", "q4p")
        if self.is_panels:
            P, nb = self.d.shape[:2] if self.d.dim() == 3 else (0, 0)
            d_shape, qs_shape = (P, nb, PANEL), (P, nb, PANEL * QK // (2 if q4 else 1))
        else:
            N, nb = self.d.shape if self.d.dim() == 2 else (0, 0)
            d_shape, qs_shape = (N, nb), (N, nb * QK // (2 if q4 else 1))
        qs_dtype = torch.uint8 if q4 else torch.int8
        parts = {"qs": (self.qs, qs_dtype, qs_shape), "d": (self.d, torch.float16, d_shape)}
        if q4:
            if self.m is None:
                raise ValueError(f"a {self.format} weight needs its block offsets m")
            parts["m"] = (self.m, torch.float16, d_shape)
        for name, (t, dtype, shape) in parts.items():
            if t.device.type != "cpu" or t.dtype != dtype:
                raise ValueError(f"weight {name} must be a {dtype} CPU tensor, got {t.dtype} on {t.device}")
            if tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"weight {name} must be {shape} contiguous, got {tuple(t.shape)}")

    @property
    def is_panels(self) -> bool:
        return self.format in ("q4p", "q8p")

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0] * (PANEL if self.is_panels else 1), self.d.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """These rows, in this order (rows are whole blocks: permuting them is exact); panels come
        back row-major."""
        if self.is_panels:
            return self.row_major().rows(index)
        return replace(self, qs=self.qs[index].contiguous(), d=self.d[index].contiguous(),
                       m=None if self.m is None else self.m[index].contiguous())

    def panels(self) -> QuantWeight:
        """This weight in panels of 16 rows, the layout the AVX-512 VNNI tiles read
        (kernels/quant_panel.h): per panel and block, pair k (weights 2 k, 2 k + 1) of the 16 rows
        side by side, so that one vector holds it for all of them.
          q4p: 4 x 16 x 2 little-endian 16-bit words, word [s, r, e] holding weights 8 s + 2 j + e
               of row 16 p + r in its nibbles j = 0..3 (bits 4 j): 64 bytes give pairs 4 s..4 s + 3;
          q8p: 16 x 16 x 2 bytes, [k, r, e] = weight 2 k + e of row 16 p + r."""
        N, C = self.shape
        if self.format not in PANELS or N % PANEL:
            raise ValueError(f"panels: a q4 or q8 weight with a multiple of {PANEL} rows, "
                             f"got {self.format} with {N}")
        P, nb = N // PANEL, C // QK
        if self.format == "q8":
            q8 = self.qs.view(P, PANEL, nb, QK // 2, 2).permute(0, 2, 3, 1, 4)  # (p, b, k, r, e)
            return replace(self, format="q8p", qs=q8.reshape(P, nb, -1).contiguous(),
                           d=self._scales_to_panels(self.d))
        q = self.qs.view(N, nb, QK // 2)
        u = torch.cat((q & 0x0F, q >> 4), dim=-1).to(torch.int32)  # (N, nb, QK) in element order
        u = u.view(P, PANEL, nb, 4, 4, 2)  # (p, r, b, s, j, e): element 8 s + 2 j + e of row 16 p + r
        words = (u.permute(0, 2, 3, 1, 5, 4) << _NIBBLE_SHIFTS).sum(-1)  # (p, b, s, r, e)
        qs = torch.from_numpy(words.numpy().astype("<u2").view(np.uint8).reshape(P, nb, -1)).clone()
        assert self.m is not None
        return replace(self, format="q4p", qs=qs, d=self._scales_to_panels(self.d),
                       m=self._scales_to_panels(self.m))

    def row_major(self) -> QuantWeight:
        """Panels back as rows (a row-major weight, itself)."""
        if not self.is_panels:
            return self
        N, C = self.shape
        P, nb = N // PANEL, C // QK
        d = self.d.permute(0, 2, 1).reshape(N, nb)
        if self.format == "q8p":
            q8 = self.qs.view(P, nb, QK // 2, PANEL, 2).permute(0, 3, 1, 2, 4)  # (p, r, b, k, e)
            return replace(self, format="q8", qs=q8.reshape(N, C), d=d)
        words = torch.from_numpy(self.qs.numpy().view("<u2").astype(np.int32)).view(P, nb, 4, PANEL, 2, 1)
        u = ((words >> _NIBBLE_SHIFTS) & 0x0F).permute(0, 3, 1, 2, 5, 4)  # (p, r, b, s, j, e)
        u = u.reshape(N, nb, QK)
        qs = (u[..., : QK // 2] | (u[..., QK // 2:] << 4)).to(torch.uint8).reshape(N, C // 2)
        assert self.m is not None
        return replace(self, format="q4", qs=qs, d=d, m=self.m.permute(0, 2, 1).reshape(N, nb))

    @staticmethod
    def _scales_to_panels(t: torch.Tensor) -> torch.Tensor:
        N, nb = t.shape
        return t.view(N // PANEL, PANEL, nb).permute(0, 2, 1).contiguous()  # (P, nb, 16)

    def dequantize(self) -> torch.Tensor:
        """(N, C) fp32: what the kernels multiply by."""
        if self.is_panels:
            return self.row_major().dequantize()
        N, C = self.shape
        scale = self.d.float()[:, :, None]  # (N, C / QK, 1)
        if self.format == "q8":
            return (self.qs.view(N, -1, QK).float() * scale).view(N, C)
        q = self.qs.view(N, -1, QK // 2)  # (N, C / QK, 16)
        u = torch.cat((q & 0x0F, q >> 4), dim=-1).float()  # (N, C / QK, QK) in element order
        assert self.m is not None
        return (u * scale + self.m.float()[:, :, None]).view(N, C)


def cat_rows(weights: list[QuantWeight], source: str | None = None) -> QuantWeight:
    """Weights of one format stacked along N (fused q/k/v, gate/up)."""
    formats = {w.format for w in weights}
    if len(formats) != 1:
        raise ValueError(f"cannot fuse weights of formats {sorted(formats)}")
    ms = [w.m for w in weights]
    return QuantWeight(weights[0].format, source or "+".join(sorted({w.source for w in weights})),
                       torch.cat([w.qs for w in weights]), torch.cat([w.d for w in weights]),
                       None if any(m is None for m in ms) else torch.cat([m for m in ms if m is not None]))


def interleave_rows(a: QuantWeight, b: QuantWeight) -> QuantWeight:
    """Rows a_0, b_0, a_1, b_1, ...: gate and up side by side for the SiLU-mul epilogue."""
    both = cat_rows([a, b])
    n = a.shape[0]
    order = torch.stack((torch.arange(n), torch.arange(n, 2 * n)), dim=1).reshape(-1)  # (2n,)
    return both.rows(order)


def from_blocks(raw: np.ndarray, qtype: Q, shape: tuple[int, int], source: str | None = None) -> QuantWeight:
    """A GGUF tensor's raw bytes ((N, C // QK * block bytes) uint8) as a QuantWeight."""
    N, C = shape
    if C % QK:
        raise ValueError(f"a {qtype.name} tensor needs in_features divisible by {QK}, got {C}")
    blocks = np.ascontiguousarray(raw).reshape(N, C // QK, -1)  # (N, nb, block bytes)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])  # (N, nb) fp16
    if qtype == Q.Q8_0:
        qs = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(N, C))
        return QuantWeight("q8", source or qtype.name, qs, d, None)
    if qtype == Q.Q4_1:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        qs = torch.from_numpy(blocks[..., 4:].reshape(N, C // 2).copy())
    elif qtype == Q.Q4_0:
        m = d * -8.0  # exact (a power of two) unless it overflows fp16
        if not torch.isfinite(m).all():
            raise ValueError("a Q4_0 block scale is too large: -8 x d overflows fp16")
        qs = torch.from_numpy(blocks[..., 2:].reshape(N, C // 2).copy())
    else:
        raise ValueError(f"{qtype.name} blocks are not kept quantized (only {[t.name for t in KEPT_TYPES]})")
    return QuantWeight("q4", source or qtype.name, qs, d, m)


def quantize(w: torch.Tensor, kind: str, source: str = "") -> QuantWeight:
    """A float weight (N, C) quantized with llama.cpp's reference rounding (gguf's NumPy port)."""
    qtype = QUANTIZE_TYPES[kind]
    N, C = w.shape
    if C % QK:
        raise ValueError(f"{kind} needs in_features divisible by {QK}, got {C}")
    raw = gguf.quants.quantize(w.detach().float().numpy(), qtype)  # (N, nb * block bytes)
    return from_blocks(raw, qtype, (N, C), source=f"{source}->{qtype.name}" if source else qtype.name)


# ---- NumPy references ----------------------------------------------------------------------

ACT_MAX = 32767  # activations are quantized to int16 blocks (kernels/quant.c says why)


def quantize_activations_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, C) fp32 -> (qs (T, C) int16, d (T, C / QK) fp32, s (T, C / QK) int32), as
    kernels/quant.c computes them: d = max|x| / 32767, q = rint(x * (1 / d)) (ties to even)."""
    T, C = x.shape
    xb = x.astype(np.float32).reshape(T, C // QK, QK)
    d = (np.abs(xb).max(axis=-1) / np.float32(ACT_MAX)).astype(np.float32)  # (T, nb)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int32)  # (T, nb, QK)
    return q.astype(np.int16).reshape(T, C), d, q.sum(axis=-1).astype(np.int32)


def integer_dots_reference(w: QuantWeight, qa: np.ndarray) -> np.ndarray:
    """Per block integer dot products (T, N, C / QK) int64 of the weight's integers (u for q4,
    q for q8) with quantized activations qa (T, C)."""
    w = w.row_major()
    N, C = w.shape
    if w.format == "q8":
        wi = w.qs.numpy().astype(np.int64).reshape(N, C // QK, QK)
    else:
        q = w.qs.numpy().reshape(N, C // QK, QK // 2)
        wi = np.concatenate((q & 0x0F, q >> 4), axis=-1).astype(np.int64)  # (N, nb, QK)
    a = qa.astype(np.int64).reshape(qa.shape[0], C // QK, QK)  # (T, nb, QK)
    return np.einsum("nbk,tbk->tnb", wi, a)


def linear_reference(w: QuantWeight, x: np.ndarray) -> np.ndarray:
    """What the kernels compute for x (T, C), in float64: (T, N)."""
    qa, d, s = quantize_activations_reference(x)
    w = w.row_major()
    dots = integer_dots_reference(w, qa).astype(np.float64)  # (T, N, nb)
    da = d.astype(np.float64)[:, None, :]  # (T, 1, nb)
    out = dots * w.d.numpy().astype(np.float64)[None] * da
    if w.m is not None:
        out += w.m.numpy().astype(np.float64)[None] * (da * s[:, None, :])
    return out.sum(axis=-1)
