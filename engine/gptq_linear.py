"""A linear layer over a GPTQ checkpoint's packed weight (engine.gptq_format), never dequantized into memory.

y = x @ W.T + bias with W[j, i] = (q[i, j] - z[g_idx[i], j]) * s[g_idx[i], j]. How it runs:
- CUDA: the packed int32 tensors as stored, through `kernels.gptq_gemm` (the Triton dequant-GEMM kernel,
  kernels/triton_gptq_gemm.py; its torch reference elsewhere).
- CPU, 4 bits: the inputs are reordered by group (identity without act-order; under act-order x is gathered by the
  same permutation each forward), and when every aligned run of INT4_GROUP_SIZE reordered inputs lies in one group
  (group sizes 32, 64, 128, ..., or -1) the weight becomes an `engine.quant.Int4Linear` with the group's scale s
  and offset (8 - z) * s repeated per run: W = (q - 8) * s + (8 - z) * s. Its int4pack path rounds s and the
  offset to bfloat16 for both its paths (fp16 scales keep 3 more bits); `dequantize` gives them exactly.
- otherwise (8 bits, other group sizes): codes as uint8 [out, in] with float32 scales and zero points per group,
  dequantized in chunks into the model's `DequantWorkspace` for a float GEMM (int8pack_mm takes one symmetric
  scale per output row, not groups).
"""

from __future__ import annotations

import torch

import kernels
from engine.gptq_format import GPTQWeight
from engine.quant import INT4_GROUP_SIZE, DequantWorkspace, Int4Linear


class GPTQLinear:
    """y = x @ W.T + bias over a GPTQWeight (module docstring); `dequantize` gives W exactly as the format defines."""

    def __init__(self, weight: GPTQWeight, bias: torch.Tensor | None, device: torch.device,
                 workspace: DequantWorkspace | None = None) -> None:
        self.shape = weight.shape                               # (out, in)
        self.config = weight.config
        self.bias = bias                                        # [out] in the model dtype, or None
        self.workspace = workspace if workspace is not None else DequantWorkspace()
        self.int4: Int4Linear | None = None
        self.packed: GPTQWeight | None = None
        if device.type == "cuda":
            self.packed = GPTQWeight(weight.qweight.to(device), weight.qzeros.to(device),
                                     weight.scales.to(device), weight.g_idx.to(device), weight.config)
            self.zero_offset = 1 if weight.config.checkpoint_format == "gptq" else 0
            return
        codes, zeros, scales, g_idx = weight.unpack()
        order = torch.argsort(g_idx, stable=True)
        self.perm = None if torch.equal(order, torch.arange(len(order))) else order   # [in] or None
        codes, col_group = codes[:, order], g_idx[order]                               # sorted by group
        offsets = (2 ** (self.config.bits - 1) - zeros.float()) * scales               # [groups, out]
        out_features, in_features = self.shape
        if self.config.bits == 4 and Int4Linear.supports_shape(out_features, in_features):
            runs = col_group.view(-1, INT4_GROUP_SIZE)
            if bool((runs == runs[:, :1]).all()):
                run_group = runs[:, 0]
                self.int4 = Int4Linear(codes, scales[run_group].t().contiguous(),
                                       offsets[run_group].t().contiguous(), bias, self.workspace)
                # float16 scales exactly (Int4Linear's table is bfloat16): what `dequantize` gives
                self.int4_scale_zero = (scales[run_group].t().contiguous(), offsets[run_group].t().contiguous())
                return
        self.codes = codes.contiguous()                          # [out, in] uint8, inputs sorted by group
        self.col_group = col_group                               # [in] int64: group of each sorted input
        self.scales = scales.t().contiguous()                    # [out, groups] float32
        self.zeros = zeros.t().float().contiguous()              # [out, groups] float32
        self.chunk_rows = self.workspace.rows_per_chunk(in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as a float [out, in] tensor, inputs in the checkpoint's order."""
        if self.packed is not None:
            eye = torch.eye(self.shape[1], dtype=torch.float16, device=self.packed.qweight.device)
            return kernels.gptq_gemm(eye, self.packed.qweight, self.packed.qzeros, self.packed.scales,
                                     self.packed.g_idx, self.config.bits, self.zero_offset).t().to(dtype)
        if self.int4 is not None:
            scale, zero = self.int4_scale_zero                                   # [out, groups] float32
            w = self.int4.codes().to(dtype).view(*scale.shape, INT4_GROUP_SIZE)
            w = w.sub_(8).mul_(scale[..., None].to(dtype)).add_(zero[..., None].to(dtype)).view(self.shape)
        else:
            w = self._dequantize_rows(dtype, slice(None))
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm, w)

    def _dequantize_rows(self, dtype: torch.dtype, rows: slice, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = self.codes[rows]
        w = torch.empty(codes.shape, dtype=dtype, device=codes.device) if out is None else out
        w.copy_(codes)
        w.sub_(self.zeros[rows][:, self.col_group].to(dtype)).mul_(self.scales[rows][:, self.col_group].to(dtype))
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out] in x.dtype
        if self.packed is not None:
            p = self.packed
            out = kernels.gptq_gemm(x, p.qweight, p.qzeros, p.scales, p.g_idx, self.config.bits, self.zero_offset)
            return out if self.bias is None else out.add_(self.bias)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.int4 is not None:
            return self.int4.forward(x)
        return self.workspace.linear(x, self.shape[0], self.chunk_rows,
                                     lambda rows, w: self._dequantize_rows(x.dtype, rows, w), self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zero points (one copy) and bias one forward reads."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.packed is not None:
            p = self.packed
            return sum(t.numel() * t.element_size() for t in (p.qweight, p.qzeros, p.scales, p.g_idx)) + bias
        if self.int4 is not None:
            return self.int4.nbytes
        return self.codes.numel() + 4 * (self.scales.numel() + self.zeros.numel()) + bias
