"""Triton GPTQ dequant-GEMM against its torch reference, and the reference against W written out by hand."""

import pytest
import torch

from kernels import reference as ref
from kernels.triton_gptq_gemm import gptq_gemm_triton


def packed_weight(in_features, out_features, bits, group_size, act_order, seed=0):
    """Random codes / zeros / scales packed by hand (low bits first), with the W they define."""
    g = torch.Generator().manual_seed(seed)
    pack, maxq = 32 // bits, (1 << bits) - 1
    groups = 1 if group_size == -1 else in_features // group_size
    codes = torch.randint(0, maxq + 1, (in_features, out_features), generator=g)
    zeros = torch.randint(1, maxq + 1, (groups, out_features), generator=g)
    scales = (torch.rand(groups, out_features, generator=g) * 0.02 + 0.001).half()
    g_idx = torch.arange(in_features) // (in_features if group_size == -1 else group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=g)]
    qweight = torch.zeros(in_features // pack, out_features, dtype=torch.int64)
    qzeros = torch.zeros(groups, out_features // pack, dtype=torch.int64)
    for k in range(pack):
        qweight |= codes[k::pack] << (bits * k)
        qzeros |= (zeros[:, k::pack] - 1) << (bits * k)  # checkpoint_format gptq stores zero - 1
    to_int32 = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    w = (codes - zeros[g_idx]).float() * scales[g_idx].float()                  # [in, out]
    return to_int32(qweight), to_int32(qzeros), scales, g_idx.to(torch.int32), w.t()


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (4, 32, True), (4, -1, False),
                                                       (8, 64, True)])
@pytest.mark.parametrize("num_rows", [1, 20])
def test_gptq_gemm_matches_reference(bits, group_size, act_order, num_rows):
    qweight, qzeros, scales, g_idx, w = packed_weight(128, 80, bits, group_size, act_order)
    x = torch.randn(num_rows, 128)
    expected = ref.gptq_gemm_ref(x, qweight, qzeros, scales, g_idx, bits, 1)
    torch.testing.assert_close(expected, x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gptq_gemm_triton(x, qweight, qzeros, scales, g_idx, bits, 1), expected,
                               rtol=1e-5, atol=1e-5)


def test_gptq_gemm_in_half_precision():
    qweight, qzeros, scales, g_idx, _ = packed_weight(64, 32, 4, 32, True)
    x = torch.randn(3, 64).half()
    out = gptq_gemm_triton(x, qweight, qzeros, scales, g_idx, 4, 0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref.gptq_gemm_ref(x, qweight, qzeros, scales, g_idx, 4, 0), rtol=2e-3, atol=2e-3)


def test_gptq_gemm_rejects_bad_arguments():
    qweight, qzeros, scales, g_idx, _ = packed_weight(64, 32, 4, 32, False)
    with pytest.raises(ValueError, match="qweight must have shape"):
        gptq_gemm_triton(torch.randn(2, 72), qweight, qzeros, scales, g_idx, 4, 1)
    with pytest.raises(ValueError, match="g_idx must have shape"):
        gptq_gemm_triton(torch.randn(2, 64), qweight, qzeros, scales, g_idx[:8], 4, 1)
    with pytest.raises(ValueError, match="bits"):
        gptq_gemm_triton(torch.randn(2, 64), qweight, qzeros, scales, g_idx, 3, 1)
