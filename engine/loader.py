"""Loading a checkpoint into plain tensors: one entry point for GGUF files and Hugging Face directories.

`load_model(path)` returns a `LoadedModel` (engine.loaded_model; engine.arch lists the weight names and shapes):
the `ModelConfig`, every weight under its Hugging Face name (on CPU, in the requested dtype or, for a GGUF's
matrices, kept in the file's encoding unless keep_quantized=False), the
tokenizer and a cheap fingerprint of the checkpoint.
q/k rows are in Hugging Face's rotate_half RoPE layout whatever the source (GGUF's interleaved layout is undone).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.gguf_loader import load_gguf
from engine.hf_loader import load_hf_directory
from engine.arch import check_weights, expected_weight_shapes
from engine.loaded_model import LoadedModel, ModelLoadError

__all__ = ["LoadedModel", "ModelLoadError", "check_weights", "expected_weight_shapes", "load_model"]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
               with_weights: bool = True, keep_quantized: bool = True) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face model directory.

    `dtype` is the floating dtype of every returned weight, except a GGUF's matrices that stay packed when
    `keep_quantized` (engine.gguf_loader); `progress` shows a tqdm bar while converting.
    `with_weights=False` reads no tensor data (weights is empty): config, tokenizer and fingerprint are what a
    gateway needs.
    Raises ModelLoadError when the path is neither, or the checkpoint is malformed or unsupported.
    """
    path = Path(path).expanduser()
    if not dtype.is_floating_point:
        raise ModelLoadError(f"dtype must be a floating point torch dtype, got {dtype}")
    if path.is_dir():
        return load_hf_directory(path, dtype=dtype, progress=progress, with_weights=with_weights)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        return load_gguf(path, dtype=dtype, progress=progress, with_weights=with_weights,
                         keep_quantized=keep_quantized)
    raise ModelLoadError(f"{path}: no such file or directory")

