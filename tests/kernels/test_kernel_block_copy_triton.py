"""Triton block gather/scatter and int8 (de)quantization against the references."""

import pytest
import torch

from kernels import reference as ref
from kernels.triton_block_copy import (dequantize_blocks_int8_triton, gather_blocks_int8_triton,
                                       gather_blocks_triton, quantize_blocks_int8_triton, scatter_blocks_int8_triton,
                                       scatter_blocks_triton)

SHAPES = [(2, 8, 1, 16), (3, 16, 3, 24)]  # (num_layers, block_size, num_kv_heads, head_dim)


def _cache(num_layers, block_size, num_kv_heads, head_dim, num_blocks=9, dtype=torch.float32, device="cpu"):
    # [L, 2, num_blocks, block_size, Hkv, D], heads at different magnitudes
    mags = torch.rand(num_kv_heads)[:, None] * 4 + 0.1
    return (torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) * mags).to(dtype).to(device)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ids", [[4, 0, 8], [2], []])
def test_gather_scatter_match_reference(shape, ids):
    kv_cache = _cache(*shape)
    block_ids = torch.tensor(ids, dtype=torch.int64)
    staging = gather_blocks_triton(kv_cache, block_ids)
    assert torch.equal(staging, ref.gather_blocks_ref(kv_cache, block_ids))
    dest_tri, dest_ref = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
    dst_ids = torch.tensor(list(reversed(range(9)))[:len(ids)], dtype=torch.int32)
    scatter_blocks_triton(staging, dest_tri, dst_ids)
    ref.scatter_blocks_ref(staging, dest_ref, dst_ids)
    assert torch.equal(dest_tri, dest_ref)


@pytest.mark.parametrize("shape", SHAPES)
def test_gather_into_out_and_scatter_out_of_shared_memory_match_reference(shape):
    # out= lands the blocks in caller memory (a shared-memory segment's pages here) and returns it; scatter reads
    # straight from such a view
    from multiprocessing import shared_memory

    kv_cache = _cache(*shape)
    block_ids = torch.tensor([7, 1, 4], dtype=torch.int64)
    num_layers, block_size, num_kv_heads, head_dim = shape
    staging_shape = (3, num_layers, 2, block_size, num_kv_heads, head_dim)
    nbytes = 4 * torch.Size(staging_shape).numel()
    segment = shared_memory.SharedMemory(create=True, size=2 * nbytes)
    try:
        # staging: [3, L, 2, block_size, Hkv, D] views of the segment, triton's at offset 0, the reference's after
        tri_out = torch.frombuffer(segment.buf, dtype=torch.float32, count=nbytes // 4).view(staging_shape)
        ref_out = torch.frombuffer(segment.buf, dtype=torch.float32, count=nbytes // 4,
                                   offset=nbytes).view(staging_shape)
        assert gather_blocks_triton(kv_cache, block_ids, out=tri_out) is tri_out
        assert ref.gather_blocks_ref(kv_cache, block_ids, out=ref_out) is ref_out
        assert torch.equal(tri_out, ref.gather_blocks_ref(kv_cache, block_ids))
        assert torch.equal(ref_out, tri_out)
        dest_tri, dest_ref = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
        dst_ids = torch.tensor([0, 8, 2], dtype=torch.int64)
        scatter_blocks_triton(tri_out, dest_tri, dst_ids)
        ref.scatter_blocks_ref(ref_out, dest_ref, dst_ids)
        assert torch.equal(dest_tri, dest_ref)
        assert torch.equal(dest_ref[:, :, dst_ids], kv_cache[:, :, block_ids])
        del tri_out, ref_out
    finally:
        segment.close()
        segment.unlink()


@pytest.mark.parametrize("gather", [gather_blocks_triton, ref.gather_blocks_ref])
@pytest.mark.parametrize("bad, what", [
    (torch.empty(2, 2, 2, 8, 1, 16), "shape"),                          # 2 blocks for 3 ids
    (torch.empty(3, 2, 2, 8, 1, 16, dtype=torch.float16), "dtype"),
    (torch.empty(3, 2, 2, 8, 1, 32)[..., ::2], "contiguous"),
])
def test_gather_out_of_the_wrong_form_is_refused_naming_out(gather, bad, what):
    kv_cache = _cache(2, 8, 1, 16)
    with pytest.raises(ValueError, match=f"out .*{what}|out {what}"):
        gather(kv_cache, torch.tensor([0, 1, 2]), out=bad)


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_dequantize_match_reference(shape):
    kv_cache = _cache(*shape)
    kv_cache[1, 0, 3, :, 0] = 0.0  # an all-zero head: scale 0, data 0
    staging = ref.gather_blocks_ref(kv_cache, torch.tensor([3, 5, 1]))
    data, scales = quantize_blocks_int8_triton(staging)
    data_ref, scales_ref = ref.quantize_blocks_int8_ref(staging)
    torch.testing.assert_close(scales, scales_ref, atol=0, rtol=1e-6)
    assert (data.int() - data_ref.int()).abs().max() <= 1  # x / scale may land either side of a .5 tie
    assert (data != data_ref).float().mean() < 1e-3
    back = dequantize_blocks_int8_triton(data_ref, scales_ref, torch.float32)
    torch.testing.assert_close(back, ref.dequantize_blocks_int8_ref(data_ref, scales_ref, torch.float32))


def test_round_half_even_like_torch():
    # one head whose absmax is 127 so x / scale == x: ties at .5 must round to even as torch.round does
    staging = torch.zeros(1, 1, 2, 8, 1, 16)
    staging[..., 0, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0])
    data, _ = quantize_blocks_int8_triton(staging)
    data_ref, _ = ref.quantize_blocks_int8_ref(staging)
    assert torch.equal(data, data_ref)
    assert data[0, 0, 0, 0, 0, :8].tolist() == [0, 2, 2, 0, -2, -2, 126, 127]


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_int8_gather_scatter_match_reference(shape):
    kv_cache = _cache(*shape)
    block_ids = torch.tensor([7, 2])
    data, scales = gather_blocks_int8_triton(kv_cache, block_ids)
    data_ref, scales_ref = ref.gather_blocks_int8_ref(kv_cache, block_ids)
    torch.testing.assert_close(scales, scales_ref, atol=0, rtol=1e-6)
    assert (data.int() - data_ref.int()).abs().max() <= 1
    dest_tri, dest_ref = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
    scatter_blocks_int8_triton(data_ref, scales_ref, dest_tri, torch.tensor([0, 8]))
    ref.scatter_blocks_int8_ref(data_ref, scales_ref, dest_ref, torch.tensor([0, 8]))
    torch.testing.assert_close(dest_tri, dest_ref)
    bound = scales_ref.amax() / 2 + 1e-6
    assert (dest_tri[:, :, [0, 8]] - kv_cache[:, :, [7, 2]]).abs().max() <= bound


def test_block_copy_rejects_bad_arguments():
    kv_cache = _cache(2, 8, 2, 16)
    with pytest.raises(ValueError, match="kv_cache must have 6 dims"):
        gather_blocks_triton(kv_cache[0], torch.tensor([0]))
    with pytest.raises(ValueError, match="block_ids dtype"):
        gather_blocks_triton(kv_cache, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="kv_cache must be contiguous in its last 3 dims"):
        gather_blocks_triton(kv_cache.transpose(3, 4), torch.tensor([0]))
    staging = gather_blocks_triton(kv_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="staging must have shape"):
        scatter_blocks_triton(staging, kv_cache, torch.tensor([0]))
    data, scales = quantize_blocks_int8_triton(staging)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_blocks_int8_triton(data, scales[:1], torch.float32)
    with pytest.raises(ValueError, match="data dtype"):
        dequantize_blocks_int8_triton(staging, scales, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_copy_cuda(dtype):
    kv_cache = _cache(4, 16, 8, 128, num_blocks=64, dtype=dtype, device="cuda")
    block_ids = torch.randperm(64, device="cuda")[:20]
    staging = gather_blocks_triton(kv_cache, block_ids)
    assert torch.equal(staging, ref.gather_blocks_ref(kv_cache, block_ids))
    dest = torch.zeros_like(kv_cache)
    scatter_blocks_triton(staging, dest, block_ids)
    assert torch.equal(dest[:, :, block_ids], kv_cache[:, :, block_ids])
    data, scales = gather_blocks_int8_triton(kv_cache, block_ids)
    data_ref, scales_ref = ref.quantize_blocks_int8_ref(staging)
    torch.testing.assert_close(scales, scales_ref, atol=0, rtol=1e-5)
    assert (data.int() - data_ref.int()).abs().max() <= 1
    back = dequantize_blocks_int8_triton(data, scales, dtype)
    torch.testing.assert_close(back, ref.dequantize_blocks_int8_ref(data, scales, dtype))
