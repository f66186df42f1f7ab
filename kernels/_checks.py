"""Argument checks shared by the Triton launchers: each failure is a ValueError naming the argument."""

from __future__ import annotations

import torch

STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t: torch.Tensor, *, ndim: int | None = None, shape: tuple | None = None,
                 dtypes: tuple | None = None, device: torch.device | None = None) -> None:
    """`shape` entries of None are wildcards."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_inner_contiguous(name: str, t: torch.Tensor, num_dims: int) -> None:
    """The trailing `num_dims` dims form one dense row-major chunk."""
    expected = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - num_dims, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(f"{name} must be contiguous in its last {num_dims} dims, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
        expected *= t.shape[dim]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_gather_out(out: torch.Tensor, kv_cache: torch.Tensor, n: int) -> None:
    """`out` of a block gather: a contiguous [n, L, 2, block_size, Hkv, D] tensor of kv_cache's dtype and device."""
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_tensor("out", out, shape=(n, num_layers, 2, block_size, num_kv_heads, head_dim), dtypes=(kv_cache.dtype,),
                 device=kv_cache.device)
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
