"""The one dispatch point: Triton kernels for CUDA tensors when triton imports, the native C ops
(kernels.cpu_ops) for CPU tensors when they build, the torch reference otherwise.

Backends: "auto" (the default: as just said), "torch" (the reference everywhere: debugging, A/B, tests that
compare against it), "native" (the native C ops on CPU, RuntimeError when they cannot be built; the ops they do
not cover, and layouts they do not take, still run the reference), "triton" (the Triton kernels even on CPU
tensors: only meaningful under TRITON_INTERPRET=1, which the kernel tests use). The environment variable
PDSERVE_KERNEL_BACKEND, read once at import, sets the initial backend; `set_backend` changes it.

Inside a torch.compile trace (engine.compiled_step) the CPU ops run the reference, which the compiler fuses.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels import reference as ref

_BACKENDS = ("auto", "torch", "native", "triton")
ENV_VAR = "PDSERVE_KERNEL_BACKEND"


def _initial_backend() -> str:
    name = os.environ.get(ENV_VAR, "auto") or "auto"
    if name not in _BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {_BACKENDS}, got {name!r}")
    return name


_backend = _initial_backend()


def set_backend(name: str) -> None:
    """Select "auto", "torch", "native" or "triton" (module docstring); "native" raises RuntimeError when the
    native ops cannot be built."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    if name == "native" and not native_available():
        raise RuntimeError("kernel backend 'native': the native CPU op kernels cannot be built (see the warning "
                           "logged by kernels.native_build)")
    _backend = name


def get_backend() -> str:
    return _backend


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton and our kernel modules import (checked once)."""
    try:
        import triton  # noqa: F401

        from kernels import (triton_block_copy, triton_decode_attention, triton_gptq_gemm,  # noqa: F401
                             triton_kv_write, triton_norm_rope, triton_prefill_attention)
    except Exception:  # ImportError, or a triton without a usable backend
        return False
    return True


@functools.cache
def _cpu_ops():
    """kernels.cpu_ops when its library builds and loads, else None (checked once; a failure logs one warning)."""
    from kernels import cpu_ops
    return cpu_ops if cpu_ops.available() else None


def native_available() -> bool:
    """True when the native CPU ops (kernels.cpu_ops) build and load."""
    return _cpu_ops() is not None


def native_serves(t: torch.Tensor) -> bool:
    """Whether the ops on CPU tensor `t` run the native C kernels now (backend auto or native, built, not inside
    a torch.compile trace): what a caller of kernels.cpu_ops' fused entry points checks first."""
    return _native_ops(t) is not None


def _use_triton(t: torch.Tensor) -> bool:
    if _backend == "torch" or _backend == "native":
        return False
    if _backend == "triton":
        return True
    return t.is_cuda and triton_available()


def _native_ops(t: torch.Tensor):
    """kernels.cpu_ops when `t` is a CPU tensor the native backend serves now, else None."""
    if (_backend == "auto" or _backend == "native") and t.is_cpu and not torch.compiler.is_compiling():
        ops = _cpu_ops()
        if ops is None and _backend == "native":
            raise RuntimeError("kernel backend 'native': the native CPU op kernels cannot be built")
        return ops
    return None


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # key, value: [num_tokens, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [num_tokens]
    if _use_triton(key):
        from kernels.triton_kv_write import write_kv_triton
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif (native := _native_ops(key)) is not None:
        native.write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        ref.write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None, softcap: float | None = None,
                    max_query_len: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Varlen causal attention over paged KV. A token at position p sees positions p - sliding_window + 1 .. p
    when sliding_window is given; softcap c turns scaled scores s into c * tanh(s / c). max_query_len /
    max_seq_len are optional host-side hints that spare the Triton path a device->host sync; they must be upper
    bounds when given."""
    # query: [num_query_tokens, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    # block_tables: [B, max_blocks_per_seq] int32; seq_lens: [B] int32; query_start_loc: [B+1] int32
    if not _use_triton(query):
        if (native := _native_ops(query)) is not None:
            return native.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                          sliding_window, softcap)
        return ref.paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                       sliding_window, softcap)
    batch = seq_lens.shape[0]
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if batch else 0
    if max_query_len == 1 and query.shape[0] == batch:
        from kernels.triton_decode_attention import decode_attention_triton
        return decode_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                       sliding_window=sliding_window, softcap=softcap, max_seq_len=max_seq_len)
    from kernels.triton_prefill_attention import prefill_attention_triton
    return prefill_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                    sliding_window=sliding_window, softcap=softcap, max_query_len=max_query_len)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    # x, residual: [T, H]; weight: [H]
    if _use_triton(x):
        from kernels.triton_norm_rope import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual)
    if (native := _native_ops(x)) is not None:
        return native.rms_norm(x, weight, eps, residual)
    return ref.rms_norm_ref(x, weight, eps, residual)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    # positions: [T]; query: [T, Hq, D]; key: [T, Hkv, D]; cos_sin_cache: [max_position, rot_dim] fp32
    if _use_triton(query):
        from kernels.triton_norm_rope import rotary_embedding_triton
        rotary_embedding_triton(positions, query, key, cos_sin_cache)
    elif (native := _native_ops(query)) is not None:
        native.rotary_embedding(positions, query, key, cos_sin_cache)
    else:
        ref.rotary_embedding_ref(positions, query, key, cos_sin_cache)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection [T, 2 I] -> [T, I] (Llama's MLP activation)."""
    if (native := _native_ops(gate_up)) is not None:
        return native.silu_mul(gate_up)
    return ref.silu_mul_ref(gate_up)


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest values of each row of x [M, N] -> [M, k] int64, in no promised order."""
    if (native := _native_ops(x)) is not None:
        return native.top_k_indices(x, k)
    return ref.top_k_indices_ref(x, k)


def recompute_logits_int8(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """out[m, ids[m, j]] <- x[m] . (qweight[n] * scale[n]) + bias[n] in float32, n = ids[m, j]; returns out."""
    if (native := _native_ops(out)) is not None:
        return native.recompute_logits_int8(out, x, qweight, scale, bias, ids)
    return ref.recompute_logits_int8_ref(out, x, qweight, scale, bias, ids)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; block_ids: [n] -> [n, L, 2, block_size, Hkv, D]
    # (written into `out` and returned when given: contiguous, that shape, the cache's dtype and device)
    if _use_triton(kv_cache):
        from kernels.triton_block_copy import gather_blocks_triton
        return gather_blocks_triton(kv_cache, block_ids, out)
    return ref.gather_blocks_ref(kv_cache, block_ids, out)


def scatter_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    # staging: [n, L, 2, block_size, Hkv, D]; kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    if _use_triton(kv_cache):
        from kernels.triton_block_copy import scatter_blocks_triton
        scatter_blocks_triton(staging, kv_cache, block_ids)
    else:
        ref.scatter_blocks_ref(staging, kv_cache, block_ids)


def quantize_blocks_int8(staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # staging: [n, L, 2, block_size, Hkv, D] -> (int8 same shape, fp32 scales [n, L, 2, Hkv])
    if _use_triton(staging):
        from kernels.triton_block_copy import quantize_blocks_int8_triton
        return quantize_blocks_int8_triton(staging)
    return ref.quantize_blocks_int8_ref(staging)


def dequantize_blocks_int8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # data: [n, L, 2, block_size, Hkv, D] int8; scales: [n, L, 2, Hkv] -> [n, L, 2, block_size, Hkv, D] dtype
    if _use_triton(data):
        from kernels.triton_block_copy import dequantize_blocks_int8_triton
        return dequantize_blocks_int8_triton(data, scales, dtype)
    return ref.dequantize_blocks_int8_ref(data, scales, dtype)


def gather_blocks_int8(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blocks_int8(gather_blocks(...)) in one pass on the Triton and native paths; written into `out` =
    (codes, scales) when given (the native path writes there itself: a KV payload's records)."""
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; block_ids: [n] -> (int8 staging, fp32 [n, L, 2, Hkv])
    if _use_triton(kv_cache):
        from kernels.triton_block_copy import gather_blocks_int8_triton
        data, scales = gather_blocks_int8_triton(kv_cache, block_ids)
    elif (native := _native_ops(kv_cache)) is not None:
        return native.gather_blocks_int8(kv_cache, block_ids, out)
    else:
        data, scales = ref.gather_blocks_int8_ref(kv_cache, block_ids)
    if out is None:
        return data, scales
    out[0].copy_(data), out[1].copy_(scales)
    return out


def scatter_blocks_int8(data: torch.Tensor, scales: torch.Tensor, kv_cache: torch.Tensor,
                        block_ids: torch.Tensor) -> None:
    """scatter_blocks(dequantize_blocks_int8(...)) in one pass on the Triton and native paths."""
    # data: [n, L, 2, block_size, Hkv, D] int8; scales: [n, L, 2, Hkv]; kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    if _use_triton(kv_cache):
        from kernels.triton_block_copy import scatter_blocks_int8_triton
        scatter_blocks_int8_triton(data, scales, kv_cache, block_ids)
    elif (native := _native_ops(kv_cache)) is not None:
        native.scatter_blocks_int8(data, scales, kv_cache, block_ids)
    else:
        ref.scatter_blocks_int8_ref(data, scales, kv_cache, block_ids)


def gptq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    # x: [M, K]; qweight: int32 [K // p, N]; qzeros: int32 [G, N // p]; scales: [G, N]; g_idx: [K] -> [M, N]
    if _use_triton(x):
        from kernels.triton_gptq_gemm import gptq_gemm_triton
        return gptq_gemm_triton(x.contiguous(), qweight, qzeros, scales, g_idx, bits, zero_offset)
    return ref.gptq_gemm_ref(x, qweight, qzeros, scales, g_idx, bits, zero_offset)
