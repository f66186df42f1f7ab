"""A checkpoint's weights kept in their file's encoding: what a loader's weights map holds beside float tensors.

    GroupedWeight   integer codes in groups along each row, a scale (and offset) per group: GGUF block types
                    (engine.gguf_blocks builds them) and their int8 regrouping
    HalfWeight      a float16 / bfloat16 matrix kept in 16 bits
    PackedWeight    either of them
    cat_rows        weights with the same input width stacked along their rows (fused q/k/v, gate/up), kept packed

Each supports the row operations the loaders apply to weight tensors (indexing rows, split, chunk, contiguous,
to) and `dequantize`, which equals the `gguf` package's float32 values bit for bit. The matmuls that read them
are engine.quant's linears.
"""

from __future__ import annotations

import torch


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


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
