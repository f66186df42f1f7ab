"""KV-cache and small-op kernels: Triton on CUDA, native C on CPU, the pure-torch reference as the definition.

Every public function below dispatches through `kernels.dispatch`: Triton when the tensors are CUDA and triton
imports; on CPU tensors the native C ops of `kernels.cpu_ops` (rms_norm, rotary_embedding, write_kv, decode
paged_attention, silu_mul, top_k_indices, recompute_logits_int8; built on first use when a C compiler exists) for
the layouts they take; `kernels.reference` otherwise. `set_backend` / PDSERVE_KERNEL_BACKEND (auto | torch |
native | triton) override the choice. Each Triton launcher and native wrapper validates shapes, dtypes and
strides (ValueError naming the argument) and has a parametrized test against its reference (tests/kernels).

Layouts:
    kv_cache      [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (one tensor per worker)
    k/v_cache     kv_cache[l, 0] / kv_cache[l, 1]: [num_blocks, block_size, num_kv_heads, head_dim]
    slot          block_id * block_size + offset_in_block; slot -1 = padding, skipped by write_kv
    staging       [n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous: the wire format of KV transfer
    int8 scales   [n, num_layers, 2, num_kv_heads] fp32: one symmetric scale per block, layer, K/V and kv head

paged_attention semantics: query holds every sequence's new tokens concatenated (query_start_loc [B+1] offsets);
seq_lens[b] counts sequence b's whole KV including those new tokens, already written to the cache; new token i of
b sits at position seq_lens[b] - q_len_b + i and attends causally to positions <= its own. Query head h reads kv
head h // (num_heads // num_kv_heads). Sequences with q_len 0 are skipped.

Numerics: storage in bf16, fp16 or fp32; every reduction (QK^T, softmax, PV accumulation, RMS, rotary products,
int8 absmax) is done in fp32 and only the result is rounded to the storage dtype. rms_norm with a residual rounds
x + residual to x.dtype first (that is the returned residual) and normalizes that rounded sum, as HF does.
silu_mul: silu(gate) * up of a fused [T, 2 I] gate/up projection (the first half is the gate) -> [T, I].
top_k_indices: the indices of the k largest values of each row [M, N] -> [M, k] int64, in no promised order (the
native kernel: of equal values the earliest index; the reference: torch.topk's choice).
recompute_logits_int8: an int8 LM head's candidates (ids [M, k]) recomputed in float32 into its logits [M, N].
gptq_gemm: x @ W.T over a GPTQ checkpoint's packed int32 qweight/qzeros, scales and g_idx (engine.gptq_format).
int8 quantization: scale = absmax / 127, q = round_half_to_even(x * (1 / scale)), all-zero heads get scale 0.

CPU matmuls over int4 / int8 weights are not dispatched here: `kernels.cpu_matmul` (native C, built on first use)
is chosen per linear at load time by engine.quant (EngineConfig.cpu_matmul), since it fixes the weights' layout.
"""

from kernels.dispatch import (dequantize_blocks_int8, gather_blocks, gather_blocks_int8, get_backend,
                              gptq_gemm, native_available, native_serves, paged_attention, quantize_blocks_int8,
                              recompute_logits_int8, rms_norm, rotary_embedding, scatter_blocks,
                              scatter_blocks_int8, set_backend, silu_mul, top_k_indices, triton_available, write_kv)

__all__ = [
    "write_kv", "paged_attention", "rms_norm", "rotary_embedding", "gather_blocks", "scatter_blocks",
    "quantize_blocks_int8", "dequantize_blocks_int8", "gather_blocks_int8", "scatter_blocks_int8", "top_k_indices",
    "recompute_logits_int8", "gptq_gemm", "silu_mul", "set_backend", "get_backend", "triton_available",
    "native_available", "native_serves",
]
