"""Kernel tests: Triton kernels run on CPU tensors through the interpreter; CUDA variants are marked `gpu`.

TRITON_INTERPRET is settled by tests/conftest.py before anything imports triton (kept if the caller set it, else 1
without CUDA and unset with CUDA). Exactly one family runs: interpreter tests (CPU tensors, `*_triton.py` without
the gpu mark) or compiled `gpu` tests; the other is skipped with the reason. bench/gpu_check.sh runs the gpu family.
"""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def pytest_collection_modifyitems(config, items):
    for item in items:
        is_gpu = item.get_closest_marker("gpu") is not None
        if is_gpu and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="gpu test: no CUDA device available"))
        elif is_gpu and INTERPRET:
            item.add_marker(pytest.mark.skip(reason="gpu test: TRITON_INTERPRET=1 would not exercise compiled kernels"))
        elif not is_gpu and not INTERPRET and item.path.name.endswith("_triton.py"):
            item.add_marker(pytest.mark.skip(
                reason="interpreter test: Triton is compiled for CUDA in this process; run with TRITON_INTERPRET=1"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
