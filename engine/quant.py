"""The model's linear layers: float weights, or int8 weight-only quantization (W8A16).

`FloatLinear` is `F.linear` over the checkpoint's weight. `Int8Linear.quantize(weight)` keeps a [out, in] weight
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
and the LM head share one int8 table.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from engine.config import QUANTIZATIONS

INT8_MAX = 127

# Crossover measured on a 2-core AVX512 Xeon (torch 2.13, 2 threads) over SmolLM2-135M's weights, int8pack_mm vs
# dequantize + float32 GEMM, ms for all 30 layers (qkv, o, gate_up, down) / for the 49152 x 576 LM head:
#   M=16: 40 vs 74 / 9.9 vs 17.7;  M=24: 62 vs 79 / 14.5 vs 19.1;  M=32: 78 vs 80 / 18.9 vs 20.0;
#   M=48: 111 vs 96 / 29.7 vs 25.1;  M=64: 145 vs 109 / 37.9 vs 31.7.
INT8PACK_MAX_ROWS = 32
"""Largest number of rows of x the CPU int8pack_mm path takes."""

DEQUANT_CHUNK_ELEMENTS = 1 << 22
"""Size of the GEMM path's scratch buffer (16 MiB of float32): the most weights dequantized at once. Smaller
chunks cost GEMM efficiency (1M elements: +5% at 512 rows on a 3072 x 576 weight)."""

# The int8pack_mm CPU kernels load 16 (AVX512) or 8 (AVX2) elements of a row at a time with aligned loads: an
# input width that is not a multiple of 16, or a tensor that does not start on an aligned address, crashes the
# process or reads garbage. Other CPU capabilities were not measured: they take the GEMM path.
_INT8PACK_K_MULTIPLE = 16
_INT8PACK_CPU_CAPABILITIES = ("AVX2", "AVX512")


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
        out_features, in_features = qweight.shape
        self.use_int8pack = (qweight.device.type == "cpu" and in_features % _INT8PACK_K_MULTIPLE == 0
                             and torch.backends.cpu.get_cpu_capability() in _INT8PACK_CPU_CAPABILITIES)
        self.workspace = workspace if workspace is not None else DequantWorkspace()
        if in_features > self.workspace.num_elements:
            raise ValueError(f"a DequantWorkspace of {self.workspace.num_elements} elements cannot hold one row of "
                             f"{in_features}")
        self.chunk_rows = self.workspace.num_elements // in_features

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

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * scale as a new float [out, in] tensor."""
        return self.qweight.to(dtype).mul_(self.scale[:, None].to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out] in x.dtype
        if self.use_int8pack and x.shape[0] <= INT8PACK_MAX_ROWS:
            xb = x.to(torch.bfloat16).contiguous()
            if xb.data_ptr() % 64:  # aligned loads (see _INT8PACK_K_MULTIPLE); a fresh tensor is aligned
                xb = xb.clone()
            out = torch._weight_int8pack_mm(xb, self.qweight, self.scale_bf16).to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        out_features, in_features = self.qweight.shape
        chunks = []
        for start in range(0, out_features, self.chunk_rows):
            q = self.qweight[start:start + self.chunk_rows]
            w = self.workspace.get(q.shape[0], in_features, x.dtype, x.device)
            w.copy_(q).mul_(self.scale[start:start + q.shape[0], None].to(x.dtype))
            chunks.append(F.linear(x, w, None if self.bias is None else self.bias[start:start + q.shape[0]]))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (a tied embedding lookup): [T] -> [T, in] float32."""
        return self.qweight.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes of weight, scales (one copy) and bias one forward reads."""
        return _nbytes(self.qweight, self.scale_bf16, self.bias)


Linear = FloatLinear | Int8Linear


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None,
                dtype: torch.dtype, device: torch.device, workspace: DequantWorkspace | None = None) -> Linear:
    """The model's linear layer over a float checkpoint weight: float in `dtype`, or quantized from float32
    (dequantizing into `workspace`, which the model's int8 linears share)."""
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if quantization is None:
        return FloatLinear(weight.to(device=device, dtype=dtype), bias)
    if quantization == "int8":
        return Int8Linear.quantize(weight.to(device=device, dtype=torch.float32), bias, workspace)
    raise ValueError(f"unknown quantization {quantization!r}; expected None or one of {QUANTIZATIONS}")


def quantized_fingerprint(fingerprint: str, quantization: str | None) -> str:
    """The model fingerprint of a checkpoint served with `quantization`: the checkpoint's own when None, else
    a different one, because quantized weights produce different KV and tokens (caches must not mix)."""
    if quantization is None:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}\0quantization={quantization}".encode()).hexdigest()


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
