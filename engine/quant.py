"""The model's linear layers: float weights, a checkpoint's own quantized encoding, or int8 (W8A16) or int4
(W4A16) weight-only quantization.

`FloatLinear` is `F.linear` over the checkpoint's weight. A weight kept in its GGUF file's encoding
(engine.packed_weight's `GroupedWeight`: 4-bit or int8 codes with a scale, and optionally an offset, per group of inputs;
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
byte per weight read; INT4PACK_MAX_ROWS says why every batch); CUDA dequantizes chunks and runs the float GEMM.
With `cpu_matmul="native"` (EngineConfig.cpu_matmul) both int4 and int8 linears run kernels.cpu_matmul on CPU
instead: x rounded to int8 per 32 inputs, integer dot products (NATIVE_INT4_MAX_ROWS, NATIVE_INT8_MAX_ROWS). With
`cpu_matmul="native-bf16"` they run its bfloat16-activation kernels (bfloat16 x, float32 sums, bfloat16-rounded
output) over torch's int4 layout and the int8 one above: int8pack_mm's values where its order is, and for int4
the exact products of x with the codes summed group by group (vdpbf16ps's arithmetic; kernels.cpu_matmul), torch's
int4pack_mm within float32 rounding (NATIVE_INT4_MAX_ROWS, NATIVE_INT8_MAX_ROWS). With `quantization="int4"`
the LM head (and a tied embedding) stays int8, as llama.cpp's Q4 files keep the token embedding at 8 bits or
more: it is the largest matrix of a small model and the most sensitive.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import CPU_MATMULS, QUANTIZATIONS
from engine.fingerprint import quantized_fingerprint  # noqa: F401  (re-exported: torch-free home)
from engine.packed_weight import GroupedWeight, PackedWeight
import kernels
from kernels import cpu_matmul as native_kernels
from kvstore.malloc_tuning import on_huge_pages

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

# Measured on AMD EPYC Zen 4 (BENCHMARKS.md "Native CPU matmuls", "Ninth session"): the native int4 kernels are at
# least as fast as int4pack at every batch; the int8-activation int8 kernel (2 threads, timed by hand) beats the
# dequantize + GEMM path at 128 / 512 / 2048 rows (4 layers' linears 12.2 / 48.3 / 230 ms against 29.1 / 87.2 / 361).
NATIVE_INT4_MAX_ROWS = sys.maxsize
"""Largest batch the native int4 kernels take (cpu_matmul="native" / "native-bf16"): every batch, as int4pack
does, so that a row's output never depends on its batch; both are at least as fast as int4pack at every size
measured (a float GEMM over dequantized weights wins from a few hundred rows but would round differently;
BENCHMARKS.md, "Native CPU matmuls on bfloat16 activations")."""
NATIVE_INT8_MAX_ROWS = sys.maxsize
"""Largest batch the native int8 kernels take (cpu_matmul="native" / "native-bf16"): every batch, so that a row's
output never depends on its batch (a prompt's rows are a decode step's). Both are faster than the dequantize +
GEMM path at every size measured: the bfloat16-activation one (2 threads, timed by hand on Zen 4) took 1.45 /
3.49 / 14.8 / 66.3 ms for a layer's 4 linears at 64 / 128 / 512 / 2048 rows against 3.97 / 6.15 / 21.0 / 78.4.
Past INT8PACK_MAX_ROWS, where the torch build (cpu_matmul="torch") takes that GEMM path, "native-bf16" keeps
int8pack_mm's arithmetic instead of that path's float32 one."""


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
                 workspace: DequantWorkspace | None = None, cpu_matmul: str = "torch") -> None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {list(qweight.shape)}")
        if scale.shape != qweight.shape[:1]:
            raise ValueError(f"scale must have shape {list(qweight.shape[:1])}, got {list(scale.shape)}")
        qweight = on_huge_pages(qweight.contiguous())
        self.qweight = qweight if qweight.data_ptr() % 64 == 0 else qweight.clone()  # [out, in] int8, aligned
        self.scale = scale.float()                          # [out] float32, bfloat16-representable
        self.scale_bf16 = self.scale.to(torch.bfloat16)     # [out]: the same values, as int8pack_mm takes them
        self.bias = bias                                    # [out] in the model dtype, or None
        self.bias_f32 = None if bias is None else bias.float().contiguous()  # as logits' recompute adds it
        in_features = qweight.shape[1]
        self.native = _native_q8(qweight, self.scale, cpu_matmul)
        """The native kernel (kernels.cpu_matmul) batches of up to native_max_rows rows take, or None."""
        self.native_max_rows = NATIVE_INT8_MAX_ROWS
        self.use_int8pack = (self.native is None and qweight.device.type == "cpu"
                             and in_features % _INT8PACK_K_MULTIPLE == 0
                             and torch.backends.cpu.get_cpu_capability() in _INT8PACK_CPU_CAPABILITIES)
        self.workspace = workspace if workspace is not None else DequantWorkspace()
        self.chunk_rows = self.workspace.rows_per_chunk(in_features)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None, cpu_matmul: str = "torch") -> Int8Linear:
        """Quantize a float [out, in] weight on its device; `bias` is kept as given."""
        w = weight.float()
        absmax = w.abs().amax(dim=1)                                       # [out]
        scale = (absmax / INT8_MAX).to(torch.bfloat16).float()             # [out], bf16-representable
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # all-zero row -> q = 0
        # Rounding the scale to bfloat16 may shrink it by up to 2^-9: |w| / scale stays under 127.25, which
        # rounds to 127; the clamp states the range.
        q = torch.round(w * inv[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return cls(q, scale, bias, workspace, cpu_matmul)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice | torch.Tensor = slice(None),
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """q * scale as a float [out, in] tensor (or its `rows`), written into `out` when given."""
        q = self.qweight[rows]
        w = torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
        return w.copy_(q).mul_(self.scale[rows, None].to(dtype))

    def _takes_int8pack(self, x: torch.Tensor, max_rows: int = INT8PACK_MAX_ROWS) -> bool:
        return self.use_int8pack and x.shape[0] <= max_rows

    def _takes_native(self, x: torch.Tensor, max_rows: int) -> bool:
        return self.native is not None and x.shape[0] <= max_rows

    def forward(self, x: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """x: [M, in] -> [M, out] in x.dtype; with cpu_matmul="native" / "native-bf16" the native kernel up to
        `max_rows` rows (NATIVE_INT8_MAX_ROWS), else int8pack_mm up to `max_rows` rows
        (INT8PACK_MAX_ROWS); beyond, the dequantize + GEMM path."""
        if self._takes_native(x, self.native_max_rows if max_rows is None else max_rows):
            out = self.native(x)
            out = out if x.dtype == torch.float32 else out.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
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

        The int8pack path rounds its output to bfloat16, steps of 0.125 at |logit| ~ 20 (the native kernel rounds
        x to int8 per 32 instead, about as coarse): logprobs would be
        coarse and near ties exact ones (argmax then takes the lower token id). So the LOGITS_EXACT_TOP_K largest
        logits of each row are recomputed in float32 from the same int8 weights and float32 x, as the GEMM path
        computes every logit: greedy picks the true maximum unless more than that many logits crowd within the
        rounding of the first. Up to INT8PACK_HEAD_MAX_ROWS (every batch) take that path (int8pack_mm or the
        native kernel): both compute each row on its own, so a row's logits do not depend on how many sequences
        the step holds."""
        out = self.forward(x, max_rows=INT8PACK_HEAD_MAX_ROWS).float()
        if not (self._takes_int8pack(x, INT8PACK_HEAD_MAX_ROWS) or self._takes_native(x, INT8PACK_HEAD_MAX_ROWS)):
            return out
        top = kernels.top_k_indices(out, min(LOGITS_EXACT_TOP_K, out.shape[-1]))      # [M, k]
        # Each row on its own (kernels.recompute_logits_int8): a row's logits do not depend on the batch it is in.
        return kernels.recompute_logits_int8(out, x.float().contiguous(), self.qweight, self.scale, self.bias_f32,
                                             top)

    @property
    def nbytes(self) -> int:
        """Bytes of weight, scales (one copy) and bias one forward reads."""
        return _nbytes(self.qweight, self.scale_bf16, self.bias)


class Int4Linear:
    """y = x @ W.T + bias with W = (q - 8) * scale + zero per group of INT4_GROUP_SIZE inputs (module docstring).

    The codes are held once: on CPU in int4pack_mm's own tiled layout (`packed`), which the GEMM path unpacks
    too, so a weight takes half a byte plus one bfloat16 (scale, zero) pair per 32 inputs, a Q4_1 file's own
    size. Only where that layout is not the plain one `_int4pack_block_rows` verified (a row count that is not a
    multiple of its block, or CUDA, which has no int4pack path) the codes are kept as `nibbles` (GGML's Q4 order
    per 32 inputs) instead (CUDA) or as well (CPU). With cpu_matmul="native" or "native-bf16" (and the kernels
    built) kernels.cpu_matmul's kernels read int4pack's layout as it is: on int8 activations ("native") or
    bfloat16 ones (int4pack_mm's sums group by group). Batches of up to NATIVE_INT4_MAX_ROWS rows run the native
    kernel, larger ones the GEMM path."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                 workspace: DequantWorkspace | None = None, cpu_matmul: str = "torch") -> None:
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
        self.bias = bias                                                         # [out] in the model dtype, or None
        self.packed: torch.Tensor | None = None   # [out, in // 2] uint8 in int4pack's layout (CPU)
        self.nibbles: torch.Tensor | None = None  # [out, in // 2] uint8: per 32 inputs, j low and j + 16 high
        self.native = None
        """The native kernel (kernels.cpu_matmul) over int4pack's `packed` and table, or None."""
        self.native_max_rows = NATIVE_INT4_MAX_ROWS
        """The largest batch the native kernel takes (larger ones the GEMM path)."""
        # [groups, out, 2] bfloat16 (scale, zero): the int4pack and native kernels' table, and the GEMM path's values.
        self.scale_zero = on_huge_pages(torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.use_int4pack = codes.device.type == "cpu"
        self.block_rows = _int4pack_block_rows() if self.use_int4pack else None
        if self.use_int4pack:
            self.packed = on_huge_pages(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
        if self.block_rows is None or out_features % self.block_rows:
            self.block_rows = None
            self.nibbles = _ggml_nibbles(codes)
        elif _native_wanted(codes, cpu_matmul):
            self.native = native_kernels.NativeMatmul("q4-bf16" if cpu_matmul == "native-bf16" else "q4", self.packed,
                                                      self.scale_zero, block_rows=self.block_rows)
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
                 workspace: DequantWorkspace | None = None, cpu_matmul: str = "torch") -> Int4Linear:
        """Quantize a float [out, in] weight on its device; `bias` is kept as given."""
        out_features, in_features = weight.shape
        w = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)                                  # [out, groups]
        scale = ((hi - lo) / 15).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))      # constant group -> q = 8
        q = torch.round((w - zero[..., None]) * inv[..., None] + 8).clamp_(0, 15).to(torch.uint8)
        return cls(q.view(out_features, in_features), scale, zero, bias, workspace, cpu_matmul)

    @classmethod
    def from_grouped(cls, weight: GroupedWeight, bias: torch.Tensor | None = None,
                     workspace: DequantWorkspace | None = None, cpu_matmul: str = "torch") -> Int4Linear:
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
        return cls(weight.unpacked_codes(), scale, zero, bias, workspace, cpu_matmul)

    @staticmethod
    def takes(weight: PackedWeight) -> bool:
        """Whether `from_grouped` maps this kept weight onto int4 codes (4 bits, groups of 32, a packable shape)."""
        return (isinstance(weight, GroupedWeight) and weight.bits == 4 and weight.group_size == INT4_GROUP_SIZE
                and Int4Linear.supports_shape(*weight.shape))

    def _table(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """The (scale, zero) pairs of `rows`: [r, groups, 2] bfloat16 (a view where the layout allows)."""
        return self.scale_zero[:, rows].transpose(0, 1)

    @property
    def scale(self) -> torch.Tensor:
        """[out, groups] float32 (bfloat16 values)."""
        return self._table()[..., 0].float()

    @property
    def zero(self) -> torch.Tensor:
        """[out, groups] float32 (bfloat16 values)."""
        return self._table()[..., 1].float()

    def codes(self, rows: slice = slice(None), out: torch.Tensor | None = None) -> torch.Tensor:
        """The codes q (or their `rows`; a multiple of block_rows when packed) as [r, in] uint8, or written
        into `out` (a [r, in] tensor of any dtype)."""
        out_features, in_features = self.shape
        start, stop, _ = rows.indices(out_features)
        if self.nibbles is not None:
            nibbles = self.nibbles[start:stop].view(stop - start, -1, INT4_GROUP_SIZE // 2)  # [r, groups, 16]
            w = torch.empty(stop - start, in_features, dtype=torch.uint8, device=nibbles.device) if out is None else out
            halves = w.view(stop - start, -1, 2, INT4_GROUP_SIZE // 2)           # [r, groups, lo/hi, 16]
            halves[:, :, 0] = nibbles & 15
            halves[:, :, 1] = nibbles >> 4
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
        table = self._table(slice(start, stop)).to(dtype)                      # [r, groups, 2]
        grouped = w.view(stop - start, -1, INT4_GROUP_SIZE)
        grouped.sub_(8).mul_(table[..., 0:1]).add_(table[..., 1:2])
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out] in x.dtype
        if self.native is not None and x.shape[0] <= self.native_max_rows:
            out = self.native(x)
            out = out if x.dtype == torch.float32 else out.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
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
            nibbles = self.nibbles.index_select(0, ids).view(ids.shape[0], -1, INT4_GROUP_SIZE // 2)
            codes = torch.stack([nibbles & 15, nibbles >> 4], dim=2).view(-1, in_features)  # [T, in]
        else:
            half = self.block_rows // 2
            tiles = self.packed.view(-1, in_features, half)                      # [blocks, in, half]
            block, row = ids // self.block_rows, ids % self.block_rows
            nibbles = tiles[block, :, row % half]                               # [T, in]
            codes = torch.where((row < half)[:, None], nibbles & 15, nibbles >> 4)
        table = self._table(ids).float()                                       # [T, groups, 2]
        w = codes.float().view(ids.shape[0], -1, INT4_GROUP_SIZE)
        return w.sub_(8).mul_(table[..., 0:1]).add_(table[..., 1:2]).view(ids.shape[0], in_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) in float32, as an LM head (a tied 4-bit GGUF embedding): [M, in] -> [M, out]."""
        return self.forward(x).float()

    @property
    def nbytes(self) -> int:
        """Bytes of codes, the bfloat16 (scale, zero) table and bias one forward reads."""
        return self.shape[0] * self.shape[1] // 2 + _nbytes(self.scale_zero, self.bias)


def _ggml_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes in [0, 15] -> [out, in // 2] bytes, GGML's Q4 order: per 32 inputs, byte j holds input j
    in its low nibble and input j + 16 in its high nibble."""
    halves = codes.view(codes.shape[0], -1, 2, INT4_GROUP_SIZE // 2)             # [out, groups, lo/hi, 16]
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(codes.shape[0], -1)


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
                dtype: torch.dtype, device: torch.device, workspace: DequantWorkspace | None = None,
                cpu_matmul: str = "torch") -> Linear:
    """The model's linear layer over a checkpoint weight: a float one in `dtype`, a packed one (GroupedWeight,
    HalfWeight) kept packed, or either quantized from float32 (dequantizing into `workspace`, which the model's
    quantized and packed linears share). An int4 weight whose shape int4 cannot take (Int4Linear.supports_shape)
    is stored as int8. `cpu_matmul` (EngineConfig.cpu_matmul: "torch", "native", "native-bf16") picks the int4 /
    int8 kernels on CPU."""
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if isinstance(weight, PackedWeight):
        if quantization in (None, "int4") and Int4Linear.takes(weight):
            return Int4Linear.from_grouped(weight.to(device), bias, workspace, cpu_matmul)
        if quantization is None and not (isinstance(weight, GroupedWeight) and weight.bits == 8):
            return PackedLinear(weight.to(device), bias, workspace)
        # 8-bit groups (Q8_0, and Q5_* / Q6_K held as int8) become int8 with one scale per row: lossy, see
        # the module docstring; the rest of a quantized model is requantized from float32 too.
        quantization = quantization or "int8"
        weight = weight.dequantize(torch.float32)
    if quantization is None:
        return FloatLinear(weight.to(device=device, dtype=dtype), bias)
    if quantization == "int4" and Int4Linear.supports_shape(*weight.shape):
        return Int4Linear.quantize(weight.to(device=device, dtype=torch.float32), bias, workspace, cpu_matmul)
    if quantization in ("int8", "int4"):
        return Int8Linear.quantize(weight.to(device=device, dtype=torch.float32), bias, workspace, cpu_matmul)
    raise ValueError(f"unknown quantization {quantization!r}; expected None or one of {QUANTIZATIONS}")


def _native_wanted(weight: torch.Tensor, choice: str) -> bool:
    if choice not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul must be one of {CPU_MATMULS}, got {choice!r}")
    return choice in ("native", "native-bf16") and weight.device.type == "cpu" and native_kernels.available()


def _native_q8(qweight: torch.Tensor, scale: torch.Tensor, choice: str) -> native_kernels.NativeMatmul | None:
    """The native kernel over an int8 weight (int8 activations for "native", bfloat16 for "native-bf16") when
    `choice` asks for it and it runs here, else None."""
    if not _native_wanted(qweight, choice) or qweight.shape[-1] % native_kernels.GROUP:
        return None
    return native_kernels.NativeMatmul("q8-bf16" if choice == "native-bf16" else "q8", qweight, scale)


def lm_head_quantization(quantization: str | None) -> str | None:
    """The LM head's quantization under the model's `quantization` (int4 keeps the head int8)."""
    return "int8" if quantization == "int4" else quantization


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
