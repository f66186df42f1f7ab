"""The model's linear layers: float weights, a checkpoint's own quantized encoding, or int8 (W8A16) or int4
(W4A16) weight-only quantization.

`FloatLinear` is `F.linear` over the checkpoint's weight. A weight kept in its GGUF file's encoding
(`GroupedWeight`: 4-bit or int8 codes with a scale, and optionally an offset, per group of inputs;
`HalfWeight`: float16/bfloat16) becomes, in `make_linear`:
- 4-bit groups of 32 (Q4_0, Q4_1, Q4_K): an `Int4Linear` over the file's own codes (`Int4Linear.from_grouped`;
  the scale and zero rounded to bfloat16, the one lossy step);
- 8-bit groups (Q8_0; Q5_*, Q6_K held as int8): an `Int8Linear` requantized to one scale per row (lossy);
- anything else (16-bit weights, shapes int4pack cannot tile): a `PackedLinear`, dequantizing it chunk by
  chunk into the `DequantWorkspace` below for every batch size; in float32 its weights are bit for bit the
  `gguf` package's dequantization.
`Int8Linear.quantize(weight)` keeps a [out, in] weight
as int8 with one symmetric scale per output channel: scale = absmax(row) / 127 rounded to a bfloat16 value,
q = round_half_to_even(w / scale) clamped to [-127, 127]; an all-zero row gets scale 0. Scales are
bfloat16-representable so that both matmul paths below multiply by exactly the same weights q * scale.

`Int8Linear.forward(x)` ([M, in] -> [M, out] in x.dtype) has two paths, chosen by M:
- CPU, M <= INT8PACK_MAX_ROWS: `torch._weight_int8pack_mm` on bfloat16 activations, accumulating in fp32 and
  rounding its output to bfloat16. It reads one byte per weight, which is what batch-1 decode is bound by.
  Its kernel converts the weights inside the FMA loop again for every 4 rows of x, so past a few dozen rows a
  BLAS GEMM over dequantized weights wins.
- otherwise (prefill, large decode batches; always on CUDA): dequantize up to DEQUANT_CHUNK_ELEMENTS weights at a
  time, in x.dtype, into a `DequantWorkspace` the model's linears share, and `F.linear` each chunk.
The two paths round differently (bfloat16 activations vs float32), so results depend slightly on how many rows
a step has: unlike float weights, int8 output is not batch-invariant on CPU. A tied embedding lookup (`embed`)
and the LM head share one int8 table. As the LM head (`logits`), the int8pack path's largest logits are
recomputed in float32, so that sampling and logprobs see the GEMM path's values where they matter.

`Int4Linear.quantize(weight)` keeps a weight as 4-bit codes in groups of INT4_GROUP_SIZE inputs with a scale and
an offset per group (asymmetric, the scheme of llama.cpp's Q4_1): w = (q - 8) * scale + zero with q in [0, 15],
scale = (max - min) / 15 and zero = min + 8 * scale of the group, both rounded to bfloat16 before q is chosen.
A weight that came from a Q4_1 GGUF tensor keeps its codes (all of the default model's do); its scale and
offset change only by that rounding to bfloat16. The codes are held once, in int4pack_mm's own tiled layout on
CPU, which the GEMM path reads too: half a byte per weight plus 4 bytes per 32, a Q4_1 file's size.
`forward`: on CPU every batch goes through `torch._weight_int4pack_mm_for_cpu` on bfloat16 activations (half a
byte per weight read; INT4PACK_MAX_ROWS says why every batch); CUDA dequantizes chunks and runs the float GEMM. With `quantization="int4"` the LM head (and a tied embedding) stays int8, as llama.cpp's Q4 files keep the
token embedding at 8 bits or more: it is the largest matrix of a small model and the most sensitive.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import QUANTIZATIONS
from engine.fingerprint import quantized_fingerprint  # noqa: F401  (re-exported: torch-free home)

INT8_MAX = 127

# Crossover measured on a 2-core AVX512 Xeon (torch 2.13, 2 threads) over SmolLM2-135M's weights, int8pack_mm vs
# dequantize + float32 GEMM, ms for all 30 layers (qkv, o, gate_up, down) / for the 49152 x 576 LM head:
#   M=16: 40 vs 74 / 9.9 vs 17.7;  M=24: 62 vs 79 / 14.5 vs 19.1;  M=32: 78 vs 80 / 18.9 vs 20.0;
#   M=48: 111 vs 96 / 29.7 vs 25.1;  M=64: 145 vs 109 / 37.9 vs 31.7.
INT8PACK_MAX_ROWS = 32
"""Largest number of rows of x the CPU int8pack_mm path takes in a layer (Int8Linear.forward)."""

INT8PACK_HEAD_MAX_ROWS = sys.maxsize
"""Largest number of rows the int8pack_mm path takes as an LM head (Int8Linear.logits): every batch. Its rows are
one per sequence of a step, so that a sequence's logits do not depend on how many others the step holds (the
GEMM path rounds differently; at 64 rows it would save ~16% of the head's time). Tests lower it to reach the GEMM
path."""

LOGITS_EXACT_TOP_K = 16
"""Logits per row an int8 LM head recomputes in float32 after int8pack_mm (Int8Linear.logits)."""

DEQUANT_CHUNK_ELEMENTS = 1 << 22
"""Size of the GEMM path's scratch buffer (16 MiB of float32): the most weights dequantized at once. Smaller
chunks cost GEMM efficiency (1M elements: +5% at 512 rows on a 3072 x 576 weight)."""

INT4_GROUP_SIZE = 32
"""Inputs per int4 scale/offset pair (llama.cpp's Q4_1 block)."""

# Crossover measured like INT8PACK_MAX_ROWS (same machine), int4pack_mm vs dequantize + float32 GEMM, ms for all
# 30 layers of SmolLM2-135M (qkv, o, gate_up, down; the LM head is int8):
#   M=1: 6.9 vs 92;  M=16: 32 vs 116;  M=32: 61 vs 106;  M=64: 140 vs 160;  M=128: 225 vs 181;  M=256: 431 vs 271.
# On AMD EPYC (1 thread, the default model's 512-token prefill, whole engine): int4pack_mm for every row 1.85 s,
# the GEMM path past 64 rows 1.87 s, float32 weights 1.61 s (a loaded machine).
INT4PACK_MAX_ROWS = sys.maxsize
"""Largest number of rows of x the CPU int4pack path takes: every batch. int4pack_mm computes each row of x on
its own (tested: a batch's rows equal the rows computed alone), so its layers' outputs do not depend on the
batch a sequence is in, nor on a prefix-cache hit (a hit's suffix is a short batch where the cold prompt was a
long one), as with float weights. The GEMM path (float32 activations; faster from ~128 rows on the
Intel host above) is what CUDA runs; tests lower this to reach it on CPU."""

# The int8pack_mm CPU kernels load 16 (AVX512) or 8 (AVX2) elements of a row at a time with aligned loads: an
# input width that is not a multiple of 16, or a tensor that does not start on an aligned address, crashes the
# process or reads garbage. Other CPU capabilities were not measured: they take the GEMM path.
_INT8PACK_K_MULTIPLE = 16
_INT8PACK_CPU_CAPABILITIES = ("AVX2", "AVX512")
_INT4PACK_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output channels in tiles of 16


class FloatLinear:
    """y = x @ weight.T + bias, in the weight's dtype (the unquantized model, exactly as F.linear computes it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias      # [out] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding table lookup): [T] -> [T, in]."""
        return F.embedding(ids, self.weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) in float32, as an LM head: [M, in] -> [M, out]."""
        return self.forward(x).float()

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) one forward reads."""
        return _nbytes(self.weight, self.bias)


class DequantWorkspace:
    """Scratch memory the GEMM path dequantizes into, shared by the linears of one model (their forwards never
    overlap). A fresh multi-MiB tensor per call costs page faults on CPU instead: the 49152 x 576 LM head took
    35-55 ms at any number of rows that way, 9-20 ms with this buffer."""

    def __init__(self, num_elements: int = DEQUANT_CHUNK_ELEMENTS) -> None:
        self.num_elements = num_elements
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [rows, cols] view of the buffer for (dtype, device), allocated on first use; rows * cols must fit."""
        assert rows * cols <= self.num_elements, (rows, cols, self.num_elements)
        buffer = self._buffers.get((dtype, device))
        if buffer is None:
            buffer = self._buffers[(dtype, device)] = torch.empty(self.num_elements, dtype=dtype, device=device)
        return buffer[:rows * cols].view(rows, cols)

    def rows_per_chunk(self, in_features: int) -> int:
        """Rows of an [out, in_features] weight one chunk holds (at least one, or ValueError)."""
        if in_features > self.num_elements:
            raise ValueError(f"a DequantWorkspace of {self.num_elements} elements cannot hold one row of "
                             f"{in_features}")
        return self.num_elements // in_features

    def linear(self, x: torch.Tensor, out_features: int, chunk_rows: int,
               dequantize: Callable[[slice, torch.Tensor], torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, W, bias) over a quantized W, `chunk_rows` rows at a time: `dequantize(rows, out)` writes
        W[rows] in x.dtype into `out` (a view of this buffer) and returns it. x: [M, in] -> [M, out_features]."""
        chunks = []
        for start in range(0, out_features, chunk_rows):
            rows = slice(start, min(start + chunk_rows, out_features))
            w = dequantize(rows, self.get(rows.stop - start, x.shape[-1], x.dtype, x.device))
            chunks.append(F.linear(x, w, None if bias is None else bias[rows]))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)


class Int8Linear:
    """y = x @ (q * scale[:, None]).T + bias with int8 q and a per-output-channel scale (module docstring)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None) -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {list(qweight.shape)}")
        if scale.shape != qweight.shape[:1]:
            raise ValueError(f"scale must have shape {list(qweight.shape[:1])}, got {list(scale.shape)}")
        qweight = qweight.contiguous()
        self.qweight = qweight if qweight.data_ptr() % 64 == 0 else qweight.clone()  # [out, in] int8, aligned
        self.scale = scale.float()                          # [out] float32, bfloat16-representable
        self.scale_bf16 = self.scale.to(torch.bfloat16)     # [out]: the same values, as int8pack_mm takes them
        self.bias = bias                                    # [out] in the model dtype, or None
        in_features = qweight.shape[1]
        self.use_int8pack = (qweight.device.type == "cpu" and in_features % _INT8PACK_K_MULTIPLE == 0
                             and torch.backends.cpu.get_cpu_capability() in _INT8PACK_CPU_CAPABILITIES)
        self.workspace = workspace if workspace is not None else DequantWorkspace()
        self.chunk_rows = self.workspace.rows_per_chunk(in_features)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None) -> Int8Linear:
        """Quantize a float [out, in] weight on its device; `bias` is kept as given."""
        w = weight.float()
        absmax = w.abs().amax(dim=1)                                       # [out]
        scale = (absmax / INT8_MAX).to(torch.bfloat16).float()             # [out], bf16-representable
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # all-zero row -> q = 0
        # Rounding the scale to bfloat16 may shrink it by up to 2^-9: |w| / scale stays under 127.25, which
        # rounds to 127; the clamp states the range.
        q = torch.round(w * inv[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return cls(q, scale, bias, workspace)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice | torch.Tensor = slice(None),
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """q * scale as a float [out, in] tensor (or its `rows`), written into `out` when given."""
        q = self.qweight[rows]
        w = torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
        return w.copy_(q).mul_(self.scale[rows, None].to(dtype))

    def _takes_int8pack(self, x: torch.Tensor, max_rows: int = INT8PACK_MAX_ROWS) -> bool:
        return self.use_int8pack and x.shape[0] <= max_rows

    def forward(self, x: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """x: [M, in] -> [M, out] in x.dtype; int8pack_mm up to `max_rows` rows (INT8PACK_MAX_ROWS), else the
        dequantize + GEMM path."""
        if self._takes_int8pack(x, INT8PACK_MAX_ROWS if max_rows is None else max_rows):
            # Aligned loads (see _INT8PACK_K_MULTIPLE): always a fresh tensor, which the allocator aligns (a check
            # of data_ptr would stop torch.compile's graph here).
            xb = (x.clone(memory_format=torch.contiguous_format) if x.dtype == torch.bfloat16
                  else x.to(torch.bfloat16, memory_format=torch.contiguous_format))
            out = torch._weight_int8pack_mm(xb, self.qweight, self.scale_bf16).to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        return self.workspace.linear(x, self.qweight.shape[0], self.chunk_rows,
                                     lambda rows, w: self.dequantize(x.dtype, rows, w), self.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (a tied embedding lookup): [T] -> [T, in] float32."""
        return self.qweight.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) in float32, as an LM head: [M, in] -> [M, out].

        The int8pack path rounds its output to bfloat16, steps of 0.125 at |logit| ~ 20: logprobs would be
        coarse and near ties exact ones (argmax then takes the lower token id). So the LOGITS_EXACT_TOP_K largest
        logits of each row are recomputed in float32 from the same int8 weights and float32 x, as the GEMM path
        computes every logit: greedy picks the true maximum unless more than that many logits crowd within the
        rounding of the first. Up to INT8PACK_HEAD_MAX_ROWS (every batch) take that path: int8pack_mm computes
        each row on its own, so a row's logits do not depend on how many sequences the step holds."""
        out = self.forward(x, max_rows=INT8PACK_HEAD_MAX_ROWS).float()
        if not self._takes_int8pack(x, INT8PACK_HEAD_MAX_ROWS):
            return out
        top = out.topk(min(LOGITS_EXACT_TOP_K, out.shape[-1]), dim=-1).indices        # [M, k]
        rows = self.dequantize(torch.float32, top.flatten()).view(*top.shape, -1)     # [M, k, in]
        # Products summed along `in` row by row (not a bmm, whose kernel and so rounding depend on M): a row's
        # logits do not depend on the batch it is in.
        exact = (rows * x.float()[:, None, :]).sum(-1)                                 # [M, k]
        if self.bias is not None:
            exact += self.bias.float()[top]
        return out.scatter_(1, top, exact)

    @property
    def nbytes(self) -> int:
        """Bytes of weight, scales (one copy) and bias one forward reads."""
        return _nbytes(self.qweight, self.scale_bf16, self.bias)


class Int4Linear:
    """y = x @ W.T + bias with W = (q - 8) * scale + zero per group of INT4_GROUP_SIZE inputs (module docstring).

    The codes are held once: on CPU in int4pack_mm's own tiled layout (`packed`), which the GEMM path unpacks
    too, so a weight takes half a byte plus one bfloat16 (scale, zero) pair per 32 inputs, a Q4_1 file's own
    size. Only where that layout is not the plain one `_int4pack_block_rows` verified (a row count that is not a
    multiple of its block, or CUDA, which has no int4pack path) the codes are kept as `nibbles` instead (CUDA)
    or as well (CPU)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None) -> None:
        # codes: [out, in] uint8 in [0, 15]; scale, zero: [out, in // INT4_GROUP_SIZE], rounded to bfloat16 here
        out_features, in_features = codes.shape
        groups = in_features // INT4_GROUP_SIZE
        if codes.dtype != torch.uint8 or in_features % INT4_GROUP_SIZE or out_features % _INT4PACK_N_MULTIPLE:
            raise ValueError(f"codes must be a uint8 [out, in] tensor with in a multiple of {INT4_GROUP_SIZE} and out "
                             f"of {_INT4PACK_N_MULTIPLE}, got {codes.dtype} {list(codes.shape)}")
        for name, t in (("scale", scale), ("zero", zero)):
            if t.shape != (out_features, groups):
                raise ValueError(f"{name} must have shape {[out_features, groups]}, got {list(t.shape)}")
        self.shape = (out_features, in_features)
        # [groups, out, 2] bfloat16 (scale, zero): the int4pack kernel's table, and the GEMM path's values.
        self.scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.bias = bias                                                         # [out] in the model dtype, or None
        self.use_int4pack = codes.device.type == "cpu"
        self.packed: torch.Tensor | None = None   # [out, in // 2] uint8 in the kernel's layout (CPU)
        self.nibbles: torch.Tensor | None = None  # [out, in // 2] uint8, even input in the low nibble
        self.block_rows = _int4pack_block_rows() if self.use_int4pack else None
        if self.use_int4pack:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        if self.block_rows is None or out_features % self.block_rows:
            self.block_rows = None
            self.nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        self.workspace = workspace if workspace is not None else DequantWorkspace()
        chunk_rows = self.workspace.rows_per_chunk(in_features)
        block = self.block_rows or 1
        if chunk_rows < block:
            raise ValueError(f"a DequantWorkspace of {self.workspace.num_elements} elements cannot hold {block} rows "
                             f"of {in_features}")
        self.chunk_rows = chunk_rows // block * block

    @staticmethod
    def supports_shape(out_features: int, in_features: int) -> bool:
        """Whether a [out, in] weight has the shape int4 needs; other weights fall back to int8 (make_linear)."""
        return in_features % INT4_GROUP_SIZE == 0 and out_features % _INT4PACK_N_MULTIPLE == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None) -> Int4Linear:
        """Quantize a float [out, in] weight on its device; `bias` is kept as given."""
        out_features, in_features = weight.shape
        w = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)                                  # [out, groups]
        scale = ((hi - lo) / 15).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))      # constant group -> q = 8
        q = torch.round((w - zero[..., None]) * inv[..., None] + 8).clamp_(0, 15).to(torch.uint8)
        return cls(q.view(out_features, in_features), scale, zero, bias, workspace)

    @classmethod
    def from_grouped(cls, weight: GroupedWeight, bias: torch.Tensor | None = None,
                     workspace: DequantWorkspace | None = None) -> Int4Linear:
        """A GGUF Q4_0 / Q4_1 / Q4_K matrix (4-bit codes in groups of 32) with its own codes:
        code_bias 8, no offset (Q4_0): w = (q - 8) * d; else w = q * d + m = (q - 8) * d + (m + 8 d). The
        file's float16 d and m (float32 d * sc, -dmin * m for Q4_K) become bfloat16 scale and zero, the one
        lossy step: up to 2^-9 of each group's scale and zero (module docstring)."""
        if not cls.takes(weight):
            raise ValueError(f"a {weight.bits}-bit GroupedWeight with groups of {weight.group_size} and shape "
                             f"{list(weight.shape)} is not int4-packable")
        scale = weight.scale.float()
        base = torch.zeros_like(scale) if weight.offset is None else weight.offset.float()
        zero = base + (8 - weight.code_bias) * scale
        return cls(weight.unpacked_codes(), scale, zero, bias, workspace)

    @staticmethod
    def takes(weight: PackedWeight) -> bool:
        """Whether `from_grouped` maps this kept weight onto int4 codes (4 bits, groups of 32, a packable shape)."""
        return (isinstance(weight, GroupedWeight) and weight.bits == 4 and weight.group_size == INT4_GROUP_SIZE
                and Int4Linear.supports_shape(*weight.shape))

    @property
    def scale(self) -> torch.Tensor:
        """[out, groups] float32 (bfloat16 values)."""
        return self.scale_zero[..., 0].t().float()

    @property
    def zero(self) -> torch.Tensor:
        """[out, groups] float32 (bfloat16 values)."""
        return self.scale_zero[..., 1].t().float()

    def codes(self, rows: slice = slice(None), out: torch.Tensor | None = None) -> torch.Tensor:
        """The codes q (or their `rows`; a multiple of block_rows when packed) as [r, in] uint8, or written
        into `out` (a [r, in] tensor of any dtype)."""
        out_features, in_features = self.shape
        start, stop, _ = rows.indices(out_features)
        if self.nibbles is not None:
            nibbles = self.nibbles[start:stop]                                   # [r, in // 2]
            w = torch.empty(stop - start, in_features, dtype=torch.uint8, device=nibbles.device) if out is None else out
            pairs = w.view(stop - start, -1, 2)
            pairs[..., 0] = nibbles & 15
            pairs[..., 1] = nibbles >> 4
            return w
        block = self.block_rows
        assert start % block == 0 and stop % block == 0, (rows, block)
        # Kernel layout: each block of `block` rows is [in, block // 2] bytes; byte (k, d) holds row d of the
        # block in its low nibble and row block // 2 + d in its high nibble.
        tiles = self.packed.view(-1)[start * in_features // 2:stop * in_features // 2].view(-1, in_features, block // 2)
        w = torch.empty(stop - start, in_features, dtype=torch.uint8) if out is None else out
        halves = w.view(-1, 2, block // 2, in_features)                          # [blocks, lo/hi, block // 2, in]
        halves[:, 0] = (tiles & 15).transpose(1, 2)
        halves[:, 1] = (tiles >> 4).transpose(1, 2)
        return w

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None),
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """(q - 8) * scale + zero as a float [out, in] tensor (or its `rows`), written into `out` when given."""
        start, stop, _ = rows.indices(self.shape[0])
        w = torch.empty(stop - start, self.shape[1], dtype=dtype, device=self.scale_zero.device) if out is None else out
        self.codes(rows, w)
        table = self.scale_zero[:, start:stop].to(dtype).transpose(0, 1)        # [r, groups, 2]
        grouped = w.view(stop - start, -1, INT4_GROUP_SIZE)
        grouped.sub_(8).mul_(table[..., 0:1]).add_(table[..., 1:2])
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out] in x.dtype
        if self.use_int4pack and x.shape[0] <= INT4PACK_MAX_ROWS:
            xb = x.to(torch.bfloat16).contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, INT4_GROUP_SIZE, self.scale_zero)
            out = out.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        return self.workspace.linear(x, self.shape[0], self.chunk_rows,
                                     lambda rows, w: self.dequantize(x.dtype, rows, w), self.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (an embedding lookup of a 4-bit GGUF table): [T] -> [T, in]
        float32."""
        in_features = self.shape[1]
        if self.nibbles is not None:
            nibbles = self.nibbles.index_select(0, ids)                          # [T, in // 2]
            codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(-1, in_features)
        else:
            half = self.block_rows // 2
            tiles = self.packed.view(-1, in_features, half)                      # [blocks, in, half]
            block, row = ids // self.block_rows, ids % self.block_rows
            nibbles = tiles[block, :, row % half]                               # [T, in]
            codes = torch.where((row < half)[:, None], nibbles & 15, nibbles >> 4)
        table = self.scale_zero[:, ids].float().transpose(0, 1)                 # [T, groups, 2]
        w = codes.float().view(ids.shape[0], -1, INT4_GROUP_SIZE)
        return w.sub_(8).mul_(table[..., 0:1]).add_(table[..., 1:2]).view(ids.shape[0], in_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) in float32, as an LM head (a tied 4-bit GGUF embedding): [M, in] -> [M, out]."""
        return self.forward(x).float()

    @property
    def nbytes(self) -> int:
        """Bytes of codes, the bfloat16 (scale, zero) table and bias one forward reads."""
        return self.shape[0] * self.shape[1] // 2 + _nbytes(self.scale_zero, self.bias)


@functools.cache
def _int4pack_block_rows() -> int | None:
    """Rows per tile of _convert_weight_to_int4pack_for_cpu's layout on this CPU (64 with AVX512, 32 with AVX2
    in torch 2.13), found by packing random codes and checking Int4Linear.codes' reading of them at two widths;
    None when neither reads back (the codes are then kept as nibbles as well)."""
    g = torch.Generator().manual_seed(0)
    for block in (64, 32):
        ok = True
        for in_features in (64, 96):
            codes = torch.randint(0, 16, (2 * block, in_features), generator=g, dtype=torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
            if packed.numel() * 2 != codes.numel():
                return None
            tiles = packed.view(-1, in_features, block // 2)
            read = torch.stack([(tiles & 15).transpose(1, 2), (tiles >> 4).transpose(1, 2)], dim=1)
            ok = ok and torch.equal(read.reshape(codes.shape), codes)
        if ok:
            return block
    return None


class GroupedWeight:
    """A [out, in] weight kept as integer codes in groups of `group_size` inputs along each row, the way GGUF
    block types store it (engine.gguf_blocks builds these from a file's blocks):

        W[o, g * group_size + j] = (code - code_bias) * scale[o, g] + offset[o, g]     (offset optional)

    computed in float32 in that order, which is gguf.quants' order: the float32 dequantization equals the
    `gguf` package's bit for bit. `bits=8`: codes are int8 [out, in]. `bits=4`: codes are uint8 [out, in // 2],
    byte j of a group holding element j in its low nibble and element j + group_size // 2 in its high nibble
    (GGML's Q4_0 / Q4_1 layout). scale and offset are [out, groups] float16 (the file's own values) or float32
    (K-quant scales folded with their super-block scale: d * sc, -dmin * m).

    Besides `dequantize`, it has the row operations the loaders apply to a weight tensor (indexing rows,
    split, chunk, contiguous, `cat_rows`), so that q/k un-permutation, fused-matrix splits and fusion work on
    the codes without dequantizing them."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None, *, bits: int,
                 group_size: int, code_bias: int = 0) -> None:
        per_byte = 2 if bits == 4 else 1
        if bits not in (4, 8) or codes.dtype != (torch.uint8 if bits == 4 else torch.int8) or codes.dim() != 2:
            raise ValueError(f"codes must be 2-D uint8 (bits=4) or int8 (bits=8), got bits={bits} {codes.dtype} "
                             f"{list(codes.shape)}")
        in_features = codes.shape[1] * per_byte
        if group_size % 2 or in_features % group_size:
            raise ValueError(f"group_size {group_size} must be even and divide the row width {in_features}")
        groups = (codes.shape[0], in_features // group_size)
        for name, t in (("scale", scale), ("offset", offset)):
            if t is not None and tuple(t.shape) != groups:
                raise ValueError(f"{name} must have shape {list(groups)}, got {list(t.shape)}")
        self.codes = codes            # [out, in] int8 or [out, in // 2] uint8
        self.scale = scale            # [out, groups] float16 or float32
        self.offset = offset          # [out, groups] like scale, or None
        self.bits = bits
        self.group_size = group_size
        self.code_bias = code_bias
        self.shape = (codes.shape[0], in_features)

    def _like(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> GroupedWeight:
        return GroupedWeight(codes, scale, offset, bits=self.bits, group_size=self.group_size,
                             code_bias=self.code_bias)

    def __getitem__(self, rows: slice | torch.Tensor) -> GroupedWeight:
        return self._like(self.codes[rows], self.scale[rows], None if self.offset is None else self.offset[rows])

    def split(self, sizes: list[int]) -> list[GroupedWeight]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self[start:start + size] for start, size in zip(starts, sizes)]

    def chunk(self, n: int) -> list[GroupedWeight]:
        size = -(-self.shape[0] // n)
        return self.split([min(size, self.shape[0] - start) for start in range(0, self.shape[0], size)])

    def contiguous(self) -> GroupedWeight:
        return self._like(self.codes.contiguous(), self.scale.contiguous(),
                          None if self.offset is None else self.offset.contiguous())

    def to(self, device: torch.device | str) -> GroupedWeight:
        return self._like(self.codes.to(device), self.scale.to(device),
                          None if self.offset is None else self.offset.to(device))

    def layout(self) -> tuple:
        """What two weights must share to be concatenated as they are."""
        return (self.bits, self.group_size, self.code_bias, self.scale.dtype, self.offset is None, self.shape[1])

    def as_int8(self, group_size: int) -> GroupedWeight:
        """The same weights as int8 codes in groups of `group_size` (a divisor of this one's), float32 scales
        and an offset: lossless (codes of 4 bits fit, scales are repeated), for fusing mixed encodings."""
        if self.group_size % group_size:
            raise ValueError(f"group size {group_size} does not divide {self.group_size}")
        codes = self.unpacked_codes().to(torch.int16).sub_(self.code_bias).to(torch.int8)
        repeat = self.group_size // group_size
        scale = self.scale.float().repeat_interleave(repeat, dim=1)
        offset = (torch.zeros_like(scale) if self.offset is None
                  else self.offset.float().repeat_interleave(repeat, dim=1))
        return GroupedWeight(codes, scale, offset, bits=8, group_size=group_size)

    def unpacked_codes(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """The codes (or their `rows`) one per element: [r, in] uint8 (bits=4) or int8."""
        codes = self.codes[rows]
        if self.bits == 8:
            return codes
        r, half = codes.shape[0], self.group_size // 2
        pairs = codes.view(r, -1, 1, half)                                       # [r, groups, 1, half]
        return torch.cat([pairs & 15, pairs >> 4], dim=2).view(r, self.shape[1])  # low nibbles, then high

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice | torch.Tensor = slice(None),
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """W (or its `rows`) as a float [r, in] tensor of `dtype`, written into `out` when given."""
        codes = self.codes[rows]
        r = codes.shape[0]
        w = torch.empty(r, self.shape[1], dtype=dtype, device=codes.device) if out is None else out
        if self.bits == 8:
            w.copy_(codes)
        else:
            half = self.group_size // 2
            pairs = w.view(r, -1, 2, half)                                       # [r, groups, lo/hi, half]
            packed = codes.view(r, -1, half)
            pairs[:, :, 0].copy_(packed & 15)
            pairs[:, :, 1].copy_(packed >> 4)
        grouped = w.view(r, -1, self.group_size)                                 # [r, groups, group_size]
        if self.code_bias:
            grouped.sub_(self.code_bias)
        grouped.mul_(self.scale[rows, :, None].to(dtype))
        if self.offset is not None:
            grouped.add_(self.offset[rows, :, None].to(dtype))
        return w

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scale, self.offset)


class HalfWeight:
    """A [out, in] float16 or bfloat16 weight kept in 16 bits (GGUF F16/BF16 tensors), cast to the compute
    dtype a chunk at a time; the same row operations as GroupedWeight."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in (torch.float16, torch.bfloat16) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D float16 or bfloat16 tensor, got {weight.dtype} "
                             f"{list(weight.shape)}")
        self.weight = weight  # [out, in]
        self.shape = tuple(weight.shape)

    def __getitem__(self, rows: slice | torch.Tensor) -> HalfWeight:
        return HalfWeight(self.weight[rows])

    def split(self, sizes: list[int]) -> list[HalfWeight]:
        return [HalfWeight(w) for w in self.weight.split(sizes)]

    def chunk(self, n: int) -> list[HalfWeight]:
        return [HalfWeight(w) for w in self.weight.chunk(n)]

    def contiguous(self) -> HalfWeight:
        return HalfWeight(self.weight.contiguous())

    def to(self, device: torch.device | str) -> HalfWeight:
        return HalfWeight(self.weight.to(device))

    def layout(self) -> tuple:
        return (self.weight.dtype, self.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice | torch.Tensor = slice(None),
                   out: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight[rows]
        return w.to(dtype) if out is None else out.copy_(w)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight)


PackedWeight = GroupedWeight | HalfWeight
"""A checkpoint weight kept in its file's encoding (a loader's weights map holds these or float tensors)."""


def cat_rows(weights: list[torch.Tensor | PackedWeight]) -> torch.Tensor | PackedWeight:
    """Weights with the same input width stacked along their rows (a fused q/k/v or gate/up matrix), kept
    packed where they are: as they are when they share a layout, else (a Q4_K q with a Q6_K v, as llama.cpp's
    *_M mixes write) as int8 groups of the smallest group size, which loses nothing. Mixed with a float
    tensor, the result is a float32 tensor."""
    if len(weights) == 1:
        return weights[0]
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)
    if any(isinstance(w, torch.Tensor) for w in weights) or len({type(w) for w in weights}) > 1:
        return torch.cat([w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32) for w in weights])
    if isinstance(weights[0], HalfWeight):
        if len({w.weight.dtype for w in weights}) > 1:  # float16 with bfloat16
            return torch.cat([w.weight.float() for w in weights])
        return HalfWeight(torch.cat([w.weight for w in weights]))
    if len({w.layout() for w in weights}) > 1:
        group_size = min(w.group_size for w in weights)
        weights = [w.as_int8(group_size) for w in weights]
    first = weights[0]
    offsets = None if first.offset is None else torch.cat([w.offset for w in weights])
    return first._like(torch.cat([w.codes for w in weights]), torch.cat([w.scale for w in weights]), offsets)


class PackedLinear:
    """y = x @ W.T + bias over a weight kept in its checkpoint's encoding (GroupedWeight, HalfWeight).

    Every batch size takes the DequantWorkspace path: W is dequantized in x.dtype a chunk of rows at a time (the
    whole float weight never exists) and F.linear runs on each chunk. In float32 the weights are exactly the
    float checkpoint's, so results match the float model up to the GEMM's summation order. An embedding lookup
    (`embed`) dequantizes only the rows it gathers."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None) -> None:
        self.weight = weight  # [out, in] packed
        self.bias = bias      # [out] in the model dtype, or None
        self.workspace = workspace if workspace is not None else DequantWorkspace()
        self.chunk_rows = self.workspace.rows_per_chunk(weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out] in x.dtype
        return self.workspace.linear(x, self.weight.shape[0], self.chunk_rows,
                                     lambda rows, w: self.weight.dequantize(x.dtype, rows, w), self.bias)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: [T] -> [T, in] float32."""
        return self.weight.dequantize(torch.float32, ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) in float32, as an LM head: [M, in] -> [M, out]."""
        return self.forward(x).float()

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and offsets (or 16-bit weights) and bias one forward reads."""
        return self.weight.nbytes + _nbytes(self.bias)


Linear = FloatLinear | Int8Linear | Int4Linear | PackedLinear
"""Every one has `forward`, `embed` and `logits`; `quantization="int4"` makes the LM head int8
(lm_head_quantization), a 4-bit GGUF table kept as it is stays Int4Linear."""


def make_linear(weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None, quantization: str | None,
                dtype: torch.dtype, device: torch.device, workspace: DequantWorkspace | None = None) -> Linear:
    """The model's linear layer over a checkpoint weight: a float one in `dtype`, a packed one (GroupedWeight,
    HalfWeight) kept packed, or either quantized from float32 (dequantizing into `workspace`, which the model's
    quantized and packed linears share). An int4 weight whose shape int4 cannot take (Int4Linear.supports_shape)
    is stored as int8."""
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if isinstance(weight, PackedWeight):
        if quantization in (None, "int4") and Int4Linear.takes(weight):
            return Int4Linear.from_grouped(weight.to(device), bias, workspace)
        if quantization is None and not (isinstance(weight, GroupedWeight) and weight.bits == 8):
            return PackedLinear(weight.to(device), bias, workspace)
        # 8-bit groups (Q8_0, and Q5_* / Q6_K held as int8) become int8 with one scale per row: lossy, see
        # the module docstring; the rest of a quantized model is requantized from float32 too.
        quantization = quantization or "int8"
        weight = weight.dequantize(torch.float32)
    if quantization is None:
        return FloatLinear(weight.to(device=device, dtype=dtype), bias)
    if quantization == "int4" and Int4Linear.supports_shape(*weight.shape):
        return Int4Linear.quantize(weight.to(device=device, dtype=torch.float32), bias, workspace)
    if quantization in ("int8", "int4"):
        return Int8Linear.quantize(weight.to(device=device, dtype=torch.float32), bias, workspace)
    raise ValueError(f"unknown quantization {quantization!r}; expected None or one of {QUANTIZATIONS}")


def lm_head_quantization(quantization: str | None) -> str | None:
    """The LM head's quantization under the model's `quantization` (int4 keeps the head int8)."""
    return "int8" if quantization == "int4" else quantization


def held_bytes(*parts: object) -> int:
    """Bytes of every tensor `parts` hold (tensors, linears, packed weights, lists of them, objects of engine
    classes holding them), each storage counted once however many objects share it: what weights occupy in
    memory, including every copy a linear keeps for its two paths."""
    seen_objects: set[int] = set()
    storages: dict[tuple[str, int], int] = {}

    def walk(obj: object) -> None:
        if id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif (type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__")
              and not isinstance(obj, DequantWorkspace)):  # scratch memory, not weights
            for value in vars(obj).values():
                walk(value)

    for part in parts:
        walk(part)
    return sum(storages.values())


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
