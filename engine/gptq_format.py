"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel / transformers): what the tensors of one quantized linear mean.

A linear `<prefix>` with weight W [out, in] quantized to `bits` (4 or 8) bits in groups of `group_size` inputs
(-1: one group for the whole row) is stored as four tensors:

    <prefix>.qweight  int32 [in * bits / 32, out]      packed along the input: word [i, j] holds the codes of
                                                      inputs i*p .. i*p+p-1 of output j, the first in the low bits
                                                      (p = 32 / bits codes per word)
    <prefix>.qzeros   int32 [groups, out * bits / 32]  packed along the output the same way: zero points per group
    <prefix>.scales   float16 [groups, out]           scale per group and output
    <prefix>.g_idx    int32 [in]                      group of each input: i // group_size, or any order under
                                                      act-order (desc_act), where inputs were quantized by
                                                      decreasing Hessian diagonal

    W[j, i] = (q[i, j] - z[g_idx[i], j]) * scales[g_idx[i], j]

config.json's `quantization_config` says `checkpoint_format`: "gptq" (v1, what AutoGPTQ and transformers write)
stores z - 1 in each qzeros field (a read adds 1 back), "gptq_v2" stores z. Symmetric quantization (`sym`) uses
z = 2 ** (bits - 1) everywhere. `GPTQWeight` is one linear's packed tensors; `shape` is the logical [out, in], so
`engine.arch.check_weights` checks it like a float weight. Nothing here dequantizes into model memory:
`unpack` yields integer codes for the linears of engine.gptq_linear, `pack` is the writer's half (engine.gptq).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

GPTQ_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
TENSOR_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GPTQConfig:
    """config.json `quantization_config` of a GPTQ checkpoint (the keys pdserve reads)."""

    bits: int
    """Bits per weight code: 4 or 8."""
    group_size: int
    """Inputs per (scale, zero) group; -1 for one group per output row."""
    desc_act: bool = False
    """Act-order: inputs were quantized by decreasing Hessian diagonal; g_idx maps each input to its group."""
    sym: bool = True
    """Symmetric: every zero point is 2 ** (bits - 1)."""
    checkpoint_format: str = "gptq"
    """"gptq" (v1: qzeros store zero - 1) or "gptq_v2" (qzeros store zero)."""

    def __post_init__(self) -> None:
        if self.bits not in GPTQ_BITS:
            raise ValueError(f"quantization_config.bits must be one of {GPTQ_BITS}, got {self.bits!r}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"quantization_config.group_size must be -1 or positive, got {self.group_size!r}")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization_config.checkpoint_format must be one of {CHECKPOINT_FORMATS}, "
                             f"got {self.checkpoint_format!r}")

    @classmethod
    def from_json(cls, q: Mapping[str, Any]) -> GPTQConfig:
        """From a parsed `quantization_config`; ValueError naming the key at fault."""
        if q.get("quant_method") != "gptq":
            raise ValueError(f"quantization_config.quant_method {q.get('quant_method')!r} is not supported "
                             "(only gptq is)")
        for key in ("bits", "group_size"):
            if not isinstance(q.get(key), int) or isinstance(q.get(key), bool):
                raise ValueError(f"quantization_config.{key} must be an integer, got {q.get(key)!r}")
        if q.get("modules_in_block_to_quantize") or q.get("dynamic"):
            raise ValueError("quantization_config.modules_in_block_to_quantize / dynamic are not supported")
        fmt = q.get("checkpoint_format", q.get("format", "gptq"))
        return cls(bits=q["bits"], group_size=q["group_size"], desc_act=bool(q.get("desc_act", False)),
                   sym=bool(q.get("sym", True)), checkpoint_format=fmt)

    def to_json(self) -> dict[str, Any]:
        """The `quantization_config` transformers' GPTQ loader reads."""
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "true_sequential": True,
                "damp_percent": 0.01, "checkpoint_format": self.checkpoint_format}

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits


@dataclass(frozen=True)
class GPTQWeight:
    """One linear's packed GPTQ tensors (module docstring), on CPU as read from the checkpoint."""

    qweight: torch.Tensor   # int32 [in // pack, out]
    qzeros: torch.Tensor    # int32 [groups, out // pack]
    scales: torch.Tensor    # float16 [groups, out]
    g_idx: torch.Tensor     # int32 [in]
    config: GPTQConfig

    @property
    def shape(self) -> tuple[int, int]:
        """The logical weight's [out, in]."""
        return (self.qweight.shape[1], self.qweight.shape[0] * self.config.pack_factor)

    def validate(self, name: str) -> None:
        """ValueError naming `name` and the tensor whose dtype or shape breaks the format."""
        out_features, in_features = self.shape
        groups = self.scales.shape[0] if self.scales.dim() == 2 else -1
        pack = self.config.pack_factor
        expected = {"qweight": (torch.int32, (in_features // pack, out_features)),
                    "qzeros": (torch.int32, (groups, out_features // pack)),
                    "scales": (torch.float16, (groups, out_features)),
                    "g_idx": (torch.int32, (in_features,))}
        for suffix, (dtype, shape) in expected.items():
            t = getattr(self, suffix)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{name}.{suffix} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        if out_features % pack:
            raise ValueError(f"{name}: {out_features} outputs are not a multiple of {pack} (qzeros packing)")
        if self.config.group_size != -1 and groups != -(-in_features // self.config.group_size):
            raise ValueError(f"{name}.scales has {groups} groups; group_size {self.config.group_size} over "
                             f"{in_features} inputs needs {-(-in_features // self.config.group_size)}")
        if in_features and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups):
            raise ValueError(f"{name}.g_idx has group ids outside [0, {groups})")

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [out, in], zeros int16 [groups, out] (the true zero points), scales float32 [groups, out],
        g_idx int64 [in])."""
        bits = self.config.bits
        codes = unpack_int32(self.qweight, bits, dim=0).t()                   # [out, in]
        zeros = unpack_int32(self.qzeros, bits, dim=1).to(torch.int16)        # [groups, out]
        if self.config.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1 (a symmetric 4-bit zero of 8 as 7)
        return codes.to(torch.uint8).contiguous(), zeros, self.scales.float(), self.g_idx.long()

    @staticmethod
    def cat(parts: Sequence[GPTQWeight], name: str) -> GPTQWeight:
        """Linears over the same input fused along the output (q/k/v, gate/up): they must share g_idx."""
        first = parts[0]
        for part in parts[1:]:
            if part.config != first.config or not torch.equal(part.g_idx, first.g_idx):
                raise ValueError(f"{name}: the fused linears have different quantization configs or g_idx "
                                 "(act-order over one input gives every linear the same order)")
        return GPTQWeight(qweight=torch.cat([p.qweight for p in parts], dim=1),
                          qzeros=torch.cat([p.qzeros for p in parts], dim=1),
                          scales=torch.cat([p.scales for p in parts], dim=1), g_idx=first.g_idx,
                          config=first.config)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Fields of `bits` bits of int32 words, low bits first, spread along `dim` (0 or 1): int32 codes."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:   # [n, m] -> [n * p, m]
        fields = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return fields.reshape(-1, packed.shape[1])
    fields = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [n, m] -> [n, m * p]
    return fields.reshape(packed.shape[0], -1)


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of unpack_int32: codes in [0, 2**bits) -> int32 words (two's complement past bit 31)."""
    p = 32 // bits
    c = codes.to(torch.int64)
    if dim == 0:
        c = c.reshape(-1, p, c.shape[1])                                   # [n, p, m]
        shifts = torch.arange(0, 32, bits, dtype=torch.int64)[None, :, None]
        words = (c << shifts).sum(dim=1)
    else:
        c = c.reshape(c.shape[0], -1, p)                                   # [n, m, p]
        shifts = torch.arange(0, 32, bits, dtype=torch.int64)[None, None, :]
        words = (c << shifts).sum(dim=2)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_weight(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                config: GPTQConfig) -> GPTQWeight:
    """The packed tensors of codes [out, in] and per-group zeros / scales [groups, out] under `config`.

    Under checkpoint_format "gptq" a stored field is zero - 1, so a zero point must be at least 1 there."""
    if config.checkpoint_format == "gptq":
        if int(zeros.min()) < 1:
            raise ValueError("checkpoint_format gptq (v1) cannot store a zero point of 0")
        zeros = zeros - 1
    return GPTQWeight(qweight=pack_int32(codes.t().contiguous(), config.bits, dim=0),
                      qzeros=pack_int32(zeros, config.bits, dim=1),
                      scales=scales.to(torch.float16).contiguous(), g_idx=g_idx.to(torch.int32).contiguous(),
                      config=config)


def dequantize_weight(weight: GPTQWeight) -> torch.Tensor:
    """The float32 [out, in] weight the packed tensors define (for tools and tests, never the serving path)."""
    codes, zeros, scales, g_idx = weight.unpack()
    return ((codes.float() - zeros.float()[g_idx].t()) * scales[g_idx].t()).contiguous()
