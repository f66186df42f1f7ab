"""Triton RMSNorm (+ residual) and rotary embedding against the references."""

import pytest
import torch

from kernels import reference as ref
from kernels.triton_norm_rope import rms_norm_triton, rotary_embedding_triton
from kv_testutil import make_cos_sin_cache


@pytest.mark.parametrize("hidden", [16, 40])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_rms_norm_matches_reference(hidden, with_residual, num_tokens):
    x, res, w = torch.randn(num_tokens, hidden), torch.randn(num_tokens, hidden), torch.randn(hidden)
    out = rms_norm_triton(x, w, 1e-5, res if with_residual else None)
    expected = ref.rms_norm_ref(x, w, 1e-5, res if with_residual else None)
    if with_residual:
        torch.testing.assert_close(out[1], expected[1], atol=0, rtol=0)
        out, expected = out[0], expected[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_strided_rows_and_inputs_untouched():
    base = torch.randn(4, 64)
    x = base[:, :32]  # row stride 64
    res = torch.randn(4, 32)
    x0, res0 = x.clone(), res.clone()
    out, new_res = rms_norm_triton(x, torch.ones(32), 1e-6, res)
    exp_out, exp_res = ref.rms_norm_ref(x0, torch.ones(32), 1e-6, res0)
    torch.testing.assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(new_res, exp_res) and torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_dim,rot_dim", [(16, 16), (24, 24), (16, 8)])
def test_rotary_embedding_matches_reference(num_heads, num_kv_heads, head_dim, rot_dim):
    cache = make_cos_sin_cache(100, rot_dim)
    positions = torch.tensor([0, 3, 99, 17, 17])
    q, k = torch.randn(5, num_heads, head_dim), torch.randn(5, num_kv_heads, head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_triton(positions, q, k, cache)
    ref.rotary_embedding_ref(positions, q_ref, k_ref, cache)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6)


def test_rotary_embedding_on_fused_qkv_views():
    qkv = torch.randn(3, (4 + 2 + 2) * 16)
    qkv_ref = qkv.clone()
    cache, positions = make_cos_sin_cache(10, 16), torch.tensor([1, 2, 9], dtype=torch.int32)
    rotary_embedding_triton(positions, qkv[:, :64].view(3, 4, 16), qkv[:, 64:96].view(3, 2, 16), cache)
    ref.rotary_embedding_ref(positions, qkv_ref[:, :64].view(3, 4, 16), qkv_ref[:, 64:96].view(3, 2, 16), cache)
    torch.testing.assert_close(qkv, qkv_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 96:], qkv_ref[:, 96:])  # V untouched


def test_norm_rope_reject_bad_arguments():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_triton(torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(2, 8).double())
    with pytest.raises(ValueError, match="x must be contiguous"):
        rms_norm_triton(torch.randn(8, 2).t(), torch.randn(8), 1e-6)
    cache = make_cos_sin_cache(10, 16)
    with pytest.raises(ValueError, match="cos_sin_cache width"):
        rotary_embedding_triton(torch.tensor([1]), torch.randn(1, 2, 8), torch.randn(1, 1, 8), cache)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding_triton(torch.tensor([1, 2]), torch.randn(1, 2, 16), torch.randn(1, 1, 16), cache)
    with pytest.raises(ValueError, match="cos_sin_cache dtype"):
        rotary_embedding_triton(torch.tensor([1]), torch.randn(1, 2, 16), torch.randn(1, 1, 16), cache.double())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_rope_cuda(dtype):
    x = torch.randn(37, 4096, device="cuda", dtype=dtype)
    res = torch.randn(37, 4096, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    out, new_res = rms_norm_triton(x, w, 1e-5, res)
    exp_out, exp_res = ref.rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(new_res, exp_res)
    torch.testing.assert_close(out, exp_out, atol=2e-2, rtol=2e-2)
    cache = make_cos_sin_cache(4096, 128).cuda()
    positions = torch.randint(0, 4096, (37,), device="cuda")
    q, k = torch.randn(37, 32, 128, device="cuda", dtype=dtype), torch.randn(37, 8, 128, device="cuda", dtype=dtype)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_triton(positions, q, k, cache)
    ref.rotary_embedding_ref(positions, q_ref, k_ref, cache)
    torch.testing.assert_close(q, q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k, k_ref, atol=2e-2, rtol=2e-2)
