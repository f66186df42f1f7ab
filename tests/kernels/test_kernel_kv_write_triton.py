"""Triton write_kv against write_kv_ref."""

import pytest
import torch

from kernels import reference as ref
from kernels.triton_kv_write import write_kv_triton


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    kv_cache = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    return kv_cache, kv_cache.clone()


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 24), (8, 8)])
def test_write_kv_matches_reference(block_size, num_kv_heads, head_dim):
    num_blocks, num_tokens = 6, 13
    kv_tri, kv_ref = _caches(num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    key, value = torch.randn(num_tokens, num_kv_heads, head_dim), torch.randn(num_tokens, num_kv_heads, head_dim)
    write_kv_triton(key, value, kv_tri[1, 0], kv_tri[1, 1], slots)  # a layer view of the full cache
    ref.write_kv_ref(key, value, kv_ref[1, 0], kv_ref[1, 1], slots)
    assert torch.equal(kv_tri, kv_ref)


def test_write_kv_from_strided_qkv_views_int32_slots():
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    key = qkv[:, 64:96].view(5, 2, 16)  # token stride 128: a view into the fused projection
    value = qkv[:, 96:].view(5, 2, 16)
    kv_tri, kv_ref = _caches(3, 8, 2, 16)
    slots = torch.tensor([0, 9, 23, -1, 4], dtype=torch.int32)
    write_kv_triton(key, value, kv_tri[0, 0], kv_tri[0, 1], slots)
    ref.write_kv_ref(key, value, kv_ref[0, 0], kv_ref[0, 1], slots)
    assert torch.equal(kv_tri, kv_ref)


def test_write_kv_no_tokens_is_a_no_op():
    kv_tri, kv_ref = _caches(2, 8, 1, 16)
    write_kv_triton(torch.empty(0, 1, 16), torch.empty(0, 1, 16), kv_tri[0, 0], kv_tri[0, 1],
                    torch.empty(0, dtype=torch.int64))
    assert torch.equal(kv_tri, kv_ref)


def test_write_kv_rejects_bad_arguments():
    kv, _ = _caches(2, 8, 2, 16)
    key = torch.randn(3, 2, 16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="key must have shape"):
        write_kv_triton(torch.randn(3, 1, 16), key, kv[0, 0], kv[0, 1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(key, key, kv[0, 0], kv[0, 1], slots[:2])
    with pytest.raises(ValueError, match="slot_mapping dtype"):
        write_kv_triton(key, key, kv[0, 0], kv[0, 1], slots.float())
    with pytest.raises(ValueError, match="v_cache"):
        write_kv_triton(key, key, kv[0, 0], kv[0, 1, :1], slots)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_cuda(dtype):
    kv_tri, kv_ref = _caches(64, 16, 8, 128, dtype=dtype, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    key = torch.randn(300, 8, 128, device="cuda", dtype=dtype)
    value = torch.randn(300, 8, 128, device="cuda", dtype=dtype)
    write_kv_triton(key, value, kv_tri[1, 0], kv_tri[1, 1], slots)
    ref.write_kv_ref(key, value, kv_ref[1, 0], kv_ref[1, 1], slots)
    assert torch.equal(kv_tri, kv_ref)
