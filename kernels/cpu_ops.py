"""Native CPU kernels for the decode step's small ops (kernels/cpu_ops.c): RMSNorm (with its residual add),
rotary embedding, KV write, single-token paged attention, SiLU * up and the top k of each row; and the KV
transfer's int8 codec (block gather + quantize, dequantize + scatter).

Each function has its kernels.reference twin's contract (same arguments, same results up to float rounding order,
~1e-6 relative: fp32 arithmetic throughout; the int8 codec's codes and scales bit for bit) and is reached through
kernels.dispatch (backend "auto" on CPU tensors, or "native"). The C source is compiled on first use by
kernels.native_build (one ISA per function picked at load: AVX512F, AVX2 + FMA, portable); no compiler, a failed
build or a failed load logs one warning and `available()` is False, and dispatch keeps the reference.

Layouts taken (anything else runs the reference, so every call is served):
    rms_norm           x, residual [T, H] float32 with rows of any stride; weight [H] float32
    rotary_embedding   query [T, Hq, D], key [T, Hkv, D] float32 views (any token and head strides, e.g. slices of
                       the fused qkv output), positions int64 [T], cos_sin_cache [max_position, rot_dim] float32
    write_kv           key, value [T, Hkv, D] float32 views; caches contiguous float32 or bfloat16; slots int64
    paged_attention    query [T, Hq, D] float32 view, caches contiguous float32 or bfloat16, block_tables,
                       seq_lens and query_start_loc int32: decode, prefill, chunks, prefix hits, mixed batches
    silu_mul           gate_up [T, 2 I] float32 with rows of any stride -> [T, I]
    gather_blocks_int8 / scatter_blocks_int8
                       the KV transfer's int8 codec: a contiguous float32 or bfloat16 cache [L, 2, num_blocks,
                       block_size, Hkv, D] (D a multiple of 16), codes [n, L, 2, block_size, Hkv, D] int8 and
                       scales [n, L, 2, Hkv] float32 dense past their block dim (any block stride: a KV payload's
                       records); the reference's bits, one pass a block, no temporaries
    top_k_indices      x [M, N] float32 with rows of any stride, k <= 64 -> [M, k] int64 (an LM head's candidates)
    recompute_logits_int8
                       those candidates of an int8 LM head recomputed in float32 into its logits [M, N] (rows of
                       any stride) from contiguous x [M, K] float32, weights [N, K] int8, scale and bias [N] float32
    DecoderLayers      a pure decode batch through every layer of a plain pre-norm decoder (RMSNorm, fused qkv with
                       RoPE, paged attention, SiLU-gated MLP; every linear a kernels.cpu_matmul.NativeMatmul) in
                       one C call: the ops above and the matmuls in the eager step's order, so the same bits
Bad arguments (shapes that do not match, a slot, position or block id out of range) raise ValueError naming the
argument. Attention computes every query row in one fixed reduction order over the positions it sees (decode per
(sequence, kv head); prompts and chunks in tiles of one kv head and up to 64 positions, each row in the decode
kernel's order), so a row's result is the same alone or in any batch, on any number of threads
(torch.get_num_threads() OpenMP threads, the process's libgomp), after any cached prefix, and as a decode step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from pathlib import Path

import torch

from kernels import native_build
from kernels import reference as ref
from kernels.cpu_matmul import NativeMatmul, matmul_address

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
_F32, _BF16 = torch.float32, torch.bfloat16


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (after one warning) when it cannot be."""
    return load_library(SOURCE)


def load_library(source: Path) -> ctypes.CDLL | None:
    """`source` (this file's C library, or another revision of it: bench/bench_attention_ab.py) built, loaded and
    its entry points typed; None (after one warning) when it cannot be built."""
    lib = native_build.load(source, "op")
    if lib is None:
        return None
    i64, ptr, f32, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "pd_rms_norm": (None, [ptr, i64, ptr, i64, ptr, i64, i64, f32, ptr, ptr, cint]),
        "pd_rotary": (cint, [ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, cint]),
        "pd_write_kv": (cint, [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, cint, i64, ptr]),
        "pd_silu_mul": (None, [ptr, i64, i64, i64, ptr, cint]),
        "pd_top_k_rows": (cint, [ptr, i64, i64, i64, i64, ptr, cint]),
        "pd_recompute_logits_int8": (cint, [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, cint]),
        "pd_paged_attention": (cint, [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, cint, i64, i64, i64, ptr, i64,
                                      i64, ptr, ptr, f32, i64, f32, ptr, cint]),
        "pd_decode_layers": (cint, [ptr, ptr, i64, ptr, ptr, ptr, cint, i64, i64, ptr, i64, ptr, ptr, ptr, cint]),
        "pd_gather_blocks_int8": (cint, [ptr, cint, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, i64, cint]),
        "pd_scatter_blocks_int8": (cint, [ptr, i64, ptr, i64, ptr, cint, i64, i64, i64, i64, i64, ptr, i64, cint]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded."""
    return library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("native CPU op kernels are unavailable (see the warning logged at first use)")
    return lib


# The wrappers below run ~180 times per batch-1 decode step, so their checks are written for speed: each tensor
# attribute read costs ~0.1 us, a torch.Size comparison ~0.3 us, the ctypes call ~2-3 us.
_INT32, _INT64 = torch.int32, torch.int64


def _rows_ok(t: torch.Tensor) -> bool:
    """A CPU float32 tensor whose last dim is contiguous (any other strides)."""
    return t.dtype is _F32 and t.is_cpu and t.stride(-1) == 1


def _dense_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous()


def _shape_error(name: str, t: torch.Tensor, want) -> ValueError:
    return ValueError(f"{name} must have shape {list(want)}, got {list(t.shape)}")


# --------------------------------------------------------------------------------------------------- RMSNorm
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """kernels.reference.rms_norm_ref: x [T, H], weight [H]; with residual [T, H], (normed, x + residual)."""
    if not (x.dim() == 2 and _rows_ok(x) and _dense_ok(weight, _F32)
            and (residual is None or (residual.dim() == 2 and _rows_ok(residual)))):
        return ref.rms_norm_ref(x, weight, eps, residual)
    num_tokens, hidden = x.shape
    if weight.numel() != hidden or weight.dim() != 1:
        raise _shape_error("weight", weight, (hidden,))
    lib = _lib()
    if residual is None:
        out = torch.empty(num_tokens, hidden)
        if num_tokens:
            lib.pd_rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), num_tokens, hidden, eps,
                            out.data_ptr(), None, torch.get_num_threads())
        return out
    if residual.shape != x.shape:
        raise _shape_error("residual", residual, x.shape)
    both = torch.empty(2, num_tokens, hidden)  # one allocation: [0] the normed rows, [1] the new residual
    if num_tokens:
        lib.pd_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                        num_tokens, hidden, eps, both.data_ptr(), both[1].data_ptr(), torch.get_num_threads())
    return both[0], both[1]


# --------------------------------------------------------------------------------------------------- rotary
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """kernels.reference.rotary_embedding_ref, in place on query [T, Hq, D] and key [T, Hkv, D]."""
    if not (query.dim() == 3 and key.dim() == 3 and _rows_ok(query) and _rows_ok(key)
            and _dense_ok(positions, _INT64) and _dense_ok(cos_sin_cache, _F32) and cos_sin_cache.dim() == 2):
        ref.rotary_embedding_ref(positions, query, key, cos_sin_cache)
        return
    num_tokens, num_heads, head_dim = query.shape
    key_tokens, num_kv_heads, key_dim = key.shape
    max_position, rot_dim = cos_sin_cache.shape
    if positions.numel() != num_tokens or positions.dim() != 1:
        raise _shape_error("positions", positions, (num_tokens,))
    if key_tokens != num_tokens or key_dim != head_dim:
        raise _shape_error("key", key, (num_tokens, "Hkv", head_dim))
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"cos_sin_cache's rot_dim must be even and <= head_dim {head_dim}, got {rot_dim}")
    q_strides, k_strides = query.stride(), key.stride()
    if num_tokens and _lib().pd_rotary(positions.data_ptr(), num_tokens, query.data_ptr(), q_strides[0],
                                       q_strides[1], num_heads, key.data_ptr(), k_strides[0], k_strides[1],
                                       num_kv_heads, cos_sin_cache.data_ptr(), max_position, rot_dim,
                                       torch.get_num_threads()):
        raise ValueError(f"positions must be in [0, {max_position}) (cos_sin_cache's rows)")


# --------------------------------------------------------------------------------------------------- KV write
_CACHE_DTYPES = (_F32, _BF16)


def _caches_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Both contiguous CPU 4-dim caches of one dtype the C code takes."""
    return (k_cache.dtype is v_cache.dtype and k_cache.dtype in _CACHE_DTYPES and k_cache.is_cpu and v_cache.is_cpu
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dim() == 4)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kernels.reference.write_kv_ref: key, value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D]."""
    if not (key.dim() == 3 and value.dim() == 3 and _rows_ok(key) and _rows_ok(value) and _caches_ok(k_cache, v_cache)
            and _dense_ok(slot_mapping, _INT64)):
        ref.write_kv_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size, cache_heads, cache_dim = k_cache.shape
    if cache_heads != num_kv_heads or cache_dim != head_dim:
        raise _shape_error("k_cache", k_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    if v_cache.shape != k_cache.shape:
        raise _shape_error("v_cache", v_cache, k_cache.shape)
    if value.shape != key.shape:
        raise _shape_error("value", value, key.shape)
    if slot_mapping.numel() != num_tokens or slot_mapping.dim() != 1:
        raise _shape_error("slot_mapping", slot_mapping, (num_tokens,))
    num_slots = num_blocks * block_size
    k_strides, v_strides = key.stride(), value.stride()
    if num_tokens and _lib().pd_write_kv(key.data_ptr(), k_strides[0], k_strides[1], value.data_ptr(), v_strides[0],
                                         v_strides[1], num_tokens, num_kv_heads, head_dim, k_cache.data_ptr(),
                                         v_cache.data_ptr(), k_cache.dtype is _BF16, num_slots,
                                         slot_mapping.data_ptr()):
        raise ValueError(f"slot_mapping entries must be -1 (padding) or in [0, {num_slots})")


# --------------------------------------------------------------------------------------------------- attention
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """kernels.reference.paged_attention_ref for every batch (decode, prefill, chunks, prefix hits, mixed)."""
    if not (query.dim() == 3 and _rows_ok(query) and _caches_ok(k_cache, v_cache) and block_tables.dim() == 2
            and _dense_ok(block_tables, _INT32) and _dense_ok(seq_lens, _INT32)
            and _dense_ok(query_start_loc, _INT32)):
        return ref.paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                       sliding_window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.numel()
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"k_cache {list(k_cache.shape)} does not fit query {list(query.shape)} (head_dim, and "
                         "query heads a multiple of kv heads)")
    if v_cache.shape != k_cache.shape:
        raise _shape_error("v_cache", v_cache, k_cache.shape)
    table_rows, max_blocks = block_tables.shape
    if table_rows != batch:
        raise _shape_error("block_tables", block_tables, (batch, "max_blocks"))
    if query_start_loc.numel() != batch + 1:
        raise _shape_error("query_start_loc", query_start_loc, (batch + 1,))
    out = torch.empty(num_tokens, num_heads, head_dim)
    if not num_tokens or not batch:
        return out
    q_strides = query.stride()
    rc = _lib().pd_paged_attention(
        query.data_ptr(), q_strides[0], q_strides[1], num_tokens, batch, num_heads, head_dim, k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.dtype is _BF16, num_blocks, block_size, num_kv_heads, block_tables.data_ptr(),
        max_blocks, max_blocks, seq_lens.data_ptr(), query_start_loc.data_ptr(), scale, sliding_window or 0,
        softcap or 0.0, out.data_ptr(), torch.get_num_threads())
    if rc == 0:
        return out
    if rc == -1:
        raise ValueError(f"block_tables entries in use must be in [0, {num_blocks})")
    if rc == -2:
        raise MemoryError("native paged attention: out of memory for its scores")
    if rc == -3:
        raise ValueError(f"seq_lens exceed block_tables' {max_blocks} blocks of {block_size}")
    raise ValueError(f"query_start_loc must rise from 0 to at most {num_tokens} query tokens, each sequence's query "
                     f"length in [0, seq_len]; got query_start_loc {query_start_loc.tolist()}, seq_lens "
                     f"{seq_lens.tolist()}")


# --------------------------------------------------------------------------------------------------- SiLU * up
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """kernels.reference.silu_mul_ref: gate_up [T, 2 I] -> silu(gate) * up [T, I]."""
    if not (gate_up.dim() == 2 and _rows_ok(gate_up)):
        return ref.silu_mul_ref(gate_up)
    num_tokens, width = gate_up.shape
    if width % 2:
        return ref.silu_mul_ref(gate_up)
    out = torch.empty(num_tokens, width // 2)
    if num_tokens:
        _lib().pd_silu_mul(gate_up.data_ptr(), gate_up.stride(0), num_tokens, width // 2, out.data_ptr(),
                           torch.get_num_threads())
    return out


# --------------------------------------------------------------------------------------------------- int8 KV blocks
def _cache_ok(kv_cache: torch.Tensor) -> bool:
    """A contiguous [L, 2, num_blocks, block_size, Hkv, D] float32 / bfloat16 CPU cache, D a multiple of 16."""
    return (kv_cache.dim() == 6 and kv_cache.dtype in _CACHE_DTYPES and kv_cache.is_cpu and kv_cache.is_contiguous()
            and kv_cache.shape[1] == 2 and kv_cache.shape[5] % 16 == 0)


def _dense_past_first(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU tensor of `dtype` laid out densely past its first dim (whose stride is free)."""
    if t.dtype is not dtype or not t.is_cpu:
        return False
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _block_ids(block_ids: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=_INT64).reshape(-1).contiguous()


def gather_blocks_int8(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.gather_blocks_int8_ref: (codes int8 [n, L, 2, block_size, Hkv, D], scales float32
    [n, L, 2, Hkv]), written into `out` = (codes, scales) when given (dense past the block dim)."""
    ids = _block_ids(block_ids)
    if not _cache_ok(kv_cache):
        data, scales = ref.gather_blocks_int8_ref(kv_cache, ids)
        if out is None:
            return data, scales
        out[0].copy_(data), out[1].copy_(scales)
        return out
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    n = ids.numel()
    shape = (n, num_layers, 2, block_size, num_kv_heads, head_dim)
    if out is None:
        data, scales = torch.empty(shape, dtype=torch.int8), torch.empty(n, num_layers, 2, num_kv_heads)
    else:
        data, scales = out
        if tuple(data.shape) != shape or not _dense_past_first(data, torch.int8):
            raise ValueError(f"out[0] must be an int8 CPU tensor of shape {list(shape)} dense past its first dim, "
                             f"got {data.dtype} {list(data.shape)} strides {list(data.stride())}")
        if tuple(scales.shape) != shape[:3] + (num_kv_heads,) or not _dense_past_first(scales, _F32):
            raise ValueError(f"out[1] must be a float32 CPU tensor of shape {list(shape[:3]) + [num_kv_heads]} "
                             f"dense past its first dim, got {scales.dtype} {list(scales.shape)}")
    if n and _lib().pd_gather_blocks_int8(kv_cache.data_ptr(), kv_cache.dtype is _BF16, num_layers, num_blocks,
                                          block_size, num_kv_heads, head_dim, ids.data_ptr(), n, data.data_ptr(),
                                          data.stride(0), scales.data_ptr(), 4 * scales.stride(0),
                                          torch.get_num_threads()):
        raise ValueError(f"block_ids entries must be in [0, {num_blocks})")
    return data, scales


def scatter_blocks_int8(data: torch.Tensor, scales: torch.Tensor, kv_cache: torch.Tensor,
                        block_ids: torch.Tensor) -> None:
    """kernels.reference.scatter_blocks_int8_ref: codes [n, L, 2, block_size, Hkv, D] int8 and scales [n, L, 2,
    Hkv] float32 (each dense past its block dim) dequantized into kv_cache's blocks block_ids (distinct, as a
    transfer's destination blocks are: blocks run in parallel, so of a repeated id which record lands is open)."""
    ids = _block_ids(block_ids)
    if not (_cache_ok(kv_cache) and _dense_past_first(data, torch.int8) and _dense_past_first(scales, _F32)):
        ref.scatter_blocks_int8_ref(data, scales, kv_cache, ids)
        return
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    n = ids.numel()
    shape = (n, num_layers, 2, block_size, num_kv_heads, head_dim)
    if tuple(data.shape) != shape:
        raise _shape_error("data", data, shape)
    if tuple(scales.shape) != shape[:3] + (num_kv_heads,):
        raise _shape_error("scales", scales, shape[:3] + (num_kv_heads,))
    if n and _lib().pd_scatter_blocks_int8(data.data_ptr(), data.stride(0), scales.data_ptr(), 4 * scales.stride(0),
                                           kv_cache.data_ptr(), kv_cache.dtype is _BF16, num_layers, num_blocks,
                                           block_size, num_kv_heads, head_dim, ids.data_ptr(), n,
                                           torch.get_num_threads()):
        raise ValueError(f"block_ids entries must be in [0, {num_blocks})")


TOP_K_MAX = 64
"""Largest k top_k_indices computes natively (the C kernel's TOPK_MAX)."""


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """kernels.reference.top_k_indices_ref: the indices of the k largest values of each row of x [M, N] float32
    -> [M, k] int64, in no promised order; of equal values the earliest index. Rows with fewer than k values
    above -inf, k above TOP_K_MAX and other layouts take the reference."""
    if not (x.dim() == 2 and x.dtype == _F32 and _rows_ok(x) and 1 <= k <= min(TOP_K_MAX, x.shape[1])):
        return ref.top_k_indices_ref(x, k)
    rows, width = x.shape
    out = torch.empty(rows, k, dtype=torch.int64)
    if rows and _lib().pd_top_k_rows(x.data_ptr(), rows, width, x.stride(0), k, out.data_ptr(),
                                     torch.get_num_threads()):
        return ref.top_k_indices_ref(x, k)
    return out


def recompute_logits_int8(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """kernels.reference.recompute_logits_int8_ref: out [M, N] float32 (rows of any stride), x [M, K] float32,
    qweight [N, K] int8, scale [N] float32, bias [N] float32 or None, ids [M, k] int64; out returned. Other
    layouts and dtypes take the reference."""
    if out.dim() != 2 or x.dim() != 2 or qweight.dim() != 2 or ids.dim() != 2:
        raise ValueError(f"out, x, qweight and ids must be 2-D, got {out.dim()}, {x.dim()}, {qweight.dim()} and "
                         f"{ids.dim()} dims")
    (rows, n), k_in = out.shape, x.shape[1]
    if tuple(qweight.shape) != (n, k_in):
        raise _shape_error("qweight", qweight, (n, k_in))
    if x.shape[0] != rows:
        raise _shape_error("x", x, (rows, k_in))
    if ids.shape[0] != rows:
        raise _shape_error("ids", ids, (rows, ids.shape[1]))
    if scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"scale and bias must have {n} entries, got {scale.numel()} and "
                         f"{None if bias is None else bias.numel()}")
    if not (_rows_ok(out) and _dense_ok(x, _F32) and _dense_ok(qweight, torch.int8) and _dense_ok(scale, _F32)
            and (bias is None or _dense_ok(bias, _F32)) and _dense_ok(ids, _INT64)):
        if ids.numel() and not bool(((ids >= 0) & (ids < n)).all()):
            raise ValueError(f"ids entries must be in [0, {n})")
        return ref.recompute_logits_int8_ref(out, x, qweight, scale, bias, ids)
    if rows and ids.shape[1] and _lib().pd_recompute_logits_int8(
            x.data_ptr(), rows, k_in, qweight.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(),
            n, ids.data_ptr(), ids.shape[1], out.data_ptr(), out.stride(0), torch.get_num_threads()):
        raise ValueError(f"ids entries must be in [0, {n})")
    return out


# --------------------------------------------------------------------------------------------------- decode layers
class _Linear(ctypes.Structure):
    _fields_ = [("operands", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("cos_sin", ctypes.c_void_p), ("window", ctypes.c_int64)]


class _Decoder(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "Hq", "Hkv", "D", "intermediate",
                                                     "rot_dim", "max_position")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("matmul", ctypes.c_void_p), ("layers", ctypes.c_void_p), ("final_norm", ctypes.c_void_p)]


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One layer as DecoderLayers takes it: float32 norms [hidden], NativeMatmuls (qkv [(Hq + 2 Hkv) D, hidden],
    o [hidden, Hq D], gate_up [2 I, hidden], down [hidden, I]) with their float32 biases or None, the layer's RoPE
    table [max_position, rot_dim] float32 and its sliding window (None: full attention)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: NativeMatmul
    o: NativeMatmul
    gate_up: NativeMatmul
    down: NativeMatmul
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    cos_sin: torch.Tensor
    window: int | None


class DecoderLayers:
    """Every layer of a pre-norm decoder for pure decode batches, one C call a step (pd_decode_layers): per layer
    rms_norm (with the residual add), qkv, rotary_embedding, write_kv, paged_attention, o, rms_norm, gate_up,
    silu_mul, down, then the final rms_norm, exactly as the eager layer loop calls them, on
    torch.get_num_threads() threads. Shapes are checked here once; `__call__` returns None for any batch the C
    side does not take (not one new token per sequence, an id out of range, a cache of another layout), which
    the eager step then runs (and names what is wrong)."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, scale: float, softcap: float | None) -> None:
        hidden = final_norm.numel()
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        intermediate = layers[0].down.in_features
        max_position, rot_dim = layers[0].cos_sin.shape
        shapes = {"qkv": (hidden, q_size + 2 * kv_size), "o": (q_size, hidden), "gate_up": (hidden, 2 * intermediate),
                  "down": (intermediate, hidden)}
        for i, layer in enumerate(layers):
            for name, (k, n) in shapes.items():
                mm = getattr(layer, name)
                if (mm.in_features, mm.out_features) != (k, n):
                    raise ValueError(f"layer {i} {name} must be [{n}, {k}], got [{mm.out_features}, {mm.in_features}]")
            for name, (_, n), bias in zip(shapes, shapes.values(), layer.biases):
                if bias is not None and not (_dense_ok(bias, _F32) and bias.shape == (n,)):
                    raise ValueError(f"layer {i} {name} bias must be a float32 [{n}] tensor")
            for name in ("input_norm", "post_norm"):
                if not (_dense_ok(getattr(layer, name), _F32) and getattr(layer, name).shape == (hidden,)):
                    raise ValueError(f"layer {i} {name} must be a float32 [{hidden}] tensor")
            if not (_dense_ok(layer.cos_sin, _F32) and layer.cos_sin.shape == (max_position, rot_dim)):
                raise ValueError(f"layer {i} cos_sin must be a float32 [{max_position}, {rot_dim}] tensor")
        if not _dense_ok(final_norm, _F32) or rot_dim % 2 or rot_dim > head_dim or num_heads % num_kv_heads:
            raise ValueError("final_norm must be float32, rot_dim even and <= head_dim, heads a multiple of kv heads")
        self._keep = (layers, final_norm)  # the C structs point into these
        self._layers = (_Layer * len(layers))(*(_Layer(
            l.input_norm.data_ptr(), l.post_norm.data_ptr(),
            *(_Linear(mm.operands, 0 if b is None else b.data_ptr(), mm.out_features)
              for mm, b in zip((l.qkv, l.o, l.gate_up, l.down), l.biases)),
            l.cos_sin.data_ptr(), l.window or 0) for l in layers))
        self._decoder = _Decoder(len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, rot_dim,
                                 max_position, eps, scale, softcap or 0.0, matmul_address(),
                                 ctypes.addressof(self._layers), final_norm.data_ptr())
        self._decoder_ptr = ctypes.addressof(self._decoder)
        self.hidden = hidden
        self._fn = _lib().pd_decode_layers

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
                 ) -> torch.Tensor | None:
        """h [B, hidden] float32 (the embedded tokens) -> the final-norm hidden states [B, hidden], KV written into
        kv_cache [layers, 2, num_blocks, block_size, Hkv, D]; None when the batch is not one it takes."""
        batch = h.shape[0]
        if not (batch and h.dim() == 2 and h.shape[1] == self.hidden and _dense_ok(h, _F32)
                and kv_cache.dim() == 6 and kv_cache.dtype in _CACHE_DTYPES and kv_cache.is_cpu
                and kv_cache.is_contiguous() and kv_cache.shape[0] == len(self._layers)
                and _dense_ok(positions, _INT64) and positions.numel() == batch
                and _dense_ok(slot_mapping, _INT64) and slot_mapping.numel() == batch
                and block_tables.dim() == 2 and block_tables.shape[0] == batch and _dense_ok(block_tables, _INT32)
                and _dense_ok(seq_lens, _INT32) and seq_lens.numel() == batch
                and _dense_ok(query_start_loc, _INT32) and query_start_loc.numel() == batch + 1):
            return None
        _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if (num_kv_heads, head_dim) != (self._decoder.Hkv, self._decoder.D):
            return None
        out = torch.empty(batch, self.hidden)
        rc = self._fn(self._decoder_ptr, h.data_ptr(), batch, positions.data_ptr(), slot_mapping.data_ptr(),
                      kv_cache.data_ptr(), kv_cache.dtype is _BF16, num_blocks, block_size, block_tables.data_ptr(),
                      block_tables.shape[1], seq_lens.data_ptr(), query_start_loc.data_ptr(), out.data_ptr(),
                      torch.get_num_threads())
        if rc == -2:
            raise MemoryError("native decode layers: out of memory for their scratch")
        return out if rc == 0 else None
