"""GGUF tensors kept in their file's encoding: GGML blocks unpacked into engine.quant's GroupedWeight / HalfWeight.

What each GGML type becomes (every conversion loses nothing: the float32 dequantization equals
gguf.quants.dequantize bit for bit, computed in gguf's order; see GroupedWeight):

    type    kept as                                              bytes per 32 weights (file)
    Q4_0    4-bit codes, groups of 32, float16 scale, bias 8     18 (18)
    Q4_1    4-bit codes, groups of 32, float16 scale and offset  20 (20)
    Q4_K    4-bit codes, groups of 32, float32 scale d * sc and  24 (18): the 6-bit sub-block scales folded
            offset -dmin * m                                             into float32 (d * sc needs 17 bits)
    Q8_0    int8 codes, groups of 32, float16 scale              34 (34)
    Q5_0    int8 codes (q - 16), groups of 32, float16 scale     34 (22)
    Q5_1    int8 codes, groups of 32, float16 scale and offset   36 (24)
    Q5_K    int8 codes, groups of 32, float32 scale and offset   40 (22)
    Q6_K    int8 codes (q - 32), groups of 16, float32 d * sc    40 (26.25)
    F16     float16 (HalfWeight)                                 64 (64)
    BF16    bfloat16 (HalfWeight)                                64 (64)

5- and 6-bit codes are held as int8 (no 5/6-bit matmul exists here to read them packed). What runs the matmuls
is engine.quant.make_linear's choice: the 4-bit types of groups of 32 become int4 over these codes, 8-bit
groups per-row int8 (both then take about the file's bytes; see engine.quant). Every other type the
`gguf` package dequantizes (Q2_K, Q3_K, IQ*, TQ*, MXFP4, ...) is dequantized at load to the load dtype by the
loader (KEPT_TYPES lists the types this module keeps).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from engine.packed_weight import GroupedWeight, HalfWeight, PackedWeight

KEPT_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.F16, T.BF16)
"""GGML types whose matrices stay in their encoding (module docstring); the others are dequantized at load."""

_TYPE_SIZES = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34, T.Q5_0: 22, T.Q5_1: 24, T.Q4_K: 144, T.Q5_K: 176,
               T.Q6_K: 210}
_BLOCK_SIZES = {T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256}  # 32 for the others


def packed_weight(data: np.ndarray, qtype: T, shape: tuple[int, ...]) -> PackedWeight:
    """A GGUF tensor's raw data (the reader's array) of type `qtype` in KEPT_TYPES, as a packed [rows, in]
    weight, rows being every dimension of torch `shape` but the last (stacked experts come out stacked).
    The result owns its memory (nothing refers to the file's mapping)."""
    rows, in_features = int(np.prod(shape[:-1])), int(shape[-1])
    if qtype in (T.F16, T.BF16):
        raw = np.array(data).view(np.float16 if qtype == T.F16 else np.int16).reshape(rows, in_features)
        weight = torch.from_numpy(raw)
        return HalfWeight(weight if qtype == T.F16 else weight.view(torch.bfloat16))
    if qtype not in _TYPE_SIZES:
        raise ValueError(f"GGML type {qtype.name} is not kept packed (KEPT_TYPES: "
                         f"{', '.join(t.name for t in KEPT_TYPES)})")
    block_size = _BLOCK_SIZES.get(qtype, 32)
    if in_features % block_size:
        raise ValueError(f"row width {in_features} is not a multiple of {qtype.name}'s block of {block_size}")
    blocks = np.asarray(data).reshape(-1, _TYPE_SIZES[qtype])
    if blocks.shape[0] != rows * in_features // block_size:
        raise ValueError(f"{blocks.shape[0]} {qtype.name} blocks do not fill shape {list(shape)}")
    codes, scale, offset, bits, group_size, code_bias = _UNPACK[qtype](blocks)

    def rows_of(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1).copy())

    return GroupedWeight(rows_of(codes), rows_of(scale), rows_of(offset), bits=bits, group_size=group_size,
                         code_bias=code_bias)


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16)  # [n, 2] bytes -> [n, 1]


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """[n, groups, 32] codes in element order -> [n, groups * 16] bytes in GroupedWeight's 4-bit layout."""
    pairs = values.reshape(values.shape[0], -1, 2, 16)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))).reshape(values.shape[0], -1)


def _five_bits(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31 [n, 32] from 16 bytes of low nibbles and a 32-bit mask of fifth bits."""
    n = qs.shape[0]
    high = (np.ascontiguousarray(qh).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([qs & 15, qs >> 4], axis=1)
    return low | (high.astype(np.uint8) << np.uint8(4))


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-32 float32 scale d * sc and offset -(dmin * m), as gguf.quants folds them."""
    d, dmin = _f16(blocks[:, 0:2]).astype(np.float32), _f16(blocks[:, 2:4]).astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_0(b):
    return b[:, 2:], _f16(b[:, 0:2]), None, 4, 32, 8


def _q4_1(b):
    return b[:, 4:], _f16(b[:, 0:2]), _f16(b[:, 2:4]), 4, 32, 0


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, 0:2]), None, 8, 32, 0


def _q5_0(b):
    return (_five_bits(b[:, 6:], b[:, 2:6]).astype(np.int8) - np.int8(16)), _f16(b[:, 0:2]), None, 8, 32, 0


def _q5_1(b):
    return _five_bits(b[:, 8:], b[:, 4:8]).astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 8, 32, 0


def _q4_k(b):
    n = b.shape[0]
    qs = b[:, 16:].reshape(n, 4, 1, 32)                       # 4 chunks of 64: low nibbles, then high
    values = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)
    scale, offset = _k_scales(b)
    return _pack_nibbles(values), scale, offset, 4, 32, 0


def _q5_k(b):
    n = b.shape[0]
    qh, qs = b[:, 16:48], b[:, 48:]
    low = np.concatenate([qs.reshape(n, 4, 1, 32) & 15, qs.reshape(n, 4, 1, 32) >> 4], axis=2).reshape(n, 8, 32)
    high = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(n, 8, 32)
    scale, offset = _k_scales(b)
    return (low | (high << np.uint8(4))).astype(np.int8), scale, offset, 8, 32, 0


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210]).astype(np.float32)
    low = np.concatenate([ql.reshape(n, 2, 1, 64) & 15, ql.reshape(n, 2, 1, 64) >> 4], axis=2).reshape(n, 8, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3).reshape(n, 8, 32)
    codes = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return codes, d * scales, None, 8, 16, 0


_UNPACK = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q4_K: _q4_k,
           T.Q5_K: _q5_k, T.Q6_K: _q6_k}
